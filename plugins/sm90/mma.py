"""Plugin module: ``triton-sm90-mma``, Hopper W4A16 decode without shared memory (M <= 8).

The kernel (`fp4_dispatch.backends.sm90.gemm_w4a16_mma`, Gluon) has no shared memory, no
pipeline and no barrier in its main loop: every warp streams its own weight rows over its
own range of K straight into registers, expands them there and multiplies with
``mma.sync`` (both operands in registers), and the latency is hidden by the many warps an
SM holds (48-88 registers a thread) instead of by stages. Tactics: 16 weight rows and 8
tokens a warp, 4 warps a CTA (each its own K range, summed once at the end), ``split_k``
1-4 CTAs a tile, and one of two variants (`MMA_VARIANTS`): one K step at a time, or two
whose loads issue together (one latency for both) with L2 prefetch two steps ahead.

Offered for M <= 8. The kernel takes 16-token tiles too, but at M = 16 the direct kernel
was faster on all six in-sample (N, K) of run 7's sweep (by 5-18%: each warp then loads
two tokens' activations a step, 4 KiB from L2 against 1 KiB of weights), and the estimate
below does not model that traffic. The kernel's 32-row warps are not offered either: the
best 32-row tactic beat the best 16-row one on 2 of that sweep's 18 shapes, by 4% at
most. The two variants are what was left of 8 (4 or 8 warps x prefetch 0 or 2 x unroll
1 or 2) on the final sweep's in-sample shapes: the smallest set whose best tactic stays
within 4% of the best of all 32 there, and whose untuned pick (under the estimate
fitted on all 32) comes within 1% of it on average (the pick among all 32: 13%). The
held-out shapes took no part.

Why a backend of its own: at 1-8 tokens it takes 0.75-0.96x the time of the best direct
tactic of ``triton-sm90-w4a16`` on every shape of RESULTS.md "Hopper W4A16" run 7
(1x8192²: 18.7 against 22.5 µs), and it has its own cost model (`_estimate_mma`): its
time is set by how many warps an SM holds, not by stages.

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 (tests/test_triton_sm90_mma.py); the numerics are checked on the H200.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from fp4_dispatch.backend import Backend, Kernel, Support
from fp4_dispatch.device import DeviceInfo
from fp4_dispatch.plugins.sm90 import _gluon_support, cost_model
from fp4_dispatch.plugins.sm90 import w4a16 as w4
from fp4_dispatch.tactics import Problem, Tactic

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig

MMA_SPLIT_K = (1, 2, 3, 4)
#: (num_warps, prefetch, unroll) offered (module docstring)
MMA_VARIANTS = ((4, 0, 1), (4, 2, 2))
MMA_MAX_M = 8
#: K elements a warp's step covers (the kernel's `STEP_K`)
MMA_TILE_K = 128

#: SASS instructions of one warp's 128-wide K step (16 rows, 8 tokens) - a hardware fact
#: of the kernel, read off its sm_90 cubin (Triton 3.9; prefetch adds 0-4, Triton 3.6 is
#: within 2)
STEP_INSTRUCTIONS = 235
#: registers a thread by (prefetch, unroll), same cubins (4 warps, whole K ranges; the
#: masked variant of a partial range takes 10-25 more, not modelled)
REGISTERS = {(0, 1): 48, (2, 1): 50, (0, 2): 51, (2, 2): 88}
#: shared memory a CTA: the final sum over its warps (4 bytes x tile x warps) and Triton's
#: reduction scratch; 2-8 KiB in the compiles above, never the limit
SHARED_BYTES = 8192


class TritonSm90MmaTactic(w4.TritonSm90W4A16Tactic):
    """A register-only W4A16 decode tactic (module docstring for the knobs)."""

    backend: Literal["triton-sm90-mma"] = "triton-sm90-mma"  # type: ignore[assignment]
    path: Literal["mma"] = "mma"  # type: ignore[assignment]
    tile_m: Literal[8] = 8  # type: ignore[assignment]
    tile_n: Literal[16] = 16  # type: ignore[assignment]
    tile_k: Literal[128] = 128  # type: ignore[assignment]
    split_k: Literal[1, 2, 3, 4] = 1  # type: ignore[assignment]
    num_stages: Literal[1] = 1  # type: ignore[assignment]
    prefetch: Literal[0, 2] = 0
    unroll: Literal[1, 2] = 1

    def kernel_config(self) -> MmaConfig:  # type: ignore[override]
        """The kernel's compile-time config."""
        from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig  # noqa: PLC0415 - optional: Triton

        return MmaConfig(block_m=self.tile_m, warps=self.num_warps, split_k=self.split_k,
                         block_n=self.tile_n, prefetch=self.prefetch,
                         unroll=self.unroll)  # fmt: skip


