"""Hopper (sm90) grouped NVFP4 GEMM in Triton: every expert of a mixture-of-experts layer
in one launch (docs/grouped.md, `fp4_dispatch.backend.GroupedOperands`).

``out[r] = alpha[e] * A[r] @ dequant(W[e]).T`` for the rows ``r`` of each expert ``e``
(``offsets``: int32 cumulative row ends, on the device). ``A`` is dense bf16/fp16
(grouped W4A16) or NVFP4 (grouped W4A4: dequantized in the kernel like the weights; Hopper
has no FP4 MMA, and e2m1 x e4m3 values are exact in fp16, so both operands dequantize
exactly and the products are the tensor cores' fp16/bf16 ones with fp32 accumulation).

Scheduling, with no host synchronisation (CUDA-graph safe): the grid is
``(N tiles, M-tile bound)`` where the bound is ``cdiv(T, BLOCK_M) + min(E, T)`` (each
non-empty expert adds at most one partial tile; at most ``min(E, T)`` experts are
non-empty) - host facts only. Each program reads all E offsets (E int32, from L2),
computes every expert's tile count and their running sum on the device, finds its
(expert, M tile), and exits at once when its index is past the last tile. So a decode
step (8 rows over 128 experts) launches ``cdiv(8, BLOCK_M) + 8`` M programs per N tile,
not ``128``: the cheap choice at decode, where each expert has 1-8 rows. The M tiles of
one expert sit next to each other in the grid's second axis and the first axis walks N,
so one expert's weight tile is read by its M tiles at nearly the same time (L2 reuse).

Two inner products, by ``BLOCK_M`` (a compile-time knob):

- ``BLOCK_M >= 16``: ``tl.dot`` on the tensor cores, operands in the activation dtype
  (W4A16) or fp16 (W4A4), fp32 accumulation;
- ``BLOCK_M < 16`` (decode, 1-8 rows per expert): fp32 multiply-adds in registers, the
  MMA's 16-row minimum being mostly padding there (the decode dequantizer's idea,
  `gemm_w4a16_decode`).

Weight dequantization is the decode kernel's (`gemm_w4a16_decode._nibbles`: its inline
PTX on a GPU, its element-wise twin under the interpreter): a nibble ``n`` placed as
fp16 bits ``(n & 7) << 9 | (n & 8) << 12`` is exactly ``e2m1(n) * 2**-14``; times the
block's e4m3 scale and ``2**14`` in fp32 that is ``e2m1 * scale`` exactly, then rounded
(exactly) to the 16-bit operand type. Shapes: any T, N >= 1, ``K % 32 == 0`` (K need not
divide by the K tile).

Not measured on a GPU yet: `benchmarks/bench_grouped.py` is the measurement.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4_dispatch.backend import GroupedOperands
from fp4_dispatch.backends.sm90.gemm_w4a16 import _USE_ASM
from fp4_dispatch.backends.sm90.gemm_w4a16_decode import _nibbles
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.nvfp4 import swizzled_scale_shape

log = logging.getLogger(__name__)

__all__ = ["BLOCK_K_CHOICES", "BLOCK_M_CHOICES", "GroupedConfig", "GroupedKernel", "build"]

#: rows (tokens x top-k of one expert) per program: 1-8 run on FMAs, 16+ on tl.dot
BLOCK_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
#: weight rows per program
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
#: K elements per loop step (a multiple of 64: one swizzled 4-group step per 64)
BLOCK_K_CHOICES = (64, 128, 256)
#: the smallest BLOCK_M that runs on the tensor cores (tl.dot's minimum M)
DOT_MIN_M = 16
#: the FMA path (BLOCK_M < 16) holds BLOCK_M x BLOCK_N x BLOCK_K fp32 products of one
#: step: at most this many per thread (32 x num_warps threads), else registers spill
FMA_PER_THREAD = 128


@dataclass(frozen=True)
class GroupedConfig:
    """Compile-time knobs: ``block_m`` rows, ``block_n`` weight rows, ``block_k`` K
    elements per step, Triton's ``num_warps`` and ``num_stages``."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, choices in (
            ("block_m", BLOCK_M_CHOICES),
            ("block_n", BLOCK_N_CHOICES),
            ("block_k", BLOCK_K_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)}")
        if self.num_warps not in (2, 4, 8):
            raise ValueError(f"num_warps: expected 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")
        per_thread = self.block_m * self.block_n * self.block_k // (32 * self.num_warps)
        if self.block_m < DOT_MIN_M and per_thread > FMA_PER_THREAD:
            raise ValueError(
                f"block_m x block_n x block_k: the FMA path (block_m < {DOT_MIN_M}) holds "
                f"at most {FMA_PER_THREAD} products per thread, got {per_thread}"
            )


