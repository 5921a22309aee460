"""Plugin module: ``triton-sm90-ws``, Hopper W4A16 with warp specialization (32-256 tokens).

The kernel (`fp4_dispatch.backends.sm90.gemm_w4a16_ws`, Gluon) splits each CTA into
dequantizing warps, which expand the NVFP4 weight tile into shared memory, and one MMA
warpgroup, which multiplies it with the activation tile (both operands from shared
memory). It reads natural weight bytes and bf16 activations through TMA. Tactics: 128
weight rows a CTA (one block of the swizzled scales), ``tile_m`` 32/64/128 tokens, 64-wide
K steps, ``split_k`` 1-4; the partition layout (3 dequant partitions of 4 warps, 4 TMA
stages, one expanded tile each, the register split) is the one measured best on the H200
(RESULTS.md, "Hopper W4A16" run 6) and fixed in `WsConfig`'s defaults.

Why a backend of its own: it competes with the ``triton-sm90-w4a16`` direct kernel where
that kernel is weakest (64-256 tokens; 10-33% faster than the other W4A16 kernels on the
issue shapes at M = 256), and its cost model is a different one (`_estimate_ws`): one
resident CTA an SM, every K step as long as the slower of the expansion and the MMA.

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 instead (tests/test_gemm_w4a16_ws.py); the numerics are checked on the H200
(the same file's GPU tests, the conformance kit).
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
from fp4_dispatch.plugins.sm90 import _gluon_support, _pow2_at_least, cost_model, split_k_rule
from fp4_dispatch.plugins.sm90 import w4a16 as w4
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16_ws import WsConfig

WS_TILE_M = (32, 64, 128)
WS_SPLIT_K = (1, 2, 3, 4)
#: weight rows per CTA and K per step (the kernel's `BLOCK_N` and `STEP_K`)
WS_TILE_N = 128
WS_TILE_K = 64
WS_STAGES = 4
#: the token range offered: the direct kernel wins at decode (16x8192²: 23.1 against
#: 31.3 µs, RESULTS.md "Hopper W4A16" run 6, call 3) and above 256 nothing is measured
WS_MIN_M = 32
WS_MAX_M = 256


class TritonSm90WsTactic(w4.TritonSm90W4A16Tactic):
    """A warp-specialized W4A16 tactic: ``tile_m`` tokens and ``split_k`` vary."""

    backend: Literal["triton-sm90-ws"] = "triton-sm90-ws"  # type: ignore[assignment]
    path: Literal["ws"] = "ws"  # type: ignore[assignment]
    tile_n: Literal[128] = 128  # type: ignore[assignment]
    tile_k: Literal[64] = 64  # type: ignore[assignment]
    num_stages: Literal[4] = 4  # type: ignore[assignment]

    def kernel_config(self) -> WsConfig:  # type: ignore[override]
        """The kernel's compile-time config: these two knobs, the measured rest."""
        from fp4_dispatch.backends.sm90.gemm_w4a16_ws import WsConfig  # noqa: PLC0415 - optional: Triton

        return WsConfig(block_m=self.tile_m, split_k=self.split_k)


