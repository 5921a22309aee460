"""Hopper (sm90) W4A8 GEMM with the weights in registers: NVFP4 bytes become E4M3 in the
warps that multiply them, through a byte table per scale block, on FP8 ``wgmma``.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T (+ bias)`` with both operands rounded
to E4M3 as `fp4_dispatch.backends.reference.w4a8` defines (lossy: ``precision="fp8"``
only; per-token activation scales, per-channel weight scales, powers of two).

Why another W4A8 kernel. The fused kernel of `gemm_w4a8` (plain Triton) stayed at
0.26-0.74x bf16: per weight element it spends 8-10 SASS instructions on the conversion,
and its K step holds three CTA barriers, two proxy fences and a round trip of the scales
through shared memory (NOTES.md, "W4A8"). This one is the W4A16 rs kernel's structure
(`gemm_w4a16_rs`: a TMA ring filled by its own warp, two consumer warpgroups of 64
weight rows, the weights as the register operand of ``wgmma``, no CTA barrier in the
loop) with a cheaper conversion:

- **A byte table per scale block.** Within one 16-element block the E4M3 code of
  ``e2m1 * s / sw`` depends only on the nibble: its 8 magnitudes ``{0, .5, 1, 1.5, 2, 3,
  4, 6} * s / sw``, rounded once to nearest even (``cvt.rn.satfinite.e4m3x2.f32``), make
  an 8-byte table in two registers (`_TABLE_ASM`, ~12 instructions a block). Then one
  ``prmt`` looks up four nibbles' magnitudes at once, and a second ``prmt`` of the same
  word gathers their sign bits (`_EXPAND_ASM`: 9 instructions for 8 values). Every value
  is the reference's: the table holds exactly the roundings the reference makes.
- **A K order that makes the lookup free of shuffles.** Thread ``(g, c)`` of a warp
  reads bytes ``16c..16c+15`` of its rows (as the W4A16 rs kernel); a 32-bit word of
  them gives two registers of four E4M3 codes, which ``wgmma``'s 8-bit register operand
  takes as they are, if the activations are stored in the matching order (`rs_order`;
  the activation pass writes them so, at no cost: `gemm_w4a8.quantize_rows`).
- **Accumulation promoted every K step.** Each step's two ``wgmma`` (K = 64 each) start
  from zero and the step's sum is added to the fp32 accumulator, so no more than 128
  products are summed in the FP8 MMA's own precision (the DeepSeek-V3 report's
  interval; docs/PRECISION.md, "Accumulation"). It costs a second accumulator: tiles of
  up to 128 tokens.

One pass before the GEMM (`_rs_pass_kernel`, plain Triton, runs under the interpreter):
its first M programs quantize a token row each (per-token scale, E4M3 codes in the rs
order), the rest compute the weight rows' channel scales (``K/16`` scale bytes a row).
The weight stays NVFP4 in memory: the channel scales are recomputed every call. The GEMM
launches with PDL (`fp4_dispatch.backends.pdl`): its TMA warp loads the ring's first
weight steps while the pass runs; the consumers wait for the pass before they read its
scales.

Shapes: any M, N >= 1; ``K % 128 == 0``; ``x`` with unit stride along K. Gluon has no
interpreter: CI compiles the GEMM for sm_90 and runs both PTX blocks on the CPU's PTX
model against the format (tests/test_inline_ptx.py); the GEMM's numerics run on an sm90
GPU (``-m gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4_dispatch.backends import pdl
from fp4_dispatch.backends.sm90.epilogue_gluon import split_steps, store_tile, tile_origin
from fp4_dispatch.backends.sm90.gemm_w4a8 import (
    _HW_CVT,
    QUANT_BLOCK_K,
    QUANT_WARPS,
    _channel_exponent,
    _pow2,
    quantize_rows,
)
from fp4_dispatch.backends.sm90.gemm_w4a16_rs import (
    _W_LAYOUT,
    WG_BLOCKS,
    WG_BYTES,
    _producer,
    _scales,
    check_ring_knobs,
    ring_buffers,
)
from fp4_dispatch.backends.sm90.gemm_w4a16_ws import _descriptor, scale_descriptor
from fp4_dispatch.backends.sm90.swizzle import scale_row_offset
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher
from fp4_dispatch.backends.workspace import Scratch
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.support.alloc import empty

STEP_K = 128
BLOCK_N = 128  # weight rows per CTA: two warpgroups of 64
BLOCK_M_CHOICES = (64, 128)
#: registers a thread by tokens a tile: (at launch, the consumer warpgroups', the TMA
#: warp's), as `gemm_w4a16_rs.SM_REGISTERS` (one CTA an SM). 128 tokens hold two
#: 64-register accumulators (the promoted sum and the step's): consumers at 240, the TMA
#: warp at 24 (at `gemm_w4a16_rs`'s 152 the main loop spilled, 34 spill instructions)
SM_REGISTERS_W4A8 = {64: (152, 152, 56), 128: (168, 240, 24)}
#: weight rows per program of the pass's channel-scale part, and scale blocks a step
CHANNEL_ROWS = 16
CHANNEL_GROUPS = 64

#: per scale block: ``$2`` = ``s / sw`` (fp32) -> ``$0``, ``$1``: the E4M3 codes of
#: ``{0, .5, 1, 1.5}`` and ``{2, 3, 4, 6}`` times it, a byte each, low byte first. The
#: products are exact in fp32 (at most 5 significant bits); each ``cvt`` rounds two of
#: them once (its first operand to the high byte).
_TABLE_ASM = gl.constexpr("""{
.reg .f32 z, h, a3, b2, b3, b4, b6;
.reg .b16 p0, p1, p2, p3;
mov.f32 z, 0f00000000;
mul.f32 h, $2, 0f3F000000;
mul.f32 a3, $2, 0f3FC00000;
add.f32 b2, $2, $2;
mul.f32 b3, $2, 0f40400000;
mul.f32 b4, $2, 0f40800000;
mul.f32 b6, $2, 0f40C00000;
cvt.rn.satfinite.e4m3x2.f32 p0, h, z;
cvt.rn.satfinite.e4m3x2.f32 p1, a3, $2;
cvt.rn.satfinite.e4m3x2.f32 p2, b3, b2;
cvt.rn.satfinite.e4m3x2.f32 p3, b6, b4;
mov.b32 $0, {p0, p1};
mov.b32 $1, {p2, p3};
}""")

#: one word of weight bytes ``$2`` (nibbles n0..n7, low first) and its block's table
#: (``$3`` bytes 0-3, ``$7`` bytes 4-7; the other operands repeat them) -> ``$0`` the E4M3
#: codes of n0..n3, ``$1`` of n4..n7, a byte each. The magnitude: ``prmt`` with the
#: nibbles' low three bits as byte selectors. The sign (each nibble's bit 3): a ``prmt``
#: in sign-replicate mode (selector bit 3) of ``w << 4`` (whose bytes' top bits are the
#: signs of n0, n2, n4, n6) and ``w`` (n1, n3, n5, n7): 0xFF or 0x00 a byte, masked to
#: bit 7. CPU CI runs both blocks on the PTX model (tests/test_inline_ptx.py).
_EXPAND_ASM = gl.constexpr("""{
.reg .b32 v, u, s4, m0, m1, g0, g1;
and.b32 v, $2, 0x77777777;
shr.b32 u, v, 16;
prmt.b32 m0, $3, $7, v;
prmt.b32 m1, $3, $7, u;
shl.b32 s4, $2, 4;
prmt.b32 g0, s4, $2, 0xD9C8;
prmt.b32 g1, s4, $2, 0xFBEA;
and.b32 g0, g0, 0x80808080;
and.b32 g1, g1, 0x80808080;
or.b32 $0, m0, g0;
or.b32 $1, m1, g1;
}""")


def rs_order(k: int) -> torch.Tensor:
    """Natural column of each position of the rs K order (``out[:, p] = x[:, rs_order(K)[p]]``),
    ``k % 128 == 0``. Why this order: position ``p = 64 g + 32 w + 16 h + 4 c + t`` of a
    128-wide step is the K index ``wgmma``'s 8-bit register operand gives thread ``c`` of
    a quad (``t`` its byte in a register, ``h`` the register, ``w`` and ``g`` the MMA and
    the half of the step); `_EXPAND_ASM` turns the thread's word ``2g + w`` of bytes
    ``16c..16c+15`` into registers ``h = 0, 1``: nibbles ``4h + t``, natural index ``32 c
    + 16 g + 8 w + 4 h + t``."""
    p = torch.arange(128)
    g, w, h, c, t = p >> 6, (p >> 5) & 1, (p >> 4) & 1, (p >> 2) & 3, p & 3
    nat = 32 * c + 16 * g + 8 * w + 4 * h + t
    return (torch.arange(0, k, 128)[:, None] + nat[None, :]).reshape(-1)


# ---- the pass ---------------------------------------------------------------------------


@triton.jit
def _rs_pass_kernel(x_ptr, q_ptr, sa_ptr, bs_ptr, sw_ptr, M, N, K, stride_xm, b_sblk,
                    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, KG: tl.constexpr,
                    HW_CVT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Programs ``0..M-1``: token row ``pid`` quantized (`gemm_w4a8.quantize_rows`, codes
    in the rs order). Programs from ``M``: ``ROWS`` weight rows' channel scales ``2**ew``
    (float32 ``sw`` [N], `gemm_w4a8._channel_exponent`). With ``PDL`` every program first
    lets the GEMM launch (`fp4_dispatch.backends.pdl`)."""
    if PDL:
        pdl.gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < M:
        tok = pid + tl.arange(0, 1)
        quantize_rows(x_ptr, q_ptr, sa_ptr, tok, M, K, stride_xm, BLOCK_K, HW_CVT, True)
    else:
        wrow = (pid - M) * ROWS + tl.arange(0, ROWS)
        ew = _channel_exponent(bs_ptr, scale_row_offset(wrow, b_sblk), wrow < N, K, ROWS, KG)
        tl.store(sw_ptr + wrow, _pow2(ew), mask=wrow < N)