def why_invalid(t: TritonSm90MmaTactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem`, else None: M <= `MMA_MAX_M`, K % 32, one of
    `MMA_VARIANTS`, and split-K only while every warp gets a K step (without split, the
    warps past a short K idle: masked, correct; bf16 and fp16 activations alike)."""
    del device  # residency is the estimate's business: every tactic fits an SM
    if problem.m > MMA_MAX_M:
        return f"M={problem.m}: offered for M <= {MMA_MAX_M} (decode)"
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    variant = (t.num_warps, t.prefetch, t.unroll)
    if variant not in MMA_VARIANTS:
        return (f"(num_warps, prefetch, unroll) = {variant}: one of {MMA_VARIANTS} "
                "(the measured best, module docstring)")  # fmt: skip
    steps = -(-problem.k // MMA_TILE_K)
    if t.split_k > 1 and t.split_k * t.num_warps > steps:
        return (f"split_k x num_warps = {t.split_k * t.num_warps} > {steps} K steps: "
                "a split whose warps have no work")  # fmt: skip
    return None


# Calibration: the "mma" part of plugins/sm90/cost_model.json, fitted by
# benchmarks/fit_w4a16_model.py --mma on the committed H200 sweep of
# benchmarks/bench_w4a16_mma.py (the file's note says on what).


def _c() -> dict:
    return cost_model.constants()["mma"]


def residency(t: TritonSm90MmaTactic) -> int:
    """CTAs an SM holds (`cost_model.resident_ctas`: registers, warps, CTAs)."""
    regs = REGISTERS[(t.prefetch, t.unroll)]
    return cost_model.resident_ctas(regs, SHARED_BYTES, t.num_warps)


def _estimate_mma(t: TritonSm90MmaTactic, p: Problem, device: DeviceInfo) -> float:
    """Waves x (K steps a warp x the step + the CTA's tail), plus a fixed cost; HBM bounds it.

    A warp's step: the instructions of every warp resident on its scheduler (4 an SM;
    `STEP_INSTRUCTIONS` each) at ``issue_per_us``, plus the load latency (``lat_us``;
    ``pf_lat`` times that with L2 prefetch; paid once for ``unroll`` steps) as far as
    the other warps do not hide it (fully at ``sat_warps`` an SM and more), and never
    less than one warp's own instructions at ``own_per_us`` (it waits on its
    dependences). The tail: the warps'
    sum through shared memory and the store (``cta_us``) and, split, the partial tile's
    round trip and counter (``split_us``); the CTA holds its slot meanwhile."""
    c = _c()
    tiles = -(-p.n // t.tile_n) * -(-p.m // t.tile_m)
    ctas = tiles * t.split_k
    per_sm = residency(t)
    waves = math.ceil(ctas / (per_sm * device.sm_count))
    resident = min(ctas, per_sm * device.sm_count) / device.sm_count * t.num_warps
    issue = STEP_INSTRUCTIONS * resident / 4.0 / c["issue_per_us"]
    lat = c["lat_us"] * (c["pf_lat"] if t.prefetch else 1.0) / t.unroll
    hidden = min(1.0, resident / c["sat_warps"])
    step = max(issue + lat * (1.0 - hidden), STEP_INSTRUCTIONS / c["own_per_us"])
    steps = math.ceil(p.k / MMA_TILE_K)
    per = math.ceil(steps / (t.split_k * t.num_warps))  # steps a warp, whole unrolls:
    per = -(-per // t.unroll) * t.unroll  # a masked second step still issues
    tail = c["cta_us"] + (c["split_us"] if t.split_k > 1 else 0.0)
    compute = waves * (per * step + tail)
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    memory = (p.n * p.k * (0.5 + 1.0 / 16) + p.m * p.k * 2.0 + 2.0 * p.m * p.n) / bw
    return max(compute, memory) + c["fixed_us"]


class TritonSm90MmaBackend(Backend):
    """Hopper W4A16, 1-8 tokens: registers and ``mma.sync`` only (Gluon)."""

    name = "triton-sm90-mma"
    family = "sm90"
    version = "1"
    tactic_type = TritonSm90MmaTactic
    operations: ClassVar[tuple[str, ...]] = ("w4a16",)
    diversity_axes = ("num_warps", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _gluon_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90MmaTactic]:
        for (nw, pf, un), split in itertools.product(MMA_VARIANTS, MMA_SPLIT_K):
            t = _tactic(nw, split, pf, un)
            if why_invalid(t, problem, device) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90MmaTactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds (`_estimate_mma`), on the scale of the other W4A16 estimates."""
        assert isinstance(tactic, TritonSm90MmaTactic)
        return _estimate_mma(tactic, problem, device)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90MmaTactic)
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what `gemm` runs for `problem` with
        contiguous activations and output of its dtype."""
        assert isinstance(tactic, TritonSm90MmaTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        p = problem
        return kernel.precompile(p.m, p.n, p.k, getattr(torch, p.out_dtype))  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on M (``do_not_specialize``): the tactic, N (the output's row
        stride), K and the dtype decide."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)


@functools.cache
def _tactic(nw: int, split: int, pf: int, un: int) -> TritonSm90MmaTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90MmaTactic(num_warps=nw, split_k=split, prefetch=pf, unroll=un)


@functools.cache
def _kernel_for(cfg: MmaConfig) -> Kernel:
    """One kernel object per config: shapes share compiled code and the split-K workspace."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16_mma.build(cfg)
