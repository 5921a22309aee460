"""The shared cost model: estimated microseconds of any tactic on any device, one scale.

Why one scale: every family's candidates are ranked together (`fp4_dispatch.policy.ranking`),
so their estimates must compare. A backend may replace the estimate for its own tactics
(`Backend.estimate_us`); this is what it falls back to.

Cost model (`estimate_us`), per tactic, on any `DeviceInfo` (real or simulated)::

    Mk, Nk   = (N, M) if swap_ab else (M, N)             # the kernel's orientation
    c        = CTAs per tile, as the tactic declares it (`Tactic.ctas_per_tile`: 2 for
               a Blackwell 2-CTA MMA, else 1; the family knows its hardware)
    tiles    = ceil(Mk / tile_m) * ceil(Nk / tile_n)     # M/N padding lives here
    CTAs     = roundup(ceil(Mk/tile_m) * c, cluster_m) * roundup(ceil(Nk/tile_n), cluster_n)
    slots    = floor(SMs / cluster) * cluster             # whole clusters only
    waves    = ceil(CTAs / slots)                         # wave quantization
    eff      = 1 / (1 + FEED_COST * (1/tile_n + 1/tile_m))  # operand feed per flop: a
               CTA loads tile_m/c rows of A and tile_n/c of B (2-CTA: half of B each)
               per k for (tile_m/c)*tile_n MACs: ratio 1/tile_n + 1/tile_m
    t_wave   = 2 * (tile_m / c) * tile_n * K / (peak_per_SM * eff) + WAVE_OVERHEAD_US
    compute  = waves * t_wave * (1 + CLUSTER_PENALTY * (cluster - 1) if tiles > 1)
    memory   = min_bytes / (mem_bw * min(1, active_CTAs / (BW_SATURATION * SMs)))
    t        = max(compute, memory) + OVERLAP * min(compute, memory) + LAUNCH_US
    t       *= SWAP_PENALTY  if M <= 8192 and swap_ab != preferred_swap(problem)

Two optional tactic fields, read by name from any family (absent = the values below,
which leave the formula above unchanged; added for FlashInfer's split-K and deep-K
kernels, whose advantage the plain model could not see):

    split_k  (default 1): S CTAs share one output tile's K range. CTAs *= S, each CTA
             walks K/S (t_wave uses K/S), and the partial sums cost
             SPLIT_K_REDUCE_US * (S - 1) plus 8 bytes (fp32 out + in) per extra slice
             per output element in `memory`. Why: at decode a narrow tile grid covers
             a fraction of the SMs and so of DRAM bandwidth (bw_frac < 1); splitting K
             is how a kernel buys more loading CTAs, and the model must credit it.
    tile_k   (default 256, the FP4 K tile of the Blackwell kernels here): K elements
             per pipeline stage. Above 256, each stage fetches longer rows (tile_k / 2
             bytes), which streams DRAM slightly better: `memory` *= eff(256) /
             eff(tile_k), eff(t) = (t/2) / (t/2 + ROW_OVERHEAD_BYTES), and the longer
             fill/drain costs WAVE_OVERHEAD_US * tile_k / 256 per wave. Only tile_k >
             256 changes anything (Hopper tactics that declare a smaller tile_k keep
             their own estimate_us).

All in microseconds: FEED_COST 8, WAVE_OVERHEAD_US 0.5, LAUNCH_US 2, OVERLAP 0.1,
BW_SATURATION 0.5, CLUSTER_PENALTY 0.01, SWAP_PENALTY 1.05. The model is a ranking
heuristic, not a prediction: it orders tactics for measurement, and measurement decides.

`peak_per_SM` is the device's dense FP4 rate (BF16 where the chip has no FP4 MMA) over
its SM count. `preferred_swap` is True iff ``M <= 32 and N > M and N % 8 == 0``. Above
M = 8192 both orientations are neutral, so measurement decides (at M = 32768 swap was
7-66% faster under an M-major persistent scheduler, measured on an SM107 part).
"""

from __future__ import annotations

from functools import lru_cache

from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic

#: operand-feed cost per (1/tile_n + 1/tile_m): 128x256 -> 0.91 efficiency, 128x8 -> 0.49
FEED_COST = 8.0
#: per-wave pipeline fill and epilogue, microseconds
WAVE_OVERHEAD_US = 0.5
#: fixed launch cost, microseconds (equal for all: it only keeps absolute numbers honest)
LAUNCH_US = 2.0
#: fraction of the smaller roofline term that does not overlap with the larger one
OVERLAP = 0.1
#: fraction of the SMs that must be loading to saturate DRAM bandwidth
BW_SATURATION = 0.5
#: cost per extra CTA of a cluster when the grid has more than one tile
CLUSTER_PENALTY = 0.01
#: the non-preferred orientation costs this factor through M = SWAP_NEUTRAL_ABOVE_M
SWAP_PENALTY = 1.05
SWAP_NEUTRAL_ABOVE_M = 8192
#: fixed cost of reducing one extra K slice of a split-K tile, microseconds
SPLIT_K_REDUCE_US = 0.5
#: the K tile the base formula assumes (FP4 Blackwell kernels: 2 x 128-element MMAs)
BASE_TILE_K = 256
#: per-row-fetch overhead in bytes: a 128-byte row streams at 128/(128+4) = 97.0% and a
#: 256-byte one at 98.5%, the 1-2% FlashInfer reports for its deep-K variant
ROW_OVERHEAD_BYTES = 4.0