_PASS_META = dict(BLOCK_K=QUANT_BLOCK_K, ROWS=CHANNEL_ROWS, KG=CHANNEL_GROUPS, HW_CVT=_HW_CVT,
                  PDL=pdl.ENABLED)  # fmt: skip
_PASS_BOUND = CachedLauncher(_rs_pass_kernel).bind(_PASS_META, QUANT_WARPS)


def pass_grid(m: int, n: int) -> tuple[int]:
    """The pass's grid: one program a token row, one per `CHANNEL_ROWS` weight rows."""
    return (m + triton.cdiv(n, CHANNEL_ROWS),)


def quantize_pass(
    a: torch.Tensor, b_scale: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 codes [M, K] in the rs order, token scales [M], channel scales [N]; float32
    powers of two) of activations ``a`` and the weight's swizzled scales: one launch."""
    m, k = a.shape
    q = empty((m, k), (k, 1), torch.float8_e4m3fn, a.device)  # `support.alloc`: eager cost
    sa = empty((m,), (1,), torch.float32, a.device)
    sw = empty((n,), (1,), torch.float32, a.device)
    sb = b_scale.view(torch.uint8)
    _PASS_BOUND(pass_grid(m, n), (a, q, sa, sb, sw, m, n, k, a.stride(0), sb.shape[1] * 128))
    return q, sa, sw


