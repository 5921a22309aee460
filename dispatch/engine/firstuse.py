"""Verify before trusting: a third-party kernel's first use is checked on sampled outputs.

The first run in a process of each (backend, tactic, shape bucket) of a plugin that is
not built in, or of a built-in backend whose kernels were compiled but never run on
hardware (`Backend.compile_only_note` set), is compared with the float64 reference on a
sample of its output.

Why: only tuning used to verify kernels. An untuned call ran the heuristic pick as it
was, so an installed third-party kernel that writes zeros, NaN rows or ignores strides
returned a wrong result, strict mode included. Built-in kernels are verified by this
project's CI; a plugin's kernels are not, so the first time a (backend, tactic, shape
bucket) of a plugin that is not built in runs in a process, its output is compared on
`SAMPLE_ROWS` rows x `SAMPLE_COLS` columns (the first and last of each, the rest seeded
random) with ``alpha * dequant(a) @ dequant(b).T`` in float64. A wrong result is a fault
of the plugin: the tactic is marked broken (excluded from the heuristic pick too) and
the call falls back to the next candidate, which rewrites ``out``.

Cost: the sample's reference is ``SAMPLE_ROWS * SAMPLE_COLS * K`` multiply-adds plus the
dequantization of those rows and columns: at M=128, N=K=4096 that is 0.1 % of the GEMM's
multiply-adds; the measured wall time is in benchmarks/RESULTS.md ("first-use check").
Later calls pay nothing: the check runs only on a plan's first run.

Switch: ``Dispatcher(verify_plugins=...)``, default ``FP4_DISPATCH_VERIFY_PLUGINS``
(on unless ``0``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from fp4_dispatch.autotune.harness import CHECK_RTOL, reference_output
from fp4_dispatch.contracts.backend import DenseOperands, GemmOperands, GroupedOperands
from fp4_dispatch.contracts.buckets import m_bucket
from fp4_dispatch.contracts.tactics import Tactic
from fp4_dispatch.engine.plans import Plan

log = logging.getLogger(__name__)

ENV = "FP4_DISPATCH_VERIFY_PLUGINS"
#: rows and columns of the output the check compares (at most; fewer when smaller)
SAMPLE_ROWS = 8
SAMPLE_COLS = 32

#: (backend, tactic, bucket key) checked in this process (all dispatchers share it: a
#: kernel's correctness does not depend on which dispatcher runs it)
Key = tuple[str, Tactic, tuple]


def default() -> bool:
    """``FP4_DISPATCH_VERIFY_PLUGINS``: on unless ``0``."""
    return os.environ.get(ENV, "1").strip() != "0"


class WrongResult(RuntimeError):
    """A kernel's output differs from the float64 reference on the sampled elements."""


def sample(size: int, count: int, salt: int) -> torch.Tensor:
    """`count` indices of ``range(size)``: the first, the last and seeded random others."""
    if size <= count:
        return torch.arange(size)
    gen = torch.Generator().manual_seed(size * 31 + salt)
    inner = 1 + torch.randperm(size - 2, generator=gen)[: count - 2]
    return torch.cat([torch.tensor([0]), inner.sort().values, torch.tensor([size - 1])])


class FirstUse:
    """The per-process record of checked kernels and the check itself.

    ``external(backend_name) -> bool`` says which backends come from a plugin that is not
    built in; only those are checked (when ``enabled``).
    """

    def __init__(self, enabled: bool, external: Callable[[str], bool]) -> None:
        self.enabled = enabled
        self._external = external
        self.checked: set[Key] = _CHECKED

    def key(self, plan: Plan) -> Key:
        m, n, k, dtype, op = plan.key[:5]
        bucket = (n, k, m_bucket(m), dtype, op, *plan.key[5:])  # E of a grouped plan
        return (plan.candidate.backend, plan.candidate.tactic, bucket)

    def needed(self, plan: Plan) -> bool:
        """Whether `plan`'s kernel has yet to be checked in this process."""
        return (self.enabled and self._external(plan.candidate.backend)
                and self.key(plan) not in self.checked)  # fmt: skip

    def mark(self, backend: str, tactic: Tactic, bucket: tuple) -> None:
        """Record a (backend, tactic, bucket) as checked (e.g. a verified cached winner)."""
        self.checked.add((backend, tactic, bucket))

    def check(self, plan: Plan, args: tuple) -> WrongResult | None:
        """After `plan` ran on `args`: None if its output matches the reference on the
        sample (recorded), else the `WrongResult` to report (not recorded: a fallback
        marks the tactic broken instead)."""
        why = wrong_output(plan.key[4], args)
        if why is None:
            self.checked.add(self.key(plan))
            log.info("first use of %s %s verified against the reference", plan.candidate.backend,
                     plan.candidate.tactic.canonical_json())  # fmt: skip
            return None
        return WrongResult(f"first-use check against the float64 reference: {why}")


_CHECKED: set[Key] = set()


def forget() -> None:
    """Forget what was checked in this process (tests)."""
    _CHECKED.clear()


def wrong_output(operation: str, args: tuple) -> str | None:
    """Why the output in `args` (checked operands, as a plan takes them) is not the
    reference's on the sampled rows and columns; None when it is."""
    ops: GemmOperands | DenseOperands | GroupedOperands
    if operation == "w4a16":
        a, b, sb, alpha, out, bias, _ = args
        ops = DenseOperands(a, b, sb, alpha)
    elif operation == "grouped_w4a16":  # `plans.GroupedPlan`'s arguments
        a, b, sb, alpha, offsets, out = args
        ops, bias = GroupedOperands(a, b, sb, alpha, offsets), None
    elif operation == "grouped_w4a4":  # `plans.GroupedW4A4Plan`'s arguments
        a, sa, b, sb, alpha, offsets, out = args
        ops, bias = GroupedOperands(a, b, sb, alpha, offsets, a_scale=sa), None
    else:
        a, sa, b, sb, alpha, out, alpha_b = args
        if alpha_b is not None:
            alpha = alpha * alpha_b
        ops, bias = GemmOperands(a, sa, b, sb, alpha), None
    m, n = out.shape
    dev = out.device
    rows, cols = sample(m, SAMPLE_ROWS, 0).to(dev), sample(n, SAMPLE_COLS, 1).to(dev)
    with torch.no_grad():
        ref = reference_output(ops, rows, cols)
        if bias is not None:
            ref = ref + bias.index_select(0, cols).to(torch.float64)
        got = out.index_select(0, rows).index_select(1, cols).to(torch.float64)
    finite = torch.isfinite(ref)
    bad = int((~torch.isfinite(got) & finite).sum())
    if bad:
        return f"{bad} of {got.numel()} sampled output elements are NaN or infinite"
    diff = float(torch.linalg.vector_norm((got - ref)[finite]))
    norm = float(torch.linalg.vector_norm(ref[finite]))
    err = diff / norm if norm > 0 else diff
    if not err <= CHECK_RTOL:
        return (f"relative error {err:.3g} exceeds {CHECK_RTOL:g} on {len(rows)}x{len(cols)} "
                f"sampled elements of {m}x{n}")  # fmt: skip
    return None