def why_invalid(t: TritonSm90WsTactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem` (M tokens, N weight rows), else None: M in
    [`WS_MIN_M`, `WS_MAX_M`], bf16 (the kernel's only activation dtype), K % 32, the
    token tile within M padded to a power of 2, split-K within one wave of CTAs (one CTA
    an SM: a second wave costs a whole round) with >= 2 K steps a split."""
    if not WS_MIN_M <= problem.m <= WS_MAX_M:
        return f"M={problem.m}: offered for {WS_MIN_M} <= M <= {WS_MAX_M} (measured range)"
    if problem.out_dtype != "bfloat16":
        return f"out_dtype={problem.out_dtype}: bf16 activations only"
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    if t.tile_m not in WS_TILE_M or t.tile_m > max(32, _pow2_at_least(problem.m)):
        return f"tile_m={t.tile_m} does not fit M={problem.m} (one of {WS_TILE_M}, <= M padded)"
    if t.split_k not in WS_SPLIT_K or t.num_warps != 4 or t.block_r != 64:
        return (f"split_k in {WS_SPLIT_K}, 4 warps, block_r 64 (got {t.split_k}, "
                f"{t.num_warps}, {t.block_r})")  # fmt: skip
    tiles = -(-problem.m // t.tile_m) * -(-problem.n // WS_TILE_N)
    # the family's split-K rule at one CTA an SM: a second wave costs a whole round
    return split_k_rule(t.split_k, tiles, -(-problem.k // WS_TILE_K), device.sm_count, 1)


# Calibration: the "ws" part of plugins/sm90/cost_model.json, fitted by
# benchmarks/fit_w4a16_model.py --ws on the committed H200 sweep of
# bench_w4a16_ws.py (benchmarks/data, the file's note says on what; the script: git
# history at d90e9a7).


def _c() -> dict:
    return cost_model.constants()["ws"]


def _estimate_ws(t: TritonSm90WsTactic, p: Problem, device: DeviceInfo) -> float:
    """`cta_waves_us` with the ws constants and its 128 x 64 step (one CTA an SM)."""
    return cta_waves_us(_c(), t.tile_m, t.split_k, WS_TILE_N, WS_TILE_K, p, device)


def cta_waves_us(c: dict, tile_m: int, split_k: int, tile_n: int, tile_k: int, p: Problem,
                 device: DeviceInfo, ctas_per_sm: int = 1) -> float:  # fmt: skip
    """Rounds of waves x K steps x the step, plus fixed and split costs (the ws kernel's
    model, `rs._estimate_rs`'s core; constants ``c``).

    A wave is ``ctas_per_sm`` CTAs on every SM. The step is the slower of the weight
    tile's MMA (``2 * tile_n * tile_m * tile_k`` flops at ``mma_eff`` of an SM's bf16
    rate) and its expansion (``deq_step_us`` for ``tile_n x tile_k`` values, whatever the
    token tile) followed by ``mma_serial`` of the MMA (0: expansion and MMA overlap
    fully, ws; the rs warpgroups wait for their own MMA before expanding again); CTAs that
    share an SM take ``shared_step`` times as long a step each
    (fitted: 2 would mean no gain over running them one after the other). HBM bounds it
    from below (the weights re-read per token tile). ``fixed_us``: launch, pipeline fill
    and epilogue. A split adds its fp32 partial tiles' round trip at HBM speed and, per
    wave, ``split_tile_us`` a 128 x 128 partial tile (the split-K epilogue's own time,
    which grows with the tile: RESULTS.md "Hopper W4A16" run 11)."""
    m_tiles, n_tiles = -(-p.m // tile_m), -(-p.n // tile_n)
    ctas = m_tiles * n_tiles * split_k
    waves = math.ceil(ctas / (device.sm_count * ctas_per_sm))
    shared = c["shared_step"] if ctas > device.sm_count and ctas_per_sm > 1 else 1.0
    steps = math.ceil(math.ceil(p.k / tile_k) / split_k)
    mma_rate = device.bf16_tflops * 1e6 / device.sm_count * c["mma_eff"]
    mma = 2.0 * tile_n * tile_m * tile_k / mma_rate
    compute = waves * steps * max(c["deq_step_us"] + c["mma_serial"] * mma, mma) * shared
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    weight_bytes = p.n * p.k * (0.5 + 1.0 / 16) * m_tiles
    memory = (weight_bytes + p.m * p.k * 2.0 + 2.0 * p.m * p.n) / bw  # x re-reads hit L2
    partial = 0.0
    if split_k > 1:
        epilogue = waves * c["split_tile_us"] * tile_m * tile_n / 128**2
        partial = 2 * 4.0 * ctas * tile_m * tile_n / bw + epilogue
    return max(compute, memory) + c["fixed_us"] + partial


class TritonSm90WsBackend(Backend):
    """Hopper W4A16, 32-256 tokens: dequantizing warps feed an MMA warpgroup (Gluon)."""

    name = "triton-sm90-ws"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_w4a16_ws", plugin=__name__)
    tactic_type = TritonSm90WsTactic
    operations: ClassVar[tuple[str, ...]] = ("w4a16",)
    diversity_axes = ("tile_m", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _gluon_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90WsTactic]:
        for tm, split in itertools.product(WS_TILE_M, WS_SPLIT_K):
            t = _tactic(tm, split)
            if why_invalid(t, problem, device) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90WsTactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds (`_estimate_ws`), on the scale of the other W4A16 estimates."""
        assert isinstance(tactic, TritonSm90WsTactic)
        return _estimate_ws(tactic, problem, device)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90WsTactic)
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what `gemm` runs for `problem` with
        contiguous bf16 activations and output."""
        assert isinstance(tactic, TritonSm90WsTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        p = problem
        return kernel.precompile(p.m, p.n, p.k, torch.bfloat16)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on M (``do_not_specialize``): the tactic, N (the output's row
        stride), K and the dtype decide."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)


@functools.cache
def _tactic(tm: int, split: int) -> TritonSm90WsTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90WsTactic(tile_m=tm, split_k=split)


@functools.cache
def _kernel_for(cfg: WsConfig) -> Kernel:
    """One kernel object per config: shapes share compiled code and the split-K workspace."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_ws  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16_ws.build(cfg)
