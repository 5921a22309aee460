"""Ranking for one device: the `Ranker`, a memoized heuristic pick per bucket and problem.

Why: FlashInfer's cut to 32 tactics silently dropped a whole kernel family (ties kept
enumeration order; the budget counted groups, not tactics). Here every candidate of
every family is scored on one scale (estimated microseconds), ties break on content,
and each family with a valid candidate is guaranteed a floor of slots.

The parts, one module each, re-exported here (this is where callers import them from):
the cost model (`fp4_dispatch.costmodel`: `estimate_us`, `preferred_swap`), the merge
(`fp4_dispatch.merge`: enumerate, re-validate, score), the cap
(`fp4_dispatch.cap`: `shortlist`, `default_floor`) and the value types
(`fp4_dispatch.candidates`: `Candidate`, `Shortlist`). The memo tables and helpers that
tests and benchmarks reach for are re-exported too: the same objects, not copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .backend import Backend
from .buckets import bucket_key, m_bucket
from .candidates import Candidate, Shortlist
from .cap import (  # noqa: F401 - re-exported
    DEFAULT_BUDGET,
    _axes_of,
    _cap,
    _floor_picks,
    default_floor,
    shortlist,
)
from .costmodel import (  # noqa: F401 - re-exported
    BASE_TILE_K,
    BW_SATURATION,
    CLUSTER_PENALTY,
    FEED_COST,
    LAUNCH_US,
    OVERLAP,
    ROW_OVERHEAD_BYTES,
    SPLIT_K_REDUCE_US,
    SWAP_NEUTRAL_ABOVE_M,
    SWAP_PENALTY,
    WAVE_OVERHEAD_US,
    _k_fields,
    _peak_tflops,
    _row_efficiency,
    _shared_us,
    ctas_per_tile,
    estimate_us,
    preferred_swap,
)
from .device import DeviceInfo
from .guard import Guard
from .merge import (  # noqa: F401 - re-exported
    _BY_ID,
    _CHECKED,
    _MEMO_LIMIT,
    _canonical,
    _collect,
    _Entry,
    _fast_canonical,
    _plain_model,
    _revalidate,
    operation_for,
)
from .tactics import Problem

__all__ = [
    "BASE_TILE_K",
    "BW_SATURATION",
    "CLUSTER_PENALTY",
    "DEFAULT_BUDGET",
    "FEED_COST",
    "LAUNCH_US",
    "OVERLAP",
    "ROW_OVERHEAD_BYTES",
    "SPLIT_K_REDUCE_US",
    "SWAP_NEUTRAL_ABOVE_M",
    "SWAP_PENALTY",
    "WAVE_OVERHEAD_US",
    "Candidate",
    "Ranker",
    "Shortlist",
    "ctas_per_tile",
    "default_floor",
    "estimate_us",
    "m_bucket",
    "preferred_swap",
    "shortlist",
]

log = logging.getLogger(__name__)


def _sort_key(e: _Entry) -> tuple[float, str, str]:
    return (e[0], e[1], e[2])


class Ranker:
    """Ranks for one device; memoizes the heuristic top-1 per (N, K, M bucket, out dtype).

    Buckets are powers of two, uncapped, filled on first use. The bucket's pick is
    computed for the representative problem ``(m_bucket(m), n, k)``. Validity rule for
    the actual M: a tactic valid at the bucket's M may not be valid at M (e.g. an
    alignment rule on the output's contiguous dimension when swapped), so the first
    call with a new exact M asks the owning backend's ``validate`` once; if it objects,
    the exact problem is ranked on its own. Either way the answer is memoized per exact
    (M, N, K, out dtype), so repeat calls are a single dict lookup.
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        device: DeviceInfo,
        budget: int = DEFAULT_BUDGET,
        guard: Guard | None = None,
    ) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget: expected a positive int, got {budget!r}")
        by_name: dict[str, Backend] = {}
        for b in backends:
            if b.name in by_name:
                raise ValueError(f"two backends are named {b.name!r}")
            by_name[b.name] = b
        self.backends: tuple[Backend, ...] = tuple(by_name[n] for n in sorted(by_name))
        self._by_name = by_name
        #: every call into a backend goes through it (faults recorded, strict raises)
        self.guard = Guard() if guard is None else guard
        self.device = device
        self.budget = budget
        #: bucket key (`fp4_dispatch.buckets.bucket_key`: E last when grouped) -> top-1
        self._buckets: dict[tuple, Candidate] = {}
        #: (M, N, K, out dtype, operation), E appended when grouped -> top-1
        self._exact: dict[tuple, Candidate] = {}

    def shortlist(self, problem: Problem) -> Shortlist:
        """The full capped ranking for this exact problem (not memoized)."""
        return shortlist(problem, self.device, self.backends, self.budget, guard=self.guard)

    def pick(
        self,
        m: int,
        n: int,
        k: int,
        out_dtype: str = "bfloat16",
        operation: str = "w4a4",
        groups: int | None = None,
    ) -> Candidate:
        """The heuristic top-1 for this shape: memoized per bucket, checked per exact M.
        ``groups``: the expert count E of a grouped operation (None otherwise)."""
        key = (m, n, k, out_dtype, operation) if groups is None else (
            m, n, k, out_dtype, operation, groups)  # fmt: skip
        hit = self._exact.get(key)
        if hit is not None:
            return hit
        return self._pick_slow(m, n, k, out_dtype, operation, groups)

    def _pick_slow(
        self, m: int, n: int, k: int, out_dtype: str, operation: str, groups: int | None
    ) -> Candidate:
        bucket = m_bucket(m)
        bkey = bucket_key(m, n, k, out_dtype, operation, groups)
        top = self._buckets.get(bkey)
        if top is None:
            rep = Problem(m=bucket, n=n, k=k, out_dtype=out_dtype, operation=operation,
                          groups=groups)  # fmt: skip
            top = self._buckets[bkey] = self._best(rep)
        if m != bucket:
            problem = Problem(m=m, n=n, k=k, out_dtype=out_dtype, operation=operation,
                              groups=groups)  # fmt: skip
            why = self._invalid_for(top, problem)
            if why is not None:
                log.info("bucket %d pick %s invalid at M=%d (%s); ranking M itself",
                         bucket, top.backend, m, why)  # fmt: skip
                top = self._best(problem)
        if len(self._exact) >= _MEMO_LIMIT:
            self._exact.clear()
        self._exact[(m, n, k, out_dtype, operation, *(() if groups is None else (groups,)))] = top
        return top

    def _invalid_for(self, cand: Candidate, problem: Problem) -> str | None:
        backend = self._by_name[cand.backend]
        problem = problem.as_operation(cand.operation)
        return self.guard.validate(backend, cand.tactic, problem, self.device)

    def _best(self, problem: Problem) -> Candidate:
        entries, skipped, _ = _collect(problem, self.device, self.backends, self.guard)
        if not entries:
            raise RuntimeError(self._none_qualifies(problem, skipped))
        e = min(entries, key=_sort_key)
        return Candidate(e[1], e[4], e[3], e[0], "heuristic top-1", e[5])

    def _none_qualifies(self, problem: Problem, skipped: dict[str, str]) -> str:
        p = (f"{problem.operation} M={problem.m} N={problem.n} K={problem.k} "
             f"out={problem.out_dtype}")  # fmt: skip
        if problem.groups is not None:
            p += f" E={problem.groups}"
        serving = [b for b in self.backends if operation_for(b, problem) is not None]
        if not serving:
            return f"no NVFP4 GEMM backend is available on {self.device.name} for {p}"
        lines = [f"no backend has a valid tactic for {p} on {self.device.name}:"]
        for b in serving:
            lines.append(f"  {b.name} ({b.family}): {skipped.get(b.name, 'no valid tactic')}")
        return "\n".join(lines)

    def clear(self) -> None:
        """Forget every memoized pick (e.g. after backends or the device changed)."""
        self._buckets.clear()
        self._exact.clear()
