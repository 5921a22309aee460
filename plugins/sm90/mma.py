"""Plugin module: ``triton-sm90-mma``, Hopper decode without shared memory (M <= 8): W4A16,
and W4A4 by expanding the activations first.

The kernel (`fp4_dispatch.backends.sm90.gemm_w4a16_mma`, Gluon) has no shared memory, no
pipeline and no barrier in its main loop: every warp streams its own weight rows over its
own range of K straight into registers, expands them there and multiplies with
``mma.sync`` (both operands in registers), and the latency is hidden by the many warps an
SM holds (44-95 registers a thread) instead of by stages. Tactics: 8 tokens and 16 weight
rows a warp; a CTA of ``tile_n`` rows, ``tile_n / 16`` warps that share one K range (its
activations then hit L1) times ``num_warps / (tile_n / 16)`` K ranges (summed once at
the end); ``split_k`` 1-4 CTAs a tile; one K step at a time, or two whose loads issue
together (one latency for both) with L2 prefetch two steps ahead.

What is offered (`MMA_VARIANTS`) was chosen on a sweep of everything the kernel runs
(`MMA_SPACE`, the removed ``bench_w4a16_mma.py --space``: 18 variants x 4 splits on the six
in-sample (N, K) at M 1, 4, 8 and 16; RESULTS.md "Hopper W4A16" run 8): the three
variants whose best tactic is within 1% of the best of all 18 on average over the 18
shapes of M <= 8 (worst 4.2%; the two of run 7: 1.8%, worst 6.5%). The third is a
32-row CTA, two warps a K range. Not offered:

- 16-token tiles: at M = 16 the best of them was 1.13-1.26x the direct kernel's time on
  all six shapes, with or without shared K ranges (so not the activations' L2 traffic,
  which sharing cuts by up to 4x; what limits it is not measured);
- CTAs of 64 and 128 rows: their best was 0.99-1.12x the best 16/32-row tactic's time.

The estimate (`_estimate_mma`) was fitted on run 7's offered variants; on run 8's sweep
its untuned pick among the three is within 0.6% of the best of them on average over the
18 shapes of M <= 8 (worst 7.8%; ``fit_w4a16_model.py --mma --check --mma-data
benchmarks/data/sm90_w4a16_mma_run8_space.json``).

W4A4 (operation ``"w4a4"``): the same tactics run `gemm_w4a16_mma.W4A4MmaKernel`, which
expands the NVFP4 activations into a kept bf16/fp16 buffer first (exact; one short
launch, `EXPAND_US`) and then multiplies them as W4A16 operands. At decode that is cheaper
than expanding them inside every CTA (``triton-sm90-dense``): 20.6 against 26.0 µs at
1x8192² (run 8). The GEMM launches with PDL (`fp4_dispatch.backends.pdl`) and prefetches
its first weight steps while the expansion runs: 0.94-1.03x the time, median 0.98
(RESULTS.md "Hopper W4A16" run 12; `EXPAND_US` is still the expansion timed alone).

Why a backend of its own: at 1-8 tokens it takes 0.75-0.96x the time of the best direct
tactic of ``triton-sm90-w4a16`` on every shape of RESULTS.md "Hopper W4A16" run 7
(1x8192²: 18.7 against 22.5 µs), and it has its own cost model (`_estimate_mma`): its
time is set by how many warps an SM holds, not by stages.

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 (tests/test_gemm_w4a16_mma.py); the numerics are checked on the H200.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import _gluon_support, cost_model
from fp4_dispatch.plugins.sm90 import w4a16 as w4
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig

MMA_SPLIT_K = (1, 2, 3, 4)
#: weight rows a warp (the kernel's ``block_n``: one MMA tile)
WARP_ROWS = 16
#: (tile_m, tile_n, num_warps): CTA shapes the kernel runs - tokens, rows (``tile_n //
#: WARP_ROWS`` warps share a K range) and warps (``num_warps // row_warps`` K ranges)
_ROWS_WARPS = ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))
MMA_SHAPES = tuple((tm, tn, nw) for tm in (8, 16) for tn, nw in _ROWS_WARPS)
#: (prefetch, unroll) pairs: one step at a time, with L2 prefetch, and two steps' loads
#: together with prefetch
MMA_PIPES = ((0, 1), (2, 1), (2, 2))
#: the tactic space the kernel runs (shape + pipe): what ``bench_w4a16_mma.py --space``
#: timed (removed; git history at d90e9a7); `MMA_VARIANTS` is the part offered
MMA_SPACE = tuple((*shape, *pipe) for shape in MMA_SHAPES for pipe in MMA_PIPES)
#: (tile_m, tile_n, num_warps, prefetch, unroll) offered (module docstring)
MMA_VARIANTS = ((8, 16, 4, 0, 1), (8, 16, 4, 2, 2), (8, 32, 4, 2, 2))
#: the most tokens an offered variant covers
MMA_MAX_M = max(v[0] for v in MMA_VARIANTS)
#: K elements a warp's step covers (the kernel's `STEP_K`)
MMA_TILE_K = 128

#: SASS instructions of one warp's 128-wide K step (16 rows) by tokens a CTA - a hardware
#: fact of the kernel, read off its sm_90 cubins (Triton 3.9, every `MMA_SHAPES` row with
#: prefetch 0: 234-235 at 8 tokens, 272-279 at 16; prefetch adds 0-4, Triton 3.6 is within
#: 2)
STEP_INSTRUCTIONS = {8: 235, 16: 272}
#: registers a thread of every `MMA_SPACE` variant, same cubins (whole K ranges; the masked
#: variant of a partial range takes 10-25 more, not modelled)
REGISTERS = {
    (8, 16, 4, 0, 1): 48, (8, 16, 4, 2, 1): 50, (8, 16, 4, 2, 2): 88,
    (8, 32, 4, 0, 1): 50, (8, 32, 4, 2, 1): 50, (8, 32, 4, 2, 2): 87,
    (8, 32, 8, 0, 1): 50, (8, 32, 8, 2, 1): 50, (8, 32, 8, 2, 2): 95,
    (8, 64, 4, 0, 1): 44, (8, 64, 4, 2, 1): 50, (8, 64, 4, 2, 2): 87,
    (8, 64, 8, 0, 1): 50, (8, 64, 8, 2, 1): 50, (8, 64, 8, 2, 2): 95,
    (8, 128, 8, 0, 1): 44, (8, 128, 8, 2, 1): 50, (8, 128, 8, 2, 2): 88,
    (16, 16, 4, 0, 1): 62, (16, 16, 4, 2, 1): 62, (16, 16, 4, 2, 2): 130,
    (16, 32, 4, 0, 1): 62, (16, 32, 4, 2, 1): 62, (16, 32, 4, 2, 2): 128,
    (16, 32, 8, 0, 1): 62, (16, 32, 8, 2, 1): 62, (16, 32, 8, 2, 2): 128,
    (16, 64, 4, 0, 1): 62, (16, 64, 4, 2, 1): 64, (16, 64, 4, 2, 2): 128,
    (16, 64, 8, 0, 1): 62, (16, 64, 8, 2, 1): 62, (16, 64, 8, 2, 2): 128,
    (16, 128, 8, 0, 1): 60, (16, 128, 8, 2, 1): 64, (16, 128, 8, 2, 2): 128,
}  # fmt: skip
#: GPU µs that a W4A4 call adds: the activations' expansion before the GEMM
#: (`gemm_w4a16_mma.W4A4MmaKernel`; M x K values, a few KiB at decode), one more launch in
#: a CUDA graph. Measured alone on the H200: 1.88-2.06 µs (median 1.96) on the 12
#: in-sample shapes of M 1 and 4 (RESULTS.md "Hopper W4A16" run 8, call 2,
#: now ``benchmarks kernels --cases w4a4-decode``); 1.82-2.14 on every shape of call 7
EXPAND_US = 2.0
#: shared memory a CTA: the final sum over its warps (4 bytes x tile x warps) and Triton's
#: reduction scratch; 2-8 KiB in the compiles above, never the limit
SHARED_BYTES = 8192


class TritonSm90MmaTactic(w4.TritonSm90W4A16Tactic):
    """A register-only W4A16 decode tactic (module docstring for the knobs)."""

    backend: Literal["triton-sm90-mma"] = "triton-sm90-mma"  # type: ignore[assignment]
    path: Literal["mma"] = "mma"  # type: ignore[assignment]
    tile_m: Literal[8, 16] = 8  # type: ignore[assignment]
    #: weight rows a CTA: `WARP_ROWS` a warp times `row_warps`
    tile_n: Literal[16, 32, 64, 128] = 16  # type: ignore[assignment]
    tile_k: Literal[128] = 128  # type: ignore[assignment]
    split_k: Literal[1, 2, 3, 4] = 1  # type: ignore[assignment]
    num_stages: Literal[1] = 1  # type: ignore[assignment]
    prefetch: Literal[0, 2] = 0
    unroll: Literal[1, 2] = 1

    @property
    def row_warps(self) -> int:
        """Warps that share one K range (and its activations), `WARP_ROWS` rows each."""
        return self.tile_n // WARP_ROWS

    @property
    def k_groups(self) -> int:
        """Groups of warps a CTA, each its own range of K steps (0: an invalid tactic,
        more rows than its warps cover; `why_invalid` says so)."""
        return self.num_warps // self.row_warps

    def kernel_config(self) -> MmaConfig:  # type: ignore[override]
        """The kernel's compile-time config."""
        from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig  # noqa: PLC0415 - optional: Triton

        return MmaConfig(block_m=self.tile_m, warps=self.k_groups, row_warps=self.row_warps,
                         split_k=self.split_k, block_n=WARP_ROWS, prefetch=self.prefetch,
                         unroll=self.unroll)  # fmt: skip