# ---- the GEMM ---------------------------------------------------------------------------


@gluon.jit
def _expand_e4m3(w, f, L4: gl.constexpr, A_L: gl.constexpr):
    """Weight bytes ``w`` [4, 16, 64] (a warpgroup's rows) and ``s / sw`` per block ``f``
    [4, 16, 8] -> the step's two A operands [64, 64] float8e4nv (K halves ``g = 0, 1`` of
    the rs order, module docstring)."""
    tlo, thi = gl.inline_asm_elementwise(
        _TABLE_ASM, "=r,=r,r", [f], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1
    )
    w4 = gl.convert_layout(w.reshape([4, 16, 8, 8]), L4, assert_trivial=True)
    tlo, w4 = gl.broadcast(gl.expand_dims(tlo, 3), w4)
    thi, w4 = gl.broadcast(gl.expand_dims(thi, 3), w4)
    o0, o1 = gl.inline_asm_elementwise(
        _EXPAND_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [w4, tlo, thi], dtype=(gl.uint8, gl.uint8),
        is_pure=True, pack=4,
    )  # fmt: skip
    # dims: warp, row, c (thread in quad), g (group of 8 bytes), w (word), t (byte), h
    a = gl.join(o0, o1).reshape([4, 16, 4, 2, 2, 4, 2])
    a = a.permute((0, 1, 3, 4, 6, 2, 5)).reshape([64, 2, 64]).permute((0, 2, 1))
    a0, a1 = gl.split(a)
    a0 = gl.convert_layout(a0.to(gl.float8e4nv, bitcast=True), A_L)
    a1 = gl.convert_layout(a1.to(gl.float8e4nv, bitcast=True), A_L)
    return a0, a1


