"""Hopper (sm90) W4A8 GEMM in Triton: dense activations x NVFP4 weights on FP8 tensor cores.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T (+ bias)``, computed with both operands
rounded to FP8 E4M3 (lossy: only under ``precision="fp8"``). The numerics are those of
`fp4_dispatch.backends.reference.w4a8`, which emulates them exactly (its docstring says
why the scales are powers of two chosen per token and per output channel); the weight
stays NVFP4 in memory.

Two paths (tactic knob ``path``, `fp4_dispatch.plugins.sm90.w4a8`), both after one fused
activation pass (`quantize_activations`: per token the absolute maximum, the power-of-two
scale and the E4M3 codes, one Triton kernel, one read of ``x``):

- ``fused``: one CTA owns ``BLOCK_N`` weight rows and ``BLOCK_M`` tokens. It first reads
  its rows' block scales once (``K/16`` bytes a row) for their per-channel scale, then
  per K step expands the NVFP4 tile (``e2m1 * block scale / channel scale``, exact, in
  bf16 pairs), rounds each pair to E4M3 with one conversion (`_weight_pairs_e4m3`, as
  the unpack pass does) and multiplies the tile with the E4M3 activation tile on the FP8
  tensor cores (``tl.dot`` on ``float8e4nv``: wgmma), accumulating in fp32. Weights are
  the MMA's wide side, tokens the narrow one, as in the W4A16 direct kernel, whose
  epilogue (bias, split-K, transposed store: `gemm_w4a16.store_dense`) it shares.
- ``unpack`` (large M): one memory-bound pass writes the weight as E4M3 into a per-call
  workspace (``N * K`` bytes) with its per-channel scale (alpha folded in), then cuBLASLt
  multiplies (``torch._scaled_mm`` with row-wise scales), as the W4A16 unpack path does
  with bf16 and ``torch.mm``. bf16 output only (row-wise scaling's rule in torch).

Accumulation. Hopper's FP8 MMA accumulates with fewer than fp32's bits unless the sum
is promoted to an fp32 register often enough (DeepSeek-V3 report, section 3.3.2). The
unpack path asks cuBLASLt for that (``use_fast_accum=False``). The fused kernel asks
Triton for it every K step (``max_num_imprecise_acc`` = ``block_k`` unless
``fast_accum``), but Triton's Hopper pipeliner splits a dot whose first operand is in
registers into two halves along K and gives each half ``max_num_imprecise_acc = 2**30``,
chaining the loop's accumulator through both: no promotion is compiled, with or without
``fast_accum`` (docs/PRECISION.md, "Accumulation"; `tests/test_gemm_w4a8.py` pins what
Triton compiles). A smaller value is refused by Triton's verifier after the split.

Rounding to E4M3. On the GPU ``x.to(tl.float8e4nv)`` is ``cvt.rn.satfinite`` (round to
nearest even, saturating). Triton's interpreter rounds ties away and flushes E4M3
subnormals, so under TRITON_INTERPRET=1 `_to_e4m3` rounds with integer operations on
the float32 bits instead (the same values as ``torch.to(float8_e4m3fn)``; tested on
every tie). Nothing reaches the saturation: the scales keep every value within 448.

Shapes: any M, N >= 1 (weight rows wrap modulo N inside a tile; token rows past M are
zero-filled loads; stores are masked); ``K % 32 == 0``. ``x`` needs unit stride along K;
``out`` may have any strides (fused) or is written through a copy when not contiguous
(unpack). Workspaces (activation codes and scales; the unpack path's E4M3 weight) come
from ``torch.empty`` per call: cheap with the caching allocator, and from the graph's
pool under CUDA-graph capture (run one call before capturing, which compiles).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.sm90.gemm_unpack import _e4m3_to_f32
from fp4_dispatch.backends.sm90.gemm_w4a16 import _dequant_scaled_bf16, store_dense
from fp4_dispatch.backends.sm90.splitk import k_tile_range
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher
from fp4_dispatch.backends.workspace import Scratch
from fp4_dispatch.contracts.backend import DenseOperands

#: the GPU's conversion instruction; the integer rounding under TRITON_INTERPRET=1
_HW_CVT = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")

#: rows per program, K elements per step and warps of the activation pass. One row a
#: program and long steps: at 4 rows x 512 a 1024-token pass had 256 programs with 32
#: bytes a thread in flight and ran at 2-3x its memory floor for K >= 14336; this is
#: 1.35-1.86x faster (8 warps within 3% of it, 2048-element steps up to 7% slower)
#: (benchmarks/RESULTS.md, "W4A8 on Hopper", runs 2-3)
QUANT_ROWS = 1
QUANT_BLOCK_K = 4096
QUANT_WARPS = 4
#: rows and K elements per program step of the unpack path's weight pass
UNPACK_BLOCK_R = (16, 32, 64)
UNPACK_BLOCK_K = (128, 256, 512)
#: programs the weight pass aims for (`unpack_grid`): 8 per SM of a 132-SM H100, enough
#: loads in flight to stream at memory speed; a round figure, not tuned
UNPACK_PROGRAMS = 1024


@triton.jit
def _pow2_exponent(amax):
    """int32 ``e``, the smallest with ``amax <= 448 * 2**e``, in [-126, 127] (exact, from
    the float32 bits; the twin of `reference.w4a8.pow2_exponent`)."""
    bits = amax.to(tl.float32).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(e, -126), 127)


@triton.jit
def _pow2(e):
    """float32 ``2**e`` for int32 ``e`` in [-126, 127] (its bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits_rne(x):
    """float32 -> float8_e4m3fn bits (uint8) rounded to nearest even, saturating at 448,
    with subnormals (NaN -> 0x7F): what ``cvt.rn.satfinite.e4m3x2.f32`` computes."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = (a >> 23).to(tl.int32) - 127
    mant = a & 0x7FFFFF
    # normal E4M3 (exp >= -6): 3 mantissa bits, the carry of the rounding runs into the
    # exponent (and from 1.111b * 2**8 to 2**9, caught by the saturation below)
    low = mant & 0xFFFFF
    keep = ((exp + 7).to(tl.uint32) << 3) | (mant >> 20)
    up = (low > 0x80000) | ((low == 0x80000) & ((keep & 1) == 1))
    normal = keep + up.to(tl.uint32)
    # subnormal (exp < -6): k * 2**-9, k = significand >> (14 - exp), rounded to even
    sig = mant | 0x800000
    shift = tl.maximum(tl.minimum(14 - exp, 31), 1).to(tl.uint32)
    k = sig >> shift
    rest = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = k + ((rest > half) | ((rest == half) & ((k & 1) == 1))).to(tl.uint32)
    out = tl.where(exp >= -6, normal, tl.where(shift >= 25, 0, sub))
    out = tl.minimum(out, 0x7E)  # 448: satfinite
    out = tl.where(a > 0x7F800000, 0x7F, out)  # NaN
    return (out | sign).to(tl.uint8)


@triton.jit
def _to_e4m3(x, HW_CVT: tl.constexpr):
    """float32 -> float8e4nv, round to nearest even (module docstring, "Rounding")."""
    if HW_CVT:
        return x.to(tl.float8e4nv)
    return _e4m3_bits_rne(x).to(tl.float8e4nv, bitcast=True)


# ---- the activation pass ----------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """Per token row: ``amax``, ``e = _pow2_exponent(amax)``, ``q = e4m3(x * 2**-e)``;
    writes ``q`` [M, K] (contiguous) and ``2**e`` [M] float32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    quantize_rows(x_ptr, q_ptr, s_ptr, rows, M, K, stride_xm, BLOCK_K, HW_CVT, False)


@triton.jit
def _natural_to_rs_order(k):
    """Where natural column ``k`` lands in the W4A8 rs kernel's K order: the bits of its
    place in a 128-wide block, ``(c, g, w, h, t)`` (2, 1, 1, 1, 2 bits), become ``(g, w, h,
    c, t)`` (`gemm_w4a8_rs.rs_order` is the host twin and says why)."""
    j = k & 127
    return (k - j) + (((j >> 2) & 7) << 4) + ((j >> 5) << 2) + (j & 3)


@triton.jit
def quantize_rows(x_ptr, q_ptr, s_ptr, rows, M, K, stride_xm, BLOCK_K: tl.constexpr,
                  HW_CVT: tl.constexpr, RS_ORDER: tl.constexpr):  # fmt: skip
    """`_quantize_rows_kernel`'s work on token ``rows``; with ``RS_ORDER`` the codes of
    each 128-wide K block are stored in the rs kernel's order (`_natural_to_rs_order`)."""
    rmask = (rows < M)[:, None]
    rk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros(rows.shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = rmask & ((k0 + rk) < K)[None, :]
        x = tl.load(x_row + (k0 + rk)[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    e = _pow2_exponent(amax)
    inv = _pow2(-e)[:, None]
    q_row = q_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        mask = rmask & ((k0 + rk) < K)[None, :]
        x = tl.load(x_row + (k0 + rk)[None, :], mask=mask, other=0.0).to(tl.float32)
        cols = k0 + rk
        if RS_ORDER:
            cols = _natural_to_rs_order(cols)
        tl.store(q_row + cols[None, :], _to_e4m3(x * inv, HW_CVT), mask=mask)
    tl.store(s_ptr + rows, _pow2(e), mask=rows < M)


#: the activation pass's compile-time arguments (`QUANT_ROWS` and beside it)
_QUANT_META = dict(BLOCK_R=QUANT_ROWS, BLOCK_K=QUANT_BLOCK_K, HW_CVT=_HW_CVT, num_warps=QUANT_WARPS)


def _quant_grid(m: int) -> tuple[int]:
    """The activation pass's grid for ``m`` token rows."""
    return (triton.cdiv(m, QUANT_ROWS),)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes ``[M, K]`` float8_e4m3fn, scales ``[M]`` float32) of a bf16/fp16/fp32
    ``[M, K]`` with unit stride along K: `reference.w4a8.quantize_activations`, one
    Triton kernel."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    _QUANT_BOUND(_quant_grid(m), (x, q, s, m, k, x.stride(0)))
    return q, s


# ---- the weight's per-channel scale and its conversion -----------------------------------


@triton.jit
def _channel_exponent(bs_ptr, s_row, rmask, K, ROWS: tl.constexpr, KG: tl.constexpr):
    """int32 exponent of the per-channel scale of the rows at ``s_row`` (their offsets in
    the swizzled block scales, read as uint8): ``_pow2_exponent(6 * max block scale)``.
    Positive e4m3 bit patterns order like their values; the sign bit is dropped."""
    rg = tl.arange(0, KG)
    best = tl.zeros((ROWS,), dtype=tl.int32)
    for g0 in range(0, K // 16, KG):
        g = g0 + rg
        sb = tl.load(bs_ptr + s_row[:, None] + scale_group_offset(g)[None, :],
                     mask=rmask[:, None] & (g < K // 16)[None, :], other=0)  # fmt: skip
        best = tl.maximum(best, tl.max(sb.to(tl.int32) & 0x7F, axis=1))
    return _pow2_exponent(6.0 * _e4m3_to_f32(best.to(tl.uint8)))


#: (even K, odd K) bf16 pairs ``v * 2**-14`` of the W4A16 dequantizer -> per element
#: pair one uint16 holding ``e4m3(v_even) | e4m3(v_odd) << 8`` (natural K order in
#: memory): times 2**14 in bf16 (exact), widened to fp32 (exact), one ``cvt`` a pair
_PAIR_E4M3_ASM = tl.constexpr("""{
.reg .b32 c, l, h, l0, l1, h0, h1;
.reg .b16 r0, r1;
mov.b32 c, 0x46804680;
mul.rn.bf16x2 l, $1, c;
mul.rn.bf16x2 h, $2, c;
shl.b32 l0, l, 16;
and.b32 l1, l, 0xFFFF0000;
shl.b32 h0, h, 16;
and.b32 h1, h, 0xFFFF0000;
cvt.rn.satfinite.e4m3x2.f32 r0, h0, l0;
cvt.rn.satfinite.e4m3x2.f32 r1, h1, l1;
mov.b32 $0, {r0, r1};
}""")


@triton.jit
def _pack_e4m3_pairs(lo, hi, HW_CVT: tl.constexpr):
    """(even K, odd K) bf16 values ``v * 2**-14`` -> uint16 ``e4m3(v_even) | e4m3(v_odd)
    << 8``: `_PAIR_E4M3_ASM` on the GPU, its integer twin (`_e4m3_bits_rne`) under the
    interpreter. Both round once, to nearest even, from the exact ``v``."""
    if HW_CVT:
        return tl.inline_asm_elementwise(
            _PAIR_E4M3_ASM, "=r,r,r", [lo, hi], dtype=tl.uint16, is_pure=True, pack=2
        )
    even = _e4m3_bits_rne(lo.to(tl.float32) * 16384.0).to(tl.uint16)
    odd = _e4m3_bits_rne(hi.to(tl.float32) * 16384.0).to(tl.uint16)
    return even | (odd << 8)


@triton.jit
def _weight_pairs_e4m3(w, sb, inv_c, ROWS: tl.constexpr, KB: tl.constexpr,
                       HW_CVT: tl.constexpr):  # fmt: skip
    """A ``[ROWS, KB]`` tile of packed e2m1 bytes with its ``[ROWS, KB/8]`` block-scale
    bytes -> ``[ROWS, KB]`` uint16, each the E4M3 codes of ``e2m1 * scale * inv_c`` of
    the byte's two nibbles (low byte: the low nibble). Why pairs: an fp32 expansion took
    ~21 PTX instructions an element in the weight pass (663 in the loop of a 16x256 tile,
    32 elements a thread), the likely bound of the pass at 1.1-1.4 TB/s (this one is
    1.3-1.7x faster, same bits: benchmarks/RESULTS.md, "W4A8 on Hopper", run 3), and in
    the fused kernel 2,203 PTX instructions a K step at 128x64 tiles against 864 (Triton
    3.9, sm_90, `tests/test_gemm_w4a8.py`); here the W4A16 kernels' bf16 dequantizer
    (``prmt`` and ``bf16x2`` products, exact: ``e2m1 * scale`` has at most 6 significant
    bits) and one conversion per pair. ``scale * inv_c`` stays exact in bf16 (``inv_c``
    is a power of two and the product stays within bf16's range)."""
    sc = _e4m3_to_f32(sb) * inv_c[:, None]
    lo, hi = _dequant_scaled_bf16(w, sc, ROWS, KB, HW_CVT, False, 0)
    return _pack_e4m3_pairs(lo, hi, HW_CVT)


@triton.jit
def _unpair(pairs, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[ROWS, BLOCK_K/2]`` uint16 pairs of E4M3 codes (`_weight_pairs_e4m3`: low byte
    the even K) -> the ``[ROWS, BLOCK_K]`` float8e4nv tile in natural K order."""
    even = (pairs & 0xFF).to(tl.uint8)
    odd = (pairs >> 8).to(tl.uint8)
    return tl.reshape(tl.join(even, odd), (ROWS, BLOCK_K)).to(tl.float8e4nv, bitcast=True)


# ---- the fused kernel -------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a8_kernel(
    q_ptr, sa_ptr, b_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_om, stride_on, b_sblk, has_bias,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HW_CVT: tl.constexpr, IMPRECISE: tl.constexpr,
):  # fmt: skip
    """``acc[BLOCK_N, BLOCK_M] = e4m3(W) @ e4m3(x).T`` for one tile (module docstring),
    times the channel and token scales, stored with alpha and the bias by `store_dense`."""
    KB: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid % grid_n  # consecutive CTAs walk N: the token tile stays hot in L2
    pid_m = pid // grid_n
    k_half = tl.multiple_of(K // 2, 16)
    kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = offs_n % N  # wrapped rows: in-bounds loads, never stored
    rm = offs_m % M
    rb = tl.arange(0, KB)
    rg = tl.arange(0, KG)
    rk = tl.arange(0, BLOCK_K)
    s_row = scale_row_offset(rn, b_sblk)
    ew = _channel_exponent(bs_ptr, s_row, rn < N, K, BLOCK_N, KG)
    inv_c = _pow2(-ew)

    w_ptrs = b_ptr + rn[:, None].to(tl.int64) * k_half + (kt0 * KB + rb)[None, :]
    s_ptrs = bs_ptr + s_row[:, None] + (scale_group_offset(rg) + kt0 * (KG // 4) * 512)[None, :]
    x_ptrs = q_ptr + rm[:, None].to(tl.int64) * K + (kt0 * BLOCK_K + rk)[None, :]
    xrow = (offs_m < M)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1):
        if EVEN_K:
            w = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
            xq = tl.load(x_ptrs, mask=xrow, other=0.0)
        else:
            kmask = (kt * KB + rb) < k_half
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
            sb = tl.load(s_ptrs, mask=((kt * KG + rg) < K // 16)[None, :], other=0)
            xq = tl.load(x_ptrs, mask=xrow & ((kt * BLOCK_K + rk) < K)[None, :], other=0.0)
        wq = _unpair(_weight_pairs_e4m3(w, sb, inv_c, BLOCK_N, KB, HW_CVT), BLOCK_N, BLOCK_K)
        acc = tl.dot(wq, tl.trans(xq), acc, max_num_imprecise_acc=IMPRECISE)
        w_ptrs += KB
        s_ptrs += (KG // 4) * 512
        x_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + rm)
    acc = acc * _pow2(ew)[:, None] * sa[None, :]  # powers of two: exact
    store_dense(acc, tl.load(alpha_ptr), bias_ptr, has_bias, out_ptr, offs_m, offs_n, M, N,
                stride_om, stride_on, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_N, BLOCK_M,
                SPLIT_K)  # fmt: skip


@dataclass(frozen=True)
class W4A8Config:
    """Compile-time knobs of the fused kernel (the tactic's, `plugins.sm90.w4a8`).
    ``fast_accum``: let the FP8 MMA accumulate a whole split's K in its own precision;
    off by default, though Triton compiles both settings alike (module docstring,
    "Accumulation")."""

    block_n: int = 128
    block_m: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fast_accum: bool = False


@dataclass
class W4A8Kernel:
    """The fused path: ``kernel(operands, out)`` with `DenseOperands` (bias fused)."""

    cfg: W4A8Config
    bias_epilogue = True
    _scratch: Scratch = field(default_factory=Scratch, repr=False)

    def grid(self, m: int, n: int) -> tuple[int, int]:
        cfg = self.cfg
        return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k

    def __call__(self, operands: DenseOperands, out: torch.Tensor) -> None:
        xq, sa = quantize_activations(operands.a)
        self.launch(xq, sa, operands, out)

    def launch(self, xq: torch.Tensor, sa: torch.Tensor, operands: DenseOperands,
               out: torch.Tensor) -> None:  # fmt: skip
        """The GEMM on already quantized activations (``xq``, ``sa``)."""
        cfg = self.cfg
        m, k = xq.shape
        b, sb = operands.b_data, operands.b_scale.view(torch.uint8)
        n = b.shape[0]
        grid = self.grid(m, n)
        if cfg.split_k > 1:
            elems = grid[0] * cfg.split_k * cfg.block_n * cfg.block_m
            ws, cnt = self._scratch.get(out.device, elems, grid[0])
        else:
            ws = cnt = out
        bias = operands.bias
        has_bias = bias is not None
        _w4a8_kernel[grid](
            xq, sa, b, sb, operands.alpha, bias if has_bias else out, out, ws, cnt,
            m, n, k, out.stride(0), out.stride(1), sb.shape[1] * 128, int(has_bias),
            BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k, EVEN_K=k % cfg.block_k == 0, HW_CVT=_HW_CVT,
            IMPRECISE=2**30 if cfg.fast_accum else cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def precompile(self, m: int, n: int, k: int, dtype: torch.dtype) -> object:
        """Compile (Triton ``warmup``, no launch) the activation pass and the GEMM a call
        with contiguous ``dtype`` activations and output runs."""
        cfg = self.cfg
        f8, f32, u8 = torch.float8_e4m3fn, torch.float32, torch.uint8
        _quantize_rows_kernel.warmup(dtype, f8, f32, m, k, k, grid=_quant_grid(m), **_QUANT_META)
        ws, cnt = (f32, torch.int32) if cfg.split_k > 1 else (dtype, dtype)
        sblk = -(-(k // 16) // 4) * 4 * 128
        return _w4a8_kernel.warmup(
            f8, f32, u8, u8, f32, dtype, dtype, ws, cnt, m, n, k, n, 1, sblk, 0,
            grid=self.grid(m, n), BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EVEN_K=k % cfg.block_k == 0,
            HW_CVT=_HW_CVT, IMPRECISE=2**30 if cfg.fast_accum else cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


# ---- the unpack path --------------------------------------------------------------------


@triton.jit
def _weight_fp8_kernel(
    b_ptr, bs_ptr, alpha_ptr, wq_ptr, sw_ptr, N, K, b_sblk, TILES_PER_PROG,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` weight rows x ``TILES_PER_PROG`` K tiles (grid axis 1 walks the K
    spans, `unpack_grid`): the rows' channel scale (a pass over all their block scales,
    repeated by every span: K/16 bytes a row, from L2 after the first), then the E4M3
    codes of the span's K tiles, two a uint16 (``wq_ptr``: the [N, K] float8 workspace
    viewed as uint16 [N, K/2]); span 0 also writes ``alpha * 2**ew`` [N]."""
    KB: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    s_row = scale_row_offset(rows, b_sblk)
    ew = _channel_exponent(bs_ptr, s_row, rmask, K, BLOCK_R, KG)
    inv_c = _pow2(-ew)
    k_half = K // 2
    rb = tl.arange(0, KB)
    rg = tl.arange(0, KG)
    kt0 = tl.program_id(1) * TILES_PER_PROG
    for kt in range(kt0, tl.minimum(kt0 + TILES_PER_PROG, tl.cdiv(K, BLOCK_K))):
        bmask = rmask[:, None] & ((kt * KB + rb) < k_half)[None, :]
        offs = rows.to(tl.int64)[:, None] * k_half + (kt * KB + rb)[None, :]
        w = tl.load(b_ptr + offs, mask=bmask, other=0)
        g = kt * KG + rg
        sb = tl.load(bs_ptr + s_row[:, None] + scale_group_offset(g)[None, :],
                     mask=rmask[:, None] & (g < K // 16)[None, :], other=0)  # fmt: skip
        tl.store(wq_ptr + offs, _weight_pairs_e4m3(w, sb, inv_c, BLOCK_R, KB, HW_CVT),
                 mask=bmask)  # fmt: skip
    if tl.program_id(1) == 0:
        tl.store(sw_ptr + rows, _pow2(ew) * tl.load(alpha_ptr), mask=rmask)


def weight_to_fp8(
    b_data: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
    block_r: int = 32, block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(E4M3 weight ``[N, K]``, ``alpha * channel scale`` ``[N]`` float32): the unpack
    path's weight pass (`reference.w4a8.weight_to_fp8`, alpha folded into the scale)."""
    n, k = b_data.shape[0], b_data.shape[1] * 2
    wq = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=b_data.device)
    sw = torch.empty((n,), dtype=torch.float32, device=b_data.device)
    sb = b_scale.view(torch.uint8)
    grid, per_prog = unpack_grid(n, k, block_r, block_k)
    meta = _weight_meta(block_r, block_k)
    bound = _bound(_WEIGHT_LAUNCH, meta)
    bound(grid, (b_data, sb, alpha, wq.view(torch.uint16), sw, n, k, sb.shape[1] * 128, per_prog))
    return wq, sw


def _weight_meta(block_r: int, block_k: int) -> dict:
    """The weight pass's compile-time arguments (its launch and its precompile)."""
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, HW_CVT=_HW_CVT, num_warps=4)


def unpack_grid(n: int, k: int, block_r: int, block_k: int) -> tuple[tuple[int, int], int]:
    """((row programs, K spans), K tiles per span) of the weight pass: K is cut into
    spans until the grid has about `UNPACK_PROGRAMS` programs. Why: one program per
    ``block_r`` rows walking all of K left the pass latency-bound (3584 x 18944: 112
    programs of 148 sequential steps on a 132-SM GPU; benchmarks/RESULTS.md, "W4A8 on
    Hopper")."""
    rows = triton.cdiv(n, block_r)
    k_tiles = triton.cdiv(k, block_k)
    per_prog = triton.cdiv(k_tiles, max(1, min(k_tiles, UNPACK_PROGRAMS // rows)))
    return (rows, triton.cdiv(k_tiles, per_prog)), per_prog


@dataclass(frozen=True)
class W4A8UnpackKernel:
    """Large-M path: the weight to E4M3 per call, then ``torch._scaled_mm`` (cuBLASLt,
    row-wise scales, bf16 out). The bias is the plan's (added after the GEMM)."""

    block_r: int = 32
    block_k: int = 128
    fast_accum: bool = False

    def __call__(self, operands: DenseOperands, out: torch.Tensor) -> None:
        xq, sa = quantize_activations(operands.a)
        wq, sw = weight_to_fp8(operands.b_data, operands.b_scale, operands.alpha,
                               self.block_r, self.block_k)  # fmt: skip
        args = (xq, wq.t(), sa[:, None], sw[None, :])
        kw = {"out_dtype": out.dtype, "use_fast_accum": self.fast_accum}
        if out.is_contiguous():
            torch._scaled_mm(*args, **kw, out=out)
        else:
            out.copy_(torch._scaled_mm(*args, **kw))

    def precompile(self, m: int, n: int, k: int, dtype: torch.dtype) -> object:
        """Compile (Triton warmup, no launch) the activation and weight passes; returns
        the weight pass's compiled kernel (its ``asm``: what the compile test reads)."""
        f8, f32, u8 = torch.float8_e4m3fn, torch.float32, torch.uint8
        _quantize_rows_kernel.warmup(dtype, f8, f32, m, k, k, grid=_quant_grid(m), **_QUANT_META)
        sblk = -(-(k // 16) // 4) * 4 * 128
        grid, per_prog = unpack_grid(n, k, self.block_r, self.block_k)
        meta = _weight_meta(self.block_r, self.block_k)
        return _weight_fp8_kernel.warmup(u8, u8, f32, torch.uint16, f32, n, k, sblk, per_prog,
                                         grid=grid, **meta)  # fmt: skip


def _bound(launcher: CachedLauncher, meta: dict) -> BoundLaunch:
    """`launcher` bound to ``meta`` (constexprs plus ``num_warps``). Why cached launchers:
    Triton's ``kernel[grid]`` rebinds and re-keys every argument on each call, host time
    an eager call of the unpack path would pay for both passes."""
    constexprs = {name: v for name, v in meta.items() if name != "num_warps"}
    return launcher.bind(constexprs, meta["num_warps"])


_WEIGHT_LAUNCH = CachedLauncher(_weight_fp8_kernel)
_QUANT_BOUND = _bound(CachedLauncher(_quantize_rows_kernel), _QUANT_META)


def build(cfg: W4A8Config) -> W4A8Kernel:
    """A fused W4A8 kernel object."""
    return W4A8Kernel(cfg)


def build_unpack(block_r: int, block_k: int) -> W4A8UnpackKernel:
    """An unpack + ``_scaled_mm`` kernel object."""
    if block_r not in UNPACK_BLOCK_R or block_k not in UNPACK_BLOCK_K:
        raise ValueError(f"block_r/block_k: expected one of {UNPACK_BLOCK_R}/{UNPACK_BLOCK_K}, "
                         f"got {block_r}/{block_k}")  # fmt: skip
    return W4A8UnpackKernel(block_r, block_k)
