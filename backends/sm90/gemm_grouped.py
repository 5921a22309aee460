"""Hopper (sm90) grouped NVFP4 GEMM in Triton: every expert of a mixture-of-experts layer
in one launch (docs/grouped.md, `fp4_dispatch.contracts.backend.GroupedOperands`).

``out[r] = alpha[e] * A[r] @ dequant(W[e]).T`` for the rows ``r`` of each expert ``e``
(``offsets``: int32 cumulative row ends, on the device). ``A`` is dense bf16/fp16
(grouped W4A16) or NVFP4 (grouped W4A4: dequantized in the kernel like the weights; Hopper
has no FP4 MMA, and e2m1 x e4m3 values are exact in fp16, so both operands dequantize
exactly and the products are the tensor cores' fp16/bf16 ones with fp32 accumulation).

Scheduling, with no host synchronisation (CUDA-graph safe): the grid is
``(N tiles, M-tile bound, split_k)`` where the bound is ``cdiv(T, BLOCK_M) + min(E, T)``
(each non-empty expert adds at most one partial tile; at most ``min(E, T)`` experts are
non-empty) - host facts only. Each program reads all E offsets (E int32, from L2),
computes every expert's tile count and their running sum on the device, finds its
(expert, M tile), and exits at once when its index is past the last tile. So a decode
step (8 rows over 128 experts) launches ``cdiv(8, BLOCK_M) + 8`` M programs per N tile,
not ``128``: the cheap choice at decode, where each expert has 1-8 rows. The M tiles of
one expert sit next to each other in the grid's second axis and the first axis walks N,
so one expert's weight tile is read by its M tiles at nearly the same time (L2 reuse).

Split-K (``GroupedConfig.split_k`` 2, 4 or 8; 1 by default): the grid's third axis
splits each tile's K tiles into equal shares (`splitk.k_tile_range`; the last share may
be shorter or empty), as the dense decode kernels do. Why: at decode a few hundred
programs each walk all of K one step after another, latency-bound (8 rows over 8 of 128
experts, N=1536, K=2048 took 31 us on an H100 where the touched weights' bytes take
~4 us at memory bandwidth: issue 35); splitting multiplies the programs in flight and
divides each one's chain of steps. Each split stores its fp32 partial into a workspace
kept on the kernel object and the last to arrive sums them in split order
(deterministic), writes the output and resets the tile's counter (`splitk.store_tile`:
one launch, no memset). A slot of the workspace belongs to one (N tile, M-tile slot of
the grid), so it is sized from host facts (``N tiles x M-tile bound`` slots rounded up
to a power of two, ``split_k`` tiles each: one pair per T, the same on every call); a
slot past the routing's last tile exits in every split before touching its counter.
With one split the tile is stored directly, as before.

Three inner products, by ``BLOCK_M`` (a compile-time knob):

- ``BLOCK_M >= 16``: ``tl.dot`` on the tensor cores, operands in the activation dtype
  (W4A16) or fp16 (W4A4), fp32 accumulation;
- dense rows and ``BLOCK_M <= 4`` (decode: 1-4 rows per expert): the decode GEMV's inner
  loop (`gemm_w4a16_decode._token_blocks`): per token, each 16-element block's products
  as one chain of fp32 FMAs in registers, times the block scale, accumulated per block;
  the MMA's 16-row minimum would be mostly padding there;
- otherwise below 16 (NVFP4 rows, or 8 dense rows): the dequantized tiles' fp32
  products reduced per step.

Weight dequantization is the decode kernel's (`gemm_w4a16_decode._nibbles`: its inline
PTX on a GPU, its element-wise twin under the interpreter): a nibble ``n`` placed as
fp16 bits ``(n & 7) << 9 | (n & 8) << 12`` is exactly ``e2m1(n) * 2**-14``; times the
block's e4m3 scale and ``2**14`` in fp32 that is ``e2m1 * scale`` exactly, then rounded
(exactly) to the 16-bit operand type. Shapes: any T, N >= 1, ``K % 32 == 0`` (K need not
divide by the K tile).

Not measured on a GPU yet: ``python -m benchmarks kernels --cases grouped`` is the
measurement.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.driver_launch import record_launches
from fp4_dispatch.backends.sm90.gemm_w4a16 import _USE_ASM
from fp4_dispatch.backends.sm90.gemm_w4a16_decode import _column, _nibbles, _token_blocks
from fp4_dispatch.backends.sm90.splitk import k_tile_range, store_tile
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher
from fp4_dispatch.backends.workspace import Scratch
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

log = logging.getLogger(__name__)

__all__ = [
    "BLOCK_K_CHOICES",
    "BLOCK_M_CHOICES",
    "SPLIT_K_CHOICES",
    "GroupedConfig",
    "GroupedKernel",
    "build",
]

#: rows (tokens x top-k of one expert) per program: 1-8 run on FMAs, 16+ on tl.dot
BLOCK_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
#: weight rows per program
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
#: K elements per loop step (a multiple of 64: one swizzled 4-group step per 64)
BLOCK_K_CHOICES = (64, 128, 256)
#: K splits per output tile (`splitk`: partials in a kept workspace, the last split sums)
SPLIT_K_CHOICES = (1, 2, 4, 8)
#: the smallest BLOCK_M that runs on the tensor cores (tl.dot's minimum M)
DOT_MIN_M = 16
#: dense rows per tile up to which the decode GEMV's inner loop runs (`_gemv_tile`: one
#: FMA chain per token and 16-element block, as `gemm_w4a16_decode`; its token limit)
GEMV_MAX_M = 4
#: the FMA path (BLOCK_M < 16) holds BLOCK_M x BLOCK_N x BLOCK_K fp32 products of one
#: step: at most this many per thread (32 x num_warps threads), else registers spill
FMA_PER_THREAD = 128


@dataclass(frozen=True)
class GroupedConfig:
    """Compile-time knobs: ``block_m`` rows, ``block_n`` weight rows, ``block_k`` K
    elements per step, Triton's ``num_warps`` and ``num_stages``; ``weights_on_m``: the
    tensor-core path multiplies ``W @ A.T`` (weight rows on the MMA's M side, as the
    dense W4A16 decode kernel does: Hopper's wgmma needs 64 rows there, a few tokens
    per expert do not have them) instead of ``A @ W.T``; ``split_k``: programs per output
    tile along K (module docstring, "Split-K")."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    weights_on_m: bool = False
    split_k: int = 1

    def __post_init__(self) -> None:
        for name, choices in (
            ("block_m", BLOCK_M_CHOICES),
            ("block_n", BLOCK_N_CHOICES),
            ("block_k", BLOCK_K_CHOICES),
            ("split_k", SPLIT_K_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)}")
        if self.num_warps not in (2, 4, 8):
            raise ValueError(f"num_warps: expected 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")
        if self.weights_on_m and self.block_m < DOT_MIN_M:
            raise ValueError(f"weights_on_m: only for the tensor-core path (block_m >= "
                             f"{DOT_MIN_M}), got block_m={self.block_m}")  # fmt: skip
        per_thread = self.block_m * self.block_n * self.block_k // (32 * self.num_warps)
        if self.block_m < DOT_MIN_M and per_thread > FMA_PER_THREAD:
            raise ValueError(
                f"block_m x block_n x block_k: the FMA path (block_m < {DOT_MIN_M}) holds "
                f"at most {FMA_PER_THREAD} products per thread, got {per_thread}"
            )