@gluon.jit
def _consumer(p, WG: gl.constexpr, SPLIT_K: gl.constexpr, PDL: gl.constexpr):
    """Warpgroup ``WG``: rows ``64 WG .. 64 WG + 63`` of the CTA's weights, every step:
    tables and expansion (registers) -> two FP8 ``wgmma`` from zero -> added to the fp32
    accumulator -> release the slot; then the scales and its own epilogue."""
    (w_bufs, s_bufs, x_bufs, ready, empty, n_steps, n0, m0, sw_ptr, sa_ptr, alpha_ptr, bias_ptr,
     has_bias, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, stride_on, pid, pid_k) = p  # fmt: skip
    STAGES: gl.constexpr = w_bufs.shape[0]
    BT: gl.constexpr = x_bufs.shape[1]
    L4: gl.constexpr = WG_BLOCKS
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4)
    RL: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))
    if PDL:  # the channel and token scales are the pass's: wait for it
        pdl.gdc_wait()
    warp = gl.arange(0, 4, layout=gl.SliceLayout(1, RL))
    rows = n0 + 64 * WG + 16 * gl.expand_dims(warp, 1)
    rows = rows + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, RL)), 0)
    inv_c = 1.0 / gl.load(sw_ptr + rows, mask=rows < N, other=1.0)  # powers of two: exact
    inv_c = gl.expand_dims(inv_c, 2)
    acc = gl.zeros([64, BT], gl.float32, ACC)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        w = w_bufs.index(slot).reshape([8, 16, 64]).slice(4 * WG, 4).load(WG_BYTES)
        sc = _scales(s_bufs.index(slot), 8).slice(4 * WG, 4).load(gl.SliceLayout(3, L4))
        f = sc.to(gl.float8e4nv, bitcast=True).to(gl.float32) * inv_c
        a0, a1 = _expand_e4m3(w, f, L4, A_L)
        step = warpgroup_mma(a0, x_bufs.index(2 * slot).permute((1, 0)), acc, use_acc=False,
                             is_async=True)  # fmt: skip
        step = warpgroup_mma(a1, x_bufs.index(2 * slot + 1).permute((1, 0)), step,
                             is_async=True)  # fmt: skip
        step = warpgroup_mma_wait(0, deps=(step,))
        mbarrier.arrive(empty.index(slot), count=1)
        acc += step
    r = n0 + 64 * WG + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    c = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
    sw = gl.load(sw_ptr + r, mask=r < N, other=0.0) * 6.103515625e-05  # 2**-14: store_tile's
    sa = gl.load(sa_ptr + c, mask=c < M, other=0.0)
    acc = acc * gl.expand_dims(sw, 1) * gl.expand_dims(sa, 0)  # powers of two: exact
    store_tile(acc, n0 + 64 * WG, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr,
               M, N, stride_om, stride_on, 2 * pid + WG, pid_k, SPLIT_K)  # fmt: skip
    return ()


@gluon.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a8_rs_kernel(x_desc, w_desc, s_desc, sw_ptr, sa_ptr, alpha_ptr, bias_ptr, out_ptr, ws_ptr,
                    cnt_ptr, M, N, K, stride_om, stride_on, has_bias, s_chunks,
                    SPLIT_K: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr,
                    TMA_REGS: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid, pid_k, pid_n, n0, m0 = tile_origin(N, BN, BT)
    kt0, n_steps = split_steps(K // 128, pid_k, SPLIT_K)
    w_bufs, s_bufs, x_bufs, ready, empty = ring_buffers(x_desc, w_desc, s_desc, STAGES)
    cons = (w_bufs, s_bufs, x_bufs, ready, empty, n_steps, n0, m0, sw_ptr, sa_ptr, alpha_ptr,
            bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, stride_on, pid,
            pid_k)  # fmt: skip
    prod = (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0,
            pid_n * s_chunks * 2, m0, kt0, n_steps)  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (cons, 0, SPLIT_K, PDL)), (_consumer, (cons, 1, SPLIT_K, PDL)),
         (_producer, (prod, PDL))],
        [4, 1],
        [REGS, TMA_REGS],
    )  # fmt: skip


# ---- host side --------------------------------------------------------------------------


def why_unsupported(operands: DenseOperands) -> str | None:
    """Why this kernel cannot run ``operands`` (None if it can)."""
    a = operands.a
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"a: expected bfloat16, float16 or float32 activations, got {a.dtype}"
    if a.shape[1] % STEP_K:
        return f"a: expected K % {STEP_K} == 0, got K={a.shape[1]}"
    if a.shape[1] > 1 and a.stride(1) != 1:
        return f"a: expected unit stride along K, got strides {tuple(a.stride())}"
    return None


@dataclass(frozen=True)
class W4A8RsConfig:
    """Compile-time knobs: ``block_m`` tokens per CTA (the MMA's N), ``split_k`` CTAs per
    output tile along K, ``stages`` TMA ring slots."""

    block_m: int = 128
    split_k: int = 1
    stages: int = 3

    def __post_init__(self) -> None:
        check_ring_knobs(self, BLOCK_M_CHOICES)


