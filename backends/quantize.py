"""Fused NVFP4 activation quantization in Triton: one launch, no host synchronisation.

Why: the torch reference (`fp4_dispatch.format.nvfp4.quantize_blocks` + `swizzle_scales`) is
~50 small kernels; a decode step needs one. `quantize_triton` reads ``x`` once and
writes the packed e2m1 codes and the e4m3 block scales - directly in the 128x4
swizzled layout (storage formula in the `fp4_dispatch.format.nvfp4` module docstring, padding
entries written as zero by the kernel, so the output is a plain ``torch.empty``) or in
the linear ``[M, K/16]`` layout.

Launches: a given global scale (a one-element float32 device tensor, or a Python float
baked in as a kernel argument) is ONE launch. The dynamic scale (``amax / (6 * 448)``
over the finite values) is one launch when the whole tensor has at most
`_FUSED_ELEMS` elements (decode rows up to K = 16384: every program of the grid
reduces the whole small tensor itself, one load, then quantizes its own tile); else,
on a GPU, one COOPERATIVE launch while the grid has at most one program per SM
(`_cooperative_ok`; M <= 16 up to K = 16384 and more at the default tile): each
program reduces its own loaded tile, the programs meet at a grid barrier
(`_grid_amax`: atomic max, arrival count, spin; the plan's two-int32 workspace is
left zero by the last program, so there is no memset and graph replays reuse it),
then quantize. Otherwise - and always under TRITON_INTERPRET=1, where programs run one
after another and a spin would never end - a partial-amax kernel (at most
`_MAX_PARTIALS` partial maxima, no memset: every slot is written) followed by the
quantize kernel, whose programs each reduce the partials. Host side, a call is one
plan look-up, the three output allocations and `BoundLaunch.launch_keyed` (no
specialization key, no argument re-binding).

Bit-exactness with the reference (the tests compare bytes):
- the block scale: ``block_amax / 6 / g`` divides twice with ``tl.math.div_rn`` as the
  reference does (Triton's ``/`` is approximate on GPU); the e4m3 rounding is one
  ``cvt.rn.satfinite.e4m3x2.f32`` on GPUs and integer arithmetic on the fp32 bits under
  the interpreter (round to nearest even on 3 mantissa bits for normals,
  ``round-half-even(v * 2**9)`` for subnormals): the same bits for 0 <= v <= 448,
  independent of how a Triton version lowers the float8 cast;
- the e2m1 codes need no per-element division. The reference rounds the float32
  quotient ``q = fl(|x| / d)`` (``d = scale * g``) against the midpoints t (0.25, 0.75,
  ... 5; ``>`` where the lower code is even, ``>=`` where it is odd: ties to even).
  ``fl(q) >= t`` holds exactly when ``|x| / d`` reaches the real midpoint between t and
  its float32 neighbour below, ``fl(q) > t`` when it passes the one above (a quotient
  of two float32 values is never such a midpoint), so each block gets seven float32
  thresholds: those boundaries times d, exact in float64 (25-bit times 24-bit), rounded
  up to float32 (`_e2m1_bounds`). Comparing ``|x|`` with them is the reference's
  division and comparison, bit for bit; a code is a 3-level binary search of ``|x|``'s
  int32 bits against the thresholds' (`_e2m1_from_bounds`), in wrapping integer
  arithmetic rather than booleans (see `_below` for why). A zero magnitude gets code
  0, never -0 (code 8);
- non-finite semantics (`fp4_dispatch.format.nvfp4` docstring): a 16-element block holding
  NaN/inf gets scale byte 0x7F and codes 0 (its thresholds pass nothing); the dynamic
  amax ignores non-finite values. The block amax and the non-finite flag are one
  integer max over ``|x|``'s bits (every NaN/inf is above FLT_MAX's bits).

bf16 input takes two elements a 32-bit operation (`_pair_codes`; the comment above
`_pair_words` says why that is exact); fp16/fp32 one an operation. PTX pieces
(``USE_ASM``: the e4m3 and directed float64 -> float32 conversions, PRMT lane masks,
``max.u16x2``) have integer twins that compute the same bits under the interpreter,
where the CI tests run; the GPU benchmark checks the PTX path's bytes.

Tiles: a program handles ``[BM, BK]`` elements loaded as two ``[BM, BK/16, 8]`` halves
(`_load_halves`: one thread holds a whole 16-element block, two 16-byte loads for
bf16, so the per-block scale work is done once a block), `_TILE_ELEMS` elements per
program (4096: the H200 sweep in benchmarks/RESULTS.md, made with the earlier kernel);
whole tiles (``EVEN``) are loaded and stored without masks. SASS for sm_90 (Triton
3.9, 8x512 tile, bf16, swizzled): 49.5 instructions an element before, 27.0 now; on
the straight path (to the first EXIT: no row padding, no division slow path) 43.3
before, 20.8 now (``bench_quantize.py --sass``, a removed script: git history at d90e9a7).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from fp4_dispatch.support.alloc import direct_allocator

from .triton_launch import BoundLaunch, CachedLauncher

log = logging.getLogger(__name__)

__all__ = ["KeptQuantize", "kept_quantize", "quantize_checked", "quantize_triton"]

#: fp32 max: ``|v| <= FLT_MAX`` is False exactly for NaN and ±inf.
_FLT_MAX = 3.4028234663852886e38
#: Elements per program: 4096 (32 a thread at 4 warps). Measured on the H200 with the
#: earlier kernel (~126 registers; RESULTS.md, issue 11 run 2 sweep): at 4096x8192
#: given scale 59.9 µs against 69.9 µs for 8192 and 103-143 µs for 16K-32K elements.
#: This kernel needs 55 registers at 4096 and 72-96 at 8192 elements on 4 warps
#: (sm_90, Triton 3.9), where fixed costs drop to 23 instructions an element: the
#: ``--variants`` run of bench_quantize.py (removed; git history at d90e9a7) decided it.
_TILE_ELEMS = 4096
#: Widest K tile of the multi-program grid: a decode row of K=8192 spreads over 16
#: programs (16 SMs load in parallel): 2.5 µs at 1x8192 against 3.6 µs for 1024.
_MAX_BK = 512
#: Elements a partial-amax program loads per step (its own, larger tile: each program
#: loops over many row tiles, so more bytes in flight per step is what it needs)
_AMAX_ELEMS = 16384
#: Largest tensor of the one-launch dynamic scale, where every program first reduces the
#: whole tensor (one load; 16K elements is 64 fp32 registers a thread at 8 warps)
_FUSED_ELEMS = 16384
#: Warps per program; None: 8 for 8K-element tiles and more, else 4 (benchmarks sweep it)
_NUM_WARPS: int | None = None
#: Upper bound on partial maxima of the dynamic scale (each quantize program reads all).
_MAX_PARTIALS = 256
#: Rows of zero scales stored per step in the swizzled row padding.
_PAD_ROWS = 32
#: From this many elements on, programs take `_LARGE_TILE` = (elements, widest K tile,
#: warps): H200, 2026-12-01 (the removed `bench_quantize.py --variants`, RESULTS.md
#: "Serving hot path" run 4): 8192-element tiles 1024 wide on 4 warps took 33.6 µs at
#: 4096x8192 and 19.8 µs at 4096x4096 (given scale) against 37.4 and 20.7 for the default
#: tile, but 4.4 against 3.1 µs at 16x8192 and 5.9 against 5.6 at 256x8192: the large
#: tile pays off only once the grid is many waves deep.
_LARGE_ELEMS = 1 << 23
_LARGE_TILE = (8192, 1024, 4)
_DEFAULT_TILE = (_TILE_ELEMS, _MAX_BK, _NUM_WARPS)

#: Under TRITON_INTERPRET=1 programs run one after another on the CPU and PTX cannot run
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
#: The PTX pieces (`_e4m3_rn`, `_bound_f32`, `_lane_mask`, ``max.u16x2``) on sm_90+
#: GPUs (`_asm_ok`); False: their integer twins everywhere (the same bits; the only
#: choice under the interpreter and before sm_90)
_USE_ASM = not _INTERPRETING
#: The dynamic scale of a tensor over `_FUSED_ELEMS` in ONE cooperative launch (grid
#: barrier, `_grid_amax`) where its grid fits on the device at once: None = wherever
#: that is safe (`_cooperative_ok`), False = never (partial-amax kernel + quantize)
_COOPERATIVE: bool | None = None

#: bf16 input two elements a 32-bit operation (`_pair_codes`); False: one an operation
_PAIRS = True

# g modes (constexpr): where the global (decode) scale comes from
_G_PTR, _G_VALUE, _G_PARTIALS, _G_FUSED, _G_BARRIER = 0, 1, 2, 3, 4

#: e4m3fn byte (low 8 bits) of fp32 $1: round to nearest even, saturating (sm89+)
_E4M3_ASM = tl.constexpr(
    "{ .reg .b16 t; .reg .f32 z; mov.f32 z, 0f00000000;"
    " cvt.rn.satfinite.e4m3x2.f32 t, z, $1; cvt.u32.u16 $0, t; }"
)


@triton.jit
def _g_from_amax(amax):
    """Dynamic decode scale: amax / (6 * 448), 1.0 when that is 0 (all zero or underflow)."""
    # amax is a 0-d value (never inf/NaN here): amax * 0 + c is c as a same-typed operand
    g = tl.math.div_rn(amax, amax * 0.0 + 2688.0)
    return tl.where(g == 0.0, 1.0, g)


@triton.jit
def _load_blocks(
    x_ptr, stride_xm, row0, col0, M, K, BM: tl.constexpr, NB: tl.constexpr,
    EVEN: tl.constexpr = False,
):  # fmt: skip
    """``[BM, NB, 16]`` float32 tile at (row0, col0); out-of-range elements are 0.
    EVEN: the tile is known to be in range (no masks: they cost registers and, kept
    alive until the stores, predicate-packing instructions)."""
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm + cols
    if EVEN:
        return tl.load(ptrs).to(tl.float32)
    mask = (rows < M)[:, None, None] & (cols < K)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_halves(
    x_ptr, stride_xm, row0, col0, M, K, BM: tl.constexpr, NB: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """The tile as its blocks' two 8-element halves, ``[BM, NB, 8]`` each (x's dtype).

    Two loads of the same shape, so one thread holds both halves of a block (same
    shape, same layout: a 16-byte vector of each for bf16/fp16) and the per-block work
    (scale, thresholds) is done once a block - not by each of the two threads that a
    16-byte-vector layout of ``[BM, NB, 16]`` spreads a block over (with nothing else
    changed: 49.5 SASS instructions an element before, 39.5 after; sm_90, Triton 3.9,
    8x512 tile).
    """
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm + cols
    if EVEN:
        return tl.load(ptrs), tl.load(ptrs + 8)
    mask = (rows < M)[:, None, None] & (cols < K)  # K % 16 == 0: one test a block
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + 8, mask=mask, other=0.0)


@triton.jit
def _finite_amax(xb):
    """max |x| over the finite values of a tile (0.0 when none)."""
    ax = tl.abs(xb)
    return tl.max(tl.max(tl.max(tl.where(ax <= 3.4028234663852886e38, ax, 0.0), 2), 1), 0)


@triton.jit
def _e4m3(v):
    """Round non-negative fp32 ``v <= 448`` to e4m3fn (nearest even): (byte, fp32 value)."""
    bits = v.to(tl.int32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    r = (r >> 20) << 20
    s_norm = r.to(tl.float32, bitcast=True)
    b_norm = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    t = v * 512.0  # subnormal step 2**-9; exact scaling
    ti = t.to(tl.int32)  # truncation = floor for t >= 0
    fr = t - ti.to(tl.float32)  # exact
    up = (fr > 0.5) | ((fr == 0.5) & ((ti & 1) == 1))
    mi = ti + up.to(tl.int32)  # 8 is 2**-6, the smallest normal: byte 0x08 either way
    s_sub = mi.to(tl.float32) * 0.001953125
    normal = v >= 0.015625
    return tl.where(normal, b_norm, mi), tl.where(normal, s_norm, s_sub)


@triton.jit
def _e4m3_value(b):
    """fp32 value of e4m3fn byte ``b`` in [0, 0x7E]: the exponent rebias (120 = 127 - 7)
    for normals (b >= 8), ``b * 2**-9`` for subnormals."""
    norm = ((b << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(b >= 8, norm, b.to(tl.float32) * 0.001953125)


@triton.jit
def _e4m3_rn(v, USE_ASM: tl.constexpr):
    """`_e4m3` in one PTX conversion on GPUs (``cvt.rn.satfinite``: round to nearest
    even, the same bits for ``0 <= v <= 448``); the integer arithmetic where PTX cannot
    run (TRITON_INTERPRET=1)."""
    if USE_ASM:
        b = tl.inline_asm_elementwise(_E4M3_ASM, "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)
        return b, _e4m3_value(b)
    return _e4m3(v)


@triton.jit
def _ceil_f32(b, STRICT: tl.constexpr):
    """The smallest float32 ``>= b`` (``> b`` when STRICT) of non-negative float64 ``b``."""
    f = b.to(tl.float32)  # round to nearest
    fb = f.to(tl.float64)
    up = (fb < b) | (fb == b) if STRICT else fb < b
    return tl.where(up, (f.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), f)


@triton.jit
def _bound_f32(b, STRICT: tl.constexpr, USE_ASM: tl.constexpr):
    """`_ceil_f32` by directed conversions on GPUs: ``cvt.rp`` is the smallest float32
    ``>= b``; the one after ``cvt.rm`` (the largest ``<= b``) the smallest ``> b``."""
    if not USE_ASM:
        return _ceil_f32(b, STRICT)
    if STRICT:
        f = tl.inline_asm_elementwise(
            "cvt.rm.f32.f64 $0, $1;", "=f,d", [b], dtype=tl.float32, is_pure=True, pack=1
        )
        return (f.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    return tl.inline_asm_elementwise(
        "cvt.rp.f32.f64 $0, $1;", "=f,d", [b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _e2m1_bounds(d, USE_ASM: tl.constexpr):
    """The seven float32 thresholds T_i of a block with divisor ``d`` (float32 > 0):
    ``fl(|x| / d)`` passes e2m1 midpoint i exactly when ``|x| >= T_i``.

    ``c_i * d`` is exact in float64 (25-bit c_i times a 24-bit d), so T_i is exactly
    the first float32 on the passing side of the real boundary (`_BOUNDS`): comparing
    ``|x|`` with T_i is the reference's division and comparison, bit for bit, with no
    per-element division.
    """
    d64 = d.to(tl.float64)
    t0 = _bound_f32(d64 * 0.25000001490116119384765625, True, USE_ASM)  # 0.25 + 2**-26: >
    t1 = _bound_f32(d64 * 0.749999970197677612304687500, False, USE_ASM)  # 0.75 - 2**-25: >=
    t2 = _bound_f32(d64 * 1.25000005960464477539062500, True, USE_ASM)  # 1.25 + 2**-24: >
    t3 = _bound_f32(d64 * 1.74999994039535522460937500, False, USE_ASM)  # 1.75 - 2**-24: >=
    t4 = _bound_f32(d64 * 2.50000011920928955078125000, True, USE_ASM)  # 2.5 + 2**-23: >
    t5 = _bound_f32(d64 * 3.49999988079071044921875000, False, USE_ASM)  # 3.5 - 2**-23: >=
    t6 = _bound_f32(d64 * 5.00000023841857910156250000, True, USE_ASM)  # 5 + 2**-22: >
    return t0, t1, t2, t3, t4, t5, t6


@triton.jit
def _bits_or_none(t, ok):
    """Threshold ``t`` ``[BM, NB]`` as int32 bits ``[BM, NB, 1]``, INT32_MIN where not ok."""
    return tl.where(ok, t.to(tl.int32, bitcast=True), -2147483648)[:, :, None]


@triton.jit
def _below(a, t):
    """-1 where ``a < t`` else 0, for int32 float bits ``a`` in [0, 2**31) and ``t`` in
    [0, 0x7F800001] or INT32_MIN (below nothing: ``a - INT32_MIN`` wraps negative).

    An arithmetic shift of a wrapping difference, never a boolean: Triton emits one
    operation over the whole tile at a time, so a boolean an element stays alive across
    the next operations, and sm90 has 7 predicate registers - the rest are packed into
    bit masks at 2 instructions each (seen in the SASS of an earlier version)."""
    return (a - t) >> 31


@triton.jit
def _pick(hi, x, below):
    """``x ^ hi`` is the other candidate: ``lo`` where below is -1, else ``hi``."""
    return hi ^ (x & below)


@triton.jit
def _e2m1_from_bounds(a, sign8, t0, t1, t2, t3, t4, t5, t6):
    """e2m1 code of ``|x|``'s int32 bits ``a`` (``sign8``: 8 for a negative x, else 0)
    against a block's threshold bits ``[BM, NB, 1]`` (`_e2m1_bounds`; INT32_MIN in
    blocks that get codes 0): the number of thresholds passed, found by a 3-level
    binary search over the sorted thresholds in integer arithmetic. A zero magnitude
    code never carries the sign (no -0, code 8)."""
    l3 = _below(a, t3)
    l1 = _below(a, _pick(t5, t5 ^ t1, l3))
    w_lo = _pick(t2, t2 ^ t0, l1)
    w_hi = _pick(t6, t6 ^ t4, l1)
    l0 = _below(a, _pick(w_hi, w_hi ^ w_lo, l3))
    mag = 7 + 4 * l3 + 2 * l1 + l0  # 0 exactly where l3 = l1 = l0 = -1
    return mag | (sign8 & ~(l3 & l1 & l0))


@triton.jit
def _packed_half(u, a, t0, t1, t2, t3, t4, t5, t6):
    """The 8 codes of a half block as one int32 word ``[BM, NB]`` (code j in bits
    4j..4j+3: little-endian bytes ``code(2i) | code(2i+1) << 4``, the reference's
    packing); ``u``: x's int32 bits, ``a`` = ``u & 0x7FFFFFFF``. The fields do not
    overlap, so the sum is their bitwise or."""
    # the sign as an integer (8 or 0), not a boolean (see `_below`)
    codes = _e2m1_from_bounds(a, (u >> 28) & 8, t0, t1, t2, t3, t4, t5, t6)
    return tl.sum(codes << (tl.arange(0, 8) * 4)[None, None, :], 2)


@triton.jit
def _scale_offsets(rows, kb, KB, NUM_K_TILES, SWIZZLED: tl.constexpr):
    """Storage offsets of scale entries (rows [R, 1], kb [1, NB]); the swizzled formula is
    the one in the `fp4_dispatch.format.nvfp4` module docstring."""
    if SWIZZLED:
        off = (
            (rows // 128) * (NUM_K_TILES * 512)
            + (kb // 4) * 512
            + (rows % 32) * 16
            + ((rows % 128) // 32) * 4
            + (kb % 4)
        )
    else:
        off = rows * KB + kb
    return off


@triton.jit
def _block_scale(bmax, g, USE_ASM: tl.constexpr):
    """Per-block e4m3 scale of the blocks' max ``|x|`` int32 bits ``bmax`` [BM, NB]
    (NaN/inf above FLT_MAX's bits: scale byte 0x7F, codes 0): ``(byte, ok, d)``, ``d``
    the divisor ``scale * g`` of the usable blocks (``ok``: nonzero, finite), 1.0
    elsewhere."""
    bad = bmax > 0x7F7FFFFF
    bamax = tl.where(bad, 0, bmax).to(tl.float32, bitcast=True)
    gb = tl.full(bamax.shape, 1.0, tl.float32) * g
    v = tl.math.div_rn(tl.math.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32)), gb)
    v = tl.minimum(v, 448.0)
    sbyte, s = _e4m3_rn(v, USE_ASM)
    sbyte = tl.where(bad, 0x7F, sbyte)
    denom = s * gb
    ok = (denom > 0.0) & (bad == 0)
    return sbyte, ok, tl.where(ok, denom, 1.0)


@triton.jit
def _codes_f32(ua, ub, ok, d, USE_ASM: tl.constexpr):
    """Packed codes ``[BM, NB, 2]`` int32 of the halves' float32 bits ``ua``, ``ub``:
    one element an operation (fp32/fp16 input)."""
    # thresholds as int32 bits (non-negative floats order like their bits); unusable
    # blocks (zero or underflowed scale, non-finite values) get INT32_MIN, which no
    # magnitude passes, so their codes are 0
    t0, t1, t2, t3, t4, t5, t6 = _e2m1_bounds(d, USE_ASM)
    t0 = _bits_or_none(t0, ok)
    t1 = _bits_or_none(t1, ok)
    t2 = _bits_or_none(t2, ok)
    t3 = _bits_or_none(t3, ok)
    t4 = _bits_or_none(t4, ok)
    t5 = _bits_or_none(t5, ok)
    t6 = _bits_or_none(t6, ok)
    wa = _packed_half(ua, ua & 0x7FFFFFFF, t0, t1, t2, t3, t4, t5, t6)
    wb = _packed_half(ub, ub & 0x7FFFFFFF, t0, t1, t2, t3, t4, t5, t6)
    return tl.join(wa, wb)  # [BM, NB, 2]: the block's 8 bytes


@triton.jit
def _store_tile(
    words, sbyte, data_ptr, scale_ptr, row0, col0, M, K, NUM_K_TILES,
    SWIZZLED: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """Store a tile's packed codes (``[BM, NB, 2]`` int32: 8 bytes a block) and its
    scale bytes ``[BM, NB]`` (swizzled or linear)."""
    rows = row0 + tl.arange(0, BM)
    rmask = rows < M
    wpr = K // 8  # int32 words a data row (K % 16 == 0)
    wcols = col0 // 8 + tl.arange(0, NB)[:, None] * 2 + tl.arange(0, 2)[None, :]
    dptrs = data_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dptrs = dptrs + rows.to(tl.int64)[:, None, None] * wpr + wcols[None, :, :]
    if EVEN:
        tl.store(dptrs, words)
    else:
        tl.store(dptrs, words, mask=rmask[:, None, None] & (wcols < wpr)[None, :, :])

    kb = col0 // 16 + tl.arange(0, NB)
    KB = K // 16
    scale_bytes = scale_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)  # e4m3 bit patterns
    if SWIZZLED:  # noqa: SIM108 (a static branch on a constexpr, clearer in jit code)
        kmask = kb < NUM_K_TILES * 4  # column padding is written (zero: masked loads)
    else:
        kmask = kb < KB
    off = _scale_offsets(rows.to(tl.int64)[:, None], kb[None, :], KB, NUM_K_TILES, SWIZZLED)
    off = tl.max_contiguous(off, [1, 1])  # bytes stored where computed: no smem shuffle
    if EVEN:  # in range: K % BK == 0 with BK a multiple of 64 pads no scale column
        tl.store(scale_bytes + off, sbyte.to(tl.uint8))
    else:
        tl.store(scale_bytes + off, sbyte.to(tl.uint8), mask=rmask[:, None] & kmask[None, :])


# ---- bf16 input: two elements a 32-bit operation ---------------------------------------
#
# A bf16 magnitude's 15 bits order like its value, and ``h >= T`` for a float32
# threshold T and the float32 ``h << 16`` holds exactly when ``h >= ceil(T / 2**16)``
# (`_pair_bound`). So two elements share one int32 word ``lo | hi << 16`` (elements 2j,
# 2j+1) and every comparison of the binary search is one subtraction for both: with
# ``o = w | 0x80008000`` and a threshold word ``t * 0x10001`` (t <= 0x8000), each 16-bit
# lane of ``o - T`` is ``0x8000 + h - t``, in [0, 0x10000) (no borrow between lanes),
# whose top bit says ``h >= t``. A lane mask is that bit replicated (`_lane_mask`: one
# PRMT). 0x8000 is the "no threshold" of unusable blocks: no magnitude reaches it.


@triton.jit
def _pair_words(x, BM: tl.constexpr, NB: tl.constexpr, USE_ASM: tl.constexpr):
    """bf16 ``[BM, NB, 8]`` -> int32 ``[BM, NB, 4]`` words ``bits(2j) | bits(2j+1) << 16``."""
    lo, hi = tl.split(tl.reshape(x.to(tl.int16, bitcast=True), [BM, NB, 4, 2]))
    if USE_ASM:  # the register pair as loaded: no arithmetic once ptxas folds the moves
        return tl.inline_asm_elementwise(
            "mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)


@triton.jit
def _max_u16x2_asm(x, y):
    """Lane-wise max of two words of two unsigned 16-bit lanes (sm90 ``max.u16x2``)."""
    return tl.inline_asm_elementwise(
        "max.u16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _max_u16x2_int(x, y):
    """`_max_u16x2_asm` in plain integer operations (TRITON_INTERPRET=1)."""
    lo = tl.maximum(x & 0xFFFF, y & 0xFFFF)
    return (tl.maximum((x >> 16) & 0xFFFF, (y >> 16) & 0xFFFF) << 16) | lo


@triton.jit
def _pair_block_max(pa, pb, USE_ASM: tl.constexpr):
    """Max ``|x|`` of each block as float32 bits ``[BM, NB]`` from its 8 pair words."""
    a = pa & 0x7FFF7FFF
    b = pb & 0x7FFF7FFF
    if USE_ASM:
        m = _max_u16x2_asm(tl.reduce(a, 2, _max_u16x2_asm), tl.reduce(b, 2, _max_u16x2_asm))
    else:
        m = _max_u16x2_int(tl.reduce(a, 2, _max_u16x2_int), tl.reduce(b, 2, _max_u16x2_int))
    return tl.maximum(m & 0xFFFF, (m >> 16) & 0xFFFF) << 16


@triton.jit
def _pair_bound(t, ok):
    """Float32 threshold ``t`` [BM, NB] as a pair word ``[BM, NB, 1]``: the smallest
    bf16 magnitude bits ``>= t`` in both lanes; 0x8000 (reached by nothing) where not ok."""
    t16 = (t.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
    return (tl.where(ok, t16, 0x8000) * 0x10001)[:, :, None]


@triton.jit
def _lane_mask(d, USE_ASM: tl.constexpr):
    """Each 16-bit lane of ``d`` -> 0xFFFF where its top bit is set, else 0."""
    if USE_ASM:  # PRMT selectors 9 and B: bytes 1 and 3 with their sign replicated
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, 0xBB99;", "=r,r", [d], dtype=tl.int32, is_pure=True, pack=1
        )
    return ((d >> 15) & 0x10001) * 0xFFFF


@triton.jit
def _pair_codes(w, t0, t1, t2, t3, t4, t5, t6, USE_ASM: tl.constexpr):
    """The e2m1 codes of the two bf16 lanes of ``w`` (`_pair_words`) against a block's
    threshold words (`_pair_bound`), code j in bits 0-3 of lane j: the binary search of
    `_e2m1_from_bounds` on both lanes at once (``p*``: lane masks of "passed")."""
    o = w | -2147450880  # 0x80008000
    p3 = _lane_mask(o - t3, USE_ASM)
    p1 = _lane_mask(o - (t1 ^ ((t5 ^ t1) & p3)), USE_ASM)
    w_lo = t0 ^ ((t2 ^ t0) & p1)
    w_hi = t4 ^ ((t6 ^ t4) & p1)
    p0 = _lane_mask(o - (w_lo ^ ((w_hi ^ w_lo) & p3)), USE_ASM)
    mag = (p3 & 0x40004) | (p1 & 0x20002) | (p0 & 0x10001)
    # the sign (bits 15, 31 -> 3, 19) where the magnitude code is not 0 (no -0)
    return mag | ((w >> 12) & 0x80008 & (p3 | p1 | p0))


@triton.jit
def _pair_packed(w, t0, t1, t2, t3, t4, t5, t6, USE_ASM: tl.constexpr):
    """A half block's four pair words -> its 4 packed bytes as one int32 ``[BM, NB]``."""
    c = _pair_codes(w, t0, t1, t2, t3, t4, t5, t6, USE_ASM)
    byte = (c | (c >> 12)) & 0xFF  # code(2j) | code(2j+1) << 4
    return tl.sum(byte << (tl.arange(0, 4) * 8)[None, None, :], 2)


@triton.jit
def _codes_pairs(pa, pb, ok, d, USE_ASM: tl.constexpr):
    """`_codes_f32` for bf16 input, two elements an operation."""
    t0, t1, t2, t3, t4, t5, t6 = _e2m1_bounds(d, USE_ASM)
    t0 = _pair_bound(t0, ok)
    t1 = _pair_bound(t1, ok)
    t2 = _pair_bound(t2, ok)
    t3 = _pair_bound(t3, ok)
    t4 = _pair_bound(t4, ok)
    t5 = _pair_bound(t5, ok)
    t6 = _pair_bound(t6, ok)
    wa = _pair_packed(pa, t0, t1, t2, t3, t4, t5, t6, USE_ASM)
    return tl.join(wa, _pair_packed(pb, t0, t1, t2, t3, t4, t5, t6, USE_ASM))


@triton.jit
def _zero_row_padding(scale_ptr, col0, M, M_PAD, NUM_K_TILES, NB: tl.constexpr):
    """Zero the swizzled scale rows [M, M_PAD) of one K tile."""
    kb = col0 // 16 + tl.arange(0, NB)
    kmask = kb < NUM_K_TILES * 4
    for r0 in range(M, M_PAD, 32):
        rows = r0 + tl.arange(0, 32)
        off = _scale_offsets(rows.to(tl.int64)[:, None], kb[None, :], 0, NUM_K_TILES, True)
        zeros = tl.zeros([32, NB], tl.uint8)
        tl.store(
            scale_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + off,
            zeros,
            mask=(rows < M_PAD)[:, None] & kmask[None, :],
        )


@triton.jit
def _grid_amax(ws_ptr, part):
    """The grid-wide max of every program's ``part`` (int32 bits of a non-negative
    float), through a barrier on the two-int32 workspace ``ws_ptr`` (``[amax, count]``,
    zero between launches). Returns ``(amax bits, whether this program resets ws)``.

    Every program: atomic max into ws[0]; arrival (acq_rel: its max is visible before
    the count moves) and a spin until all ``n`` arrived; read ws[0]; a second arrival
    (acq_rel: after its read). The program whose second arrival makes the count
    ``2n`` resets both words (`_grid_reset`), so the next launch - stream-ordered after
    this one - finds zeros (no memset launch). Needs every program resident at once:
    the launch is cooperative (``launch_cooperative_grid``), and never under
    TRITON_INTERPRET=1 with more than one program (programs run one after another
    there; `_cooperative_ok`).
    """
    n = tl.num_programs(0) * tl.num_programs(1)
    tl.atomic_max(ws_ptr, part, sem="relaxed", scope="gpu")
    seen = tl.atomic_add(ws_ptr + 1, 1, sem="acq_rel", scope="gpu") + 1
    while seen < n:
        seen = tl.atomic_add(ws_ptr + 1, 0, sem="acquire", scope="gpu")
    amax = tl.atomic_max(ws_ptr, 0, sem="relaxed", scope="gpu")
    left = tl.atomic_add(ws_ptr + 1, 1, sem="acq_rel", scope="gpu")
    return amax, left == 2 * n - 1


@triton.jit
def _grid_reset(ws_ptr):
    """Zero the barrier workspace of `_grid_amax` (by its last program only)."""
    tl.atomic_xchg(ws_ptr, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ws_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr, stride_xm, data_ptr, scale_ptr, g_ptr, g_value, g_out_ptr, part_ptr, n_part,
    M, K, M_PAD, NUM_K_TILES,
    G_MODE: tl.constexpr, SWIZZLED: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, PART_BLOCK: tl.constexpr,
    FM: tl.constexpr, FNB: tl.constexpr, EVEN: tl.constexpr,
    USE_ASM: tl.constexpr, PAIRS: tl.constexpr,
):  # fmt: skip
    """One ``[BM, NB * 16]`` tile. G_MODE (`_G_PTR`...): where g comes from; in
    `_G_BARRIER` mode ``part_ptr`` is the int32 barrier workspace of `_grid_amax`."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m * BM
    col0 = pid_k * NB * 16
    xa, xb = _load_halves(x_ptr, stride_xm, row0, col0, M, K, BM, NB, EVEN)
    if PAIRS and (xa.dtype == tl.bfloat16):  # static: two bf16 elements an operation
        ua = _pair_words(xa, BM, NB, USE_ASM)
        ub = _pair_words(xb, BM, NB, USE_ASM)
        bmax = _pair_block_max(ua, ub, USE_ASM)
    else:
        ua = xa.to(tl.float32).to(tl.int32, bitcast=True)
        ub = xb.to(tl.float32).to(tl.int32, bitcast=True)
        bmax = tl.maximum(tl.max(ua & 0x7FFFFFFF, 2), tl.max(ub & 0x7FFFFFFF, 2))
    # bmax [BM, NB]: the blocks' max |x| as int32 bits (positive floats order like their
    # bits, every NaN/inf is above FLT_MAX's: one integer max gives the amax and whether
    # the block holds a non-finite value)
    reset = False
    if G_MODE == 0:
        g = tl.load(g_ptr)
    elif G_MODE == 1:
        g = g_value
    elif G_MODE == 2:
        pidx = tl.arange(0, PART_BLOCK)
        parts = tl.load(part_ptr + pidx, mask=pidx < n_part, other=0.0)
        g = _g_from_amax(tl.max(parts, 0))
    elif G_MODE == 3:  # small tensor: every program reduces all of it (one [FM, FNB*16] load)
        g = _g_from_amax(_finite_amax(_load_blocks(x_ptr, stride_xm, 0, 0, M, K, FM, FNB)))
    else:  # grid barrier: the finite block maxima of every program's own tile
        finite = tl.where(bmax > 0x7F7FFFFF, 0, bmax)
        amax, reset = _grid_amax(part_ptr, tl.max(tl.max(finite, 1), 0))
        g = _g_from_amax(amax.to(tl.float32, bitcast=True))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(g_out_ptr, g)
    sbyte, ok, d = _block_scale(bmax, g, USE_ASM)
    if PAIRS and (xa.dtype == tl.bfloat16):
        words = _codes_pairs(ua, ub, ok, d, USE_ASM)
    else:
        words = _codes_f32(ua, ub, ok, d, USE_ASM)
    _store_tile(
        words, sbyte, data_ptr, scale_ptr, row0, col0, M, K, NUM_K_TILES, SWIZZLED, BM, NB,
        EVEN,
    )  # fmt: skip
    if SWIZZLED:  # noqa: SIM102 (static constexpr branch around a runtime one)
        if pid_m == tl.num_programs(0) - 1:
            _zero_row_padding(scale_ptr, col0, M, M_PAD, NUM_K_TILES, NB)
    if G_MODE == 4:  # noqa: SIM102 (static constexpr branch around a runtime one)
        if reset:
            _grid_reset(part_ptr)


@triton.jit
def _partial_amax_kernel(
    x_ptr, stride_xm, part_ptr, M, K, BM: tl.constexpr, NB: tl.constexpr
):  # fmt: skip
    """Partial finite amax: program (pm, pk) reduces row tiles pm, pm + GM, ... of K tile
    pk into ``part_ptr[pm * GK + pk]``."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    gm = tl.num_programs(0)
    acc = tl.zeros([BM, NB, 16], tl.float32)
    for row0 in range(pm * BM, M, gm * BM):
        ax = tl.abs(_load_blocks(x_ptr, stride_xm, row0, pk * NB * 16, M, K, BM, NB))
        acc = tl.maximum(acc, tl.where(ax <= 3.4028234663852886e38, ax, 0.0))
    amax = tl.max(tl.max(tl.max(acc, 2), 1), 0)
    tl.store(part_ptr + pm * tl.num_programs(1) + pk, amax)


# ---- host side -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Grid and meta-parameters of one (shape, stride, dtype, layout, scale kind)."""

    grid: tuple[int, int]
    bm: int
    nb: int
    num_warps: int
    g_mode: int
    m_pad: int
    num_k_tiles: int
    scale_shape: tuple[int, int]
    amax_grid: tuple[int, int] | None
    part_block: int
    n_part: int
    launch: BoundLaunch
    amax_launch: BoundLaunch | None
    #: `_G_BARRIER`: the two-int32 barrier workspace of each device (`barrier_workspace`)
    workspaces: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def barrier_workspace(self, device: torch.device) -> torch.Tensor:
        """The zeroed ``[amax, count]`` int32 words `_grid_amax` synchronises through.

        Allocated once per device (the first call, outside any CUDA graph capture when
        the caller warms up first) and left zero by every launch, so calls and graph
        replays reuse it without a memset. Two launches of one plan must not run
        concurrently (on two streams): they would share the counter.
        """
        ws = self.workspaces.get(device)
        if ws is None:
            ws = self.workspaces[device] = torch.zeros(2, dtype=torch.int32, device=device)
        return ws


_plans: dict[tuple, _Plan] = {}
_quant_launch = CachedLauncher(_nvfp4_quantize_kernel)
_amax_launch = CachedLauncher(_partial_amax_kernel)
_sm_counts: dict[int, int] = {}
_capabilities: dict[int, tuple[int, int]] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(m: int, k: int, elems: int, max_bk: int) -> tuple[int, int]:
    """(BM, BK): BK a power of two >= 64 (whole groups of 4 scale columns, so the last K
    tile also writes the swizzled column padding), BM*BK <= elems where M allows."""
    bk = max(64, min(_next_pow2(k), elems, max_bk))
    bm = max(1, min(_next_pow2(m), elems // bk))
    return bm, bk


def _fused_tile(m: int, k: int) -> tuple[int, int] | None:
    """The one tile covering all of ``[m, k]`` when it is small enough that every program
    can reduce the whole tensor itself (one load, from L2 after the first program)."""
    bm, bk = _next_pow2(m), max(64, _next_pow2(k))
    return (bm, bk) if bm * bk <= min(_FUSED_ELEMS, 2 * _TILE_ELEMS) else None


def _asm_ok() -> bool:
    """Whether the PTX pieces run here: not under the interpreter, and a current device
    of compute capability 9.0+ (``max.u16x2`` needs sm_90, the e4m3 conversion sm_89);
    older GPUs take the integer twins (the same bits)."""
    if _INTERPRETING or not torch.cuda.is_available():
        return False
    dev = torch.cuda.current_device()
    cap = _capabilities.get(dev)
    if cap is None:
        cap = _capabilities[dev] = torch.cuda.get_device_capability(dev)
    return cap >= (9, 0)


def _triton_launches_cooperative() -> bool:
    """Whether this Triton has the ``launch_cooperative_grid`` launch option (its NVIDIA
    backend's options; the launcher then sets CU_LAUNCH_ATTRIBUTE_COOPERATIVE, which
    CUDA graphs keep on the kernel node)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _cooperative_ok(programs: int) -> bool:
    """Whether the dynamic scale may use the one-launch grid barrier for this grid.

    Under TRITON_INTERPRET=1 only a one-program grid (programs run one after another
    there: a second one would wait for ever), whatever `_COOPERATIVE` says. On a GPU
    (auto, ``_COOPERATIVE is None``) while the grid has at most one program per SM of
    the current device: co-resident whatever the occupancy, and the cooperative launch
    makes the driver check it (an error, never a hang). ``_COOPERATIVE = True`` drops
    the size rule (the driver still checks), False turns the path off.
    """
    if _COOPERATIVE is False:
        return False
    if _INTERPRETING:
        return programs == 1 and _COOPERATIVE is True
    if not _triton_launches_cooperative():
        return False
    if _COOPERATIVE is True:
        return True
    if not torch.cuda.is_available():
        return False
    dev = torch.cuda.current_device()
    sms = _sm_counts.get(dev)
    if sms is None:
        sms = _sm_counts[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return programs <= sms


def _tile_knobs(m: int, k: int) -> tuple[int, int, int | None]:
    """(elements a program, widest K tile, warps or None for the rule) for ``[m, k]``: the
    module knobs, or `_LARGE_TILE` from `_LARGE_ELEMS` elements on (unless the knobs were
    changed from their defaults, as the benchmark's variants do)."""
    if m * k >= _LARGE_ELEMS and (_TILE_ELEMS, _MAX_BK, _NUM_WARPS) == _DEFAULT_TILE:
        return _LARGE_TILE
    return _TILE_ELEMS, _MAX_BK, None


def _make_plan(m: int, k: int, swizzled: bool, kind: str) -> _Plan:
    kb = k // 16
    num_k_tiles = -(-kb // 4)
    m_pad = -(-m // 128) * 128 if swizzled else m
    scale_shape = (m_pad, num_k_tiles * 4) if swizzled else (m, kb)
    fused = _fused_tile(m, k) if kind == "dynamic" else None
    elems, max_bk, warps = _tile_knobs(m, k)
    bm, bk = _tile(m, k, elems, min(max_bk, elems))
    grid = (-(-m // bm), -(-k // bk))
    g_mode = {"tensor": _G_PTR, "value": _G_VALUE}.get(kind, _G_PARTIALS)
    amax_grid = None
    part_block = 1
    if kind == "dynamic":
        if fused:
            g_mode = _G_FUSED
        elif _cooperative_ok(grid[0] * grid[1]):
            g_mode = _G_BARRIER
        else:
            gk = grid[1]
            bm_amax = max(1, min(_next_pow2(m), _AMAX_ELEMS // bk))
            gm = max(1, min(-(-m // bm_amax), _MAX_PARTIALS // gk))
            amax_grid = (gm, gk)
            part_block = _next_pow2(gm * gk)
    fm, fk = fused or (1, 16)
    num_warps = _NUM_WARPS or warps or (8 if max(bm * bk, fm * fk // 2) >= 8192 else 4)
    meta = {"G_MODE": g_mode, "SWIZZLED": swizzled, "BM": bm, "NB": bk // 16,
            "PART_BLOCK": part_block, "FM": fm, "FNB": fk // 16,
            "EVEN": m % bm == 0 and k % bk == 0,
            "USE_ASM": _USE_ASM and _asm_ok(), "PAIRS": _PAIRS}  # fmt: skip
    if g_mode == _G_BARRIER:  # a launch option, passed with the constexprs to kernel[grid]
        meta["launch_cooperative_grid"] = True
    launch = _quant_launch.bind(meta, num_warps)
    amax_launch = None
    if amax_grid is not None:
        warps = 8 if bm_amax * bk >= 8192 else 4
        amax_launch = _amax_launch.bind({"BM": bm_amax, "NB": bk // 16}, warps)
    return _Plan(
        grid, bm, bk // 16, num_warps, g_mode, m_pad, num_k_tiles, scale_shape, amax_grid,
        part_block, amax_grid[0] * amax_grid[1] if amax_grid else 0, launch, amax_launch,
    )  # fmt: skip


def _check(x: torch.Tensor, g: object, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] % 16:
        raise ValueError(f"x: K must be a multiple of 16, got K={x.shape[1]}")
    if x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride along K, got strides {x.stride()}")
    if layout not in ("swizzled", "linear"):
        raise ValueError(f"layout: expected 'swizzled' or 'linear', got {layout!r}")
    if isinstance(g, torch.Tensor):
        if g.dtype != torch.float32 or g.numel() != 1:
            raise TypeError(
                f"global_scale: expected a one-element float32 tensor, "
                f"got dtype {g.dtype} with shape {tuple(g.shape)}"
            )
        if g.device != x.device:
            raise ValueError(f"global_scale: expected a tensor on {x.device}, got {g.device}")
    elif g is not None and (not isinstance(g, (int, float)) or isinstance(g, bool)):
        raise TypeError(f"global_scale: expected a tensor, a float or None, got {type(g)}")


def quantize_triton(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    layout: str = "swizzled",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x [M, K]`` in one fused kernel (two for a large dynamic scale).

    ``global_scale``: the decode multiplier as a one-element float32 tensor on x's
    device (read by the kernel, never on the host), a Python float (passed as a kernel
    argument), or None for ``amax(finite |x|) / (6 * 448)`` (1.0 when that is 0).
    Nothing is validated that would need a host sync (see `quantize_nvfp4`).
    Returns ``(data uint8 [M, K/2], scale float8_e4m3fn, g float32 0-dim)``; scale is
    ``[ceil128(M), ceil4(K/16)]`` swizzled or ``[M, K/16]`` linear.
    """
    _check(x, global_scale, layout)
    return quantize_checked(x, global_scale, layout)


def quantize_checked(
    x: torch.Tensor, global_scale: torch.Tensor | float | None, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_triton` minus its argument checks, for callers that made them already
    (`fp4_dispatch.format.nvfp4.quantize_fields`): a CUDA ``x`` with unit stride along K."""
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"x: quantize_triton needs M, K > 0, got shape {tuple(x.shape)}")
    index = x.device.index
    if index is not None and index != torch.cuda.current_device():
        with torch.cuda.device(index):  # Triton launches on the current device
            return _quantize(x, global_scale, layout)
    return _quantize(x, global_scale, layout)


def _quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float | None, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hot path: one plan look-up, the three outputs, one or two launches.

    The launch key (`BoundLaunch.launch_keyed`) is what can vary for a fixed plan: the
    input's dtype, alignment and row stride, and the alignment of a given scale tensor
    (the outputs are fresh caching-allocator blocks, always 16-byte aligned).
    """
    m, k = x.shape
    pkey, key, g_value = _launch_key(x, global_scale, layout)
    kind = pkey[3]
    plan = _plans.get(pkey)
    if plan is None:
        plan = _plans[pkey] = _make_plan(m, k, layout == "swizzled", kind)
    dev = x.device
    # three allocations: one block cut into five views costs about as much host time
    # (profiled, benchmarks/RESULTS.md "Eager launch" run 2) and shares one storage
    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty(plan.scale_shape, dtype=torch.float8_e4m3fn, device=dev)
    g_out = torch.empty((), dtype=torch.float32, device=dev)
    stride = x.stride(0)
    g_ptr, parts = x, x
    if kind == "tensor":
        g_ptr = global_scale  # one element: the kernel loads it through its data pointer
    elif kind == "dynamic" and plan.amax_grid is not None:
        parts = torch.empty((plan.n_part,), dtype=torch.float32, device=dev)
        plan.amax_launch.launch_keyed(key, plan.amax_grid, (x, stride, parts, m, k))
    elif plan.g_mode == _G_BARRIER:  # one launch: the barrier words take parts' place
        parts = plan.barrier_workspace(dev)
    args = (x, stride, data, scale, g_ptr, g_value, g_out, parts, plan.n_part, m, k,
            plan.m_pad, plan.num_k_tiles)  # fmt: skip
    if plan.amax_grid is None and _replays_on():
        per_call = (x, data, scale, g_out, g_ptr)
        if _replayed(pkey, key, g_value, dev, plan, args, per_call):
            return data, scale, g_out
    plan.launch.launch_keyed(key, plan.grid, args)
    return data, scale, g_out


#: replays of the quantize launch (`fp4_dispatch.backends.driver_launch`), by plan, launch
#: key, scalar scale and device; None: refused (the reason was logged once)
_replays: dict[tuple, object] = {}
#: replay keys launched once through Triton (the kernel is compiled): record on the next
_launched: set[tuple] = set()
_UNSEEN = object()


def _launch_key(
    x: torch.Tensor, g: torch.Tensor | float | None, layout: str = "swizzled"
) -> tuple[tuple, tuple, float]:
    """(plan key, launch key, scalar scale) of a call: what `_quantize` looks a plan and a
    replay up by (the kind of scale - dynamic, tensor or value - the input's dtype,
    16-byte alignment and row stride, a scale tensor's alignment)."""
    m, k = x.shape
    key: tuple = (x.dtype, x.data_ptr() % 16, x.stride(0))
    if g is None:
        return (m, k, layout, "dynamic"), key, 1.0
    if isinstance(g, torch.Tensor):
        return (m, k, layout, "tensor"), (*key, g.data_ptr() % 16), 1.0
    return (m, k, layout, "value"), key, float(g)


@dataclass(frozen=True)
class KeptQuantize:
    """The recorded replay of one swizzled quantize call, kept by a caller that checks the
    call's signature itself (`fp4_dispatch.integrations.nn`'s W4A4 fast call):
    ``kept(x)`` allocates the three outputs and replays the launch for ``x`` (same shape,
    dtype, row stride and 16-byte alignment as the recorded call; a given scale tensor
    stays the one it was recorded with). Returns ``(data, scale, g)`` as `quantize_checked`
    does, or None, launching nothing, while a Triton launch hook is set or replays are
    turned off (`_replays_on`, read per call as `_quantize` reads it)."""

    replay: object
    data_shape: tuple[int, int]
    scale_shape: tuple[int, int]
    #: the given global-scale tensor (patched like the input), or None: the input's
    #: address fills the unused pointer slot, as `_quantize` passes it
    scale_tensor: torch.Tensor | None
    device: torch.device
    #: `packed_layout` of the outputs (None: three allocations)
    packed: tuple[int, int, int] | None = None

    def __call__(
        self, x: torch.Tensor, g: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``g``: another float32 one-element scale tensor of the recorded alignment to
        read instead of the kept one (ignored for a dynamic scale)."""
        if not _replays_on():
            return None
        data, scale, g_out = self.outputs()
        if self.scale_tensor is None:
            g = x
        elif g is None:
            g = self.scale_tensor
        if self.replay((x, data, scale, g_out, g)):
            return data, scale, g_out
        return None

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New (data, scale, global scale) tensors for one call: three allocations through
        Inductor's allocator where it serves (`fp4_dispatch.support.alloc`: ~1 µs each);
        else, up to `PACKED_MAX_BYTES` in all, views of one ``torch.empty``
        (`packed_layout`), and three above that.

        Why: one CUDA ``torch.empty`` cost ~5.7 µs on an H100 host, the three outputs of a
        one-row quantize 17.0 of its 22.6 µs (benchmarks/RESULTS.md, "Eager launch" run
        6); five views cost ~5 µs more (run 13), so three direct allocations beat one
        ``torch.empty`` and its views. Packed views share a storage, so one output kept
        alone keeps all three alive: bounded by `PACKED_MAX_BYTES`."""
        dev = self.device
        new = direct_allocator(dev)
        if new is not None:
            return (new(self.data_shape, (self.data_shape[1], 1), torch.uint8),
                    new(self.scale_shape, (self.scale_shape[1], 1), torch.float8_e4m3fn),
                    new((), (), torch.float32))  # fmt: skip
        layout = self.packed
        if layout is None:
            return (torch.empty(self.data_shape, dtype=torch.uint8, device=dev),
                    torch.empty(self.scale_shape, dtype=torch.float8_e4m3fn, device=dev),
                    torch.empty((), dtype=torch.float32, device=dev))  # fmt: skip
        words, scale_at, data_at = layout
        buf = torch.empty(words, dtype=torch.float32, device=dev)
        u8 = buf.view(torch.uint8)
        scale = u8.as_strided(self.scale_shape, (self.scale_shape[1], 1), scale_at)
        data = u8.as_strided(self.data_shape, (self.data_shape[1], 1), data_at)
        return data, scale.view(torch.float8_e4m3fn), buf.as_strided((), (), 0)


#: the most bytes a kept quantize call's three outputs share one allocation for
#: (`KeptQuantize.outputs`): a decode call's (the swizzled scales pad to 128 rows, so
#: one row of K = 14336 already takes 112 KiB of scales; 16 rows of K = 28672, ~1 MiB
#: in all); a prefill's get their own
PACKED_MAX_BYTES = 1 << 20


def packed_layout(data_shape: tuple[int, int], scale_shape: tuple[int, int]
                  ) -> tuple[int, int, int] | None:  # fmt: skip
    """(float32 words, scale's byte offset, data's byte offset) of one buffer holding the
    global scale (bytes 0-3), the scales and the data, each at a 16-byte aligned offset
    (what the kernels and the replays' keys assume), or None above `PACKED_MAX_BYTES`."""
    scale_at = 16
    data_at = scale_at + -(-scale_shape[0] * scale_shape[1] // 16) * 16
    end = data_at + data_shape[0] * data_shape[1]
    if end > PACKED_MAX_BYTES:
        return None
    return -(-end // 16) * 4, scale_at, data_at


def kept_quantize(x: torch.Tensor, global_scale: torch.Tensor | None) -> KeptQuantize | None:
    """The replay a swizzled `quantize_checked` call with these arguments would run, once
    one is recorded (the third call of its kind), as a `KeptQuantize`; None where there
    is none: not recorded yet, refused (logged), a two-launch plan (large dynamic
    scale), replays turned off, or a Python-float scale (baked into the recording)."""
    if global_scale is not None and not isinstance(global_scale, torch.Tensor):
        return None
    pkey, key, g_value = _launch_key(x, global_scale)
    plan = _plans.get(pkey)
    if plan is None or plan.amax_grid is not None or not _replays_on():
        return None
    replay = _replays.get((pkey, key, g_value, x.device.index))
    if not callable(replay):
        return None
    data_shape = (x.shape[0], x.shape[1] // 2)
    scale_shape = tuple(plan.scale_shape)
    return KeptQuantize(replay, data_shape, scale_shape, global_scale, x.device,  # type: ignore[arg-type]
                        packed_layout(data_shape, scale_shape))  # type: ignore[arg-type]  # fmt: skip


def _replays_on() -> bool:
    """Whether the quantize launch may replay (``FP4_DISPATCH_REPLAY``, on unless ``0``)."""
    return os.environ.get("FP4_DISPATCH_REPLAY", "1") != "0"


def _replayed(pkey: tuple, key: tuple, g_value: float, dev: torch.device, plan: _Plan,
              args: tuple, per_call: tuple) -> bool:  # fmt: skip
    """Run the quantize launch as a driver-API replay when one exists (True), or record
    one from this call's ordinary launch on the second call of its kind (the first
    compiles): False means the caller launches through Triton."""
    rkey = (pkey, key, g_value, dev.index)
    replay = _replays.get(rkey, _UNSEEN)
    if replay is None:
        return False
    if replay is not _UNSEEN:
        return replay(per_call)
    if rkey not in _launched:
        _launched.add(rkey)
        return False
    from .driver_launch import record_launches  # noqa: PLC0415 (cuda-python, on first use)

    with record_launches("quantize_nvfp4", per_call, ()) as rec:
        plan.launch.launch_keyed(key, plan.grid, args)
    _replays[rkey] = rec.replay
    return True