@triton.jit
def _nvfp4_tile(data_ptr, scale_ptr, rows, row_ok, k0, K, s_blk, KT: tl.constexpr,
                EVEN_K: tl.constexpr, OUT: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """Dequantized ``[len(rows), KT]`` tile (K elements ``k0..k0+KT``) of an NVFP4
    operand, as ``OUT`` (exact: e2m1 x e4m3 fits fp16 and bf16). ``rows``: row indices
    (int64 offsets of ``data_ptr``'s rows, ``K/2`` bytes each); ``row_ok`` masks them;
    the scales are the 128x4-swizzled layout at ``scale_ptr`` (``s_blk`` elements per
    128-row block)."""
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
    s = tl.load(scale_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
    lo, hi = _nibbles(w, USE_ASM, False)  # fp32 e2m1 * 2**-14 (the decode kernel's PTX)
    lo = lo * s[:, :, None]
    hi = hi * s[:, :, None]
    vals = tl.join(lo, hi)  # [R, KG, 8, 2]: element 16 g + 2 i + nibble
    return tl.reshape(vals, (rows.shape[0], KT)).to(OUT)


@triton.jit(do_not_specialize=["T", "N"])
def _grouped_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    alpha_ptr,
    off_ptr,
    out_ptr,
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
    A_FP4: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DT: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
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
    if tile >= total:
        return
    first = tl.sum(tl.where(ex == e, csum - tiles, 0), axis=0)  # expert e's first tile
    row0 = tl.sum(tl.where(ex == e, starts, 0), axis=0) + (tile - first) * BLOCK_M
    row_end = tl.sum(tl.where(ex == e, ends, 0), axis=0)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    rm = tl.where(m_ok, offs_m, row0).to(tl.int64)  # masked rows read row0 (in bounds)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rn = tl.where(n_ok, offs_n, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    b_e = b_ptr + e64 * N * (K // 2)
    bs_e = bs_ptr + e64 * b_eslab
    rk = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _nvfp4_tile(b_e, bs_e, rn, n_ok, k0, K, b_sblk, BLOCK_K, EVEN_K, DT, USE_ASM)
        if A_FP4:
            x = _nvfp4_tile(a_ptr, as_ptr, rm, m_ok, k0, K, a_sblk, BLOCK_K, EVEN_K, DT, USE_ASM)
        else:
            x_ptrs = a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        if BLOCK_M >= 16:
            acc = tl.dot(x, tl.trans(w), acc)
        else:  # [BLOCK_M, BLOCK_N, BLOCK_K] products of this step, reduced at once
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    alpha = tl.load(alpha_ptr + e)
    y = (acc * alpha).to(out_ptr.dtype.element_ty)
    o_ptrs = out_ptr + rm[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(o_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


def m_tile_bound(t: int, e: int, block_m: int) -> int:
    """Programs along M: ``cdiv(T, block_m) + min(E, T)`` (host facts only; module doc)."""
    return -(-t // block_m) + min(e, t)


@dataclass
class GroupedKernel:
    """A built grouped kernel: ``kernel(operands, out)`` with `GroupedOperands`."""

    cfg: GroupedConfig

    def __call__(self, ops: GroupedOperands, out: torch.Tensor) -> None:
        if ops.m == 0 or ops.n == 0:
            return
        grid, args, meta = self._launch(ops, out)
        _grouped_kernel[grid](*args, **meta)

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
        pointers = [torch.empty(16, dtype=dt) for dt in dtypes]  # aligned like real ones
        return _grouped_kernel.warmup(*pointers, *args[len(pointers) :], grid=grid, **meta)

    def _launch(self, ops, out) -> tuple[tuple[int, int], list, dict]:
        """(grid, positional arguments, meta-parameters) of one call."""
        t, n, k, e = ops.m, ops.n, ops.k, ops.groups
        cfg = self.cfg
        a_fp4 = ops.a_scale is not None
        grid = (triton.cdiv(n, cfg.block_n), m_tile_bound(t, e, cfg.block_m))
        b_sblk = ops.b_scale.shape[2] * 128
        a_sblk = ops.a_scale.shape[1] * 128 if a_fp4 else 0
        args = [
            ops.a,
            ops.a_scale if a_fp4 else ops.a,
            ops.b_data,
            ops.b_scale,
            ops.alpha,
            ops.offsets,
            out,
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
        meta = {
            "E_PAD": triton.next_power_of_2(e),
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "A_FP4": a_fp4,
            "EVEN_K": k % cfg.block_k == 0,
            "NUM_STAGES": cfg.num_stages,
            "DT": tl.float16 if a_fp4 or ops.a.dtype == torch.float16 else tl.bfloat16,
            "USE_ASM": _USE_ASM,
            "num_warps": cfg.num_warps,
        }
        return grid, args, meta


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