def variant(t: TritonSm90MmaTactic) -> tuple[int, int, int, int, int]:
    """(tile_m, tile_n, num_warps, prefetch, unroll): the keys of `MMA_SPACE`."""
    return (t.tile_m, t.tile_n, t.num_warps, t.prefetch, t.unroll)


def why_not_run(t: TritonSm90MmaTactic, problem: Problem) -> str | None:
    """Why the kernel does not run `t` for `problem` (or should not), else None: a
    variant of `MMA_SPACE`, at most 16 tokens on the smallest token tile that covers
    them (an 8-token tile at M > 8 streams the weights once a tile), K % 32, and split-K
    only while every K range gets a step (without split, the warps past a short K idle:
    masked, correct; bf16 and fp16 activations alike)."""
    if variant(t) not in MMA_SPACE:
        return (f"(tile_m, tile_n, num_warps, prefetch, unroll) = {variant(t)}: not a "
                "variant of MMA_SPACE")  # fmt: skip
    if problem.m > 16:
        return f"M={problem.m}: the kernel serves M <= 16 (decode)"
    tokens = 8 if problem.m <= 8 else 16
    if t.tile_m != tokens:
        return f"tile_m={t.tile_m}: M={problem.m} runs {tokens}-token tiles"
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    steps = -(-problem.k // MMA_TILE_K)
    if t.split_k > 1 and t.split_k * t.k_groups > steps:
        return (f"split_k x K ranges = {t.split_k * t.k_groups} > {steps} K steps: "
                "a split whose warps have no work")  # fmt: skip
    return None


def why_invalid(t: TritonSm90MmaTactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem`, else None: `why_not_run`, then one of
    `MMA_VARIANTS` (M <= `MMA_MAX_M`)."""
    del device  # residency is the estimate's business: every tactic fits an SM
    if problem.m > MMA_MAX_M:
        return f"M={problem.m}: offered for M <= {MMA_MAX_M} (decode)"
    why = why_not_run(t, problem)
    if why is None and variant(t) not in MMA_VARIANTS:
        why = (f"(tile_m, tile_n, num_warps, prefetch, unroll) = {variant(t)}: one of "
               f"{MMA_VARIANTS} (the measured best, module docstring)")  # fmt: skip
    return why


def space(problem: Problem) -> list[TritonSm90MmaTactic]:
    """Every tactic of `MMA_SPACE` the kernel runs for `problem` (`why_not_run`), offered
    or not: the sweep that chose `MMA_VARIANTS` (``bench_w4a16_mma.py --space``, removed)."""
    every = (_tactic(*v, split) for v in MMA_SPACE for split in MMA_SPLIT_K)
    return [t for t in every if why_not_run(t, problem) is None]


# Calibration: the "mma" part of plugins/sm90/cost_model.json, fitted by
# benchmarks/fit_w4a16_model.py --mma on the committed H200 sweep of
# bench_w4a16_mma.py (benchmarks/data, the file's note says on what; the script: git
# history at d90e9a7).


def _c() -> dict:
    return cost_model.constants()["mma"]


def residency(t: TritonSm90MmaTactic) -> int:
    """CTAs an SM holds (`cost_model.resident_ctas`: registers, warps, CTAs)."""
    regs = REGISTERS[variant(t)]
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
    round trip and counter (``split_us``); the CTA holds its slot meanwhile.

    ``time_scale`` multiplies the kernel's time for the ranking against the other
    backends (one factor: it never changes the pick among mma tactics); W4A4 adds
    `EXPAND_US`."""
    c = _c()
    tiles = -(-p.n // t.tile_n) * -(-p.m // t.tile_m)
    ctas = tiles * t.split_k
    per_sm = residency(t)
    waves = math.ceil(ctas / (per_sm * device.sm_count))
    resident = min(ctas, per_sm * device.sm_count) / device.sm_count * t.num_warps
    instructions = STEP_INSTRUCTIONS[t.tile_m]
    issue = instructions * resident / 4.0 / c["issue_per_us"]
    lat = c["lat_us"] * (c["pf_lat"] if t.prefetch else 1.0) / t.unroll
    hidden = min(1.0, resident / c["sat_warps"])
    step = max(issue + lat * (1.0 - hidden), instructions / c["own_per_us"])
    steps = math.ceil(p.k / MMA_TILE_K)
    per = math.ceil(steps / (t.split_k * t.k_groups))  # steps a warp, whole unrolls:
    per = -(-per // t.unroll) * t.unroll  # a masked second step still issues
    tail = c["cta_us"] + (c["split_us"] if t.split_k > 1 else 0.0)
    compute = waves * (per * step + tail)
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    memory = (p.n * p.k * (0.5 + 1.0 / 16) + p.m * p.k * 2.0 + 2.0 * p.m * p.n) / bw
    expand = EXPAND_US if p.operation == "w4a4" else 0.0
    return (max(compute, memory) + c["fixed_us"]) * c["time_scale"] + expand


class TritonSm90MmaBackend(Backend):
    """Hopper W4A16 and W4A4, 1-8 tokens: registers and ``mma.sync`` only (Gluon)."""

    name = "triton-sm90-mma"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_w4a16_mma", plugin=__name__)
    tactic_type = TritonSm90MmaTactic
    operations: ClassVar[tuple[str, ...]] = ("w4a16", "w4a4")
    diversity_axes = ("tile_n", "num_warps", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _gluon_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90MmaTactic]:
        for v, split in itertools.product(MMA_VARIANTS, MMA_SPLIT_K):
            t = _tactic(*v, split)
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
        """The W4A16 kernel, or for a W4A4 problem its wrapper that expands the
        activations first (`gemm_w4a16_mma.W4A4MmaKernel`)."""
        assert isinstance(tactic, TritonSm90MmaTactic)
        return _kernel_for(tactic.kernel_config(), problem.operation)

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
def _tactic(tm: int, tn: int, nw: int, pf: int, un: int, split: int) -> TritonSm90MmaTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90MmaTactic(tile_m=tm, tile_n=tn, num_warps=nw, prefetch=pf, unroll=un,
                               split_k=split)  # fmt: skip


@functools.cache
def _kernel_for(cfg: MmaConfig, operation: str) -> Kernel:
    """One kernel object per config and operation: shapes share compiled code and the
    kept buffers."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma  # noqa: PLC0415 - optional: Triton

    return (gemm_w4a16_mma.build_w4a4 if operation == "w4a4" else gemm_w4a16_mma.build)(cfg)
