"""The sm90 family's cost model: a roofline over one CTA step, times fitted efficiencies.

Constants are data, not code: ``cost_model.json`` next to this module (shipped in the
wheel), written by ``benchmarks/fit_cost_model.py`` from the selection benchmark's
per-tactic measurements (it records which files and which device). This module only
defines the documented function of (tactic, problem, device) they plug into. The file's
``w4a16`` part holds the (not yet fitted) constants of the W4A16 backend's model
(`fp4_dispatch.plugins.sm90.w4a16`).

**triton-sm90** (direct kernel), in the kernel's orientation (M and N exchanged for a
swapped tactic); per SM, ``per_sm = ceil(CTAs / SMs)`` CTAs each walk ``steps =
ceil(K / split_k / tile_k)`` K tiles::

    latency = ceil(per_sm / ctas_per_sm) * steps * step_us
    dequant = per_sm * steps * (tile_m * a_side_cost + tile_n) * tile_k / dequant_elems_per_sm_us
    mma     = per_sm * steps * 2 * tile_m * tile_n * tile_k / (bf16 rate per SM * mma_eff[tile_m])
    memory  = (NVFP4 bytes + output + split-K partials) / (bandwidth * bw_fraction * fill)
    base    = max(latency, dequant, mma, memory) + launch_us + split_reduce_us * log2(split_k)
    t       = base * exp(sum of log_factor[f] for f in direct_features(tactic, problem))

``fill = min(1, bytes in flight / in_flight_bytes)`` (Little's law: resident CTAs x
their pipelined tiles). The features are the tactic's knobs in the kernel's orientation
(``tile=16x256``, ``tile_k=128``, ``split_k=4``, ``group_m=8``, ``warps=8``) and
``swap=nonpreferred`` (the orientation the shared rule `preferred_swap` does not prefer,
through M = 8192); the tile, tile_k, split_k and swap factors also vary linearly in
`log_m` (``name*logm``), so an efficiency measured at M = 32 and 256 is interpolated at
M = 128, not copied. A feature absent from the file has factor 1, so a tactic or a
shape far from the data falls back to the roofline terms.

**triton-sm90-unpack**: unpack pass (bytes at ``bw_fraction``, padded tiles, a fixed
cost per CTA) + bf16 GEMM (max of FLOPs at ``bf16 rate * gemm_eff`` and its bytes) +
alpha pass + ``launch_us``, times ``exp(log_factor["block=RxK"] + log_factor["unpack*logm"]
* log_m)``.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4_dispatch.ranking import SWAP_NEUTRAL_ABOVE_M, preferred_swap

if TYPE_CHECKING:
    from fp4_dispatch.device import DeviceInfo
    from fp4_dispatch.tactics import Problem, Tactic

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
                   "split_reduce_us", "sat_warps", "log_factor"),
        "unpack": ("gemm_eff", "bw_fraction", "cta_us", "launch_us", "log_factor"),
        "w4a16": ("dequant_elems_per_sm_us", "step_us", "ctas_per_sm", "bw_fraction",
                  "launch_us", "in_flight_bytes", "split_reduce_us", "mma_eff",
                  "unpack_gemm_eff", "unpack_launch_us"),
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
#: registers per thread assumed for a kernel absent from the occupancy table (Triton's
#: per-thread cap: the pessimistic end)
FALLBACK_REGISTERS = 255


class _Scalar:
    """The element-wise operations the formulas use, on Python floats; the fitting script
    passes numpy instead (one formula for the plugin and the vectorized fit)."""

    ceil = staticmethod(math.ceil)
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
        "a_elems": per_sm * steps * tm * tk,
        "b_elems": per_sm * steps * tn * tk,
        "mma_flop": per_sm * steps * 2.0 * tm * tn * tk,
        "sm_flops_us": device.bf16_tflops * 1e6 / device.sm_count,
        "bytes": problem.min_bytes + (8.0 * ctas * tm * tn if split > 1 else 0.0),
        "tile_bytes": stages * (tm + tn) * tk / 2,
        "bw_us": device.mem_bw_gbps * 1e3,
        "sms": device.sm_count,
        "split_m1": split - 1.0,
        "resident": resident_ctas(regs, shared, tactic.num_warps),  # type: ignore[attr-defined]
        "warps": tactic.num_warps,  # type: ignore[attr-defined]
        "tile_m": tm,
    }


def log_m(problem: Problem) -> float:
    """The regime coordinate: ``(log2 M - 6) / 6`` of the caller's M (-1 at M = 1, 0 at
    64, 1 at 4096), clamped to [-1, 1.5] so that shapes beyond the data extrapolate
    no further than M = 32768."""
    return min(1.5, max(-1.0, (math.log2(problem.m) - 6.0) / 6.0))


def direct_features(problem: Problem, tactic: Tactic) -> dict[str, float]:
    """The fitted factors that apply to `tactic` on `problem`, with their values (module
    doc): an indicator per knob, and for the tile, tile_k, split_k and swap knobs a
    second term ``name*logm`` whose value is `log_m` - an efficiency that changes
    linearly in log M between the measured M (interpolated, not tabulated per M)."""
    t: Any = tactic
    u = log_m(problem)
    feats: dict[str, float] = {}
    for name in (f"tile={t.tile_m}x{t.tile_n}", f"tile_k={t.tile_k}", f"split_k={t.split_k}"):
        feats[name] = 1.0
        feats[f"{name}*logm"] = u
    feats[f"group_m={t.group_m}"] = 1.0
    feats[f"warps={t.num_warps}"] = 1.0
    if problem.m <= SWAP_NEUTRAL_ABOVE_M and t.swap_ab != preferred_swap(problem):
        feats["swap=nonpreferred"] = 1.0
        feats["swap=nonpreferred*logm"] = u
    return feats


def direct_base_us(x: dict[str, Any], c: dict[str, Any], xp: Any = _Scalar) -> float:
    """The roofline part of the direct model from `direct_terms` and constants `c` (module
    doc); `xp`: the element-wise operations (numpy arrays in the fit, floats here)."""
    resident = xp.minimum(x["resident"], c["ctas_per_sm"])
    latency = xp.ceil(x["per_sm"] / resident) * x["steps"] * c["step_us"]
    occupancy = xp.minimum(1.0, xp.minimum(x["per_sm"], resident) * x["warps"] / c["sat_warps"])
    dequant = (x["a_elems"] * c["a_side_cost"] + x["b_elems"]) / (
        c["dequant_elems_per_sm_us"] * occupancy
    )
    mma = x["mma_flop"] / (x["sm_flops_us"] * xp.lookup(c["mma_eff"], x["tile_m"]) * occupancy)
    in_flight = xp.minimum(x["ctas"], x["sms"] * resident) * x["tile_bytes"]
    fill = xp.minimum(1.0, in_flight / c["in_flight_bytes"])
    memory = x["bytes"] / (x["bw_us"] * c["bw_fraction"] * fill)
    extra = c["launch_us"] + c["split_reduce_us"] * x["split_m1"]
    return xp.maximum(xp.maximum(latency, dequant), xp.maximum(mma, memory)) + extra


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
        "flops_us": device.bf16_tflops * 1e6,
        "gemm_bytes": (m + n) * k * 2.0 + m * n * prod_bytes,
        "alpha_bytes": m * n * (prod_bytes + 2.0),
        "bw_us": device.mem_bw_gbps * 1e3,
    }


def unpack_features(problem: Problem, tactic: Tactic) -> dict[str, float]:
    """An indicator per unpack tile, and ``unpack*logm`` (the path's efficiency in log M)."""
    t: Any = tactic
    return {f"block={t.block_r}x{t.block_k}": 1.0, "unpack*logm": log_m(problem)}


def unpack_base_us(x: dict[str, Any], c: dict[str, Any], xp: Any = _Scalar) -> float:
    """The unpack model's time from `unpack_terms` and constants `c` (module doc)."""
    bw = x["bw_us"] * c["bw_fraction"]
    unpack = x["unpack_bytes"] / bw + x["ctas_per_sm"] * c["cta_us"]
    gemm = xp.maximum(x["flop"] / (x["flops_us"] * c["gemm_eff"]), x["gemm_bytes"] / bw)
    return unpack + gemm + x["alpha_bytes"] / bw + c["launch_us"]


def unpack_us(
    problem: Problem, device: DeviceInfo, tactic: Tactic, c: dict[str, Any] | None = None
) -> float:
    """Estimated microseconds of a triton-sm90-unpack tactic (module doc)."""
    c = constants()["unpack"] if c is None else c
    base = unpack_base_us(unpack_terms(problem, device, tactic), c)
    return base * factor(unpack_features(problem, tactic), c["log_factor"])
