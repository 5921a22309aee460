"""Plugin module: ``triton-sm90-grouped``, the grouped (mixture-of-experts) NVFP4 GEMM on
Hopper (`fp4_dispatch.backends.sm90.gemm_grouped`; docs/grouped.md).

Serves ``grouped_w4a16`` (dense bf16/fp16 rows) and ``grouped_w4a4`` (NVFP4 rows, both
operands dequantized in the kernel: Hopper has no FP4 MMA, and one kernel reading the
packed activations moves fewer bytes than a dequantize pass followed by the W4A16
kernel). Tiles are scheduled over (expert, M tile, N tile) from the offsets on the
device.

Tactics: ``tile_m`` rows per program (1-8: fp32 multiply-adds, the decode path; 16-128:
tensor cores), ``tile_n`` weight rows, ``tile_k``, warps, stages and ``split_k`` (programs
per output tile along K: 2, 4 or 8 while every split keeps >= 2 K tiles and the kept
fp32 partials of the bucket's grid stay within `SPLIT_WORKSPACE_MAX` bytes). ``tile_m`` is
offered up to the balanced rows per expert of the bucket (M / min(E, M), docs/grouped.md)
rounded up to a power of two, and always 16 (the tensor-core path), so decode buckets
rank the FMA path and prefill buckets the MMA path. ``swap_ab`` is never set.

The estimate is a roofline written from the kernel's structure and the device's peak
rates, NOT fitted to any measurement (`UNFITTED`): the weight bytes of the touched
experts (each read once per N tile), the dequantization of each program's weight tile,
the padded rows' products, and each program's chain of dependent K steps (the latency
split-K divides); it ranks tactics for measurement, which decides.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import PROFILE, SMEM_LIMIT, _sm90_support
from fp4_dispatch.support.sources import SourceVersion

#: said in `explain` and the docs: the estimate's constants are not fitted
UNFITTED = True
TILE_M = (1, 2, 4, 8, 16, 32, 64, 128)
TILE_N = (16, 32, 64, 128)
TILE_K = (64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3)
#: below this tile_m the kernel multiplies on FMAs (`gemm_grouped.DOT_MIN_M`)
DOT_MIN_M = 16
#: FMA path: products of one step per thread (`gemm_grouped.FMA_PER_THREAD`)
FMA_PER_THREAD = 128
#: unfitted roofline constants. Instructions per weight element and program: the decode
#: GEMV's inner loop (dense tiles of <= 4 rows) takes 5.1 at one token and ~1.5 more per
#: extra token (SASS counts of `gemm_w4a16_decode`'s sm_90 cubin, its docstring); the
#: other paths dequantize to a scaled 16-bit tile first, about 6 (counted from the
#: source: expansion, convert, scale multiply, convert), plus 2 per row on FMAs below
#: tile_m 16. EFFICIENCY: the fraction of the peak rates reached (a guess, to be fitted)
GEMV_OPS, GEMV_OPS_PER_TOKEN = 5.1, 1.5
DEQUANT_OPS = 6.0
EFFICIENCY = 0.6
#: dense rows per tile up to which the GEMV loop runs (`gemm_grouped.GEMV_MAX_M`)
GEMV_MAX_M = 4
#: ALU lanes per SM per clock on Hopper (4 sub-partitions x 32) and its boost clock, GHz
LANES_PER_SM = 128
CLOCK_GHZ = 1.98
LAUNCH_US = 3.0
#: per wave of programs (PROGRAMS_PER_SM resident per SM): each program's prologue
#: (reading E offsets, the running sum over experts) and its pipeline fill, a guess
WAVE_US = 1.0
PROGRAMS_PER_SM = 4
#: one K step of a program's loop, as a chain of dependent steps: about one global load's
#: round trip under load (a guess, not fitted; the pipeline's prefetch hides part of it).
#: Why it is modelled: at decode (8 rows over 8 of 128 experts, N=1536, K=2048) the
#: kernel took 31 us on an H100 where the touched weights' bytes take ~4 us (issue 35):
#: few programs, each walking all K tiles in turn
STEP_US = 0.8
#: split-K's reduction: the counter's atomic and the last split's reload of the partials,
#: two L2 round trips (a guess, not fitted)
SPLIT_SYNC_US = 1.0
SPLIT_K = (1, 2, 4, 8)
#: the largest split-K workspace (fp32 partials) a tactic may keep for its bucket's grid:
#: a chosen bound, not measured, so the scratch a kernel object keeps per T stays small
#: beside the weights (decode buckets need 1-20 MiB; a prefill grid would need GBs)
SPLIT_WORKSPACE_MAX = 64 << 20


class TritonSm90GroupedTactic(Tactic):
    """One variant of the grouped kernel (`gemm_grouped.GroupedConfig`)."""

    backend: Literal["triton-sm90-grouped"] = "triton-sm90-grouped"
    tile_m: Literal[1, 2, 4, 8, 16, 32, 64, 128]
    tile_n: Literal[16, 32, 64, 128]
    swap_ab: Literal[False] = False
    tile_k: Literal[64, 128, 256] = 128
    num_warps: Literal[4, 8] = 4
    num_stages: Literal[2, 3] = 2
    #: tensor-core path only: weight rows on the MMA's M side (`GroupedConfig`)
    weights_on_m: bool = False
    #: programs per output tile along K (`GroupedConfig.split_k`)
    split_k: Literal[1, 2, 4, 8] = 1

    def kernel_config(self):
        """The kernel's config (imports the Triton module: only on a build)."""
        from fp4_dispatch.backends.sm90.gemm_grouped import (  # noqa: PLC0415 - optional: Triton
            GroupedConfig,
        )

        return GroupedConfig(self.tile_m, self.tile_n, self.tile_k, self.num_warps,
                             self.num_stages, self.weights_on_m, split_k=self.split_k)  # fmt: skip


