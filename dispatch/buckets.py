"""The bucket policy: which problems share a tuned winner and a built kernel.

M is bucketed to the next power of two, uncapped: a capped table (the old FlashInfer
one stopped at 4096) sends a prefill of M = 100000 to the M = 4096 decision. N, K, the
output dtype and the operation (``w4a4``: both operands NVFP4; ``w4a16``: dense
activations) are exact: the two operations run different kernels, so they never share a
winner.

Grouped problems (mixture-of-experts, docs/grouped.md) add the expert count E, exact, as
a sixth key element; their M is the total rows over all experts, bucketed like any M.
Why not a bucket of the real per-expert row counts: those live on the device (the
offsets) and reading them would synchronise every call. So the token distribution is
described by host facts only, (M bucket, E), read under a balanced-routing assumption:
``M / E`` rows per expert, ``min(M, E)`` experts touched. Dense keys are unchanged.
"""

from __future__ import annotations

#: (N, K, M bucket, out dtype, operation), plus E for a grouped operation: the unit a
#: tuned winner covers
BucketKey = tuple[int, int, int, str, str] | tuple[int, int, int, str, str, int]

#: what an entry or key without an operation means (everything tuned before W4A16 was)
DEFAULT_OPERATION = "w4a4"


def m_bucket(m: int) -> int:
    """Next power of two >= m, uncapped."""
    if type(m) is not int or m < 1:
        raise ValueError(f"m: expected a positive int, got {m!r}")
    return 1 << (m - 1).bit_length()


def describe(bkey: BucketKey) -> str:
    """A bucket key as log and error text: ``N=.. K=.. M<=.. dtype operation`` (and
    ``E=..`` for a grouped bucket)."""
    n, k, mb, dtype, op = bkey[:5]
    text = f"N={n} K={k} M<={mb} {dtype} {op}"
    return text if len(bkey) < 6 else f"{text} E={bkey[5]}"


def bucket_key(
    m: int,
    n: int,
    k: int,
    out_dtype: str,
    operation: str = DEFAULT_OPERATION,
    groups: int | None = None,
) -> BucketKey:
    """The bucket an exact (M, N, K, out dtype, operation[, E]) falls into (a dense
    problem's key has five elements, a grouped one's six: E last)."""
    if groups is None:
        return (n, k, m_bucket(m), out_dtype, operation)
    return (n, k, m_bucket(m), out_dtype, operation, groups)