def preferred_swap(problem: Problem) -> bool:
    """At decode sizes the swapped orientation is preferred: ``M <= 32 < ... N > M, N % 8 == 0``."""
    return problem.m <= 32 and problem.n > problem.m and problem.n % 8 == 0


def ctas_per_tile(tactic: Tactic, device: DeviceInfo | None = None) -> int:
    """SMs one output tile occupies: what the tactic says (`Tactic.ctas_per_tile`).

    The family knows its own hardware (a 2-CTA MMA on Blackwell-class parts spans two
    SMs); the core applies no per-architecture rule. `device` is accepted for callers
    that pass it and is not used.
    """
    return tactic.ctas_per_tile


@lru_cache(maxsize=1 << 16)
def _shared_us(
    m: int,
    n: int,
    k: int,
    sms: int,
    peak_tflops: float,
    bw_gbps: float,
    tile_m: int,
    tile_n: int,
    cluster_m: int,
    cluster_n: int,
    swap: bool,
    cpt: int,
    split_k: int = 1,
    tile_k: int = BASE_TILE_K,
) -> float:
    """The shared formula (module docstring) on plain numbers, memoized by geometry."""
    mk, nk = (n, m) if swap else (m, n)
    tiles_m = -(-mk // tile_m)
    tiles_n = -(-nk // tile_n)
    ctas_m = -(-(tiles_m * cpt) // cluster_m) * cluster_m
    ctas_n = -(-tiles_n // cluster_n) * cluster_n
    cluster = cluster_m * cluster_n
    slots = max(cluster, (sms // cluster) * cluster)
    ctas = ctas_m * ctas_n * split_k
    waves = -(-ctas // slots)
    eff = 1.0 / (1.0 + FEED_COST * (1.0 / tile_n + 1.0 / tile_m))
    per_sm_flops_us = peak_tflops * 1e6 / sms
    deep = max(1.0, tile_k / BASE_TILE_K)
    t_wave = (
        2.0 * (tile_m / cpt) * tile_n * (k / split_k) / (per_sm_flops_us * eff)
        + WAVE_OVERHEAD_US * deep
    )
    compute = waves * t_wave
    if tiles_m * tiles_n > 1:
        compute *= 1.0 + CLUSTER_PENALTY * (cluster - 1)
    min_bytes = (m + n) * k * (0.5 + 1.0 / 16) + 2.0 * m * n + 8.0 * m * n * (split_k - 1)
    active = min(ctas, slots)
    bw_frac = min(1.0, active / (BW_SATURATION * sms))
    memory = min_bytes / (bw_gbps * 1e3 * bw_frac)
    if tile_k > BASE_TILE_K:  # longer row fetches stream better than the base K tile's
        memory *= _row_efficiency(BASE_TILE_K) / _row_efficiency(tile_k)
    t = max(compute, memory) + OVERLAP * min(compute, memory) + LAUNCH_US
    t += SPLIT_K_REDUCE_US * (split_k - 1)
    if m <= SWAP_NEUTRAL_ABOVE_M and swap != (m <= 32 and n > m and n % 8 == 0):
        t *= SWAP_PENALTY
    return t


def _row_efficiency(tile_k: int) -> float:
    """DRAM streaming efficiency of FP4 row fetches of ``tile_k / 2`` bytes."""
    row = tile_k / 2
    return row / (row + ROW_OVERHEAD_BYTES)


def _peak_tflops(device: DeviceInfo) -> float:
    return device.fp4_tflops if device.fp4_tflops is not None else device.bf16_tflops


def estimate_us(problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
    """The shared cost model: estimated microseconds of `tactic` on `problem` (see module)."""
    return _shared_us(
        problem.m,
        problem.n,
        problem.k,
        device.sm_count,
        _peak_tflops(device),
        device.mem_bw_gbps,
        tactic.tile_m,
        tactic.tile_n,
        tactic.cluster_m,
        tactic.cluster_n,
        bool(tactic.swap_ab),
        ctas_per_tile(tactic, device),
        *_k_fields(tactic),
    )


def _k_fields(tactic: Tactic) -> tuple[int, int]:
    """(split_k, tile_k) of a tactic: its optional fields of those names, else (1, 256)."""
    d = tactic.__dict__
    split_k, tile_k = d.get("split_k", 1), d.get("tile_k", BASE_TILE_K)
    return (
        split_k if type(split_k) is int and split_k >= 1 else 1,
        tile_k if type(tile_k) is int and tile_k >= 1 else BASE_TILE_K,
    )
