"""Hopper (sm90) W4A16 GEMM in Triton: dense bf16/fp16 activations x NVFP4 weights.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T`` where ``W`` is stored as NVFP4
(``b_data`` uint8 ``[N, K/2]``, e2m1 pairs low nibble first; ``b_scale`` e4m3 in the
128x4 swizzled order) and ``alpha`` (a one-element float32 device tensor) is the
weight's global scale. Activations are never quantized.

Two paths (a tactic knob, ``path``):

- ``direct`` (decode and small M): the weights are the MMA's wide operand. Each CTA
  owns ``BLOCK_N`` weight rows (64 or 128: the 64-row side of a Hopper MMA) and
  ``BLOCK_M`` tokens (16-128: the narrow side), streams its weight bytes once, expands
  them in registers to fp16 and computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T``
  with fp32 accumulation. The output is written transposed through ``out``'s strides.
  Split-K for shapes with fewer tiles than SMs (deterministic, see below).
- ``unpack`` (M >= ~1024): the weight is expanded once per call to the activation
  dtype by the memory-bound unpack kernel of `gemm_unpack` with alpha folded
  into it, then cuBLAS (``torch.mm``) multiplies. No alpha pass over the output.

Exactness of the direct path. A nibble placed as fp16 bits ``(n & 7) << 9 | (n & 8) << 12``
is exactly ``e2m1(n) * 2**-14`` (see `fp4_dispatch.backends.sm90.gemm_direct`); times the
e4m3 block scale in fp16 it stays exact (at most 6 significant bits, no smaller than
``2**-24``). For bf16 activations the default (``bf16_dequant="native"``) places the nibble
as bf16 ``e2m1 * 2**-126`` (bf16 subnormals for code 1) and multiplies by the bf16 scale
times ``2**112``: the same ``e2m1 * scale * 2**-14``, exact, and the dot is bf16 x bf16
(``"cast"``: the fp16 values cast to bf16, also exact, one F2F per element); for fp16
activations the dot is fp16 x fp16. The epilogue multiplies by ``alpha * 2**14``. So the
direct path is ``x @ dequant(W).T`` with fp32 accumulation and one rounding at the store.
The unpack path rounds each weight once (``e2m1 * scale * alpha`` to the activation
dtype) before cuBLAS.

Dequantization cost: Hopper has no FP4 MMA, so every weight element costs ALU work before
the tensor cores see it; at decode that work bounded the previous kernels (RESULTS.md,
issue 13). Three things keep it small (SASS instructions per weight element of the main
loop, sm_90 cubin compiled on the CPU with Triton 3.9, 128x16x128 tile, bf16):

1. the PTX dequantizers (`_dequant_asm`) build each pair of values in 3 instructions where
   the PRMT's zero bytes keep the magnitude and sign sources apart, else 4;
2. the dot runs in a permuted K order (`_from_prepared`, activations permuted to match):
   each MMA lane's 4 weight bytes are one 32-bit word of memory (no byte repacking) and
   share one block scale;
3. the sm90-prepared weight layout (`prepare_weight`, `fp4_dispatch.format.nvfp4`) also rotates
   each high nibble (both bf16 pairs take 3 instructions) and groups 32 bytes so that each
   lane holds one whole scale block per row (4x fewer scale conversions).

| weights | before (base commit) | now |
|---|---:|---:|
| natural | 6.99 (cast) / 6.14 (native) | 4.20 |
| sm90-prepared | 5.20 (native) | 3.73 |

Under TRITON_INTERPRET=1 (CPU) the element-wise twins compute the same bits, and
tests/test_gemm_w4a16.py runs the PTX itself through a small model of its
instructions on every byte value.

Activations in the dot's order (``W4A16Config.x_dot``, token tiles of 64 or more). The
dot's K order is not natural, so each CTA moves its activation tile through registers to
permute it (and through shared memory again for the MMA), once per weight tile: at 64-256
tokens that was 18-27% of the kernel on the H200. With ``x_dot`` one pass per call
(`dot_order_activations`, the kernel's own permutation code) writes the activations in
that order and every CTA hands its tile to the MMA as loaded (``X_DOT``; K % 128 == 0 and
128-wide K steps, else the in-kernel permutation runs). Bit-identical results.

Split-K: each split writes its fp32 partial tile into a workspace and bumps a per-tile
counter (acq_rel atomic after a CTA barrier); the last split sums the partials in fixed
split order (deterministic), stores ``out`` and resets the counter to zero. The
workspace and counters are owned by the kernel object (allocated on first use per
device and size; counters zeroed once there and self-resetting after), so a call does
no memset and no allocation: CUDA-graph capturable once a first call has run outside
the capture (which compiling the Triton kernel requires anyway). One kernel object must
not run on two streams concurrently.

Shapes: any M, N >= 1 (weight rows wrap modulo N inside a tile, token rows past M are
masked loads, so every address is in bounds; stores are masked); ``K % 32 == 0``; K need
not divide by the K tile. ``x`` must have unit stride along K; ``out`` may have any
strides.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.driver_launch import record_launches
from fp4_dispatch.backends.sm90 import gemm_unpack
from fp4_dispatch.backends.sm90.gemm_unpack import BLOCK_K_CHOICES as UK
from fp4_dispatch.backends.sm90.gemm_unpack import BLOCK_R_CHOICES as UR
from fp4_dispatch.backends.sm90.gemm_unpack import unpack_nvfp4
from fp4_dispatch.backends.sm90.splitk import k_tile_range, store_tile
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.backends.triton_launch import (
    BoundLaunch,
    CachedLauncher,
    launch_aligned,
    tracing,
)
from fp4_dispatch.backends.workspace import Scratch
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.format.nvfp4 import (  # noqa: F401 - rotate/unrotate re-exported
    rotate_high_nibbles,
    sm90_prepare_data,
    sm90_unprepare_data,
    swizzled_scale_shape,
    unrotate_high_nibbles,
)

log = logging.getLogger(__name__)

#: The packed PTX dequantizer on GPUs; the element-wise twin under TRITON_INTERPRET=1.
_USE_ASM = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")

#: 2**14 undoes the 2**-14 carried by each dequantized weight (module docstring).
_UNSCALE = float(2**14)

BLOCK_N_CHOICES = (64, 128)
BLOCK_M_CHOICES = (16, 32, 64, 128)
BLOCK_K_CHOICES = (64, 128, 256)
ACT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class W4A16Operands(DenseOperands):
    """`fp4_dispatch.DenseOperands` plus ``prepared``: True when ``b_data`` is in the
    `prepare_weight` byte order (the fragment-matched layout the direct kernel
    dequantizes with fewer instructions). The dispatcher hands plain `DenseOperands`
    (natural order); the kernels read ``prepared`` with a False default."""

    prepared: bool = False


@dataclass(frozen=True)
class W4A16Config:
    """Compile-time knobs of one direct-kernel variant.

    ``block_n`` weight rows per CTA (the MMA's 64/128-row side), ``block_m`` tokens per
    CTA (the narrow side), ``block_k`` K elements per main-loop step.
    """

    block_n: int = 128
    block_m: int = 16
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    #: bf16 activations: "cast" = the fp16 dequantizer + an exact cast to bf16 (one F2F
    #: per element); "native" = the bf16 PTX dequantizer (no F2F; relies on bf16
    #: subnormal arithmetic, checked on the GPU by test_gpu_ptx_dequantizers_bit_exact)
    bf16_dequant: str = "native"
    #: put the activations in the dot's K order in one pass per call first
    #: (`dot_order_activations`) and read them straight into the MMA in every CTA,
    #: instead of each CTA permuting its tile through registers; where K % 128 == 0
    #: and block_k == 128 (otherwise the in-kernel permutation runs)
    x_dot: bool = False

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
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps: expected 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")
        if self.bf16_dequant not in ("cast", "native"):
            raise ValueError(
                f"bf16_dequant: expected 'cast' or 'native', got {self.bf16_dequant!r}"
            )


def smem_estimate(cfg: W4A16Config) -> int:
    """Shared memory of one CTA in bytes (for validity rules and residency).

    ``num_stages - 1`` buffers of raw loads (weight bytes + scales + the activation tile
    at 2 bytes an element: Triton's pipeline keeps one stage fewer than ``num_stages``)
    plus the activation tile re-laid for the MMA's shared-memory operand (the dequantized
    weights stay in registers); or the epilogue's fp32 layout shuffle if that is larger.
    Equal to what the H200's Triton 3.6 allocated for the decode tiles measured
    (RESULTS.md, "Hopper W4A16" run 4: 44032 bytes for 128x16x128 at 4 stages, 30720 at
    3, 30208 for 64 weight rows at 4, 61440 for tile_k 256 at 3).
    """
    bn, bm, bk = cfg.block_n, cfg.block_m, cfg.block_k
    raw = bn * (bk // 2 + bk // 16) + bm * bk * 2
    return max((cfg.num_stages - 1) * raw + bm * bk * 2, bn * bm * 4)


# ---- the prepared weight layout -------------------------------------------------------


def prepare_weight(b_data: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[N, K/2]`` (natural order) -> the sm90-prepared weight layout.

    The layout is `fp4_dispatch.format.nvfp4.sm90_prepare_data` (an ``Nvfp4Tensor`` with
    ``data_layout="sm90-prepared"`` holds it): a byte permutation matched to the MMA
    operand fragment (in natural order Triton repacks the fragment's bytes one by one with
    PRMT) and a rotation of each high nibble (`rotate_high_nibbles`: both bf16 value
    pairs then take the 3-instruction "or" form). Tile-size independent.
    """
    return sm90_prepare_data(b_data)


def unprepare_weight(prepared: torch.Tensor) -> torch.Tensor:
    """The inverse of `prepare_weight`: prepared bytes -> natural packed e2m1 order."""
    return sm90_unprepare_data(prepared)


@triton.jit
def _from_prepared(w, ROWS: tl.constexpr, KB: tl.constexpr):
    """Prepared bytes [ROWS, KB] (memory order) -> the dot's K order, at the tensor level.

    Memory ``(group16, q, h, e)`` becomes tensor ``(group16, h, q, e)``: a pure relabelling
    that Triton folds into the register layout of the MMA operand (no data movement when
    the fragment matches, which is the point of the layout). The dot's byte order is not
    natural: with ``group16 = (G, c)`` dot byte ``(G, c, h, q, e)`` is natural byte
    ``32G + 8q + 4c + 2h + e`` (`fp4_dispatch.format.nvfp4.sm90_prepare_data`), so each MMA lane
    q holds the 8 bytes of one scale block per row; the activations are permuted to match
    (`_natural_to_dot`) and the scales broadcast in that order (`_scale_per_byte`).
    """
    g = tl.reshape(w, (ROWS, KB // 16, 4, 2, 2))
    return tl.reshape(tl.permute(g, (0, 1, 3, 2, 4)), (ROWS, KB))


@triton.jit
def _dot_to_natural(w, ROWS: tl.constexpr, KB: tl.constexpr):
    """Dot order -> natural byte order: tensor ``(G, c, h, q, e)`` -> ``(G, q, c, h, e)``
    (natural byte ``32G + 8q + 4c + 2h + e``; see `fp4_dispatch.format.nvfp4.sm90_prepare_data`)."""
    g = tl.reshape(w, (ROWS, KB // 32, 2, 2, 4, 2))
    return tl.reshape(tl.permute(g, (0, 1, 4, 2, 3, 5)), (ROWS, KB))


@triton.jit
def _natural_to_dot(x, ROWS: tl.constexpr, KB: tl.constexpr):
    """The inverse of `_dot_to_natural` (used on the activations' byte-pair index)."""
    g = tl.reshape(x, (ROWS, KB // 32, 4, 2, 2, 2))
    return tl.reshape(tl.permute(g, (0, 1, 3, 4, 2, 5)), (ROWS, KB))


@triton.jit
def _scale_per_byte(s, ROWS: tl.constexpr, KB: tl.constexpr, ORDER: tl.constexpr):
    """Scales [ROWS, KB // 8] -> one per byte [ROWS, KB] in the byte order ``ORDER``.

    - 0, natural: byte j has scale j // 8;
    - 1, natural memory in dot order (`_from_prepared` applied to natural bytes): dot byte
      ``(g, h, q, e)`` is natural byte ``16g + 4q + 2h + e``, scale ``2g + q // 2`` (each
      MMA lane's 4 bytes of a 16-byte step share one scale);
    - 2, sm90-prepared memory in dot order: dot byte ``(G, c, h, q, e)``, scale ``4G + q``
      (each MMA lane holds ONE scale block per row over two steps).
    """
    KG: tl.constexpr = KB // 8
    if ORDER == 2:
        s4 = tl.reshape(s, (ROWS, KB // 32, 1, 1, 4, 1))
        return tl.reshape(tl.broadcast_to(s4, (ROWS, KB // 32, 2, 2, 4, 2)), (ROWS, KB))
    elif ORDER == 1:
        s2 = tl.reshape(s, (ROWS, KB // 16, 1, 2, 1, 1))
        return tl.reshape(tl.broadcast_to(s2, (ROWS, KB // 16, 2, 2, 2, 2)), (ROWS, KB))
    else:
        return tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, KG, 8)), (ROWS, KB))


# ---- dequantization -------------------------------------------------------------------

# The packed PTX dequantizers. Each turns 4 packed bytes ($4) and their 4 block scales (two
# per register, $5 = s0|s1, $6 = s2|s3, in the product's 16-bit type) into 4 values of the
# low nibbles ($0 = lo0|lo1, $1 = lo2|lo3) and 4 of the high nibbles ($2, $3), each
# ``e2m1 * scale * 2**-14`` exactly. PRMT spreads two bytes into the low bytes of the two
# 16-bit halves of a word ``t`` (the upper byte of each half is zero). Every output keeps
# the position of its input byte, so the result does not depend on how Triton groups
# registers, and the element-wise twins below compute the same bits.
#
# A pair of values is built by one of two forms (`_pair`):
# - "or":     ``((t << a) | (t << b)) & mask`` - 2 shifts + 1 LOP3. Valid when the
#   magnitude source has shifted-in zeros at the sign positions and the sign source has
#   them at the magnitude positions (checked by `tests/test_gemm_w4a16.py` through
#   the twins, which are exact per element);
# - "masked": ``((t << a) & mag) | ((t << b) & sign)`` - 2 shifts + 2 LOP3.
# then one MUL.F16X2/BF16X2 applies two block scales.
#
# Bit targets: fp16 ``e2m1 * 2**-14`` is sign at bit 15, magnitude at bits 9-11; bf16
# ``e2m1 * 2**-126`` is sign at 15, magnitude at 6-8 (code 1 lands on the bf16 subnormal
# 2**-127, exact: PTX bf16 arithmetic keeps subnormals); the bf16 scales carry
# ``2**112`` so that the product is the fp16 path's ``e2m1 * scale * 2**-14``.
# Instructions per 8 values (4 bytes), SASS: 2 PRMT + 4 pairs + 4 multiplies.
#
# | dequantizer            | low nibble pair | high nibble pair | per value |
# |---|---|---|---:|
# | fp16, natural/prepared | masked (4)      | masked (4)       | 2.75 |
# | bf16, natural          | or (3)          | masked (4)       | 2.5  |
# | bf16, prepared         | or (3)          | or (3)           | 2.25 |
#
# The prepared layout rotates each high nibble (sign at bit 4, magnitude at 5-7) so that
# both bf16 pairs take the "or" form (`rotate_high_nibbles`).


def _pair(out: str, a: int, b: int, mask_mag: int, mask_sign: int, form: str) -> str:
    """PTX of one pair (see above): ``out`` from ``t`` shifted left by a (magnitude), b (sign)."""
    head = f"shl.b32 p, t, {a};\nshl.b32 q, t, {b};\n"
    if form == "or":
        return head + f"or.b32 r, p, q;\nand.b32 {out}, r, {mask_mag | mask_sign:#010x};\n"
    return (
        head
        + f"and.b32 p, p, {mask_mag:#010x};\nand.b32 q, q, {mask_sign:#010x};\n"
        + f"or.b32 {out}, p, q;\n"
    )


def ptx_one_line(text: str) -> str:
    """`text` with its line breaks as spaces (PTX statements end at ``;``, so the code is
    the same). Why: torch.compile copies a kernel's constants into the source of its
    generated module inside a triple-quoted string without escaping backslashes (torch
    2.11), so a ``\\n`` in a copied constant breaks that module; the kernels' constants
    hold no backslash (`engine/inductor.py` launches them from Inductor's code)."""
    return text.replace("\n", " ")


def _dequant_asm(dtype: str, lo: tuple[int, int, str], hi: tuple[int, int, str]) -> str:
    """The PTX block for one (dtype, layout): lo/hi = (mag shift, sign shift, form)."""
    mag = 0x0E000E00 if dtype == "f16" else 0x01C001C0
    sign = 0x80008000
    body = ".reg .b32 t, p, q, r, v;\n"
    for sel, (o_lo, o_hi, sc) in (("0x4140", ("$0", "$2", "$5")), ("0x4342", ("$1", "$3", "$6"))):
        body += f"prmt.b32 t, $4, 0, {sel};\n"
        body += _pair("v", lo[0], lo[1], mag, sign, lo[2])
        body += f"mul.rn.{dtype}x2 {o_lo}, v, {sc};\n"
        body += _pair("v", hi[0], hi[1], mag, sign, hi[2])
        body += f"mul.rn.{dtype}x2 {o_hi}, v, {sc};\n"
    return "{\n" + body + "}"


# (magnitude shift, sign shift, form) per nibble, per (dtype, layout)
_F16_NATURAL = _dequant_asm("f16", (9, 12, "masked"), (5, 8, "masked"))
_F16_PREPARED = _dequant_asm("f16", (9, 12, "masked"), (4, 11, "masked"))
_BF16_NATURAL = _dequant_asm("bf16", (6, 12, "or"), (2, 8, "masked"))
_BF16_PREPARED = _dequant_asm("bf16", (6, 12, "or"), (1, 11, "or"))
_DEQUANT_F16_NATURAL_ASM = tl.constexpr(ptx_one_line(_F16_NATURAL))
_DEQUANT_F16_PREPARED_ASM = tl.constexpr(ptx_one_line(_F16_PREPARED))
_DEQUANT_BF16_NATURAL_ASM = tl.constexpr(ptx_one_line(_BF16_NATURAL))
_DEQUANT_BF16_V2_ASM = tl.constexpr(ptx_one_line(_BF16_PREPARED))


@triton.jit
def _dequant_asm_call(asm: tl.constexpr, x, s, dtype: tl.constexpr):
    """One of the dequantizers' PTX blocks (`_dequant_asm`): 4 packed bytes and their
    per-byte scales -> (even K, odd K) pairs of ``dtype``, two values per register."""
    return tl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r,r,r", [x, s], dtype=(dtype.value, dtype.value), is_pure=True, pack=4
    )


@triton.jit
def _dequant_elementwise_bf16(x, s32, PREPARED: tl.constexpr):
    """Element-wise twin of the bf16 PTX, in fp32: the same bit placement one exponent
    field wider (fp32 ``e2m1 * 2**-126``, code 1 on the fp32 subnormal 2**-127; the
    interpreter flushes bf16 subnormals, fp32 ones it keeps), times ``scale * 2**112``.
    Exact, so the bf16 result equals the PTX's."""
    x32 = x.to(tl.uint32)
    lo = (((x32 & 0x7) << 22) | ((x32 & 0x8) << 28)).to(tl.float32, bitcast=True)
    if PREPARED:  # rotated high nibble: sign at bit 4, magnitude at 5-7
        hi_bits = ((x32 & 0xE0) << 17) | ((x32 & 0x10) << 27)
    else:
        hi_bits = ((x32 & 0x70) << 18) | ((x32 & 0x80) << 24)
    hi = hi_bits.to(tl.float32, bitcast=True)
    return (lo * s32).to(tl.bfloat16), (hi * s32).to(tl.bfloat16)


@triton.jit
def _dequant_scaled_bf16(
    x,
    s,
    ROWS: tl.constexpr,
    KB: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREPARED: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Like `_dequant_scaled` but straight to bf16 (``e2m1 * scale * 2**-14`` exactly)."""
    s32 = s.to(tl.float32) * 5.192296858534828e33  # 2**112, exact
    if USE_ASM:
        sb = _scale_per_byte(s32.to(tl.bfloat16), ROWS, KB, ORDER)
        asm: tl.constexpr = _DEQUANT_BF16_V2_ASM if PREPARED else _DEQUANT_BF16_NATURAL_ASM
        lo, hi = _dequant_asm_call(asm, x, sb, tl.bfloat16)
    else:
        sf = _scale_per_byte(s32, ROWS, KB, ORDER)
        lo, hi = _dequant_elementwise_bf16(x, sf, PREPARED)
    return lo, hi


@triton.jit
def _dequant_elementwise(x, s16, PREPARED: tl.constexpr):
    """The element-wise twin of the fp16 PTX: bytes and per-byte fp16 scales -> (lo, hi)."""
    x16 = x.to(tl.uint16)
    lo = (((x16 & 0x7) << 9) | ((x16 & 0x8) << 12)).to(tl.float16, bitcast=True)
    if PREPARED:  # rotated high nibble: sign at bit 4, magnitude at 5-7
        hi_bits = ((x16 & 0xE0) << 4) | ((x16 & 0x10) << 11)
    else:
        hi_bits = ((x16 & 0x70) << 5) | ((x16 & 0x80) << 8)
    hi = hi_bits.to(tl.float16, bitcast=True)
    return lo * s16, hi * s16


@triton.jit
def _dequant_scaled(
    x,
    s,
    ROWS: tl.constexpr,
    KB: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREPARED: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Packed bytes [ROWS, KB] + e4m3 scales [ROWS, KB // 8] -> (even K, odd K) fp16.

    Each result is ``e2m1 * scale * 2**-14`` exactly. The scale of byte ``j`` is
    ``s[:, j // 8]``, broadcast to one fp16 per byte so that the PTX applies it with
    HMUL2 in the same pass as the nibble expansion.
    """
    s16 = _scale_per_byte(s.to(tl.float16), ROWS, KB, ORDER)
    if USE_ASM:
        asm: tl.constexpr = _DEQUANT_F16_PREPARED_ASM if PREPARED else _DEQUANT_F16_NATURAL_ASM
        lo, hi = _dequant_asm_call(asm, x, s16, tl.float16)
    else:
        lo, hi = _dequant_elementwise(x, s16, PREPARED)
    return lo, hi


@triton.jit
def _dequant_tile_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    R,
    K,
    s_blk,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREPARED: tl.constexpr,
    BF16: tl.constexpr,
):
    """out[r, k] = float32(dequantizer output) * 2**14 for one tile (tests the dequantizer).

    The fp16 outputs are written as even/odd K columns so the stored matrix is in natural
    K order; float32 and the 2**14 factor are exact.
    """
    KB: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rr = rows % R
    rb = pid_k * KB + tl.arange(0, KB)
    rg = pid_k * KG + tl.arange(0, KG)
    x = tl.load(data_ptr + rr[:, None].to(tl.int64) * (K // 2) + rb[None, :])
    s_row = scale_row_offset(rr, s_blk)
    s = tl.load(scale_ptr + s_row[:, None] + scale_group_offset(rg)[None, :])
    if PREPARED:
        x = _from_prepared(x, BLOCK_R, KB)
    ORDER: tl.constexpr = 2 if PREPARED else 0
    if BF16:
        lo, hi = _dequant_scaled_bf16(x, s, BLOCK_R, KB, USE_ASM, PREPARED, ORDER)
    else:
        lo, hi = _dequant_scaled(x, s, BLOCK_R, KB, USE_ASM, PREPARED, ORDER)
    if PREPARED:  # dot order -> natural order for the store
        lo = _dot_to_natural(lo, BLOCK_R, KB)
        hi = _dot_to_natural(hi, BLOCK_R, KB)
    base = out_ptr + rows[:, None].to(tl.int64) * K + 2 * rb[None, :]
    mask = (rows < R)[:, None]
    tl.store(base, lo.to(tl.float32) * 16384.0, mask=mask)
    tl.store(base + 1, hi.to(tl.float32) * 16384.0, mask=mask)


def dequantize_weight(
    b_data: torch.Tensor, b_scale: torch.Tensor, prepared: bool = False, bf16: bool = False
) -> torch.Tensor:
    """``e2m1 * block scale`` as float32 ``[N, K]`` through the kernel's dequantizer.

    For tests (interpreter: the element-wise twin) and the GPU check in
    tests/test_triton_sm90_w4a16.py (the PTX); no global scale is applied. K % 64 == 0.
    """
    rows, k = b_data.shape[0], b_data.shape[1] * 2
    if k % 64:
        raise ValueError(f"b_data: K must be a multiple of 64 here, got {k}")
    out = torch.empty((rows, k), dtype=torch.float32, device=b_data.device)
    grid = (triton.cdiv(rows, 16), k // 64)
    _dequant_tile_kernel[grid](
        b_data,
        b_scale,
        out,
        rows,
        k,
        b_scale.shape[1] * 128,
        BLOCK_R=16,
        BLOCK_K=64,
        USE_ASM=_USE_ASM,
        PREPARED=prepared,
        BF16=bf16,
    )
    return out


# ---- activations in the dot's K order ---------------------------------------------------


@triton.jit
def _activations_dot_order(xv, ROWS: tl.constexpr, KB: tl.constexpr, PREPARED: tl.constexpr):
    """bf16/fp16 activations ``[ROWS, 2 KB]`` (natural K) -> (even K, odd K) halves, each
    ``[ROWS, KB]`` in the weights' dot byte order (`_from_prepared` for natural weight
    bytes, `_natural_to_dot` for prepared ones): value ``2j + h`` pairs with byte j's
    nibble h."""
    xe, xo = tl.split(tl.reshape(xv, (ROWS, KB, 2)))
    if PREPARED:
        xe = _natural_to_dot(xe, ROWS, KB)
        xo = _natural_to_dot(xo, ROWS, KB)
    else:
        xe = _from_prepared(xe, ROWS, KB)
        xo = _from_prepared(xo, ROWS, KB)
    return xe, xo


@triton.jit
def _join_k(lo, hi, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[lo | hi]`` along K: two ``[ROWS, BLOCK_K / 2]`` halves -> ``[ROWS, BLOCK_K]``."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (ROWS, BLOCK_K))


@triton.jit
def _dot_order_kernel(x_ptr, out_ptr, M, K, stride_xm, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREPARED: tl.constexpr):  # fmt: skip
    """``out`` = ``x`` with each 128-wide K tile in the order the direct kernel's dot
    reads it (``X_DOT``), by the kernel's own permutation code: one pass, so that every
    CTA of the GEMM reads its activation tile straight into the MMA's shared memory."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None]
    xv = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask)
    xe, xo = _activations_dot_order(xv, BLOCK_R, BLOCK_K // 2, PREPARED)
    x2 = _join_k(xe, xo, BLOCK_R, BLOCK_K)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], x2, mask=mask)


#: rows per CTA of the activation pass (`_dot_order_kernel`; 128 K columns each)
DOT_ORDER_ROWS = 16


def dot_order_activations(a: torch.Tensor, prepared: bool) -> torch.Tensor:
    """``a`` ``[M, K]`` (K % 128 == 0, unit K stride) in the direct kernel's dot K order
    for 128-wide K tiles (a new contiguous tensor), for ``X_DOT`` variants."""
    m, k = a.shape
    out = torch.empty((m, k), dtype=a.dtype, device=a.device)
    bound = _dot_order_binding(prepared)
    grid = (-(-m // DOT_ORDER_ROWS), k // 128)
    args = (a, out, m, k, a.stride(0))
    launch_aligned(bound, (m, k, a.stride(0), a.dtype), grid, args, (a, out))
    return out


_DOT_ORDER_LAUNCH = CachedLauncher(_dot_order_kernel)


@functools.cache
def _dot_order_binding(prepared: bool) -> BoundLaunch:
    meta = {"BLOCK_R": DOT_ORDER_ROWS, "BLOCK_K": 128, "PREPARED": prepared}
    return _DOT_ORDER_LAUNCH.bind(meta, 4)


# ---- the direct kernel ----------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_kernel(
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
    xs_ptr,
    x_sblk,
    alpha_b_ptr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREPARED: tl.constexpr,
    BF16_NATIVE: tl.constexpr,
    A_NVFP4: tl.constexpr,
    X_DOT: tl.constexpr,
):
    # A_NVFP4 (the W4A4 entry, `gemm_w4a4_dense`): x_ptr holds NVFP4 activation bytes
    # [M, K/2] with their swizzled e4m3 scales at xs_ptr (row block x_sblk), dequantized
    # in the weights' dot order like the weights (bf16, or fp16 without BF16_NATIVE; exact
    # either way: e2m1 * scale * 2**-14), and
    # the epilogue multiplies by alpha * alpha_b * 2**28. Otherwise the three trailing
    # runtime arguments are unused. X_DOT: the bf16/fp16 activations are already in the
    # dot's K order (`dot_order_activations`; 128-wide K tiles, EVEN_K): no permutation.
    KB: tl.constexpr = BLOCK_K // 2  # packed weight bytes per row of a K tile
    KG: tl.constexpr = BLOCK_K // 16  # block scales per row of a K tile
    # one dot of K = BLOCK_K (the lo and hi halves side by side) instead of two of K/2:
    # a few % faster at 128-wide K steps and slower at 256 in the exploratory H200 timings
    # behind RESULTS.md "Hopper W4A16" run 4; 64-wide steps were not timed that way
    ONE_DOT: tl.constexpr = BLOCK_K == 128

    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    # consecutive CTAs walk N: the token tile (small) stays hot in L2, weights stream
    pid_n = pid % grid_n
    pid_m = pid // grid_n

    # the cast is a no-op for a runtime K; it makes a K that torch.compile passes as a
    # constant (its mutation analysis, torch 2.11) a tensor that can carry the hint
    k_half = tl.multiple_of(tl.cast(K // 2, tl.int32), 16)  # K % 32 == 0: 16-byte rows
    kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = offs_n % N  # wrapped rows: unmasked, in-bounds loads; never stored
    rm = offs_m % M  # tokens past M: masked loads (xrow below) at in-bounds addresses
    rb = tl.arange(0, KB)
    rg = tl.arange(0, KG)

    w_ptrs = b_ptr + rn[:, None].to(tl.int64) * k_half + (kt0 * KB + rb)[None, :]
    s_row = scale_row_offset(rn, b_sblk)
    s_ptrs = bs_ptr + s_row[:, None] + (scale_group_offset(rg) + kt0 * (KG // 4) * 512)[None, :]
    rk = tl.arange(0, BLOCK_K)
    if A_NVFP4:  # packed activation bytes and their scales, addressed like the weights'
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (kt0 * KB + rb)[None, :]
        xs_row = scale_row_offset(rm, x_sblk)[:, None]
        xs_ptrs = xs_ptr + xs_row + (scale_group_offset(rg) + kt0 * (KG // 4) * 512)[None, :]
    else:
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (kt0 * BLOCK_K + rk)[None, :]

    # token rows past M: zero-filled, no memory traffic (wrapped rows would re-read x)
    xrow = (offs_m < M)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1):
        if EVEN_K:
            w = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
            if A_NVFP4:
                xv = tl.load(x_ptrs, mask=xrow, other=0)
                xsv = tl.load(xs_ptrs)
            else:
                xv = tl.load(x_ptrs, mask=xrow, other=0.0)
        else:
            kmask = (kt * KB + rb) < k_half
            gmask = ((kt * KG + rg) < K // 16)[None, :]
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
            s = tl.load(s_ptrs, mask=gmask, other=0.0)
            if A_NVFP4:
                xv = tl.load(x_ptrs, mask=xrow & kmask[None, :], other=0)
                xsv = tl.load(xs_ptrs, mask=gmask, other=0.0)
            else:
                xv = tl.load(x_ptrs, mask=xrow & ((kt * BLOCK_K + rk) < K)[None, :], other=0.0)
        # the weight tile in the dot's byte order (each MMA lane's 4 bytes one 32-bit word
        # of memory); the activations are permuted to the same order
        w = _from_prepared(w, BLOCK_N, KB)
        ORDER: tl.constexpr = 2 if PREPARED else 1
        if BF16_NATIVE:
            w_lo, w_hi = _dequant_scaled_bf16(w, s, BLOCK_N, KB, USE_ASM, PREPARED, ORDER)
        else:
            w_lo, w_hi = _dequant_scaled(w, s, BLOCK_N, KB, USE_ASM, PREPARED, ORDER)
        if A_NVFP4:
            # the activation bytes moved to the natural weights' dot order, then expanded
            # like them: byte j's low nibble is K 2j, its high 2j + 1 (natural weights
            # only: the W4A4 operands carry no prepared copy)
            tl.static_assert(not PREPARED)
            xv = _from_prepared(xv, BLOCK_M, KB)
            if BF16_NATIVE:
                xe, xo = _dequant_scaled_bf16(xv, xsv, BLOCK_M, KB, USE_ASM, False, ORDER)
                dot_dtype: tl.constexpr = tl.bfloat16
            else:  # fp16 products (exact too; what the interpreter runs, see tests)
                xe, xo = _dequant_scaled(xv, xsv, BLOCK_M, KB, USE_ASM, False, ORDER)
                dot_dtype: tl.constexpr = tl.float16
        elif X_DOT:  # already in the dot's order: the tile goes to the MMA as loaded
            tl.static_assert(ONE_DOT and EVEN_K)
            dot_dtype: tl.constexpr = xv.dtype
        else:
            xe, xo = _activations_dot_order(xv, BLOCK_M, KB, PREPARED)
            dot_dtype: tl.constexpr = xv.dtype
        if ONE_DOT:  # [lo | hi] along K: one wgmma group and one wait per step
            w2 = _join_k(w_lo, w_hi, BLOCK_N, BLOCK_K)
            if X_DOT:  # noqa: SIM108 - constexpr branches as statements
                x2 = xv
            else:
                x2 = _join_k(xe, xo, BLOCK_M, BLOCK_K)
            acc = tl.dot(w2.to(dot_dtype), tl.trans(x2.to(dot_dtype)), acc)
        else:
            acc = tl.dot(w_lo.to(dot_dtype), tl.trans(xe.to(dot_dtype)), acc)
            acc = tl.dot(w_hi.to(dot_dtype), tl.trans(xo.to(dot_dtype)), acc)
        w_ptrs += KB
        s_ptrs += (KG // 4) * 512
        if A_NVFP4:
            x_ptrs += KB
            xs_ptrs += (KG // 4) * 512
        else:
            x_ptrs += BLOCK_K

    if A_NVFP4:  # alpha * alpha_b * 2**28: both operands carry 2**-14
        scale = tl.load(alpha_ptr) * 268435456.0 * tl.load(alpha_b_ptr)
    else:
        scale = tl.load(alpha_ptr) * 16384.0  # alpha * 2**14
    store_dense(acc, scale, bias_ptr, has_bias, out_ptr, offs_m, offs_n, M, N, stride_om,
                stride_on, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_N, BLOCK_M, SPLIT_K)  # fmt: skip


@triton.jit
def store_dense(acc, scale, bias_ptr, has_bias, out_ptr, offs_m, offs_n, M, N, stride_om,
                stride_on, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """The W4A16 epilogue both kernels share (this module's and `gemm_w4a16_decode`'s):
    ``acc [BLOCK_N, BLOCK_M]`` (weight rows x tokens) times ``scale`` plus the bias of each
    output column n, stored to the transposed tile of ``out`` through `store_tile`. The
    bias is a runtime flag, not a constexpr: one compiled variant serves layers with and
    without bias, so the precompile covers both."""
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
    out_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    bias = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    if has_bias != 0:
        bias = tl.load(bias_ptr + offs_n[:, None], mask=offs_n[:, None] < N, other=0.0)
        bias = bias.to(tl.float32)
    store_tile(acc, scale, out_ptrs, out_mask, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_N, BLOCK_M,
               SPLIT_K, bias, True)  # fmt: skip


def check_operands(operands: W4A16Operands, out: torch.Tensor) -> None:
    """Raise with a clear message if operands or out do not fit the W4A16 contract."""
    a, b, s, alpha = operands.a, operands.b_data, operands.b_scale, operands.alpha
    if a.dtype not in ACT_DTYPES:
        raise TypeError(f"a: expected bfloat16 or float16 activations, got {a.dtype}")
    if b.dtype != torch.uint8:
        raise TypeError(f"b_data: expected uint8, got {b.dtype}")
    if s.dtype != torch.float8_e4m3fn:
        raise TypeError(f"b_scale: expected float8_e4m3fn, got {s.dtype}")
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise TypeError(
            f"alpha: expected a one-element float32 tensor, got {alpha.dtype} "
            f"with shape {tuple(alpha.shape)}"
        )
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b_data must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    if k % 32:
        raise ValueError(f"a: K must be a multiple of 32, got {k}")
    if getattr(operands, "prepared", False) and k % 64:
        raise ValueError(f"b_data: the sm90-prepared layout needs K % 64 == 0, got K={k}")
    if b.shape[1] * 2 != k:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} vs b_data {tuple(b.shape)}")
    if a.stride(1) != 1 or not b.is_contiguous() or not s.is_contiguous():
        raise ValueError("a must have unit stride along K; b_data and b_scale must be contiguous")
    want = swizzled_scale_shape(n, k)
    if tuple(s.shape) != want:
        raise ValueError(f"b_scale: expected swizzled shape {want}, got {tuple(s.shape)}")
    devices = {a.device, b.device, s.device, alpha.device, out.device}
    if len(devices) != 1:
        raise ValueError(f"operands and out must be on one device, got {sorted(map(str, devices))}")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
    if out.dtype not in ACT_DTYPES:
        raise TypeError(f"out: expected bfloat16 or float16, got {out.dtype}")


@dataclass
class DenseKernel:
    """What the W4A16 kernels with the shared signature (`launch_dense`) have in common:
    ``kernel(operands, out)``, the kept split-K workspace, the precompile. A subclass
    gives ``cfg`` (block_n, block_m, block_k, split_k) and `_binding`.

    The split-K workspace (one fp32 partial buffer and one int32 counter array per
    (device, tile count)) is made outside CUDA-graph pools on the first call that needs
    it (`fp4_dispatch.backends.workspace`) and reused after; the kernel resets every
    counter it uses, so no call writes a memset. Run the first call outside capture; one
    object must not run on two streams at once.
    """

    cfg: Any
    bias_epilogue: ClassVar[bool] = True
    #: records a call's launches for the plan's driver-API replays
    #: (`fp4_dispatch.engine.plans`; a launch it cannot replay keeps Triton's launcher)
    record: ClassVar = staticmethod(record_launches)
    #: states a call as launches torch.compile traces (`fp4_dispatch.engine.inductor`);
    #: None in a subclass that keeps a buffer between calls beyond `Scratch`
    trace: ClassVar = staticmethod(tracing)
    _scratch: Scratch = field(default_factory=Scratch, repr=False)
    #: the Triton launch handle of the latest compiling call (its ``asm`` holds PTX and
    #: cubin: the benchmarks count SASS instructions per element from it)
    compiled: object = field(default=None, repr=False)
    #: the binding's constexpr key -> cached launcher binding (`_binding`)
    _bound: dict = field(default_factory=dict, repr=False)

    @property
    def tile_rows(self) -> int:
        """Weight rows of one output tile (a CTA): ``cfg.block_n`` unless a subclass's
        CTA spans several of them."""
        return self.cfg.block_n

    @property
    def counters_per_tile(self) -> int:
        """Split-K counters of one output tile: one unless a subclass's CTA stores its
        tile as several."""
        return 1

    def workspace(self, device: torch.device, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 partials, int32 counters) for ``tiles`` output tiles on ``device``."""
        elems = tiles * self.cfg.split_k * self.tile_rows * self.cfg.block_m
        return self._scratch.get(device, elems, tiles * self.counters_per_tile)

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """(output tiles, splits): the launch grid for M tokens and N weight rows."""
        cfg = self.cfg
        return -(-m // cfg.block_m) * -(-n // self.tile_rows), cfg.split_k

    def launch_space(
        self, m: int, n: int, out: torch.Tensor
    ) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
        """(grid, split-K partials, counters) of a call with M tokens and N weight rows;
        without split-K ``out`` stands in for both buffers (never read)."""
        grid = self.grid(m, n)
        if self.cfg.split_k > 1:
            ws, cnt = self.workspace(out.device, grid[0])
        else:
            ws = cnt = out
        return grid, ws, cnt

    def __call__(self, operands: W4A16Operands, out: torch.Tensor) -> None:
        """Launch on `operands` with the host work a decode step can afford (as
        `gemm_direct.Nvfp4GemmKernel.__call__`: integer ceil-divisions, a launch key)."""
        m, n, k = operands.a.shape[0], operands.b_data.shape[0], operands.a.shape[1]
        grid, ws, cnt = self.launch_space(m, n, out)
        # the sm90-prepared bytes when the caller has them (`DenseOperands.b_prepared`)
        b = getattr(operands, "b_prepared", None) if k % 64 == 0 else None  # its K rule
        prepared = b is not None or bool(getattr(operands, "prepared", False))
        if b is None:
            b = operands.b_data
        bound = self._binding(k, prepared, operands.a.dtype)
        a = self._activations(operands.a, prepared)
        launch_dense(bound, grid, operands, out, ws, cnt, b, self._tail(out), a)
        self.compiled = bound.last_compiled

    def precompile(
        self, m: int, n: int, k: int, dtype: torch.dtype, prepared: bool = False
    ) -> object:
        """Compile the variant a call of these sizes launches, launching nothing.

        Mirrors `__call__` for contiguous ``dtype`` activations and output (what
        `Dispatcher.gemm` and the tuner pass), each tensor given by its dtype (Triton's
        placeholder, 16-byte aligned like every allocation). The kernels do not
        specialize on M or N (``do_not_specialize``): K, N's row stride and the dtypes
        decide the variant, so one compile serves every M bucket of an (N, K).
        """
        cfg = self.cfg
        ws, cnt = (torch.float32, torch.int32) if cfg.split_k > 1 else (dtype, dtype)
        sblk = swizzled_scale_shape(n, k)[1] * 128
        args = (dtype, torch.uint8, torch.float8_e4m3fn, torch.float32, dtype, dtype, ws, cnt,
                m, n, k, k, n, 1, sblk, 0, *self._tail(dtype))  # fmt: skip
        return self._binding(k, prepared, dtype).warmup(self.grid(m, n), args)

    def _binding(self, k: int, prepared: bool, act_dtype: torch.dtype) -> BoundLaunch:
        raise NotImplementedError

    def _tail(self, out: object) -> tuple:
        """Runtime arguments after the shared signature (none here). ``out`` is the
        output tensor, or its dtype for a precompile (Triton's placeholder)."""
        return ()

    def _activations(self, a: torch.Tensor, prepared: bool) -> torch.Tensor:
        """The activations the kernel reads (``a`` itself here)."""
        return a


@dataclass
class W4A16Kernel(DenseKernel):
    """A built direct (wgmma) kernel: ``kernel(operands, out)``; ``out = alpha * a @
    dequant(b).T`` plus ``operands.bias`` (added in fp32 before the one rounding)."""

    cfg: W4A16Config

    def _binding(self, k: int, prepared: bool, act_dtype: torch.dtype) -> BoundLaunch:
        """The launcher binding of (even K, prepared, native bf16 dequant), made once."""
        cfg = self.cfg
        native = cfg.bf16_dequant == "native" and act_dtype == torch.bfloat16
        key = (k % cfg.block_k == 0, prepared, native, self._x_dot(k))
        bound = self._bound.get(key)
        if bound is None:
            meta = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k,
                    "SPLIT_K": cfg.split_k, "EVEN_K": key[0], "USE_ASM": _USE_ASM,
                    "PREPARED": prepared, "BF16_NATIVE": native, "A_NVFP4": False,
                    "X_DOT": key[3], "num_stages": cfg.num_stages}  # fmt: skip
            bound = self._bound[key] = _W4A16_LAUNCH.bind(meta, cfg.num_warps)
        return bound

    def _x_dot(self, k: int) -> bool:
        """Whether a call with this K runs the ``X_DOT`` variant (`W4A16Config.x_dot`)."""
        return self.cfg.x_dot and self.cfg.block_k == 128 and k % 128 == 0

    def _activations(self, a: torch.Tensor, prepared: bool) -> torch.Tensor:
        """``a``, or for an ``X_DOT`` variant its copy in the dot's K order."""
        return dot_order_activations(a, prepared) if self._x_dot(a.shape[1]) else a

    def precompile(
        self, m: int, n: int, k: int, dtype: torch.dtype, prepared: bool = False
    ) -> object:
        """`DenseKernel.precompile`, plus the activation pass of an ``X_DOT`` variant."""
        if self._x_dot(k):
            grid = (-(-m // DOT_ORDER_ROWS), k // 128)
            _dot_order_binding(prepared).warmup(grid, (dtype, dtype, m, k, k))
        return super().precompile(m, n, k, dtype, prepared)

    def _tail(self, out: object) -> tuple:
        """The W4A4 entry's three arguments, unused here (`_w4a16_kernel`): ``out``
        stands in for both pointers (never read), 0 for the scale row block."""
        return (out, 0, out)


_W4A16_LAUNCH = CachedLauncher(_w4a16_kernel)


def launch_dense(
    bound: BoundLaunch,
    grid: tuple[int, int],
    operands: W4A16Operands,
    out: torch.Tensor,
    ws: torch.Tensor,
    cnt: torch.Tensor,
    b: torch.Tensor,
    tail: tuple = (),
    a: torch.Tensor | None = None,
) -> None:
    """Launch a W4A16 kernel of the shared signature (this module's direct kernel and
    `gemm_w4a16_decode`'s gemv: x, weight, scales, alpha, bias, out, workspace, counters,
    M, N, K, strides, scale row block, has_bias; then ``tail``, a kernel's own arguments:
    `DenseKernel._tail`) on `operands`, reading the weight bytes ``b``
    (``operands.b_data`` or its sm90-prepared copy, as ``bound`` was compiled for) and
    the activations ``a`` (default ``operands.a``; an ``X_DOT`` variant's reordered copy).

    No bias: ``out`` stands in for the pointer (never read; the same dtype, so the same
    compiled variant). Aligned pointers launch by a key of what varies between calls
    (sizes, strides, dtypes: `BoundLaunch.launch_keyed`); anything else through Triton's
    full specialization key."""
    sb, alpha = operands.b_scale, operands.alpha
    a = operands.a if a is None else a
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    bias = operands.bias
    has_bias = bias is not None
    if not has_bias:
        bias = out
    sa0, (so0, so1) = a.stride(0), out.stride()
    args = (a, b, sb, alpha, bias, out, ws, cnt, m, n, k, sa0, so0, so1,
            sb.shape[1] * 128, int(has_bias), *tail)  # fmt: skip
    key = (m, n, k, sa0, so0, so1, a.dtype, out.dtype, bias.dtype)
    launch_aligned(bound, key, grid, args, (a, b, sb, alpha, bias, out))


# ---- the unpack path (large M) --------------------------------------------------------


@dataclass(frozen=True)
class W4A16UnpackKernel:
    """Large-M kernel: unpack the weight once (alpha folded in) to the activation dtype,
    then cuBLAS. ``block_r x block_k`` is the unpack pass's tile."""

    block_r: int = 64
    block_k: int = 128

    def precompile(self, n: int, k: int, dtype: torch.dtype) -> None:
        """Compile (Triton warmup, no launch) the weight's unpack pass of `__call__`:
        ``n`` rows to ``dtype`` with alpha folded in; cuBLAS needs no compile."""
        gemm_unpack.unpack_nvfp4_kernel.warmup(
            torch.uint8, torch.uint8, dtype, torch.float32, n, k,
            swizzled_scale_shape(n, k)[1] * 128,
            grid=(triton.cdiv(n, self.block_r), triton.cdiv(k, self.block_k)),
            BLOCK_R=self.block_r, BLOCK_K=self.block_k, HAS_ALPHA=True,
            num_warps=gemm_unpack._num_warps(self.block_r, self.block_k),
        )  # fmt: skip

    def __call__(self, operands: W4A16Operands, out: torch.Tensor) -> None:
        a = operands.a
        # the unpack pass reads natural order: a prepared weight is restored first (one
        # extra pass over N*K/2 bytes; the unpack path is for large M, where it is small)
        data = (
            unprepare_weight(operands.b_data)
            if getattr(operands, "prepared", False)
            else operands.b_data
        )
        w = unpack_nvfp4(
            data,
            operands.b_scale,
            self.block_r,
            self.block_k,
            dtype=a.dtype,
            alpha=operands.alpha,
        )
        if out.dtype != a.dtype:
            out.copy_(torch.mm(a, w.t()))
        elif out.is_contiguous():
            torch.mm(a, w.t(), out=out)
        elif out.t().is_contiguous():
            torch.mm(w, a.t(), out=out.t())  # column-major out: write out.T row-major
        else:
            out.copy_(torch.mm(a, w.t()))


def build(cfg: W4A16Config) -> W4A16Kernel:
    """A direct kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A16Kernel(cfg)


def build_unpack(block_r: int, block_k: int) -> W4A16UnpackKernel:
    """An unpack + cuBLAS kernel object."""

    if block_r not in UR or block_k not in UK:
        raise ValueError(f"block_r/block_k: expected one of {UR}/{UK}, got {block_r}/{block_k}")
    return W4A16UnpackKernel(block_r, block_k)
