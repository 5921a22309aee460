"""Hopper (sm90) W4A16 decode kernel without tensor cores: a GEMV-shaped Triton kernel.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T`` for a handful of tokens (``M <= 4``
per CTA), same operands and contract as `fp4_dispatch.backends.sm90.gemm_w4a16` (its
``W4A16Operands``, natural or sm90-prepared weight bytes, bf16/fp16 activations).

Why a second decode kernel. The wgmma kernel of `gemm_w4a16` issues ~4.2 SASS
instructions per weight element at 1x8192² but reaches only ~38% of HBM bandwidth
(RESULTS.md, "Hopper W4A16", run 2: latency-bound, ~8 warps per SM). At M <= 4 the MMA
does almost no useful work (16 token columns, at most 4 used), so this kernel drops it:
every thread dequantizes its own weight bytes in registers and multiplies them with the
activations in fp32 FMAs. The weights never pass through shared memory unless the
cp.async pipeline is on (``num_stages >= 2``: Triton's ``tl.range`` software pipeline;
1 = plain loads); the activations do (Triton's layout conversion of the small x tile,
one barrier per step). CTAs are small (16-64 rows), so many are resident per SM, each
with its own loads in flight: the bet is that this hides the latency the wgmma kernel
exposes. Its sweep: ``python -m benchmarks kernels --cases w4a16-decode --top 0``.

Arithmetic (exact up to the fp32 summation order). A nibble placed as fp16 bits ``(n & 7)
<< 9 | (n & 8) << 12`` is exactly ``e2m1(n) * 2**-14`` (fp16 subnormal for code 1; see
`gemm_direct`); its fp32 conversion is exact and a normal fp32 number, so the fp32
products with the activations keep full precision (bit patterns placed straight into
fp32 would be ``e2m1 * 2**-126``, and their products with activations below 1 would
lose bits as fp32 subnormals). The 16 products of one scale block are one chain of fp32
FMAs, then multiplied by the block's e4m3 scale (exact in fp32) and accumulated; the
epilogue multiplies by ``alpha * 2**14``. So the kernel computes ``x @ dequant(W).T``
with fp32 accumulation and one rounding at the store, like the wgmma kernel (another
summation order: equal within fp32 rounding, not bit-identical to it). The natural and
the sm90-prepared weight layouts are summed in the same order: bit-identical.

Instructions per weight element of the main loop (static SASS count of the sm_90 cubin
built on the CPU with Triton 3.9, 16 rows x 512 K, 4 warps, bf16): 5.1 at one token with
plain loads (nibble expansion 2.25: the fp16 pair of `gemm_w4a16` without its scale
multiply, 2 shifts + 2 LOP3 a pair and a PRMT per 2 bytes; fp16 -> fp32 conversion 1;
FFMA 1; block scale, activations and loop ~0.8), 6.8 with the cp.async pipeline, about
1.5 more per extra token (9.7 at four). Registers: 69 a thread at one token, 155 at four.

Split-K as in `gemm_w4a16` (`splitk.store_tile`: deterministic, self-resetting counters,
workspace owned by the kernel object). Shapes: any M, N >= 1 (rows wrap modulo M/N
inside a tile: unmasked loads; masked stores), ``K % 32 == 0`` (``K % 64 == 0`` for the
prepared layout); K need not divide by the K tile. ``x`` must have unit stride along K;
``out`` may have any strides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.sm90.gemm_w4a16 import (
    _USE_ASM,
    DenseKernel,
    _pair,
    ptx_one_line,
    store_dense,
)
from fp4_dispatch.backends.sm90.splitk import k_tile_range
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher

log = logging.getLogger(__name__)

__all__ = [
    "BLOCK_K_CHOICES",
    "BLOCK_M_CHOICES",
    "BLOCK_N_CHOICES",
    "W4A16GemvConfig",
    "W4A16GemvKernel",
    "build_gemv",
]

#: weight rows per CTA: small tiles put many CTAs (and loads) on each SM
BLOCK_N_CHOICES = (8, 16, 32, 64)
#: tokens per CTA: each costs one FFMA per weight element (M = 8 would double the
#: per-element work of M = 4: the wgmma kernel's territory)
BLOCK_M_CHOICES = (1, 2, 4)
#: K elements per loop step (a multiple of 64: the swizzled scales' 4-group step)
BLOCK_K_CHOICES = (128, 256, 512, 1024)


@dataclass(frozen=True)
class W4A16GemvConfig:
    """Compile-time knobs of one GEMV variant: ``block_n`` weight rows, ``block_m`` tokens
    and ``block_k`` K elements per CTA step; ``num_stages`` of Triton's load pipeline."""

    block_n: int = 16
    block_m: int = 1
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name, choices in (
            ("block_n", BLOCK_N_CHOICES),
            ("block_m", BLOCK_M_CHOICES),
            ("block_k", BLOCK_K_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)}")
        if self.split_k < 1:
            raise ValueError(f"split_k: expected >= 1, got {self.split_k}")
        if self.num_warps not in (2, 4, 8):
            raise ValueError(f"num_warps: expected 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")


