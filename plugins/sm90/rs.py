"""Plugin module: ``triton-sm90-rs``, Hopper W4A16 from wgmma-register weights (64-256 tokens).

The kernel (`fp4_dispatch.backends.sm90.gemm_w4a16_rs`, Gluon, its warp-specialized
variant) gives each of two warpgroups 64 of a CTA's 128 weight rows: they expand their
NVFP4 bytes in registers and feed them to ``wgmma`` as its A operand, the tokens (B) come
from shared memory, a TMA warp fills the ring. The activations are first written in the
dot's K order by a short pass (part of each call). Tactics: ``tile_m`` 64 (4 stages), 128
(3 stages) or 256 (3 stages) tokens, 128-wide K steps, ``split_k`` 1-4 within one wave
(RESULTS.md, "Hopper W4A16" runs 9-11); with 64-token tiles also ``ctas_per_sm`` 2 (a
register budget that lets two CTAs share an SM, offered where the grid is over one CTA an
SM: 0.85-0.97x the one-CTA time on most such shapes in run 10; below one wave the second
slot stays empty). A 256-token tile expands each weight once for twice the tokens: at
M = 192-256 it is the fastest rs tactic on 8 of 12 shapes of run 11 (256x13824x5120: 61.0
against 73.4 µs with 128-token tiles). The kernel's single-partition variant stays in
`RsConfig`, benchmarked and not offered.

Why a backend of its own: it competes with ``triton-sm90-ws`` (faster on 14 of the 18
shapes of run 9 at M = 64-256, by up to 24%, within 2% on the rest) and with the direct
kernel, and its cost model has its own constants (`_estimate_rs`).

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 instead (tests/test_gemm_w4a16_rs.py) and runs the activation pass under
the interpreter; the numerics are checked on the H200.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import _gluon_support, _pow2_at_least, cost_model, split_k_rule
from fp4_dispatch.plugins.sm90 import w4a16 as w4
from fp4_dispatch.plugins.sm90.ws import cta_waves_us
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16_rs import RsConfig

RS_TILE_M = (64, 128, 256)
#: the largest M each token tile is offered for: what the sweeps timed (64-token tiles at
#: M 64 and 128 only; at M = 256 the estimate would otherwise pick an untimed tactic)
RS_TILE_MAX_M = {64: 128, 128: 256, 256: 256}
RS_SPLIT_K = (1, 2, 3, 4)
#: CTAs an SM by token tile (`gemm_w4a16_rs.SM_REGISTERS`: a 128-token accumulator does
#: not fit the two-CTA budget)
RS_CTAS_PER_SM = {64: (1, 2), 128: (1,), 256: (1,)}
#: ring slots per token tile: the best of each in run 9; 256 tokens: as many as fit
#: (shared memory: 100 / 123 / 219 KiB)
RS_STAGES = {64: 4, 128: 3, 256: 3}
#: weight rows per CTA and K per step (the kernel's `BLOCK_N` and `STEP_K`)
RS_TILE_N = 128
RS_TILE_K = 128
#: the token range offered: measured at 64-256 (run 9); the mma and direct kernels own
#: decode, and above 256 nothing is measured
RS_MIN_M = 64
RS_MAX_M = 256


class TritonSm90RsTactic(w4.TritonSm90W4A16Tactic):
    """A register-sourced wgmma W4A16 tactic: ``tile_m`` tokens and ``split_k`` vary."""

    backend: Literal["triton-sm90-rs"] = "triton-sm90-rs"  # type: ignore[assignment]
    path: Literal["rs"] = "rs"  # type: ignore[assignment]
    tile_m: Literal[64, 128, 256] = 128  # type: ignore[assignment]
    tile_n: Literal[128] = 128  # type: ignore[assignment]
    tile_k: Literal[128] = 128  # type: ignore[assignment]
    #: CTAs one SM holds at once (`RS_CTAS_PER_SM`)
    ctas_per_sm: Literal[1, 2] = 1

    def kernel_config(self) -> RsConfig:  # type: ignore[override]
        """The kernel's compile-time config (warp-specialized, the tile's stages)."""
        from fp4_dispatch.backends.sm90.gemm_w4a16_rs import RsConfig  # noqa: PLC0415 - optional: Triton

        return RsConfig(block_m=self.tile_m, split_k=self.split_k, stages=self.num_stages,
                        specialized=True, ctas_per_sm=self.ctas_per_sm)  # fmt: skip


def why_invalid(t: TritonSm90RsTactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem`, else None: M in [`RS_MIN_M`, `RS_MAX_M`],
    K % 128 (whole steps), the token tile within M padded to a power of 2 and its
    `RS_TILE_MAX_M`, with its stages, split-K within one wave of CTAs (``ctas_per_sm``
    CTAs an SM) with >= 2 K steps a split; two CTAs an SM only where the grid is over
    one CTA an SM (below, the second slot stays empty and the smaller register budget
    only costs)."""
    if not RS_MIN_M <= problem.m <= RS_MAX_M:
        return f"M={problem.m}: offered for {RS_MIN_M} <= M <= {RS_MAX_M} (measured range)"
    if problem.k % RS_TILE_K:
        return f"K={problem.k} must be a multiple of {RS_TILE_K}"
    if t.tile_m not in RS_TILE_M or t.tile_m > _pow2_at_least(problem.m):
        return f"tile_m={t.tile_m} does not fit M={problem.m} (one of {RS_TILE_M}, <= M padded)"
    if problem.m > RS_TILE_MAX_M[t.tile_m]:
        return f"tile_m={t.tile_m}: offered up to M={RS_TILE_MAX_M[t.tile_m]} (measured range)"
    if t.num_stages != RS_STAGES[t.tile_m]:
        return f"num_stages={t.num_stages}: tile_m={t.tile_m} runs {RS_STAGES[t.tile_m]}"
    if t.split_k not in RS_SPLIT_K or t.num_warps != 4 or t.block_r != 64:
        return (f"split_k in {RS_SPLIT_K}, 4 warps, block_r 64 (got {t.split_k}, "
                f"{t.num_warps}, {t.block_r})")  # fmt: skip
    if t.ctas_per_sm not in RS_CTAS_PER_SM[t.tile_m]:
        return (f"ctas_per_sm={t.ctas_per_sm}: tile_m={t.tile_m} runs "
                f"{RS_CTAS_PER_SM[t.tile_m]}")  # fmt: skip
    tiles = -(-problem.m // t.tile_m) * -(-problem.n // RS_TILE_N)
    if t.ctas_per_sm > 1 and tiles * t.split_k <= device.sm_count:
        return (f"ctas_per_sm={t.ctas_per_sm}: {tiles * t.split_k} CTAs fit one an SM "
                f"({device.sm_count} SMs)")  # fmt: skip
    return split_k_rule(t.split_k, tiles, problem.k // RS_TILE_K, device.sm_count,
                        t.ctas_per_sm)  # fmt: skip


# Calibration: the "rs" part of plugins/sm90/cost_model.json, fitted by
# benchmarks/fit_w4a16_model.py --rs on the committed H200 sweep of bench_w4a16_rs.py
# (benchmarks/data, the file's note says on what; the script: git history at d90e9a7).


def _c() -> dict:
    return cost_model.constants()["rs"]


def _estimate_rs(t: TritonSm90RsTactic, p: Problem, device: DeviceInfo) -> float:
    """`ws.cta_waves_us` with the rs constants, its 128 x 128 step and the tactic's CTAs
    an SM (``fixed_us``: both launches, pipeline fill and epilogue), plus the activation
    pass, which reads and writes the activations once at HBM speed."""
    c = _c()
    gemm = cta_waves_us(c, t.tile_m, t.split_k, RS_TILE_N, RS_TILE_K, p, device, t.ctas_per_sm)
    return gemm + 4.0 * p.m * p.k / (device.mem_bw_gbps * 1e3 * c["bw_fraction"])


class TritonSm90RsBackend(Backend):
    """Hopper W4A16, 64-256 tokens: warpgroups expand their weights into wgmma's registers."""

    name = "triton-sm90-rs"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_w4a16_rs", plugin=__name__)
    tactic_type = TritonSm90RsTactic
    operations: ClassVar[tuple[str, ...]] = ("w4a16",)
    diversity_axes = ("tile_m", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _gluon_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90RsTactic]:
        for tm, split in itertools.product(RS_TILE_M, RS_SPLIT_K):
            for ctas in RS_CTAS_PER_SM[tm]:
                t = _tactic(tm, split, ctas)
                if why_invalid(t, problem, device) is None:
                    yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90RsTactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds (`_estimate_rs`), on the scale of the other W4A16 estimates."""
        assert isinstance(tactic, TritonSm90RsTactic)
        return _estimate_rs(tactic, problem, device)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90RsTactic)
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) the GEMM `gemm` runs for `problem` with
        bf16 activations and output (the activation pass compiles on its first call)."""
        assert isinstance(tactic, TritonSm90RsTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        p = problem
        return kernel.precompile(p.m, p.n, p.k, torch.bfloat16)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on M (``do_not_specialize``): the tactic, N, K and the dtype."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)


@functools.cache
def _tactic(tm: int, split: int, ctas: int) -> TritonSm90RsTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90RsTactic(tile_m=tm, split_k=split, num_stages=RS_STAGES[tm],
                              ctas_per_sm=ctas)  # fmt: skip


@functools.cache
def _kernel_for(cfg: RsConfig) -> Kernel:
    """One kernel object per config: shapes share compiled code and the buffers."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16_rs.build(cfg)
