"""Plugin module: the Hopper W4A16 backend ``triton-sm90-w4a16`` (registered by the sm90
family's hookimpl, `fp4_dispatch.plugins.sm90`).

W4A16 = dense bf16/fp16 activations ``x [M, K]`` times NVFP4 weights ``[N, K]``
(`fp4_dispatch.backends.sm90.gemm_w4a16`). The problem is read as ``Problem(m=M
tokens, n=N weight rows, k=K, out_dtype)``; the activation dtype is the output dtype's
family at call time (the kernel specializes on it). Two paths, one tactic type:

- ``path="direct"``: the fused kernel; ``tile_n`` weight rows (64/128, the MMA's wide
  side), ``tile_m`` tokens (16-128, the narrow side; 64 and more read activations put in
  the dot's K order once per call, `X_DOT_MIN_TILE_M`), ``tile_k``, ``split_k``, warps,
  stages (tile_m 128 needs 8 warps). Offered for M <= `DIRECT_MAX_M`.
- ``path="unpack"``: expand the weight once to the activation dtype (alpha folded in),
  then cuBLAS; ``block_r`` x ``tile_k`` is the unpack tile, ``tile_m``/``tile_n`` are
  nominal 128. Offered for M >= `UNPACK_MIN_M`.
- ``path="gemv"``: the tensor-core-free decode kernel of
  `fp4_dispatch.backends.sm90.gemm_w4a16_decode` (fp32 FMAs in registers, no tensor
  cores; measured on the H200, its estimate scaled, not fitted): ``tile_m`` tokens (1, 2, 4:
  the padded M, one token tile), ``tile_n`` weight rows (16-64), ``tile_k``
  (256-1024), ``split_k``, warps, ``num_stages`` 1 (plain loads) or 2 (Triton's
  cp.async pipeline). Offered for M <= `GEMV_MAX_M`.

Orientation is the kernel's own (weights always on the wide side), so every tactic has
``swap_ab=False``. ``operations = ("w4a16",)``: the dispatcher ranks these tactics for
W4A16 problems only.
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
from fp4_dispatch.plugins.sm90 import (
    _pow2_at_least,
    _sm90_support,
    cost_model,
    smem_rule,
    split_k_rule,
    triton_config,
)
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16 import W4A16Config
    from fp4_dispatch.backends.sm90.gemm_w4a16_decode import W4A16GemvConfig

TILE_M = (16, 32, 64, 128)
TILE_N = (64, 128)
TILE_K = (64, 128, 256)
#: split-K widths of the direct path: every width to 8 (the K tiles need not divide: the
#: last split takes the remainder), then 16. The widths between the powers of two fill
#: the resident CTA slots more evenly: on the H200 (RESULTS.md, "Hopper W4A16" run 5)
#: 3 splits ran 1x13824x5120 in 22.0 µs against 24.3 at 4, 7 ran 1x4608x3584 in 9.8
#: against 10.9, and 6 ran 1x5120² in 12.6 against 13.4
SPLIT_K = (1, 2, 3, 4, 5, 6, 7, 8, 16)
WARPS = (4, 8)
STAGES = (3, 4, 6)
BLOCK_R = (32, 64, 128)
#: gemv (decode) knobs: tokens per CTA, weight rows per CTA, K per step, splits, stages
GEMV_TILE_M = (1, 2, 4)
GEMV_TILE_N = (16, 32, 64)
GEMV_TILE_K = (256, 512, 1024)
GEMV_SPLIT_K = (1, 2, 4, 8)
GEMV_STAGES = (1, 2)
#: the gemv tactics offered (a subset of what the kernel and `_why_invalid_gemv` accept):
#: on the H200 decode sweep (2026-12-01, RESULTS.md "W4A16 decode") the best gemv of every
#: M = 1 shape had tile_k 256 and one stage; 512/1024-wide K steps and the cp.async
#: pipeline measured 1.1-2x slower, and at M = 2-4 every gemv took 1.3-3.9x the direct
#: kernel's best (one FMA per token and weight element: the wgmma kernel's products are free)
GEMV_OFFERED_TILE_K = (256,)
GEMV_OFFERED_STAGES = (1,)
GEMV_OFFERED_MAX_M = 1
#: the largest M the gemv kernel runs (validity); more tokens: the wgmma kernel
GEMV_MAX_M = 4
#: weight bytes one thread holds per K step, (min, max): fewer leaves the loop overhead
#: unamortised, more spills the dequantized values (registers)
GEMV_THREAD_BYTES = (16, 64)
#: the grid split-K may grow a gemv grid to (16 CTAs per SM: several rounds of the 3-7
#: that fit at once, `gemv_ctas_per_sm`; more only adds split-K partials)
GEMV_MAX_CTAS_PER_SM = 16
#: the direct kernel re-streams the whole weight per token tile: past this M the unpack
#: path (one expansion, then cuBLAS) is cheaper (W4A4 measurement: RESULTS.md, "Hopper")
DIRECT_MAX_M = 1024
#: split-K up to this many direct-kernel CTAs per SM (the W4A4 rule's 4 rejected the
#: measured best decode tiles: 64 weight rows x split 4-8 run 4-6 CTAs per SM)
DIRECT_MAX_CTAS_PER_SM = 8
#: below this M the unpack pass alone costs about as much as the direct kernel
UNPACK_MIN_M = 256
#: direct tiles of this many tokens or more take their activations in the dot's K order,
#: made once per call (`gemm_w4a16.dot_order_activations`), instead of every CTA
#: permuting its tile: at 64 and 128 tokens that permutation cost 18-27% of the kernel
#: on the H200 (RESULTS.md, "Hopper W4A16" run 5); at 16 the SASS loop grew instead
#: (294 against 270 instructions at 64x16x128), so decode tiles keep it
X_DOT_MIN_TILE_M = 64


class TritonSm90W4A16Tactic(Tactic):
    """One variant of the W4A16 backend (see the module docstring for the knobs)."""

    backend: Literal["triton-sm90-w4a16"] = "triton-sm90-w4a16"
    path: Literal["direct", "unpack", "gemv"] = "direct"
    tile_m: Literal[1, 2, 4, 16, 32, 64, 128] = 16
    tile_n: Literal[16, 32, 64, 128] = 128
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    swap_ab: Literal[False] = False
    tile_k: Literal[64, 128, 256, 512, 1024] = 128
    split_k: Literal[1, 2, 3, 4, 5, 6, 7, 8, 16] = 1
    num_warps: Literal[4, 8] = 4
    num_stages: Literal[1, 2, 3, 4, 6] = 3
    block_r: Literal[32, 64, 128] = 64

    def kernel_config(self) -> W4A16Config:
        """The direct kernel's compile-time config (direct path only): token tiles of
        `X_DOT_MIN_TILE_M` or more read activations put in the dot's order per call."""
        from fp4_dispatch.backends.sm90.gemm_w4a16 import W4A16Config  # noqa: PLC0415 - optional: Triton

        return triton_config(W4A16Config, self, x_dot=self.tile_m >= X_DOT_MIN_TILE_M)

    def gemv_config(self) -> W4A16GemvConfig:
        """The gemv kernel's compile-time config (gemv path only)."""
        from fp4_dispatch.backends.sm90.gemm_w4a16_decode import W4A16GemvConfig  # noqa: PLC0415 - optional: Triton

        return triton_config(W4A16GemvConfig, self)