# ---- dequantization: nibbles -> fp16 e2m1 * 2**-14, no scale ---------------------------

# The pair builders of `gemm_w4a16` (same shifts and masks as its fp16 dequantizers) with
# the scale multiply left out: 4 packed bytes ($2) -> 4 fp16 values of the low nibbles
# ($0 = lo0|lo1 ... packed as two registers) and 4 of the high nibbles. Outputs keep the
# position of their input byte, so the element-wise twin below computes the same bits.


def _unscaled_asm(lo: tuple[int, int, str], hi: tuple[int, int, str]) -> str:
    """PTX for 4 bytes -> ($0, $1) low-nibble fp16 pairs, ($2, $3) high-nibble pairs."""
    mag, sign = 0x0E000E00, 0x80008000
    body = ".reg .b32 t, p, q, r;\n"
    for sel, (o_lo, o_hi) in (("0x4140", ("$0", "$2")), ("0x4342", ("$1", "$3"))):
        body += f"prmt.b32 t, $4, 0, {sel};\n"
        body += _pair(o_lo, lo[0], lo[1], mag, sign, lo[2])
        body += _pair(o_hi, hi[0], hi[1], mag, sign, hi[2])
    return "{\n" + body + "}"


# (magnitude shift, sign shift, form) per nibble: the fp16 rows of `gemm_w4a16`
_NATURAL = _unscaled_asm((9, 12, "masked"), (5, 8, "masked"))
_PREPARED = _unscaled_asm((9, 12, "masked"), (4, 11, "masked"))
_NATURAL_ASM = tl.constexpr(ptx_one_line(_NATURAL))
_PREPARED_ASM = tl.constexpr(ptx_one_line(_PREPARED))


@triton.jit
def _nibbles_elementwise(w, PREPARED: tl.constexpr):
    """Element-wise twin of the PTX: bytes -> (low, high) nibble as fp16 e2m1 * 2**-14."""
    w16 = w.to(tl.uint16)
    lo = (((w16 & 0x7) << 9) | ((w16 & 0x8) << 12)).to(tl.float16, bitcast=True)
    if PREPARED:  # rotated high nibble: sign at bit 4, magnitude at 5-7
        hi_bits = ((w16 & 0xE0) << 4) | ((w16 & 0x10) << 11)
    else:
        hi_bits = ((w16 & 0x70) << 5) | ((w16 & 0x80) << 8)
    return lo, hi_bits.to(tl.float16, bitcast=True)