def rows_per_expert(problem: Problem) -> int:
    """Balanced rows per touched expert of a grouped problem: ``ceil(M / min(E, M))``."""
    return -(-problem.m // problem.touched_groups)


def max_tile_m(problem: Problem) -> int:
    """The largest tile_m offered: the balanced rows per expert as a power of two, at
    least the tensor-core minimum (16), at most 128."""
    rows = 1 << (rows_per_expert(problem) - 1).bit_length()
    return min(128, max(DOT_MIN_M, rows))


def split_workspace_bytes(t: Tactic, problem: Problem) -> int:
    """Bytes of the fp32 partials a split-K kernel keeps for `problem`'s grid (any grouped
    tactic with ``tile_m`` rows and ``tile_n`` weight rows a program, ``split_k``)
    (`gemm_grouped.GroupedKernel.workspace`: one tile per split and slot, slots = N tiles
    x the M-tile bound ``cdiv(M, tile_m) + min(E, M)``, rounded up to a power of two)."""
    m, e = problem.m, problem.groups or 1
    slots = math.ceil(problem.n / t.tile_n) * (-(-m // t.tile_m) + min(e, m))
    return (1 << (slots - 1).bit_length()) * t.split_k * t.tile_m * t.tile_n * 4


def why_split_invalid(t: TritonSm90GroupedTactic, problem: Problem) -> str | None:
    """Why `t`'s split_k is refused: each split must own >= 2 K tiles (fewer: the
    partials' round trip buys almost nothing), and the workspace must stay within
    `SPLIT_WORKSPACE_MAX`."""
    if t.split_k == 1:
        return None
    k_tiles = -(-problem.k // t.tile_k)
    if k_tiles < 2 * t.split_k:
        return f"split_k={t.split_k} leaves < 2 K tiles per split ({k_tiles} K tiles)"
    ws = split_workspace_bytes(t, problem)
    if ws > SPLIT_WORKSPACE_MAX:
        return f"split_k={t.split_k}: {ws} workspace bytes > {SPLIT_WORKSPACE_MAX}"
    return None


def why_invalid(t: TritonSm90GroupedTactic, problem: Problem) -> str | None:
    """Why `t` is not offered for `problem`, else None."""
    if not problem.grouped:
        return f"operation {problem.operation!r}: grouped operations only"
    if problem.k % 32:
        return f"K={problem.k}: the kernels need K % 32 == 0"
    if t.tile_m > max_tile_m(problem):
        return f"tile_m={t.tile_m} > {max_tile_m(problem)} (balanced rows per expert)"
    split = why_split_invalid(t, problem)
    if split is not None:
        return split
    threads = 32 * t.num_warps
    if t.weights_on_m and (t.tile_m < DOT_MIN_M or t.tile_n < 64):
        return "weights_on_m: the tensor-core path with tile_n >= 64 (wgmma's M) only"
    if t.tile_m < DOT_MIN_M:
        per_thread = t.tile_m * t.tile_n * t.tile_k // threads
        if per_thread > FMA_PER_THREAD:
            return f"FMA path: {per_thread} products per thread > {FMA_PER_THREAD}"
        return None
    smem = (t.tile_m + t.tile_n) * t.tile_k * 2 * t.num_stages
    if smem > SMEM_LIMIT:
        return f"{smem} bytes of shared memory exceed Hopper's {SMEM_LIMIT}"
    return None


class TritonSm90GroupedBackend(Backend):
    """Hopper grouped W4A16 and W4A4 (one Triton kernel, expert tiles from device offsets)."""

    name = "triton-sm90-grouped"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_grouped", plugin=__name__)
    tactic_type = TritonSm90GroupedTactic
    diversity_axes = ("tile_m", "tile_n", "split_k")
    operations = ("grouped_w4a16", "grouped_w4a4")
    device_profiles = (PROFILE,)

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90GroupedTactic]:
        for tm, tn, tk, warps, stages, w_on_m, split in itertools.product(
            TILE_M, TILE_N, TILE_K, WARPS, STAGES, (False, True), SPLIT_K
        ):
            t = _tactic(tm, tn, tk, warps, stages, w_on_m, split)
            if why_invalid(t, problem) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90GroupedTactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """Microseconds, an UNFITTED roofline (module docstring): max(memory, compute,
        K-step chain) plus the waves, split-K's reduction and a launch, where memory =
        the touched experts' weights + A + out (+ the split partials, written and read
        once) at the device's bandwidth, compute = the instructions of each program's
        weight tile (expansion and, below tile_m 16, the FMAs) on the SMs' lanes + the
        padded rows' tensor-core products from tile_m 16, and the chain = each wave's
        programs walking their K tiles (``cdiv(K tiles, split_k)``) one after another."""
        assert isinstance(tactic, TritonSm90GroupedTactic)
        t, p = tactic, problem
        n_tiles = math.ceil(p.n / t.tile_n)
        m_tiles = p.touched_groups * math.ceil(rows_per_expert(p) / t.tile_m)  # balanced
        tiles = n_tiles * m_tiles
        programs = tiles * t.split_k
        memory_us = _bytes(t, p, tiles) / (device.mem_bw_gbps * 1e3)
        compute_us = _compute_us(t, p, device, n_tiles, m_tiles)
        # fewer programs than SMs leave bandwidth unused (one program per SM at best)
        fill = min(1.0, programs / device.sm_count)
        waves = math.ceil(programs / (device.sm_count * PROGRAMS_PER_SM))
        chain_us = waves * math.ceil(math.ceil(p.k / t.tile_k) / t.split_k) * STEP_US
        split_us = SPLIT_SYNC_US if t.split_k > 1 else 0.0
        return (max(memory_us / fill, compute_us, chain_us) + waves * WAVE_US + split_us
                + LAUNCH_US)  # fmt: skip

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90GroupedTactic)
        return _kernel_for(tactic)

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what a grouped call of `problem` runs:
        activations in the output dtype (W4A16) or NVFP4, a contiguous output."""
        assert isinstance(tactic, TritonSm90GroupedTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.out_dtype]
        p = problem
        return kernel.precompile(p.m, p.n, p.k, p.groups, dtype, not p.dense)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on T (``do_not_specialize``; T only sizes the grid): the
        tactic, N, K, E, dtype and operation."""
        p = problem
        return (tactic, p.n, p.k, p.groups, p.out_dtype, p.operation)


def _bytes(t: TritonSm90GroupedTactic, p: Problem, tiles: int) -> float:
    """Bytes a call moves: the touched experts' weights (once per N tile), A, the output
    and, split, every tile's fp32 partials written and read once."""
    n_tiles = math.ceil(p.n / t.tile_n)
    weight_bytes = p.touched_groups * n_tiles * t.tile_n * p.k * (0.5 + 1 / 16)
    a_bytes = p.m * p.k * (2.0 if p.dense else 0.5625)
    partials = 2.0 * tiles * t.split_k * t.tile_m * t.tile_n * 4 if t.split_k > 1 else 0.0
    return weight_bytes + a_bytes + 2.0 * p.m * p.n + partials


def _compute_us(
    t: TritonSm90GroupedTactic, p: Problem, device: DeviceInfo, n_tiles: int, m_tiles: int
) -> float:
    """Instruction issue of every tile's weight expansion (and FMAs below tile_m 16) on
    the SMs' lanes, plus the padded rows' tensor-core products (split-K divides the work
    among more programs; it does not change its total)."""
    tiles = n_tiles * m_tiles
    elements = tiles * t.tile_n * p.k  # weight elements expanded, all programs
    lanes_per_us = device.sm_count * LANES_PER_SM * CLOCK_GHZ * 1e3
    mac_us = 0.0
    if p.dense and t.tile_m <= GEMV_MAX_M:  # the GEMV loop: FMAs counted in its ops
        ops = elements * (GEMV_OPS + GEMV_OPS_PER_TOKEN * (t.tile_m - 1))
    else:
        ops = elements * DEQUANT_OPS
        if not p.dense:  # the activations' tile too, in every N tile
            ops += tiles * t.tile_m * p.k * DEQUANT_OPS
        if t.tile_m < DOT_MIN_M:
            ops += elements * 2 * t.tile_m
        else:
            padded_flops = 2.0 * m_tiles * t.tile_m * n_tiles * t.tile_n * p.k
            mac_us = padded_flops / (device.bf16_tflops * 1e6)
    return (ops / lanes_per_us + mac_us) / EFFICIENCY


@functools.cache
def _tactic(
    tm: int, tn: int, tk: int, warps: int, stages: int, w_on_m: bool = False, split: int = 1
) -> TritonSm90GroupedTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90GroupedTactic(tile_m=tm, tile_n=tn, tile_k=tk, num_warps=warps,
                                   num_stages=stages, weights_on_m=w_on_m,
                                   split_k=split)  # fmt: skip


@functools.cache
def _kernel_for(tactic: TritonSm90GroupedTactic) -> Kernel:
    """One kernel object per tactic (shapes share Triton's compiled variants)."""
    from fp4_dispatch.backends.sm90 import gemm_grouped  # noqa: PLC0415 - optional: Triton

    return gemm_grouped.build(tactic.kernel_config())