def smem_bytes(tile_n: int, tile_m: int, tile_k: int, stages: int) -> int:
    """Mirror of `gemm_w4a16.smem_estimate` (kept here: no Triton import needed)."""
    raw = tile_n * (tile_k // 2 + tile_k // 16) + tile_m * tile_k * 2
    return max((stages - 1) * raw + tile_m * tile_k * 2, tile_n * tile_m * 4)


def _why_invalid_direct(t: TritonSm90W4A16Tactic, p: Problem, device: DeviceInfo) -> str | None:
    """Rules of the direct path: fitting tiles, register and shared-memory budgets, split-K
    only while the grid is under two waves (at most four CTAs per SM, >= 2 K steps each)."""
    if p.m > DIRECT_MAX_M:
        return f"M={p.m} > {DIRECT_MAX_M}: the unpack path serves large M"
    if t.block_r != 64:
        return "block_r is an unpack knob (64 for direct tactics)"
    if t.tile_m not in TILE_M or t.tile_m > max(16, _pow2_at_least(p.m)):
        return f"tile_m={t.tile_m} does not fit M={p.m} (16..128, <= M padded to a power of 2)"
    if t.tile_n not in TILE_N or t.tile_k not in TILE_K or t.num_stages not in STAGES:
        return (f"direct tiles: tile_n in {TILE_N}, tile_k in {TILE_K}, num_stages in "
                f"{STAGES} (got {t.tile_n}, {t.tile_k}, {t.num_stages})")  # fmt: skip
    if t.tile_n > max(64, _pow2_at_least(p.n)):
        return f"tile_n={t.tile_n} exceeds N={p.n}"
    if t.tile_k > max(64, _pow2_at_least(p.k)):
        return f"tile_k={t.tile_k} exceeds K={p.k}"
    if t.tile_k == 256:
        # slower than tile_k 128 on every decode shape timed on the H200 (RESULTS.md,
        # "Hopper W4A16" run 2: 29.4 vs 25.2 µs at 1x8192²; again in run 4's exploration:
        # two wgmma groups a step, 234 registers at 128 rows); larger M never fitted it
        return "tile_k=256: slower than 128 wherever it fits (measured), not offered"
    if t.num_warps == 8 and t.tile_n < 128:
        return "8 warps only with tile_n=128 (one 64-row warpgroup MMA per 4 warps)"
    if t.tile_m == 128 and (t.num_warps != 8 or t.tile_n != 128 or t.tile_k > 128):
        return "tile_m=128 only as 128x128 tiles, 8 warps, tile_k <= 128 (registers)"
    if t.num_stages == 4 and t.tile_k == 256:
        return "4 stages only with tile_k <= 128 (shared memory)"
    if t.num_stages == 6:
        # slower than 4 stages on every decode shape timed on the H200 (RESULTS.md, "Hopper
        # W4A16" run 2: 34.7 vs 25.2 µs at 1x8192², and run 4's exploration; why is not
        # established)
        return "6 stages: slower than 4 on every shape measured, not offered"
    why = smem_rule(smem_bytes(t.tile_n, t.tile_m, t.tile_k, t.num_stages))
    if why:
        return why
    tiles = -(-p.m // t.tile_m) * -(-p.n // t.tile_n)
    return split_k_rule(t.split_k, tiles, -(-p.k // t.tile_k), device.sm_count,
                        DIRECT_MAX_CTAS_PER_SM)  # fmt: skip


def _why_invalid_unpack(t: TritonSm90W4A16Tactic, p: Problem) -> str | None:
    """Rules of the unpack path: M >= UNPACK_MIN_M; direct-only knobs at their defaults."""
    if p.m < UNPACK_MIN_M:
        return f"M={p.m} < {UNPACK_MIN_M}: the direct kernel wins there"
    defaults = (t.tile_m, t.tile_n, t.split_k, t.num_warps, t.num_stages)
    if defaults != (128, 128, 1, 4, 3):
        return "unpack tactics keep tile 128x128, split_k 1, 4 warps, 3 stages (nominal)"
    if t.tile_k not in TILE_K:
        return f"unpack tile_k: expected one of {TILE_K}, got {t.tile_k}"
    if t.block_r * t.tile_k > 128 * 128:
        return f"unpack tile {t.block_r}x{t.tile_k} exceeds 16384 elements"
    if t.tile_k > max(64, _pow2_at_least(p.k)):
        return f"tile_k={t.tile_k} exceeds K={p.k}"
    return None


def gemv_thread_bytes(t: TritonSm90W4A16Tactic) -> float:
    """Packed weight bytes one thread of a gemv CTA holds per K step."""
    return t.tile_n * t.tile_k / 2 / (32 * t.num_warps)


def _why_invalid_gemv(t: TritonSm90W4A16Tactic, p: Problem, device: DeviceInfo) -> str | None:
    """Rules of the gemv path: M <= GEMV_MAX_M in one token tile, its own tile choices,
    a per-thread register budget, split-K while the grid stays small (>= 2 K steps)."""
    if p.m > GEMV_MAX_M:
        return f"M={p.m} > {GEMV_MAX_M}: the wgmma kernel serves more tokens"
    if t.tile_m != _pow2_at_least(p.m):
        return f"gemv tile_m must be M={p.m} padded to a power of 2 (one token tile)"
    if t.block_r != 64:
        return "block_r is an unpack knob (64 for gemv tactics)"
    if (t.tile_m not in GEMV_TILE_M or t.tile_n not in GEMV_TILE_N
            or t.tile_k not in GEMV_TILE_K or t.split_k not in GEMV_SPLIT_K
            or t.num_stages not in GEMV_STAGES):  # fmt: skip
        return (f"gemv: tile_m in {GEMV_TILE_M}, tile_n in {GEMV_TILE_N}, tile_k in "
                f"{GEMV_TILE_K}, split_k in {GEMV_SPLIT_K}, num_stages in "
                f"{GEMV_STAGES}")  # fmt: skip
    low, high = GEMV_THREAD_BYTES
    if not low <= gemv_thread_bytes(t) <= high:
        return f"gemv: {gemv_thread_bytes(t):g} weight bytes per thread and step (not {low}-{high})"
    if t.tile_n > max(16, _pow2_at_least(p.n)):
        return f"tile_n={t.tile_n} exceeds N={p.n}"
    k_steps = -(-p.k // t.tile_k)
    if t.tile_k > max(256, _pow2_at_least(p.k)):
        return f"tile_k={t.tile_k} exceeds K={p.k}"
    if t.split_k > 1:
        ctas = -(-p.n // t.tile_n) * t.split_k
        if ctas > GEMV_MAX_CTAS_PER_SM * device.sm_count:
            return f"split-K beyond {GEMV_MAX_CTAS_PER_SM} CTAs per SM ({ctas} CTAs)"
        if k_steps < 2 * t.split_k:
            return f"split_k={t.split_k} leaves < 2 K steps per split ({k_steps} steps)"
    return None


def why_invalid(t: TritonSm90W4A16Tactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem` (M tokens, N weight rows), else None."""
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    if t.path == "direct":
        return _why_invalid_direct(t, problem, device)
    if t.path == "gemv":
        return _why_invalid_gemv(t, problem, device)
    return _why_invalid_unpack(t, problem)


# Calibration: the "w4a16" part of plugins/sm90/cost_model.json (`_c()`).
#
# Direct path (v2, fitted; the file's note says on what). The time is the largest of four
# bounds plus launch and split-K reduction (`_estimate_direct`): the chain of dependent K
# steps (``step_us`` per 128-wide step, scaled by sqrt(tile_k / 128): a wider step carries
# more bytes but the same chain) times the rounds of CTAs the busiest SM runs; the weight
# dequantization at ``dequant_elems_per_sm_us``; the MMA at ``mma_eff`` of the bf16 peak by
# tile_m (its N side: tokens); and HBM at ``direct_bw_fraction``, reduced while the
# resident CTAs keep fewer than ``in_flight_bytes`` of weights in their pipeline stages.
# Residency (`direct_ctas_per_sm`) is the tightest of registers, shared memory and warps:
# why 64-row weight tiles win at decode (74 registers a thread, 6 CTAs an SM, against 4 at
# 128 rows). The four constants come from benchmarks/fit_w4a16_model.py on the committed
# H200 decode sweep (v3, on the driver's bandwidth as the dispatcher sees it live: the
# untuned pick's measured time over the best offered one: mean 1.026, worst 1.140
# in-sample; 1.020 and 1.047 on the held-out shapes; mean |log(estimate / measured)| 0.18
# and 0.24). launch_us, split_reduce_us, mma_eff: v0's (the W4A4 model's). The unpack
# path: ``unpack_gemm_eff`` and ``unpack_launch_us`` (optimistic by 8-20% at M = 256:
# RESULTS.md "Hopper W4A16" run 6).
#
# M = 32-256 (tiles of 32+ tokens): ``mid_step_scale`` and ``mma_eff`` at tile_m 32, 64
# and 128, fitted by ``fit_w4a16_model.py --mid`` (pick/best 1.048 in-sample, 1.039
# held-out, worst 1.115 held-out); the decode terms are not refitted by it.
#
# The W4A4 entry of the same kernel (``nvfp4_activations``, `plugins.sm90.dense`):
# ``dense_step_scale`` and ``dense_time_scale``, fitted by ``fit_w4a16_model.py --dense``
# (its docstring) after the four above.
#
# gemv (`_estimate_gemv`): bound by issue or by memory. Issue: SASS instructions per
# weight element of its main loop (static counts of the sm_90 cubin, Triton 3.9:
# ``gemv_instr`` at one token and 1 stage, ``gemv_instr_per_token`` for each further
# token, ``gemv_instr_pipelined`` extra with Triton's cp.async pipeline), issued at
# ``gemv_instr_per_sm_us`` thread-instructions per SM and µs (4 schedulers x 32 lanes x
# 1.98 GHz x an assumed 60% issue efficiency). Memory: HBM at bw_fraction, reduced when
# the resident CTAs keep fewer than ``gemv_in_flight_bytes`` in flight (Little's law:
# ~4.25 TB/s x ~1.4 µs of loaded latency). Not measured yet: benchmarks kernels --cases w4a16-decode
# gives the data to fit these on.


def _c() -> dict:
    return cost_model.constants()["w4a16"]


def w4a16_min_bytes(problem: Problem) -> float:
    """Fewest bytes: bf16 activations, NVFP4 weights + scales, 2-byte output."""
    m, n, k = problem.m, problem.n, problem.k
    return m * k * 2.0 + n * k * (0.5 + 1.0 / 16) + 2.0 * m * n


def direct_registers(t: TritonSm90W4A16Tactic) -> int:
    """Registers per thread of a direct-kernel variant, a formula read off the H200's
    Triton 3.6 compiles (RESULTS.md, "Hopper W4A16" run 4: 128 for 128x16x128 at 4 warps,
    74 at 64 rows, 75 at 8 warps, 234 and 140 for tile_k 256 at 4 and 8 warps): the
    expanded weight tile (1.5 registers per 2 values a thread), the fp32 accumulator and
    16 of addresses and loop state; at most 255."""
    threads = 32 * t.num_warps
    regs = 16 + 1.5 * t.tile_n * t.tile_k / (2 * threads) + t.tile_n * t.tile_m / threads
    return min(255, math.ceil(regs))


def direct_ctas_per_sm(t: TritonSm90W4A16Tactic) -> int:
    """Direct-kernel CTAs one SM holds at once (`cost_model.resident_ctas`: registers,
    shared memory and warps) for `direct_registers` and `smem_bytes`."""
    shared = smem_bytes(t.tile_n, t.tile_m, t.tile_k, t.num_stages)
    return cost_model.resident_ctas(direct_registers(t), shared, t.num_warps)


def _estimate_direct(
    t: TritonSm90W4A16Tactic, p: Problem, device: DeviceInfo, nvfp4_activations: bool = False
) -> float:
    """max(step latency, weight dequantization, MMA, memory) + launch + split reduction.

    ``nvfp4_activations``: the W4A4 entry of the same kernel (`plugins.sm90.dense`): each
    step also expands its ``tile_m x tile_k`` activation values, its dependent chain is
    ``dense_step_scale`` times longer, and the activations are NVFP4 bytes."""
    c = _c()
    tm, tn, tk, split = t.tile_m, t.tile_n, t.tile_k, t.split_k
    m_tiles, n_tiles = -(-p.m // tm), -(-p.n // tn)
    ctas = m_tiles * n_tiles * split
    steps = math.ceil(p.k / split / tk)
    per_sm = math.ceil(ctas / device.sm_count)
    resident = direct_ctas_per_sm(t)
    waves = per_sm / resident  # the busiest SM's CTAs, `resident` at a time
    if nvfp4_activations:
        # the W4A4 entry is latency-bound: whole rounds of CTAs, each step as long as the
        # values a thread expands (80 for 64 weight rows, 16 tokens and tile_k 128)
        per_thread = (tn + tm) * tk / (32 * t.num_warps)
        chain = math.ceil(waves) * c["dense_step_scale"] * per_thread / 80
    elif tm >= 32:
        # M = 32-256: the step is as long as the values a thread moves (weights, and the
        # activation tile where it is permuted in-kernel: `X_DOT_MIN_TILE_M`), 64 per
        # thread at 64 weight rows and 4 warps
        moved = tn + (0 if tm >= X_DOT_MIN_TILE_M and tk == 128 else tm)
        chain = waves * c["mid_step_scale"] * moved * tk / (32 * t.num_warps) / 64
    else:
        chain = waves
    latency = chain * steps * c["step_us"] * math.sqrt(max(tk, 128) / 128)
    expanded = (tn + tm if nvfp4_activations else tn) * tk
    dequant = per_sm * steps * expanded / c["dequant_elems_per_sm_us"]
    mma_rate = device.bf16_tflops * 1e6 / device.sm_count * c["mma_eff"][str(tm)]
    mma = per_sm * steps * 2.0 * tm * tn * tk / mma_rate
    # weights are re-read once per token tile; activations once per weight tile (L2)
    weight_bytes = p.n * p.k * (0.5 + 1.0 / 16) * m_tiles
    partial = 8.0 * ctas * tm * tn if split > 1 else 0.0
    # weight bytes the resident CTAs keep in flight (their pipeline stages)
    in_flight = min(ctas, device.sm_count * resident) * t.num_stages * tn * tk / 2
    fill = min(1.0, in_flight / c["in_flight_bytes"])
    bw = device.mem_bw_gbps * 1e3 * c["direct_bw_fraction"] * fill
    act_bytes = p.m * p.k * ((0.5 + 1.0 / 16) if nvfp4_activations else 2.0)
    memory = (weight_bytes + act_bytes + 2.0 * p.m * p.n + partial) / bw
    reduce = c["split_reduce_us"] * math.log2(split)
    # a smooth maximum (4-norm): near-equal bounds add up, so ties go to the smaller rest
    bound = (latency**4 + dequant**4 + mma**4 + memory**4) ** 0.25
    total = bound + c["launch_us"] + reduce
    return total * c["dense_time_scale"] if nvfp4_activations else total


def gemv_instr_per_element(t: TritonSm90W4A16Tactic) -> float:
    """SASS instructions per weight element of the gemv main loop (calibration above)."""
    c = _c()
    extra = c["gemv_instr_pipelined"] if t.num_stages > 1 else 0.0
    return c["gemv_instr"] + c["gemv_instr_per_token"] * (t.tile_m - 1) + extra


def gemv_ctas_per_sm(t: TritonSm90W4A16Tactic) -> int:
    """Gemv CTAs one SM holds at once (`cost_model.resident_ctas`; registers bind, the
    1 KiB of shared memory never does). Registers per thread are a proxy fitted to sm_90
    compiles (Triton 3.9, ptxas): ~2 per weight byte a thread holds, 40% more per extra
    token, + 8 (69 at 32 bytes and one token, 127 at 64 bytes, 155 at 32 bytes and four
    tokens; 4 warps)."""
    regs = 2.0 * gemv_thread_bytes(t) * (1 + 0.4 * (t.tile_m - 1)) + 8
    return cost_model.resident_ctas(min(255, math.ceil(regs)), 0, t.num_warps)


def _estimate_gemv(t: TritonSm90W4A16Tactic, p: Problem, device: DeviceInfo) -> float:
    """max(instruction issue, memory) + launch + split reduction (calibration above).

    Issue: the busiest SM's CTAs times each CTA's instructions, at the SM's issue rate
    (the SM is the shared resource, whatever its residency). Memory: the resident CTAs
    (`gemv_ctas_per_sm`) keep ``num_stages`` K tiles each in flight."""
    c = _c()
    ctas = -(-p.m // t.tile_m) * -(-p.n // t.tile_n) * t.split_k
    per_cta = -(-p.k // t.split_k) * t.tile_n * gemv_instr_per_element(t)
    issue = math.ceil(ctas / device.sm_count) * per_cta / c["gemv_instr_per_sm_us"]
    resident = min(ctas, device.sm_count * gemv_ctas_per_sm(t))
    in_flight = resident * t.num_stages * t.tile_n * t.tile_k / 2
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    bw *= min(1.0, in_flight / c["gemv_in_flight_bytes"])
    partial = 8.0 * ctas * t.tile_m * t.tile_n if t.split_k > 1 else 0.0
    memory = (w4a16_min_bytes(p) + partial) / bw
    reduce = c["split_reduce_us"] * math.log2(t.split_k)
    # measured / estimated time, median over the H200 decode sweep's gemv tactics: the
    # terms above are not fitted yet, this keeps the scale honest against the direct path
    return (max(issue, memory) + c["launch_us"] + reduce) * c["gemv_time_scale"]


def _estimate_unpack(t: TritonSm90W4A16Tactic, p: Problem, device: DeviceInfo) -> float:
    """Unpack pass (weight only: N K (1/2 + 1/16 + 2) bytes) + cuBLAS GEMM + launches."""
    c = _c()
    bw = device.mem_bw_gbps * 1e3 * c["bw_fraction"]
    padded = (-(-p.n // t.block_r) * t.block_r * -(-p.k // t.tile_k) * t.tile_k) / (p.n * p.k)
    unpack = p.n * p.k * (0.5 + 1.0 / 16 + 2.0) / bw * padded
    gemm = max(
        p.flops / (device.bf16_tflops * 1e6 * c["unpack_gemm_eff"]),
        ((p.m + p.n) * p.k * 2.0 + p.m * p.n * 2.0) / bw,
    )
    return unpack + gemm + c["unpack_launch_us"]


class TritonSm90W4A16Backend(Backend):
    """Hopper W4A16: bf16/fp16 activations x NVFP4 weights (direct kernel or unpack)."""

    name = "triton-sm90-w4a16"
    family = "sm90"
    version = SourceVersion(
        "1",
        "fp4_dispatch.backends.sm90.gemm_w4a16",
        "fp4_dispatch.backends.sm90.gemm_w4a16_decode",
        plugin=__name__,
    )
    tactic_type = TritonSm90W4A16Tactic
    operations: ClassVar[tuple[str, ...]] = ("w4a16",)
    diversity_axes = ("path", "split_k")
    states_launches = True  # the direct and gemv kernels (`DenseKernel.trace`)

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90W4A16Tactic]:
        for tm, tn, tk, split, warps, stages in itertools.product(
            TILE_M, TILE_N, TILE_K, SPLIT_K, WARPS, STAGES
        ):
            t = _tactic("direct", tm, tn, tk, split, warps, stages, 64)
            if why_invalid(t, problem, device) is None:
                yield t
        for br, tk in itertools.product(BLOCK_R, TILE_K):
            t = _tactic("unpack", 128, 128, tk, 1, 4, 3, br)
            if why_invalid(t, problem, device) is None:
                yield t
        if problem.m <= GEMV_OFFERED_MAX_M:
            tm = _pow2_at_least(problem.m)
            for tn, tk, split, warps, stages in itertools.product(
                GEMV_TILE_N, GEMV_OFFERED_TILE_K, GEMV_SPLIT_K, WARPS, GEMV_OFFERED_STAGES
            ):
                t = _tactic("gemv", tm, tn, tk, split, warps, stages, 64)
                if why_invalid(t, problem, device) is None:
                    yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90W4A16Tactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds on one microsecond scale for both paths (see the two helpers)."""
        assert isinstance(tactic, TritonSm90W4A16Tactic)
        if tactic.path == "direct":
            return _estimate_direct(tactic, problem, device)
        if tactic.path == "gemv":
            return _estimate_gemv(tactic, problem, device)
        return _estimate_unpack(tactic, problem, device)

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what `gemm` runs for `problem` with
        contiguous activations and output of the output dtype (as `Dispatcher.gemm` and
        the tuner pass them): the direct kernel, or the unpack path's weight pass."""
        assert isinstance(tactic, TritonSm90W4A16Tactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.out_dtype]
        if tactic.path == "unpack":
            kernel.precompile(problem.n, problem.k, dtype)  # type: ignore[attr-defined]
            return kernel
        # direct and gemv kernels: the same precompile signature
        return kernel.precompile(problem.m, problem.n, problem.k, dtype)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """Neither path specializes on M (the direct kernel: ``do_not_specialize``; the
        unpack pass reads the weight only): the tactic, N, K and the dtype decide."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90W4A16Tactic)
        if tactic.path == "unpack":
            return _unpack_kernel_for(tactic.block_r, tactic.tile_k)
        if tactic.path == "gemv":
            return _gemv_kernel_for(tactic.gemv_config())
        return _kernel_for(tactic.kernel_config())


@functools.cache
def _tactic(
    path: str, tm: int, tn: int, tk: int, split: int, warps: int, stages: int, br: int
) -> TritonSm90W4A16Tactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90W4A16Tactic(
        path=path,
        tile_m=tm,
        tile_n=tn,
        tile_k=tk,
        split_k=split,
        num_warps=warps,
        num_stages=stages,
        block_r=br,
    )


@functools.cache
def _kernel_for(cfg: W4A16Config) -> Kernel:
    """One kernel object per config: shapes share compiled code and the split-K workspace."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16.build(cfg)


@functools.cache
def _gemv_kernel_for(cfg: W4A16GemvConfig) -> Kernel:
    """One gemv kernel object per config (shared compiled code and split-K workspace)."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_decode  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16_decode.build_gemv(cfg)


@functools.cache
def _unpack_kernel_for(block_r: int, block_k: int) -> Kernel:
    from fp4_dispatch.backends.sm90 import gemm_w4a16  # noqa: PLC0415 - optional: Triton

    return gemm_w4a16.build_unpack(block_r, block_k)