@triton.jit
def _nibbles(w, USE_ASM: tl.constexpr, PREPARED: tl.constexpr):
    """Packed bytes -> (low nibble, high nibble) as fp32 ``e2m1 * 2**-14`` (exact)."""
    if USE_ASM:
        if PREPARED:
            lo, hi = tl.inline_asm_elementwise(
                _PREPARED_ASM, "=r,=r,=r,=r,r", [w],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            lo, hi = tl.inline_asm_elementwise(
                _NATURAL_ASM, "=r,=r,=r,=r,r", [w],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
            )  # fmt: skip
    else:
        lo, hi = _nibbles_elementwise(w, PREPARED)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _byte_offsets(KG: tl.constexpr, PREPARED: tl.constexpr):
    """[KG, 8] memory offsets, within one K tile's row, of the 8 weight bytes of each scale
    block (block ``b``, byte ``i`` = natural byte ``8b + i``: K elements ``16b + 2i`` and
    ``16b + 2i + 1``).

    Natural order: ``8b + i``. sm90-prepared (`fp4_dispatch.format.nvfp4.sm90_prepare_data`):
    within each 32-byte group ``G`` memory byte ``16c + 4q + 2h + e`` holds natural byte
    ``32G + 8q + 4c + 2h + e``, so block ``b = 4G + q``, byte ``i = 4c + 2h + e`` sits at
    ``32G + 16c + 4q + (i % 4)`` (two runs of 4 bytes)."""
    b = tl.arange(0, KG)[:, None]
    i = tl.arange(0, 8)[None, :]
    if PREPARED:
        return 32 * (b // 4) + 16 * (i // 4) + 4 * (b % 4) + i % 4
    else:
        return 8 * b + i


@triton.jit
def _halves(t):
    """[..., 2k] -> (even, odd) halves of the last axis, each [..., k] (in registers: the
    8 bytes of a scale block sit in one thread, so a split moves no data)."""
    if t.shape[-1] == 2:
        return tl.split(t)
    else:
        # list concatenation: Triton's frontend has no starred expressions
        return tl.split(tl.reshape(t, t.shape[:-1] + [t.shape[-1] // 2, 2]))  # noqa: RUF005


@triton.jit
def _token_blocks(lo, hi, x_row_ptrs, xmask, EVEN_K: tl.constexpr):
    """One token's block sums [ROWS, KG]: ``sum_i lo_i * x[2i] + hi_i * x[2i + 1]`` over
    the 8 bytes i of each block (`x_row_ptrs` [KG, 8, 2]: the token's K elements).

    Written as one chain of 16 fused multiply-adds per block (the 8 bytes split apart
    in registers) rather than products plus an add tree (`tl.sum`): 16 instead of 23
    fp32 instructions per block and token."""
    xv = tl.load(x_row_ptrs) if EVEN_K else tl.load(x_row_ptrs, mask=xmask, other=0.0)
    xe, xo = tl.split(xv.to(tl.float32))  # [KG, 8] each
    l0, l1 = _halves(lo)  # bytes i = 2a + b: l0 the even bytes, [ROWS, KG, 4]
    h0, h1 = _halves(hi)
    e0, e1 = _halves(xe[None, :, :])
    o0, o1 = _halves(xo[None, :, :])
    acc = _chain4(l0, h0, e0, o0, None)
    return _chain4(l1, h1, e1, o1, acc)


@triton.jit
def _chain4(lo, hi, xe, xo, acc):
    """``acc + sum over the last axis (size 4) of lo * xe + hi * xo``, as a chain."""
    la, lb = _halves(lo)
    ha, hb = _halves(hi)
    ea, eb = _halves(xe)
    oa, ob = _halves(xo)
    acc = _chain2(la, ha, ea, oa, acc)
    return _chain2(lb, hb, eb, ob, acc)


@triton.jit
def _chain2(lo, hi, xe, xo, acc):
    """``acc + sum over the last axis (size 2) of lo * xe + hi * xo``, as a chain."""
    l0, l1 = _halves(lo)
    h0, h1 = _halves(hi)
    e0, e1 = _halves(xe)
    o0, o1 = _halves(xo)
    if acc is None:
        acc = l0 * e0
    else:
        acc += l0 * e0
    acc += h0 * o0
    acc += l1 * e1
    acc += h1 * o1
    return acc


@triton.jit
def _column(total, col, t: tl.constexpr):
    """``total`` [ROWS, COLS] with column ``t`` set to ``col`` [ROWS] (the epilogue)."""
    return tl.where(tl.arange(0, total.shape[1])[None, :] == t, col[:, None], total)


# ---- the kernel -----------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_gemv_kernel(
    x_ptr,
    b_ptr,
    bs_ptr,
    alpha_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_on,
    b_sblk,
    has_bias,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREPARED: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    KB: tl.constexpr = BLOCK_K // 2  # packed weight bytes per row of a K tile
    KG: tl.constexpr = BLOCK_K // 16  # block scales per row of a K tile

    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid % grid_n  # consecutive CTAs walk N: the tokens stay hot in L2
    pid_m = pid // grid_n

    # the cast is a no-op for a runtime K; it makes a K that torch.compile passes as a
    # constant (its mutation analysis, torch 2.11) a tensor that can carry the hint
    k_half = tl.multiple_of(tl.cast(K // 2, tl.int32), 16)  # K % 32 == 0: 16-byte rows
    kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # wrapped rows: unmasked, in-bounds loads; never stored
    rg = tl.arange(0, KG)
    rb = _byte_offsets(KG, PREPARED)  # [KG, 8]
    # K element of (block b, byte i, nibble e): 16 b + 2 i + e, as [KG, 8, 2]
    rk = (16 * rg[:, None, None] + 2 * tl.arange(0, 8)[None, :, None]
          + tl.arange(0, 2)[None, None, :])  # fmt: skip

    w_ptrs = b_ptr + rn[:, None, None].to(tl.int64) * k_half + (kt0 * KB + rb)[None, :, :]
    s_row = scale_row_offset(rn, b_sblk)
    s_ptrs = bs_ptr + s_row[:, None] + (scale_group_offset(rg) + kt0 * (KG // 4) * 512)[None, :]
    # one row of x per token of the tile (rows wrap modulo M: in bounds, never stored)
    m0 = pid_m * BLOCK_M
    x_ptrs = x_ptr + (m0 % M).to(tl.int64) * stride_xm + kt0 * BLOCK_K + rk
    x1 = ((m0 + 1) % M - m0 % M).to(tl.int64) * stride_xm  # pointer steps to tokens 1-3
    x2 = ((m0 + 2) % M - m0 % M).to(tl.int64) * stride_xm
    x3 = ((m0 + 3) % M - m0 % M).to(tl.int64) * stride_xm

    acc0 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KG), dtype=tl.float32)
    for kt in tl.range(kt0, kt1, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
            xmask = None
        else:
            w = tl.load(w_ptrs, mask=((kt * KB + rb) < k_half)[None, :, :], other=0)
            s = tl.load(s_ptrs, mask=((kt * KG + rg) < K // 16)[None, :], other=0.0)
            xmask = (kt * BLOCK_K + rk) < K
        lo, hi = _nibbles(w, USE_ASM, PREPARED)  # [BLOCK_N, KG, 8] fp32 each
        sf = s.to(tl.float32)
        acc0 += _token_blocks(lo, hi, x_ptrs, xmask, EVEN_K) * sf
        if BLOCK_M > 1:
            acc1 += _token_blocks(lo, hi, x_ptrs + x1, xmask, EVEN_K) * sf
        if BLOCK_M > 2:
            acc2 += _token_blocks(lo, hi, x_ptrs + x2, xmask, EVEN_K) * sf
            acc3 += _token_blocks(lo, hi, x_ptrs + x3, xmask, EVEN_K) * sf
        w_ptrs += KB
        s_ptrs += (KG // 4) * 512
        x_ptrs += BLOCK_K

    scale = tl.load(alpha_ptr) * 16384.0  # alpha * 2**14
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    total = _column(total, tl.sum(acc0, axis=1), 0)
    if BLOCK_M > 1:
        total = _column(total, tl.sum(acc1, axis=1), 1)
    if BLOCK_M > 2:
        total = _column(total, tl.sum(acc2, axis=1), 2)
        total = _column(total, tl.sum(acc3, axis=1), 3)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    store_dense(total, scale, bias_ptr, has_bias, out_ptr, offs_m, offs_n, M, N, stride_om,
                stride_on, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_N, BLOCK_M, SPLIT_K)  # fmt: skip


_GEMV_LAUNCH = CachedLauncher(_w4a16_gemv_kernel)


@dataclass
class W4A16GemvKernel(DenseKernel):
    """A built GEMV kernel: ``kernel(operands, out)``; ``out = alpha * a @ dequant(b).T``
    plus ``operands.bias``. Calls, workspace and precompile as every `DenseKernel`."""

    cfg: W4A16GemvConfig

    def _binding(self, k: int, prepared: bool, act_dtype: torch.dtype) -> BoundLaunch:
        """The launcher binding of (even K, prepared), made once per kernel object (the
        activation dtype changes no constexpr of the gemv)."""
        cfg = self.cfg
        key = (k % cfg.block_k == 0, prepared)
        bound = self._bound.get(key)
        if bound is None:
            meta = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k,
                    "SPLIT_K": cfg.split_k, "EVEN_K": key[0], "USE_ASM": _USE_ASM,
                    "PREPARED": prepared, "NUM_STAGES": cfg.num_stages}  # fmt: skip
            bound = self._bound[key] = _GEMV_LAUNCH.bind(meta, cfg.num_warps)
        return bound


def build_gemv(cfg: W4A16GemvConfig) -> W4A16GemvKernel:
    """A GEMV kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A16GemvKernel(cfg)
