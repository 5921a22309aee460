"""The sm90 family's cost model: a roofline of the busiest SM, times fitted efficiencies.

Constants are data, not code: ``cost_model.json`` next to this module (shipped in the
wheel), written by ``benchmarks/fit_cost_model.py`` from the selection benchmark's
per-tactic measurements (it records which files, grids and date, and its
cross-validation figures). This module only defines the documented function of (tactic,
problem, device) they plug into. The file's ``w4a16`` part holds the (not yet fitted)
constants of the W4A16 backend's model (`fp4_dispatch.plugins.sm90.w4a16`).

**triton-sm90** (direct kernel), in the kernel's orientation (M and N exchanged for a
swapped tactic). ``per_sm = ceil(CTAs / SMs)`` CTAs land on the busiest SM, each
walking ``steps = ceil(K / split_k / tile_k)`` K tiles::

    resident = min(occupancy of the compiled kernel, ctas_per_sm)
    latency  = ceil(per_sm / resident) * steps * step_us
    busy     = sm_ctas(per_sm, resident, warps)        # CTA-times, waves and tail counted
    dequant  = busy * steps * (tile_m * a_side_cost + tile_n) * tile_k * order
               / dequant_elems_per_sm_us
    mma      = busy * steps * 2 * tile_m * tile_n * tile_k / (bf16 rate per SM * mma_eff[tile_m])
    memory   = (NVFP4 bytes + output + split-K partials) / (bandwidth * bw_fraction * fill)
    base     = p-norm(latency, dequant, mma, memory; overlap_p) + launch_us
               + split_reduce_us * (split_k - 1)
    t        = base * exp(sum of log_factor[f] for f in direct_features(tactic, problem))

Why each term:

- *Occupancy* (`resident_ctas`): how many CTAs an SM holds is set by the compiled
  kernel's registers and shared memory (Hopper: 64K registers, 228 KiB); both are
  measured per kernel config by compiling it for sm_90 (``occupancy`` in the data file,
  ``fit_cost_model.py --occupancy``, with the H200 runs' Triton 3.6: e.g. 16x128x256
  uses 252 registers, 2 CTAs per SM; 64x16x128 96 registers, 5). The upper shared-memory
  estimate `smem_bytes` guards validity only; it overstates what Triton allocates by up
  to 3x.
- *Latency*: a K step waits on its loads; CTAs beyond the resident ones run in later
  rounds, so a grid one CTA per SM over the resident count pays a whole extra round.
- *Waves* (`sm_ctas`): a round of n resident CTAs issues at ``min(1, n * warps /
  sat_warps)`` of the SM's rate, so a tail round or a lone CTA per SM is as slow as an
  under-occupied full one (what split-K buys at decode).
- *Dequantizer order*: tiles of >= 64 rows and >= 128 K use the dot-order dequantizer
  (`gemm_direct`'s ``DOT_ORDER``), the others the natural order at ``natural_order_cost``
  per element (``order``); SASS counts of issue 13 run 2: 6.1-7.0 vs 4.2 instructions
  per element. (The run-3 fit put it at its lower bound, 1: with ``a_side_cost`` at 2
  the times show no further order cost. The file's ``at_bounds`` lists such constants.)
- *Memory*: ``fill = min(1, bytes in flight / in_flight_bytes)`` (Little's law:
  resident CTAs x their pipelined tiles).
- *Overlap*: the four times overlap imperfectly: their ``overlap_p``-norm (1: they add,
  large: the largest alone) instead of a hard max.
- *Split-K*: each extra split's partial tile is written, then read by the last split.

Features (`direct_features`): one indicator per value of each knob (``tile_m=64``,
``tile_n=16``, ``tile_k=128``, ``split_k=4``, ``group_m=8``, ``warps=8``),
``swap=nonpreferred`` (the orientation the shared rule `preferred_swap` does not prefer,
through M = 8192) and ``spill`` (stack frame bytes per thread / 256 of the compiled
kernel: ptxas spills what exceeds 255 registers). A feature absent from the file has
factor 1, so a tactic far from the data falls back to the roofline terms.

**triton-sm90-unpack**: unpack pass (bytes at ``bw_fraction``, padded tiles, a fixed
cost per CTA) + bf16 GEMM (max of its FLOPs at ``bf16 rate * gemm_eff``, times cuBLAS's
wave quantization `gemm_waves` to the power ``wave_exp``, and its bytes) + alpha pass +
``launch_us``, times the fitted factor of its unpack tile (`unpack_features`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4_dispatch.policy.ranking import SWAP_NEUTRAL_ABOVE_M, preferred_swap

if TYPE_CHECKING:
    from fp4_dispatch.contracts.device import DeviceInfo
    from fp4_dispatch.contracts.tactics import Problem, Tactic

#: the data file the plugin reads (written by benchmarks/fit_cost_model.py)
MODEL_FILE = Path(__file__).with_name("cost_model.json")


@functools.cache
def constants() -> dict[str, Any]:
    """The fitted constants (read once per process)."""
    return load(MODEL_FILE)


def load(path: Path) -> dict[str, Any]:
    """Read and check one cost-model file: every constant the formulas need is present."""
    data = json.loads(Path(path).read_text())
    need = {
        "direct": ("step_us", "ctas_per_sm", "a_side_cost", "dequant_elems_per_sm_us",
                   "mma_eff", "bw_fraction", "in_flight_bytes", "launch_us",
                   "split_reduce_us", "sat_warps", "natural_order_cost", "overlap_p",
                   "log_factor"),
        "unpack": ("gemm_eff", "bw_fraction", "cta_us", "launch_us", "wave_exp", "log_factor"),
        "w4a16": ("dequant_elems_per_sm_us", "step_us", "direct_bw_fraction", "bw_fraction",
                  "launch_us", "in_flight_bytes", "split_reduce_us", "mma_eff",
                  "unpack_gemm_eff", "unpack_launch_us"),
        "ws": ("deq_step_us", "mma_eff", "bw_fraction", "fixed_us"),
        "rs": ("deq_step_us", "mma_eff", "bw_fraction", "fixed_us"),
        "mma": ("lat_us", "pf_lat", "sat_warps", "own_per_us", "issue_per_us", "bw_fraction",
                "fixed_us", "cta_us", "split_us", "time_scale"),
    }  # fmt: skip
    for part, keys in need.items():
        missing = [k for k in keys if k not in data.get(part, {})]
        if missing:
            raise ValueError(f"{path}: [{part}] lacks {missing}")
    return data


# ---- triton-sm90 ---------------------------------------------------------------------

#: Hopper's per-SM limits (compute capability 9.0; CUDA C++ Programming Guide, "Technical
#: Specifications per Compute Capability"): 228 KiB of shared memory for resident CTAs,
#: 1 KiB of it reserved per CTA, 64K 32-bit registers allocated per warp in units of
#: 256, 64 resident warps, 32 resident CTAs
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_BYTES = 1024
SM_REGISTERS = 65536
REGISTER_UNIT = 256
SM_MAX_WARPS = 64
SM_MAX_CTAS = 32
#: the direct kernel dequantizes in the dot's K order (its faster dequantizer) for tiles of
#: at least this many rows and K elements (`gemm_direct._nvfp4_gemm_kernel`'s DOT_ORDER)
DOT_ORDER_MIN_M = 64
DOT_ORDER_MIN_K = 128
#: the unit of the ``spill`` feature: stack frame bytes per thread (where ptxas puts the
#: registers that do not fit in 255)
SPILL_UNIT_BYTES = 256
#: registers per thread assumed for a kernel absent from the occupancy table (Triton's
#: per-thread cap: the pessimistic end)
FALLBACK_REGISTERS = 255


class _Scalar:
    """The element-wise operations the formulas use, on Python floats; the fitting script
    passes numpy instead (one formula for the plugin and the vectorized fit)."""

    ceil = staticmethod(math.ceil)
    floor = staticmethod(math.floor)
    minimum = staticmethod(min)
    maximum = staticmethod(max)

    @staticmethod
    def lookup(table: dict[str, float], key: float) -> float:
        return table[str(int(key))]


def occupancy_key(tactic: Tactic) -> str:
    """The occupancy table's key of a direct tactic: what decides the compiled kernel's
    registers and shared memory (tile, K tile, warps, and whether split-K's epilogue is
    compiled in); swap, raster and the problem do not."""
    t: Any = tactic
    return f"{t.tile_m}x{t.tile_n}x{t.tile_k}/w{t.num_warps}" + ("/splitk" if t.split_k > 1 else "")


def resident_ctas(registers: int, shared: int, warps: int) -> int:
    """CTAs of a kernel (`registers` per thread, `shared` bytes per CTA, `warps` per CTA)
    that one Hopper SM holds at once: the least of the register file, shared memory, warp
    and CTA limits (the occupancy calculation of the CUDA guide, at least 1)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = SM_REGISTERS // (per_warp * warps)
    by_smem = SM_SHARED_BYTES // (shared + CTA_RESERVED_BYTES)
    return max(1, min(by_regs, by_smem, SM_MAX_WARPS // warps, SM_MAX_CTAS))


def kernel_resources(tactic: Tactic) -> tuple[int, int, int]:
    """(registers per thread, shared memory bytes per CTA, stack frame bytes per thread) of
    `tactic`'s compiled kernel: the shipped file's occupancy table (``occupancy.kernels``,
    measured by compiling each kernel for sm_90), else `FALLBACK_REGISTERS`, the plugin's
    upper estimate of shared memory (`smem_bytes`) and no spills."""
    from fp4_dispatch.plugins.sm90 import smem_bytes  # noqa: PLC0415 - the plugin imports us

    t: Any = tactic
    row = constants().get("occupancy", {}).get("kernels", {}).get(occupancy_key(t))
    if row is None:
        return FALLBACK_REGISTERS, smem_bytes(t.tile_m, t.tile_n, t.tile_k, t.num_stages), 0
    return int(row[0]), int(row[1]), int(row[2])


def direct_terms(problem: Problem, device: DeviceInfo, tactic: Tactic) -> dict[str, float]:
    """The constant-free quantities of the direct model (the fit precomputes them once)."""
    p = problem.swapped() if tactic.swap_ab else problem
    tm, tn = tactic.tile_m, tactic.tile_n
    tk, split = tactic.tile_k, tactic.split_k  # type: ignore[attr-defined]
    stages = tactic.num_stages  # type: ignore[attr-defined]
    ctas = -(-p.m // tm) * -(-p.n // tn) * split
    steps = math.ceil(p.k / split / tk)
    per_sm = math.ceil(ctas / device.sm_count)
    regs, shared, _ = kernel_resources(tactic)
    return {
        "ctas": ctas,
        "per_sm_steps": per_sm * steps,
        "steps": steps,
        "per_sm": per_sm,
        "cta_a_elems": steps * tm * tk,
        "cta_b_elems": steps * tn * tk,
        "cta_flop": steps * 2.0 * tm * tn * tk,
        "sm_flops_us": device.bf16_tflops * 1e6 / device.sm_count,
        "bytes": problem.min_bytes + (8.0 * ctas * tm * tn if split > 1 else 0.0),
        "tile_bytes": stages * (tm + tn) * tk / 2,
        "bw_us": device.mem_bw_gbps * 1e3,
        "sms": device.sm_count,
        "split_m1": split - 1.0,
        "natural": 0.0 if tm >= DOT_ORDER_MIN_M and tk >= DOT_ORDER_MIN_K else 1.0,
        "resident": resident_ctas(regs, shared, tactic.num_warps),  # type: ignore[attr-defined]
        "warps": tactic.num_warps,  # type: ignore[attr-defined]
        "tile_m": tm,
    }


def direct_features(problem: Problem, tactic: Tactic) -> dict[str, float]:
    """The fitted factors that apply to `tactic` on `problem`, with their values (module
    doc): one indicator per value of each knob in the kernel's orientation (``tile_m=``,
    ``tile_n=``, ``tile_k=``, ``split_k=``, ``group_m=``, ``warps=``), ``swap=nonpreferred``
    and ``spill`` (the compiled kernel's stack frame per thread, in 256-byte units)."""
    t: Any = tactic
    feats = {f"tile_m={t.tile_m}": 1.0, f"tile_n={t.tile_n}": 1.0, f"tile_k={t.tile_k}": 1.0,
             f"split_k={t.split_k}": 1.0, f"group_m={t.group_m}": 1.0,
             f"warps={t.num_warps}": 1.0}  # fmt: skip
    if problem.m <= SWAP_NEUTRAL_ABOVE_M and t.swap_ab != preferred_swap(problem):
        feats["swap=nonpreferred"] = 1.0
    spill = kernel_resources(t)[2] / SPILL_UNIT_BYTES
    if spill:
        feats["spill"] = spill
    return feats


def sm_ctas(x: dict[str, Any], c: dict[str, Any], xp: Any = _Scalar) -> Any:
    """The busiest SM's CTAs in units of one CTA run at full issue rate: ``per_sm`` CTAs
    run in rounds of ``resident`` (the least of the compiled kernel's occupancy and the
    ``ctas_per_sm`` cap), and a round of n CTAs issues at ``min(1, n * warps /
    sat_warps)`` of the SM's rate (too few warps cannot hide the dequantizer's and the
    MMA's latencies). So a tail round (``per_sm % resident`` CTAs) costs as much as a
    full one when both are under-occupied: wave quantization, not an average."""
    resident = xp.minimum(x["resident"], c["ctas_per_sm"])
    full = xp.floor(x["per_sm"] / resident)
    tail = x["per_sm"] - full * resident

    def slowdown(n: Any) -> Any:
        return 1.0 / xp.minimum(1.0, xp.maximum(n, 1e-9) * x["warps"] / c["sat_warps"])

    return full * resident * slowdown(resident) + tail * slowdown(tail)


def direct_base_us(x: dict[str, Any], c: dict[str, Any], xp: Any = _Scalar) -> float:
    """The roofline part of the direct model from `direct_terms` and constants `c` (module
    doc); `xp`: the element-wise operations (numpy arrays in the fit, floats here)."""
    resident = xp.minimum(x["resident"], c["ctas_per_sm"])
    latency = xp.ceil(x["per_sm"] / resident) * x["steps"] * c["step_us"]
    busy = sm_ctas(x, c, xp)
    order = 1.0 + x["natural"] * (c["natural_order_cost"] - 1.0)
    cta_elems = x["cta_a_elems"] * c["a_side_cost"] + x["cta_b_elems"]
    dequant = busy * cta_elems * order / c["dequant_elems_per_sm_us"]
    mma = busy * x["cta_flop"] / (x["sm_flops_us"] * xp.lookup(c["mma_eff"], x["tile_m"]))
    in_flight = xp.minimum(x["ctas"], x["sms"] * resident) * x["tile_bytes"]
    fill = xp.minimum(1.0, in_flight / c["in_flight_bytes"])
    memory = x["bytes"] / (x["bw_us"] * c["bw_fraction"] * fill)
    extra = c["launch_us"] + c["split_reduce_us"] * x["split_m1"]
    # the p-norm of the four, scaled by the largest (no overflow at large p)
    q = c["overlap_p"]
    top = xp.maximum(xp.maximum(latency, dequant), xp.maximum(mma, memory))
    parts = (latency / top) ** q + (dequant / top) ** q + (mma / top) ** q + (memory / top) ** q
    return top * parts ** (1.0 / q) + extra


def factor(features: dict[str, float], table: dict[str, float]) -> float:
    """``exp(sum of table[f] * value)`` over the features (absent from the table: factor 1)."""
    return math.exp(sum(table.get(f, 0.0) * v for f, v in features.items()))


def direct_us(
    problem: Problem, device: DeviceInfo, tactic: Tactic, c: dict[str, Any] | None = None
) -> float:
    """Estimated microseconds of a triton-sm90 tactic (module doc); `c`: the "direct"
    constants (default: the shipped file)."""
    c = constants()["direct"] if c is None else c
    base = direct_base_us(direct_terms(problem, device, tactic), c)
    return base * factor(direct_features(problem, tactic), c["log_factor"])


# ---- triton-sm90-unpack ----------------------------------------------------------------


#: the output tile assumed for cuBLAS's bf16 GEMM when counting its waves (it picks its own;
#: 128x128 is what the unpack tactic's nominal fields report)
CUBLAS_TILE = 128


def gemm_waves(m: int, n: int, sms: int) -> float:
    """Wave quantization of an M x N GEMM of `CUBLAS_TILE` tiles on `sms` SMs: SM-slots
    launched per tile that does work (1 when the tiles fill whole waves, 2 for a grid of
    half the SMs). cuBLAS hides part of it (split-K, stream-K): ``wave_exp`` of the fit."""
    tiles = -(-m // CUBLAS_TILE) * -(-n // CUBLAS_TILE)
    return -(-tiles // sms) * sms / tiles


def unpack_terms(problem: Problem, device: DeviceInfo, tactic: Tactic) -> dict[str, float]:
    """Constant-free quantities of the unpack model."""
    m, n, k = problem.m, problem.n, problem.k
    br, bk = tactic.block_r, tactic.block_k  # type: ignore[attr-defined]
    row_tiles = -(-m // br) + -(-n // br)
    k_tiles = -(-k // bk)
    padded = (row_tiles * br * k_tiles * bk) / ((m + n) * k)
    prod_bytes = 2.0 if problem.out_dtype == "bfloat16" else 4.0
    return {
        "unpack_bytes": (m + n) * k * (0.5 + 1.0 / 16 + 2.0) * padded,
        "ctas_per_sm": row_tiles * k_tiles / device.sm_count,
        "flop": problem.flops,
        "gemm_waves": gemm_waves(m, n, device.sm_count),
        "flops_us": device.bf16_tflops * 1e6,
        "gemm_bytes": (m + n) * k * 2.0 + m * n * prod_bytes,
        "alpha_bytes": m * n * (prod_bytes + 2.0),
        "bw_us": device.mem_bw_gbps * 1e3,
    }


def unpack_features(problem: Problem, tactic: Tactic) -> dict[str, float]:
    """An indicator per unpack tile (a slope in log M, v4's ``unpack*logm``, changed no
    cross-validated pick on the run-3 data and was dropped)."""
    t: Any = tactic
    return {f"block={t.block_r}x{t.block_k}": 1.0}


def unpack_base_us(x: dict[str, Any], c: dict[str, Any], xp: Any = _Scalar) -> float:
    """The unpack model's time from `unpack_terms` and constants `c` (module doc)."""
    bw = x["bw_us"] * c["bw_fraction"]
    unpack = x["unpack_bytes"] / bw + x["ctas_per_sm"] * c["cta_us"]
    flop_us = x["flop"] / (x["flops_us"] * c["gemm_eff"]) * x["gemm_waves"] ** c["wave_exp"]
    gemm = xp.maximum(flop_us, x["gemm_bytes"] / bw)
    return unpack + gemm + x["alpha_bytes"] / bw + c["launch_us"]


def unpack_us(
    problem: Problem, device: DeviceInfo, tactic: Tactic, c: dict[str, Any] | None = None
) -> float:
    """Estimated microseconds of a triton-sm90-unpack tactic (module doc)."""
    c = constants()["unpack"] if c is None else c
    base = unpack_base_us(unpack_terms(problem, device, tactic), c)
    return base * factor(unpack_features(problem, tactic), c["log_factor"])