@triton.jit
def _nvfp4_bytes(data_ptr, scale_ptr, rows, row_ok, k0, K, s_blk, KT: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """(low, high) nibbles ``[len(rows), KT/16, 8]`` as fp32 ``e2m1 * 2**-14`` and the
    block scales ``[len(rows), KT/16]`` as fp32, of K elements ``k0..k0+KT`` of an NVFP4
    operand. ``rows``: row indices (int64; rows of ``K/2`` bytes); ``row_ok`` masks them;
    the scales are the 128x4-swizzled layout at ``scale_ptr`` (``s_blk`` elements per
    128-row block). Byte ``i`` of group ``g`` holds K elements ``16 g + 2 i`` (low
    nibble) and ``16 g + 2 i + 1`` (high)."""
    KG: tl.constexpr = KT // 16
    g = k0 // 16 + tl.arange(0, KG)  # scale groups of this step
    b = tl.arange(0, 8)
    # byte i of group g: natural byte 8 g + i (K elements 16 g + 2 i, + 1)
    offs = rows[:, None, None] * (K // 2) + (g[None, :, None] * 8 + b[None, None, :])
    s_offs = scale_row_offset(rows, s_blk)[:, None] + scale_group_offset(g)[None, :]
    if EVEN_K:
        mask = row_ok[:, None, None]
        s_mask = row_ok[:, None]
    else:
        mask = row_ok[:, None, None] & (g < K // 16)[None, :, None]
        s_mask = row_ok[:, None] & (g < K // 16)[None, :]
    w = tl.load(data_ptr + offs, mask=mask, other=0)
    s = tl.load(scale_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    lo, hi = _nibbles(w, USE_ASM, False)  # fp32 e2m1 * 2**-14 (the decode kernel's PTX)
    return lo, hi, s


@triton.jit
def _nvfp4_tile(data_ptr, scale_ptr, rows, row_ok, k0, K, s_blk, KT: tl.constexpr,
                EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """Dequantized ``[len(rows), KT]`` fp32 tile (`_nvfp4_bytes`' K elements): exact, and
    exact again in fp16 and bf16 (e2m1 x e4m3 values)."""
    lo, hi, s = _nvfp4_bytes(data_ptr, scale_ptr, rows, row_ok, k0, K, s_blk, KT, EVEN_K,
                             USE_ASM)  # fmt: skip
    s = s * 16384.0  # undoes the nibbles' 2**-14
    vals = tl.join(lo * s[:, :, None], hi * s[:, :, None])  # [R, KG, 8, 2]: 16 g + 2 i + e
    return tl.reshape(vals, (rows.shape[0], KT))


@triton.jit
def _gemv_tile(a_ptr, b_e, bs_e, row0, row_end, rn, n_ok, k_lo, k_hi, K, stride_am, s_blk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """The fp32 ``[BLOCK_N, BLOCK_M]`` tile (weight rows x tokens, in units of
    ``2**-14``: the caller's scale undoes it) of one expert's rows ``row0..row0+BLOCK_M``
    (at most 4; those from ``row_end`` on are read as ``row0`` and never stored) over K
    elements ``k_lo..k_hi``, the decode GEMV's way (`gemm_w4a16_decode`): per token, each
    16-element block's products summed as one FMA chain in registers, times the block
    scale, accumulated per block."""
    KG: tl.constexpr = BLOCK_K // 16
    # K element of (block g, byte i, nibble e): 16 g + 2 i + e, as [KG, 8, 2]
    rk = (16 * tl.arange(0, KG)[:, None, None] + 2 * tl.arange(0, 8)[None, :, None]
          + tl.arange(0, 2)[None, None, :])  # fmt: skip
    x0 = a_ptr + row0.to(tl.int64) * stride_am + rk
    x1 = tl.where(row0 + 1 < row_end, 1, 0).to(tl.int64) * stride_am  # tokens 1-3
    x2 = tl.where(row0 + 2 < row_end, 2, 0).to(tl.int64) * stride_am
    x3 = tl.where(row0 + 3 < row_end, 3, 0).to(tl.int64) * stride_am
    acc0 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        lo, hi, s = _nvfp4_bytes(b_e, bs_e, rn, n_ok, k0, K, s_blk, BLOCK_K, EVEN_K, USE_ASM)
        xmask = None if EVEN_K else (k0 + rk) < K
        acc0 += _token_blocks(lo, hi, x0 + k0, xmask, EVEN_K) * s
        if BLOCK_M > 1:
            acc1 += _token_blocks(lo, hi, x0 + x1 + k0, xmask, EVEN_K) * s
        if BLOCK_M > 2:
            acc2 += _token_blocks(lo, hi, x0 + x2 + k0, xmask, EVEN_K) * s
            acc3 += _token_blocks(lo, hi, x0 + x3 + k0, xmask, EVEN_K) * s
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    total = _column(total, tl.sum(acc0, axis=1), 0)
    if BLOCK_M > 1:
        total = _column(total, tl.sum(acc1, axis=1), 1)
    if BLOCK_M > 2:
        total = _column(total, tl.sum(acc2, axis=1), 2)
        total = _column(total, tl.sum(acc3, axis=1), 3)
    return total


@triton.jit
def _mma_tile(a_ptr, as_ptr, b_e, bs_e, rm, m_ok, rn, n_ok, k_lo, k_hi, K, stride_am, a_sblk,
              b_sblk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              A_FP4: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              USE_ASM: tl.constexpr, W_ON_M: tl.constexpr):  # fmt: skip
    """The fp32 ``[BLOCK_M, BLOCK_N]`` tile of rows ``rm`` (``m_ok``) times weight rows
    ``rn`` (``n_ok``) over K elements ``k_lo..k_hi``: ``tl.dot`` from ``BLOCK_M`` 16
    (``W_ON_M``: as ``W @ A.T``, then transposed), else the dequantized tiles' fp32
    products reduced per step."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # W_ON_M: out tile transposed
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        w = _nvfp4_tile(b_e, bs_e, rn, n_ok, k0, K, b_sblk, BLOCK_K, EVEN_K, USE_ASM)
        if A_FP4:
            x = _nvfp4_tile(a_ptr, as_ptr, rm, m_ok, k0, K, a_sblk, BLOCK_K, EVEN_K, USE_ASM)
            if BLOCK_M >= 16:  # fp16 MMA operands: exact for e2m1 x e4m3 values
                x = x.to(tl.float16)
                w = w.to(tl.float16)
        else:
            x_ptrs = a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
            if BLOCK_M >= 16:
                w = w.to(a_ptr.dtype.element_ty)  # the activations' 16-bit type (exact)
        if BLOCK_M >= 16:
            if W_ON_M:  # the weight rows on the MMA's M side (wgmma's 64-row minimum)
                acc_t = tl.dot(w, tl.trans(x), acc_t)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:  # [BLOCK_M, BLOCK_N, BLOCK_K] products of this step, reduced at once
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if W_ON_M:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _k_bounds(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, pid_k):
    """``(k_lo, k_hi)``: the K elements split ``pid_k`` reduces (`splitk.k_tile_range`'s
    K tiles; the last split's range may be shorter or empty). One split: all of K."""
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)
        k_lo = kt0 * BLOCK_K
        k_hi = tl.minimum(kt1 * BLOCK_K, K)
    return k_lo, k_hi


@triton.jit(do_not_specialize=["T", "N"])
def _grouped_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    alpha_ptr,
    off_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    T,
    N,
    K,
    E,
    stride_am,
    stride_om,
    stride_on,
    a_sblk,
    b_sblk,
    b_eslab,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    A_FP4: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    GEMV: tl.constexpr,
    W_ON_M: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    pid_k = tl.program_id(2)
    # ---- which (expert, M tile): from the offsets, on the device -------------------
    ex = tl.arange(0, E_PAD)
    in_e = ex < E
    ends = tl.load(off_ptr + ex, mask=in_e, other=0)
    starts = tl.load(off_ptr + ex - 1, mask=in_e & (ex > 0), other=0)
    sizes = tl.maximum(ends - starts, 0)
    tiles = tl.where(in_e, (sizes + BLOCK_M - 1) // BLOCK_M, 0)
    csum = tl.cumsum(tiles, axis=0)  # inclusive
    total = tl.sum(tiles, axis=0)
    e = tl.sum((csum <= tile).to(tl.int32), axis=0)  # empty experts are stepped over
    if tile >= total:  # every split of this slot leaves here: its counter stays untouched
        return
    first = tl.sum(tl.where(ex == e, csum - tiles, 0), axis=0)  # expert e's first tile
    row0 = tl.sum(tl.where(ex == e, starts, 0), axis=0) + (tile - first) * BLOCK_M
    row_end = tl.sum(tl.where(ex == e, ends, 0), axis=0)
    # split-K: this split's K range, and the workspace slot of this (N tile, M-tile slot)
    k_lo, k_hi = _k_bounds(K, BLOCK_K, SPLIT_K, pid_k)
    slot = pid_n * tl.num_programs(1) + tile

    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    rm = tl.where(m_ok, offs_m, row0).to(tl.int64)  # masked rows read row0 (in bounds)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rn = tl.where(n_ok, offs_n, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    b_e = b_ptr + e64 * N * (K // 2)
    bs_e = bs_ptr + e64 * b_eslab
    if GEMV:  # dense rows, at most 4 per tile: the decode GEMV's inner loop
        acc_t = _gemv_tile(a_ptr, b_e, bs_e, row0, row_end, rn, n_ok, k_lo, k_hi, K,
                           stride_am, b_sblk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM,
                           NUM_STAGES)  # fmt: skip
        o_ptrs = (out_ptr + rm[None, :] * stride_om
                  + offs_n[:, None].to(tl.int64) * stride_on)  # fmt: skip
        store_tile(acc_t, tl.load(alpha_ptr + e) * 16384.0, o_ptrs,  # alpha * 2**14
                   m_ok[None, :] & n_ok[:, None], ws_ptr, cnt_ptr, slot, pid_k, BLOCK_N,
                   BLOCK_M, SPLIT_K, 0.0, False)  # fmt: skip
        return
    acc = _mma_tile(a_ptr, as_ptr, b_e, bs_e, rm, m_ok, rn, n_ok, k_lo, k_hi, K, stride_am,
                    a_sblk, b_sblk, BLOCK_M, BLOCK_N, BLOCK_K, A_FP4, EVEN_K, NUM_STAGES,
                    USE_ASM, W_ON_M)  # fmt: skip
    o_ptrs = out_ptr + rm[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    store_tile(acc, tl.load(alpha_ptr + e), o_ptrs, m_ok[:, None] & n_ok[None, :], ws_ptr,
               cnt_ptr, slot, pid_k, BLOCK_M, BLOCK_N, SPLIT_K, 0.0, False)  # fmt: skip


def m_tile_bound(t: int, e: int, block_m: int) -> int:
    """Programs along M: ``cdiv(T, block_m) + min(E, T)`` (host facts only; module doc)."""
    return -(-t // block_m) + min(e, t)


_LAUNCH = CachedLauncher(_grouped_kernel)


@dataclass
class GroupedKernel:
    """A built grouped kernel: ``kernel(operands, out)`` with `GroupedOperands`.

    Launches through `triton_launch.CachedLauncher` (the compiled binary called directly
    after the first call of a specialization) and records its launch for the plan's
    driver-API replays (``record``: `fp4_dispatch.engine.plans`): no torch operation runs in a
    call, so a warm eager call is one launch with the per-call pointers patched.

    Split-K (``cfg.split_k > 1``) keeps its fp32 partials and int32 counters on the
    object (`fp4_dispatch.backends.workspace.Scratch`, made outside CUDA-graph pools on
    the first call of a size, never freed while the object lives, counters reset by the
    kernel): the same T always gets the same pair, so a recorded replay's and a CUDA
    graph's workspace pointers stay valid. Run the first call of a T outside capture;
    one object must not run on two streams at once."""

    cfg: GroupedConfig
    record: ClassVar = staticmethod(record_launches)
    #: the kernel's launcher (a subclass runs another kernel of the same arguments)
    launcher: ClassVar[CachedLauncher] = _LAUNCH
    #: constexpr values -> launcher binding (`_binding`)
    _bound: dict = field(default_factory=dict, repr=False)
    _scratch: Scratch = field(default_factory=Scratch, repr=False)

    def __call__(self, ops: GroupedOperands, out: torch.Tensor) -> None:
        if ops.m == 0 or ops.n == 0:
            return
        grid, args, meta = self._launch(ops, out)
        self._binding(meta)(grid, args)

    def workspace(
        self, device: torch.device, grid: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 partials, int32 counters) for a launch on `grid`: one slot per (N tile,
        M-tile slot), whether or not the routing fills it. The slot count is rounded up
        to a power of two, so the calls of one T share a pair and calls of many T (a
        prefill's varying lengths) make at most one pair per power of two, each at most
        twice the size needed, instead of one per T."""
        slots = 1 << (grid[0] * grid[1] - 1).bit_length()
        elems = slots * self.cfg.split_k * math.prod(self.tile_shape)
        return self._scratch.get(device, elems, slots * self.counters_per_tile)

    @property
    def counters_per_tile(self) -> int:
        """Split-K counters an output tile (a kernel whose tile is stored in parts has
        one a part)."""
        return 1

    @property
    def tile_shape(self) -> tuple[int, int]:
        """(rows of one expert, weight rows) of a program's output tile."""
        return self.cfg.block_m, self.cfg.block_n

    @property
    def threads_warps(self) -> int:
        """Warps a program."""
        return self.cfg.num_warps

    def _binding(self, meta: dict) -> BoundLaunch:
        """The launcher binding of these constexprs (made once per kernel object)."""
        key = tuple(meta.values())
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self.launcher.bind(
                meta, self.threads_warps, **self.bind_options()
            )
        return bound

    def precompile(
        self, t: int, n: int, k: int, e: int, out_dtype: torch.dtype, a_fp4: bool
    ) -> object:
        """Compile (Triton ``warmup``, nothing launched) what a call with T rows, E experts
        of ``[N, K]``, activations in `out_dtype` (W4A16) or NVFP4 (`a_fp4`) and a
        contiguous `out_dtype` output runs. Stand-in one-element tensors carry the dtypes
        (the kernel specializes on pointer alignment, never on the data)."""
        u8, f8 = torch.uint8, torch.float8_e4m3fn
        a = _Shaped((t, k // 2), u8) if a_fp4 else _Shaped((t, k), out_dtype)
        a_scale = _Shaped(swizzled_scale_shape(t, k), f8) if a_fp4 else None
        b_data = _Shaped((e, n, k // 2), u8)
        b_scale = _Shaped((e, *swizzled_scale_shape(n, k)), f8)
        ops = _StandIn(a, b_data, b_scale, a_scale, t, n, k, e)
        grid, args, meta = self._launch(ops, _Shaped((t, n), out_dtype))
        dtypes = (a.dtype, (a_scale or a).dtype, u8, f8, torch.float32, torch.int32, out_dtype)
        ws = (torch.float32, torch.int32) if self.cfg.split_k > 1 else (out_dtype, out_dtype)
        pointers = [torch.empty(16, dtype=dt) for dt in (*dtypes, *ws)]  # aligned like real
        return self._binding(meta).warmup(grid, [*pointers, *args[len(pointers) :]])

    def _launch(self, ops, out) -> tuple[tuple[int, int, int], list, dict]:
        """(grid, positional arguments, meta-parameters) of one call; a precompile's
        stand-in output leaves the split-K workspace unmade (its pointers are replaced)."""
        t, n, k, e = ops.m, ops.n, ops.k, ops.groups
        a_fp4 = ops.a_scale is not None
        grid = self.grid(t, n, e)
        if self.cfg.split_k > 1 and isinstance(out, torch.Tensor):
            ws, cnt = self.workspace(out.device, grid)
        else:  # one split never reads them: the output stands in
            ws = cnt = out
        return grid, self.launch_args(ops, out, ws, cnt), self.constexprs(k, e, a_fp4)

    def constexprs(self, k: int, e: int, a_fp4: bool) -> dict:
        """Every constexpr of a launch: ``E_PAD`` (E as a power of two, for the offsets'
        scan) and the kernel's own (`meta`)."""
        return {"E_PAD": max(2, triton.next_power_of_2(e)), **self.meta(k, a_fp4)}

    def grid(self, t: int, n: int, e: int) -> tuple[int, int, int]:
        """``(N tiles, M-tile bound, split_k)`` for T rows over E experts of N rows."""
        rows, cols = self.tile_shape
        return triton.cdiv(n, cols), m_tile_bound(t, e, rows), self.cfg.split_k

    def launch_args(self, ops, out, ws, cnt) -> list:
        """The kernel's positional arguments for operands `ops`, output `out` and the
        split-K workspace pair (``out`` standing in for both with one split)."""
        t, n, k, e = ops.m, ops.n, ops.k, ops.groups
        a_fp4 = ops.a_scale is not None
        b_sblk = ops.b_scale.shape[2] * 128
        a_sblk = ops.a_scale.shape[1] * 128 if a_fp4 else 0
        return [
            ops.a,
            ops.a_scale if a_fp4 else ops.a,
            ops.b_data,
            ops.b_scale,
            ops.alpha,
            ops.offsets,
            out,
            ws,
            cnt,
            t,
            n,
            k,
            e,
            0 if a_fp4 else ops.a.stride(0),
            out.stride(0),
            out.stride(1),
            a_sblk,
            b_sblk,
            ops.b_scale.shape[1] * ops.b_scale.shape[2],
        ]

    def bind_options(self) -> dict:
        """Launch options beside the warps (none here)."""
        return {}

    def meta(self, k: int, a_fp4: bool) -> dict:
        """The kernel's constexprs (beside ``E_PAD``) for K and the activations' format."""
        cfg = self.cfg
        return {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "SPLIT_K": cfg.split_k,
            "A_FP4": a_fp4,
            "EVEN_K": k % cfg.block_k == 0,
            "NUM_STAGES": cfg.num_stages,
            "USE_ASM": _USE_ASM,
            "GEMV": not a_fp4 and cfg.block_m <= GEMV_MAX_M,
            "W_ON_M": cfg.weights_on_m,
        }


class _Shaped:
    """What `GroupedKernel._launch` reads of a tensor (shape, dtype, strides of a
    contiguous one), for a precompile without allocating the operands."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = tuple(shape), dtype

    def stride(self, dim: int) -> int:
        return math.prod(self.shape[dim + 1 :])


@dataclass
class _StandIn:
    """The fields of `GroupedOperands` `GroupedKernel._launch` reads, for a precompile."""

    a: object
    b_data: object
    b_scale: object
    a_scale: object
    m: int
    n: int
    k: int
    groups: int
    offsets: object = None
    alpha: object = None


def build(cfg: GroupedConfig) -> GroupedKernel:
    """A grouped kernel object for `cfg` (Triton compiles on the first call)."""
    return GroupedKernel(cfg)
