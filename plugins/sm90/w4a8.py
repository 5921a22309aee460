"""Plugin module: the Hopper W4A8 backend ``triton-sm90-w4a8`` (registered by the sm90
family's hookimpl, `fp4_dispatch.plugins.sm90`).

W4A8 (``operations = ("w4a8",)``, lossy) serves dense calls under ``precision="fp8"``:
activations rounded to FP8 E4M3 per token, NVFP4 weights turned into E4M3 per output
channel, FP8 tensor cores (`fp4_dispatch.backends.sm90.gemm_w4a8`, numerics in
docs/PRECISION.md). It is ranked against the exact W4A16 backends of the same problem on
one microsecond scale. Two paths, one tactic type:

- ``path="fused"``: the weight turned into E4M3 tile by tile inside the GEMM;
  ``tile_n`` weight rows (64/128), ``tile_m`` tokens (16-128), ``tile_k`` (64/128),
  ``split_k``, warps, stages. Offered for M <= `FUSED_MAX_M`.
- ``path="unpack"``: the weight in E4M3 once per call (``block_r`` rows per program,
  ``tile_k`` K per step), then cuBLASLt's FP8 GEMM (``torch._scaled_mm``); ``tile_m``/
  ``tile_n`` nominal 128. Offered for M >= `UNPACK_MIN_M`, bf16 output, N % 16 == 0.
- ``path="rs"``: the warp-specialized Gluon kernel (`gemm_w4a8_rs`: a TMA ring, the
  weight turned into E4M3 by a byte table per scale block in the warps that multiply
  it); ``tile_m`` tokens (64/128), ``split_k``, ``num_stages``; ``tile_n``/``tile_k``
  128, 4 warps nominal. Offered for M > `RS_MIN_M` and K % 128 == 0.

Every tactic has ``swap_ab=False`` (the kernels have their own orientation).

The estimate (`estimate_us`) is a roofline NOT fitted on measurements yet: the terms and
their constants below are stated assumptions, so the W4A16/W4A8 choice of an untuned call
is only as good as they are; tuning measures it (``benchmarks kernels --cases w4a8`` gives the data
to fit them on).
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
from fp4_dispatch.plugins.sm90 import _pow2_at_least, _sm90_support, cost_model, smem_rule
from fp4_dispatch.plugins.sm90 import split_k_rule as _split_k_rule
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a8 import W4A8Config
    from fp4_dispatch.backends.sm90.gemm_w4a8_rs import W4A8RsConfig

TILE_M = (16, 32, 64, 128)
TILE_N = (64, 128)
TILE_K = (64, 128)
SPLIT_K = (1, 2, 4, 8)
WARPS = (4, 8)
STAGES = (3, 4)
BLOCK_R = (16, 32, 64)
UNPACK_TILE_K = (128, 256, 512)
#: the weight pass's time at (block_r, tile_k) over its fastest tile's, 16 x 512
#: (measured on an H100, GPU time in graphs, one run over 13824x5120, 3584x18944 and
#: 4096x14336 at 4 warps, the mean of the three ratios: benchmarks/RESULTS.md, "W4A8 on
#: Hopper" run 4); tiles not listed were slower than every listed one on all three
UNPACK_TILE_SLOWDOWN = {(16, 512): 1.0, (32, 512): 1.17, (32, 256): 1.19, (16, 256): 1.23,
                        (64, 256): 1.23}  # fmt: skip
#: the slowdown assumed for a tile `UNPACK_TILE_SLOWDOWN` does not list
UNPACK_TILE_SLOWDOWN_OTHER = 1.3
#: the fused kernel re-converts the weight once per token tile: past this M the unpack
#: path (one conversion, then cuBLASLt) is the one offered (as W4A16's DIRECT_MAX_M)
FUSED_MAX_M = 1024
#: below this M the weight pass alone costs more than the whole fused kernel
UNPACK_MIN_M = 128
#: the rs kernel's token tiles are 64 or 128: below this M most of a tile is padding
RS_MIN_M = 32
RS_TILE_M = (64, 128)
#: SASS instructions of one K step (128 K) of an rs consumer thread by token tile:
#: counted in the sm_90 compile on the CPU (Triton 3.9, `tests/test_gemm_w4a8_rs.py`
#: pins the bound); 64 fp32 additions of the promoted sum more at 128 tokens
RS_LOOP_INSTR = {64: 208.0, 128: 235.0}
#: µs one CTA takes per K step whatever its tile: on an H100 the rs kernel ran 0.7-0.8 µs
#: a step at 64 and 128 tokens, far above its issue and MMA bounds (benchmarks/RESULTS.md,
#: "W4A8 on Hopper" run 8; read off those six shapes, not fitted or held out)
RS_STEP_US = 0.72
#: split-K up to this many CTAs per SM (the W4A16 direct kernel's rule)
MAX_CTAS_PER_SM = 8

# ---- the estimate's assumptions (not fitted; module docstring) --------------------------
#: instructions per weight element of the fused kernel's conversion (e2m1 decode, two
#: multiplies, the E4M3 rounding, register moves: counted from the kernel's source, a
#: guess until the SASS is counted as for W4A16)
CONVERT_INSTR = 10.0
#: the unpack pass's conversion, per element: 269 PTX instructions in the loop of a 16 x
#: 256 tile for 32 elements a thread (`gemm_w4a8._weight_pairs_e4m3`; the fp32 expansion
#: before it counted 663), counted on this project's CPU compile, not SASS
UNPACK_CONVERT_INSTR = 8.5
#: thread-instructions one SM issues per microsecond: 4 schedulers x 32 lanes x 1.98 GHz
#: x an assumed 60% issue efficiency (the W4A16 gemv model's figure)
INSTR_PER_SM_US = 152000.0
#: fraction of the FP8 peak the fused MMA reaches, by token tile (the W4A16 direct
#: kernel's measured bf16 fractions, ``mma_eff``, carried over)
MMA_EFF = {16: 0.3, 32: 0.4, 64: 0.5, 128: 0.9}
#: fraction of the FP8 peak cuBLASLt's ``_scaled_mm`` reaches at large M (the issue's
#: H200 measurement: FP8 _scaled_mm ran at 1.75-1.91x bf16 cuBLAS at M = 4096)
SCALED_MM_EFF = 0.8
#: a launch of a small kernel (the activation pass, the weight pass), µs
PASS_LAUNCH_US = 3.0


class TritonSm90W4A8Tactic(Tactic):
    """One variant of the W4A8 backend (module docstring)."""

    backend: Literal["triton-sm90-w4a8"] = "triton-sm90-w4a8"
    path: Literal["fused", "unpack", "rs"] = "fused"
    tile_m: Literal[16, 32, 64, 128] = 64
    tile_n: Literal[64, 128] = 128
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    swap_ab: Literal[False] = False
    tile_k: Literal[64, 128, 256, 512] = 128
    split_k: Literal[1, 2, 4, 8] = 1
    num_warps: Literal[4, 8] = 4
    num_stages: Literal[3, 4] = 3
    block_r: Literal[16, 32, 64] = 32

    def rs_config(self) -> W4A8RsConfig:
        """The rs kernel's compile-time config."""
        from fp4_dispatch.backends.sm90.gemm_w4a8_rs import W4A8RsConfig  # noqa: PLC0415 - optional: Triton

        return W4A8RsConfig(block_m=self.tile_m, split_k=self.split_k, stages=self.num_stages)

    def kernel_config(self) -> W4A8Config:
        """The fused kernel's compile-time config."""
        from fp4_dispatch.backends.sm90.gemm_w4a8 import W4A8Config  # noqa: PLC0415 - optional: Triton

        return W4A8Config(block_n=self.tile_n, block_m=self.tile_m, block_k=self.tile_k,
                          split_k=self.split_k, num_warps=self.num_warps,
                          num_stages=self.num_stages)  # fmt: skip