def _x_layout(block_m: int) -> object:
    """The E4M3 activation box's shared layout (64 bytes a row: the 64-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.float8e4nv)


@dataclass
class W4A8RsKernel:
    """``kernel(operands, out)``: the pass (`quantize_pass`), then the GEMM. Its split-K
    workspace is made on the first call that needs it (outside CUDA-graph capture); the
    pass's outputs come from the caching allocator each call (from the graph's pool
    under capture)."""

    cfg: W4A8RsConfig
    bias_epilogue: ClassVar[bool] = True
    _scratch: Scratch = field(default_factory=Scratch, repr=False)
    _bound: BoundLaunch | None = field(default=None, repr=False)
    compiled: object = field(default=None, repr=False)

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """(output tiles, splits)."""
        return -(-m // self.cfg.block_m) * -(-n // BLOCK_N), self.cfg.split_k

    def __call__(self, operands: DenseOperands, out: torch.Tensor) -> None:
        why = why_unsupported(operands)
        if why is not None:
            raise ValueError(why)
        n = operands.b_data.shape[0]
        q, sa, sw = quantize_pass(operands.a, operands.b_scale, n)
        self.launch(q, sa, sw, operands, out)

    def launch(self, q: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor,
               operands: DenseOperands, out: torch.Tensor) -> None:  # fmt: skip
        """The GEMM on the pass's outputs."""
        m, k = q.shape
        b, s = operands.b_data, operands.b_scale.view(torch.uint8)
        n = b.shape[0]
        grid = self.grid(m, n)
        if self.cfg.split_k > 1:
            ws, cnt = self._scratch.get(out.device, grid[0] * self.cfg.split_k * BLOCK_N
                                        * self.cfg.block_m, 2 * grid[0])  # fmt: skip
        else:
            ws = cnt = out
        bias = out if operands.bias is None else operands.bias
        so0, so1 = out.stride()
        args = (*self._descriptors(q, b, s), sw, sa, operands.alpha, bias, out, ws, cnt, m, n,
                k, so0, so1, int(operands.bias is not None), s.shape[1] // 4)  # fmt: skip
        bound = self._binding()
        bound(grid, args)
        self.compiled = bound.last_compiled

    def _binding(self) -> BoundLaunch:
        if self._bound is None:
            launch, consumer, tma = SM_REGISTERS_W4A8[self.cfg.block_m]
            options = pdl.launch_options(True)
            meta = {"SPLIT_K": self.cfg.split_k, "STAGES": self.cfg.stages, "REGS": consumer,
                    "TMA_REGS": tma, "PDL": bool(options)}  # fmt: skip
            self._bound = _LAUNCH.bind(meta, 4, maxnreg=launch, **options)
        return self._bound

    def _descriptors(self, q: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple:
        """TMA descriptors of the E4M3 activations, the weight bytes and scale chunks."""
        (m, k), n, bm = q.shape, b.shape[0], self.cfg.block_m
        x_desc = _descriptor(q, [m, k], [k, 1], [bm, 64], _x_layout(bm))
        w_desc = _descriptor(b, [n, k // 2], [k // 2, 1], [BLOCK_N, 64], _W_LAYOUT)
        return x_desc, w_desc, scale_descriptor(s, 2)

    def precompile(self, m: int, n: int, k: int, dtype: torch.dtype) -> object:
        """Compile the pass and the GEMM a call with contiguous ``dtype`` activations and
        output runs, launching nothing; returns the GEMM's compiled kernel."""
        from fp4_dispatch.format.nvfp4 import swizzled_scale_shape  # noqa: PLC0415

        meta = torch.device("meta")
        f8, f32, u8 = torch.float8_e4m3fn, torch.float32, torch.uint8
        q = torch.empty((m, k), dtype=f8, device=meta)
        b = torch.empty((n, k // 2), dtype=u8, device=meta)
        s = torch.empty(swizzled_scale_shape(n, k), dtype=u8, device=meta)
        sblk = s.shape[1] * 128
        _PASS_BOUND.warmup(pass_grid(m, n), (dtype, f8, f32, u8, f32, m, n, k, k, sblk))
        ws, cnt = (f32, torch.int32) if self.cfg.split_k > 1 else (dtype, dtype)
        args = (*self._descriptors(q, b, s), f32, f32, f32, dtype, dtype, ws, cnt, m, n, k, n,
                1, 0, s.shape[1] // 4)  # fmt: skip
        return self._binding().warmup(self.grid(m, n), args)


_LAUNCH = CachedLauncher(_w4a8_rs_kernel)


def build(cfg: W4A8RsConfig) -> W4A8RsKernel:
    """A kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A8RsKernel(cfg)