def smem_bytes(tile_n: int, tile_m: int, tile_k: int, stages: int) -> int:
    """Upper estimate of a fused CTA's shared memory: pipelined raw tiles (packed weight
    bytes, scales, E4M3 activations), the E4M3 weight tile for the MMA, or the epilogue."""
    raw = tile_n * (tile_k // 2 + tile_k // 16) + tile_m * tile_k
    return max(stages * raw + tile_n * tile_k, tile_n * tile_m * 4)


def _why_invalid_fused(t: TritonSm90W4A8Tactic, p: Problem, device: DeviceInfo) -> str | None:
    if p.m > FUSED_MAX_M:
        return f"M={p.m} > {FUSED_MAX_M}: the unpack path serves large M"
    if t.block_r != 32:
        return "block_r is an unpack knob (32 for fused tactics)"
    if t.tile_m > max(16, _pow2_at_least(p.m)):
        return f"tile_m={t.tile_m} exceeds M={p.m} padded to a power of 2"
    if t.tile_n > max(64, _pow2_at_least(p.n)):
        return f"tile_n={t.tile_n} exceeds N={p.n}"
    if t.tile_k not in TILE_K or t.tile_k > max(64, _pow2_at_least(p.k)):
        return f"tile_k={t.tile_k}: expected one of {TILE_K}, at most K={p.k} padded"
    if t.num_warps == 8 and (t.tile_n < 128 or t.tile_m < 64):
        return "8 warps only for tiles of 128 weight rows x >= 64 tokens"
    if t.tile_n == 128 and t.tile_m == 128 and t.num_warps != 8:
        return "128x128 tiles need 8 warps (128 fp32 accumulators a thread at 4)"
    why = smem_rule(smem_bytes(t.tile_n, t.tile_m, t.tile_k, t.num_stages))
    if why:
        return why
    tiles = -(-p.m // t.tile_m) * -(-p.n // t.tile_n)
    return _split_k_rule(t.split_k, tiles, -(-p.k // t.tile_k), device.sm_count, MAX_CTAS_PER_SM)


def _why_invalid_unpack(t: TritonSm90W4A8Tactic, p: Problem) -> str | None:
    if p.m < UNPACK_MIN_M:
        return f"M={p.m} < {UNPACK_MIN_M}: the fused kernel wins there"
    if p.out_dtype != "bfloat16":
        return "bfloat16 output only (torch._scaled_mm's row-wise scaling)"
    if p.n % 16:
        return f"N={p.n} must be a multiple of 16 (torch._scaled_mm)"
    nominal = (t.tile_m, t.tile_n, t.split_k, t.num_warps, t.num_stages)
    if nominal != (128, 128, 1, 4, 3):
        return "unpack tactics keep tile 128x128, split_k 1, 4 warps, 3 stages (nominal)"
    if t.tile_k not in UNPACK_TILE_K:
        return f"unpack tile_k: expected one of {UNPACK_TILE_K}, got {t.tile_k}"
    return None


def _why_invalid_rs(t: TritonSm90W4A8Tactic, p: Problem, device: DeviceInfo) -> str | None:
    if p.m <= RS_MIN_M:
        return f"M={p.m} <= {RS_MIN_M}: the rs kernel's token tiles are 64 or 128"
    if p.k % 128:
        return f"K={p.k} must be a multiple of 128 (the rs kernel's whole K steps)"
    if t.tile_m not in RS_TILE_M:
        return f"rs tile_m: expected one of {RS_TILE_M}, got {t.tile_m}"
    if t.tile_m > max(64, _pow2_at_least(p.m)):
        return f"tile_m={t.tile_m} exceeds M={p.m} padded to a power of 2"
    if (t.tile_n, t.tile_k, t.num_warps, t.block_r) != (128, 128, 4, 32):
        return "rs tactics keep tile_n 128, tile_k 128, 4 warps, block_r 32 (nominal)"
    tiles = -(-p.m // t.tile_m) * -(-p.n // t.tile_n)
    # one CTA an SM (the register budget of `gemm_w4a8_rs.SM_REGISTERS_W4A8`)
    return _split_k_rule(t.split_k, tiles, p.k // 128, device.sm_count, 1)


def why_invalid(t: TritonSm90W4A8Tactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem` (M tokens, N weight rows), else None."""
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    if t.path == "fused":
        return _why_invalid_fused(t, problem, device)
    if t.path == "rs":
        return _why_invalid_rs(t, problem, device)
    return _why_invalid_unpack(t, problem)


def _activation_pass_us(p: Problem, device: DeviceInfo) -> float:
    """The per-token quantization: reads x twice (bf16), writes one byte an element."""
    bw = device.mem_bw_gbps * 1e3 * cost_model.constants()["w4a16"]["bw_fraction"]
    return PASS_LAUNCH_US + p.m * p.k * 5.0 / bw


def _tiled_bytes(t: TritonSm90W4A8Tactic, p: Problem) -> float:
    """Bytes a tiled W4A8 GEMM (fused or rs) moves: the NVFP4 weight and its scales once per
    token tile, the E4M3 activations once (L2 after), the bf16/fp16 output, and the fp32
    split-K partials of every CTA."""
    m_tiles, n_tiles = -(-p.m // t.tile_m), -(-p.n // t.tile_n)  # weight rows wrap in a tile
    weight = p.n * p.k * (0.5 + 1.0 / 16) * m_tiles
    partial = 8.0 * m_tiles * n_tiles * t.split_k * t.tile_m * t.tile_n if t.split_k > 1 else 0.0
    return weight + p.m * p.k + 2.0 * p.m * p.n + partial


def estimate_fused(t: TritonSm90W4A8Tactic, p: Problem, device: DeviceInfo) -> float:
    """Activation pass + a smooth maximum (4-norm, as the W4A16 model) of the conversion,
    the MMA and memory over the waves of CTAs + launch + split-K reduction."""
    c = cost_model.constants()["w4a16"]
    m_tiles, n_tiles = -(-p.m // t.tile_m), -(-p.n // t.tile_n)  # weight rows wrap in a tile
    ctas = m_tiles * n_tiles * t.split_k
    per_sm = math.ceil(ctas / device.sm_count)
    steps = math.ceil(p.k / t.split_k / t.tile_k)
    elems = t.tile_n * t.tile_k  # weight elements a CTA converts per step
    convert = per_sm * steps * elems * CONVERT_INSTR / INSTR_PER_SM_US
    mma_rate = device.fp8_tflops * 1e6 / device.sm_count * MMA_EFF[t.tile_m]
    mma = per_sm * steps * 2.0 * t.tile_m * elems / mma_rate
    memory = _tiled_bytes(t, p) / (device.mem_bw_gbps * 1e3 * c["direct_bw_fraction"])
    bound = (convert**4 + mma**4 + memory**4) ** 0.25
    reduce = c["split_reduce_us"] * math.log2(t.split_k)
    return _activation_pass_us(p, device) + bound + c["launch_us"] + reduce


def estimate_rs(t: TritonSm90W4A8Tactic, p: Problem, device: DeviceInfo) -> float:
    """The pass (activations and channel scales) + a smooth maximum of the consumers'
    issue (`RS_LOOP_INSTR`, 8 warps a CTA), the FP8 MMA, memory and the measured step
    latency (`RS_STEP_US`) over the waves of CTAs + launch + split-K reduction."""
    c = cost_model.constants()["w4a16"]
    m_tiles, n_tiles = -(-p.m // t.tile_m), -(-p.n // t.tile_n)
    waves = math.ceil(m_tiles * n_tiles * t.split_k / device.sm_count)
    steps = math.ceil(p.k / 128 / t.split_k)
    issue = waves * steps * 8 * 32 * RS_LOOP_INSTR[t.tile_m] / INSTR_PER_SM_US
    mma_rate = device.fp8_tflops * 1e6 / device.sm_count * MMA_EFF[t.tile_m]
    mma = waves * steps * 2.0 * t.tile_m * t.tile_n * 128 / mma_rate
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    memory = _tiled_bytes(t, p) / bw
    latency = waves * steps * RS_STEP_US
    bound = (issue**4 + mma**4 + memory**4 + latency**4) ** 0.25
    reduce = c["split_reduce_us"] * math.log2(t.split_k)
    weight_scales = p.n * p.k / 16 / bw  # the pass reads every block scale once
    return _activation_pass_us(p, device) + weight_scales + bound + c["launch_us"] + reduce


def estimate_unpack(t: TritonSm90W4A8Tactic, p: Problem, device: DeviceInfo) -> float:
    """Activation pass + weight pass (memory or conversion bound) + ``_scaled_mm``."""
    c = cost_model.constants()["w4a16"]
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    # the pass's grid cuts K into spans until every SM has programs
    # (`gemm_w4a8.unpack_grid`): the conversion spreads evenly over the SMs
    per_sm = math.ceil(p.n * p.k / device.sm_count)
    convert = per_sm * UNPACK_CONVERT_INSTR / INSTR_PER_SM_US
    slowdown = UNPACK_TILE_SLOWDOWN.get((t.block_r, t.tile_k), UNPACK_TILE_SLOWDOWN_OTHER)
    unpack = max(p.n * p.k * (0.5 + 1.0 / 16 + 1.0) / bw, convert) * slowdown + PASS_LAUNCH_US
    gemm = max(
        p.flops / (device.fp8_tflops * 1e6 * SCALED_MM_EFF),
        ((p.m + p.n) * p.k + 2.0 * p.m * p.n) / bw,
    )
    return _activation_pass_us(p, device) + unpack + gemm + c["launch_us"]


class TritonSm90W4A8Backend(Backend):
    """Hopper W4A8: dense activations x NVFP4 weights on FP8 tensor cores (lossy)."""

    name = "triton-sm90-w4a8"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_w4a8",
                            "fp4_dispatch.backends.sm90.gemm_w4a8_rs", plugin=__name__)  # fmt: skip
    tactic_type = TritonSm90W4A8Tactic
    operations: ClassVar[tuple[str, ...]] = ("w4a8",)
    diversity_axes = ("path", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90W4A8Tactic]:
        for tm, tn, tk, split, warps, stages in itertools.product(
            TILE_M, TILE_N, TILE_K, SPLIT_K, WARPS, STAGES
        ):
            t = _tactic("fused", tm, tn, tk, split, warps, stages, 32)
            if why_invalid(t, problem, device) is None:
                yield t
        for br, tk in itertools.product(BLOCK_R, UNPACK_TILE_K):
            t = _tactic("unpack", 128, 128, tk, 1, 4, 3, br)
            if why_invalid(t, problem, device) is None:
                yield t
        for tm, split, stages in itertools.product(RS_TILE_M, SPLIT_K, STAGES):
            t = _tactic("rs", tm, 128, 128, split, 4, stages, 32)
            if why_invalid(t, problem, device) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90W4A8Tactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds, on the W4A16 backends' scale (module docstring: not fitted)."""
        assert isinstance(tactic, TritonSm90W4A8Tactic)
        if tactic.path == "fused":
            return estimate_fused(tactic, problem, device)
        if tactic.path == "rs":
            return estimate_rs(tactic, problem, device)
        return estimate_unpack(tactic, problem, device)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90W4A8Tactic)
        if tactic.path == "unpack":
            return _unpack_kernel_for(tactic.block_r, tactic.tile_k)
        if tactic.path == "rs":
            return _rs_kernel_for(tactic.rs_config())
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) the passes a call with contiguous
        activations and output of the output dtype runs."""
        assert isinstance(tactic, TritonSm90W4A8Tactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.out_dtype]
        kernel.precompile(problem.m, problem.n, problem.k, dtype)  # type: ignore[attr-defined]
        return kernel

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """Neither path specializes on M (``do_not_specialize``); N, K and the dtype do."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)


@functools.cache
def _tactic(
    path: str, tm: int, tn: int, tk: int, split: int, warps: int, stages: int, br: int
) -> TritonSm90W4A8Tactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90W4A8Tactic(path=path, tile_m=tm, tile_n=tn, tile_k=tk, split_k=split,
                                num_warps=warps, num_stages=stages, block_r=br)  # fmt: skip


@functools.cache
def _kernel_for(cfg: W4A8Config) -> Kernel:
    """One kernel object per config: shapes share compiled code and the split-K workspace."""
    from fp4_dispatch.backends.sm90 import gemm_w4a8  # noqa: PLC0415 - optional: Triton

    return gemm_w4a8.build(cfg)


@functools.cache
def _unpack_kernel_for(block_r: int, block_k: int) -> Kernel:
    from fp4_dispatch.backends.sm90 import gemm_w4a8  # noqa: PLC0415 - optional: Triton

    return gemm_w4a8.build_unpack(block_r, block_k)


@functools.cache
def _rs_kernel_for(cfg: W4A8RsConfig) -> Kernel:
    from fp4_dispatch.backends.sm90 import gemm_w4a8_rs  # noqa: PLC0415 - optional: Triton

    return gemm_w4a8_rs.build(cfg)
