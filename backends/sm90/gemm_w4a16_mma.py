"""Hopper (sm90) W4A16 decode GEMM without shared memory or barriers (Gluon, ``mma.sync``).

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T`` with the operands of `gemm_w4a16`
(bf16 or fp16 activations, NVFP4 weight bytes in natural order, 128x4-swizzled e4m3
scales, ``alpha`` a one-element float32 tensor).

Why a third direct kernel. At 1-16 tokens `gemm_w4a16._w4a16_kernel` moves every K step
through a shared-memory pipeline with two CTA-wide barriers and permutes the activation
tile in registers, and its warps issued on about half the cycles (RESULTS.md "Hopper
W4A16" run 4, Nsight Compute). Here nothing is shared:

- each warp owns 16 weight rows and 8 (or 16) tokens, and a range of 128-wide K steps
  (``KW`` groups of warps a CTA split the CTA's K range; their partial sums meet once, at
  the end, through Triton's reduction); the ``RW`` warps of a group share its K range
  and take ``RW`` different 16-row slices (the CTA covers ``16 RW`` rows), so they load
  the same activations (L1 hits after the first) - nothing else is shared;
- a step loads the warp's weight bytes straight into registers (thread ``(g, c)`` of
  the warp: 16 bytes, natural K ``32c .. 32c + 31`` of rows ``g`` and ``g + 8``; one
  128-bit load each), its scales (two adjacent bytes of the swizzle) and its
  activations (token ``lane // 4``, the same 32 K: four 128-bit loads, L1/L2 hits);
- the bytes are expanded by the packed PTX dequantizer of `gemm_w4a16` (``e2m1 * scale *
  2**-14``, exact) and multiplied with ``mma.sync.m16n8k16`` (`mma_v2`), both operands
  in registers. The dot runs in a permuted K order that the thread's own registers
  define (`_step`): position ``kd = (i1, i0, t, h, c, e)`` holds nibble ``h`` of byte
  ``16c + 8 i1 + 4 i0 + 2t + e``, the activations are viewed in the same order, and the
  layouts meet without data movement (the conversions are register renamings; the only
  cost is one PRMT a register pair on the activations);
- the latency is hidden by warps, not stages: 48 registers a thread (the 4-warp CTA,
  one step at a time) let an SM hold 40 warps. ``UNROLL`` 2 issues two steps' loads
  before expanding either (one latency for two steps: the small shapes, where a warp
  has few steps); ``PREFETCH`` n issues ``prefetch.global.L2`` for the weight bytes n
  steps ahead (no registers held).

A step is 235 SASS instructions for 16 x 128 weight values a warp (3.7 a value, 2.5 of
them the dequantizer; the wgmma kernel's loop: 4.2), none of them a shared-memory access
or a barrier (tests/test_gemm_w4a16_mma.py checks the cubin).

Epilogue: ``alpha * 2**14``, bias in fp32, one rounding, a masked store through
``out``'s strides; split-K (``SPLIT_K`` CTAs a tile) through the deterministic workspace
protocol of `splitk` (partials, a counter, the last split sums in order).

Shapes: any M (token tiles of ``BM``), N >= 1 (rows wrap modulo N: in-bounds loads,
never stored), ``K % 32 == 0`` (a thread's 32 K are all in range or all out; masks past
K unless ``EVEN``: whole steps for every warp). ``x`` needs unit stride along K.
`W4A4MmaKernel` runs W4A4 through it: the NVFP4 activations expanded first (`expand_rows`),
the GEMM launched with PDL (``PDL``: `PDL_STEPS` weight steps prefetched to L2, then the
wait for the expansion).
Prepared (sm90-prepared) weight bytes alone run the direct kernel (`_direct_fallback`);
a prepared copy beside the natural bytes is ignored. Gluon has no interpreter: CI
compiles this kernel for sm_90, the numerics are checked on the H200.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fp4_dispatch.backends import pdl
from fp4_dispatch.backends.sm90 import expand_rows, gemm_w4a16
from fp4_dispatch.backends.sm90.epilogue_gluon import store_tile, tile_origin
from fp4_dispatch.backends.sm90.gemm_w4a16 import (
    _BF16_NATURAL,
    _F16_NATURAL,
    DenseKernel,
    W4A16Operands,
    launch_dense,
)
from fp4_dispatch.backends.triton_launch import CachedLauncher
from fp4_dispatch.backends.workspace import Scratch, one_like
from fp4_dispatch.contracts.backend import GemmOperands

STEP_K = gl.constexpr(128)
#: K steps of each warp's weight bytes prefetched to L2 before a PDL-launched kernel
#: waits for the kernel before it (`fp4_dispatch.backends.pdl`): 4 steps are a quarter
#: of the weights at 1x8192² (8 MiB, ~1.7 µs of HBM time: about what the activations'
#: expansion takes)
PDL_STEPS = gl.constexpr(4)

_BF16_ASM = gl.constexpr(_BF16_NATURAL)
_F16_ASM = gl.constexpr(_F16_NATURAL)


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, kk, wk, sk, xk, x_row, k_half, K, live,
               EVEN: gl.constexpr, GUARD: gl.constexpr):  # fmt: skip
    """Weight bytes, scale bytes and activations of one K step (``kk`` K past the
    warps' first step), masked past K unless ``EVEN``; with ``GUARD`` also unless
    ``live`` (a scalar: the second step of an unrolled pair past the warp's range)."""
    if EVEN and not GUARD:
        w = gl.load(w_ptrs + kk // 2)
        s = gl.load(s_ptrs + (kk // 64) * 512)
        xv = gl.load(x_ptrs + kk, mask=x_row, other=0.0)
    elif EVEN:
        w = gl.load(w_ptrs + kk // 2, mask=live, other=0)
        s = gl.load(s_ptrs + (kk // 64) * 512, mask=live, other=0)
        xv = gl.load(x_ptrs + kk, mask=x_row & live, other=0.0)
    else:
        w = gl.load(w_ptrs + kk // 2, mask=(wk + kk // 2 < k_half) & live, other=0)
        s = gl.load(s_ptrs + (kk // 64) * 512, mask=(sk + kk < K) & live, other=0)
        xv = gl.load(x_ptrs + kk, mask=x_row & (xk + kk < K) & live, other=0.0)
    return w, s, xv


@gluon.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of each address where ``mask`` (no registers held: the
    demand load of a later step then hits L2)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _warp_rows(n0, warp, r, N, BN: gl.constexpr, RW: gl.constexpr):
    """[NW, BN] weight rows of each warp (``warp``: its index, ``r``: 0..BN-1, slices of
    one layout): group ``warp % RW`` of the CTA's ``RW`` groups of ``BN``; wrapped modulo
    N (in-bounds loads of rows that are never stored)."""
    return (n0 + gl.expand_dims((warp % RW) * BN, 1) + gl.expand_dims(r, 0)) % N


@gluon.jit
def expand_dot_order(w, s, dtype: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr,
                     L4: gl.constexpr):  # fmt: skip
    """Weight bytes ``w`` [KW, BN, 64] (thread ``(g, c)`` of a warp: bytes 16c..16c+15 of
    rows g, g + 8) and their scale bytes ``s`` [KW, BN, 8] -> [KW, BN, 128] values of
    ``dtype`` (``e2m1 * scale * 2**-14``) in the dot's K order: position ``kd = (i1, i0, t,
    h, c, e)`` holds nibble h of byte ``16c + 8 i1 + 4 i0 + 2t + e`` (`dot_order` says
    where each natural K lands). Also the A operand of `gemm_w4a16_rs`."""
    if dtype == gl.bfloat16:
        sv = (s.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 5.192296858534828e33).to(
            gl.bfloat16
        )  # 2**112: the bf16 dequantizer's e2m1 * 2**-126 becomes e2m1 * scale * 2**-14
        asm: gl.constexpr = _BF16_ASM
    else:
        sv = s.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        asm: gl.constexpr = _F16_ASM
    w4 = gl.convert_layout(w.reshape([KW, BN, 8, 8]), L4, assert_trivial=True)
    s_b, w4 = gl.broadcast(gl.expand_dims(sv, 3), w4)
    lo, hi = gl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r,r,r", [w4, s_b], dtype=(sv.dtype, sv.dtype), is_pure=True, pack=4
    )
    jn = gl.join(lo, hi).reshape([KW, BN, 4, 2, 2, 2, 2, 2])
    return jn.permute((0, 1, 3, 4, 5, 7, 2, 6)).reshape([KW, BN, 128])


@gluon.jit
def _step(w, s, xv, acc, KW: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, L4: gl.constexpr,
          A_L: gl.constexpr, B_L: gl.constexpr):  # fmt: skip
    """acc += expand(w, s) @ xv.T for one K step, in the dot's K order (module doc)."""
    a = gl.convert_layout(expand_dot_order(w, s, xv.dtype, KW, BN, L4), A_L)
    xr = xv.reshape([KW, BM, 4, 2, 2, 2, 2, 2])
    b = xr.permute((0, 3, 4, 5, 7, 2, 6, 1)).reshape([KW, 128, BM])
    b = gl.convert_layout(b, B_L)
    return mma_v2(a, b, acc)


def dot_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] (K % 128 == 0) with each 128-wide K block in the dot order of
    `expand_dot_order` (a new contiguous tensor; the host twin of `_step`'s permutation
    of the activations, for kernels whose activations come through shared memory)."""
    *lead, k = x.shape
    v = x.reshape(*lead, k // 128, 4, 2, 2, 2, 2, 2)  # (c, i1, i0, t, e, h)
    n = len(lead) + 1
    order = (*range(n), n + 1, n + 2, n + 3, n + 5, n, n + 4)
    return v.permute(order).reshape(*lead, k)


@gluon.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_mma_kernel(x_ptr, b_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, K, stride_xm, stride_om, stride_on, b_sblk, has_bias,
                      BN: gl.constexpr, BM: gl.constexpr, KW: gl.constexpr,
                      RW: gl.constexpr, SPLIT_K: gl.constexpr, EVEN: gl.constexpr,
                      PREFETCH: gl.constexpr, UNROLL: gl.constexpr,
                      PDL: gl.constexpr):  # fmt: skip
    pid, pid_k, _, n0, m0 = tile_origin(N, BN * RW, BM)
    total = mma_tile(x_ptr, b_ptr, bs_ptr, M, N, K, stride_xm, b_sblk, n0, m0, pid_k, BN, BM,
                     KW, RW, SPLIT_K, EVEN, PREFETCH, UNROLL, PDL)  # fmt: skip
    store_tile(total, n0, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, pid, pid_k, SPLIT_K)  # fmt: skip


@gluon.jit
def mma_tile(x_ptr, b_ptr, bs_ptr, M, N, K, stride_xm, b_sblk, n0, m0, pid_k,
             BN: gl.constexpr, BM: gl.constexpr, KW: gl.constexpr, RW: gl.constexpr,
             SPLIT_K: gl.constexpr, EVEN: gl.constexpr, PREFETCH: gl.constexpr,
             UNROLL: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """The fp32 ``[BN * RW, BM]`` tile (weight rows ``n0..``, tokens ``m0..`` below ``M``,
    units of ``2**-14``: `store_tile` undoes them) of split ``pid_k`` over its K steps:
    the module docstring's loop, shared by the dense kernel and the grouped one
    (`gemm_grouped_mma`, which points ``b_ptr`` / ``bs_ptr`` at one expert)."""
    # NW = KW x RW warps along dim 0: warp b takes K range b // RW (of KW) and the rows
    # of group b % RW (of RW groups of BN a CTA); K last
    NW: gl.constexpr = KW * RW
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    SL: gl.constexpr = gl.SliceLayout(3, L4)
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)

    k_steps = gl.cdiv(K, STEP_K)
    per = gl.cdiv(k_steps, SPLIT_K * KW)
    k_half = gl.multiple_of(K // 2, 16)  # K % 32 == 0: 16-byte rows
    sbytes = bs_ptr.to(gl.pointer_type(gl.uint8), bitcast=True)

    # weight bytes [KW, 16, 64]: thread (g, c) holds bytes 16c..16c+15 of rows g, g + 8
    wb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    wr = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    wj = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    w_k0 = (pid_k * KW + wb // RW) * per * 64  # first byte of each warp's K range
    rows = _warp_rows(n0, wb, wr, N, BN, RW)
    wk = gl.expand_dims(gl.expand_dims(w_k0, 1), 2) + gl.expand_dims(gl.expand_dims(wj, 0), 1)
    w_ptrs = b_ptr + gl.expand_dims(rows.to(gl.int64) * k_half, 2) + wk
    # scales [KW, 16, 8]: thread c holds blocks 2c, 2c + 1 (adjacent in the 128x4 swizzle)
    sb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL)))
    sr = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
    sg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
    srow = _warp_rows(n0, sb, sr, N, BN, RW)
    s_row = (srow // 128).to(gl.int64) * b_sblk + (srow % 32) * 16 + ((srow % 128) // 32) * 4
    grp = gl.expand_dims(gl.expand_dims((pid_k * KW + sb // RW) * per * 8, 1), 2)
    grp = grp + gl.expand_dims(gl.expand_dims(sg, 0), 1)
    s_ptrs = sbytes + gl.expand_dims(s_row, 2) + (grp // 4) * 512 + grp % 4
    sk = grp * 16
    # activations [NW, BM, 128]: thread (n, c) holds K 32c..32c+31 of token n; the RW
    # warps of a K range load the same bytes (L1 hits after the first)
    xb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))) // RW
    xm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
    xj = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
    xk = gl.expand_dims(gl.expand_dims((pid_k * KW + xb) * per * 128, 1), 2) + gl.expand_dims(
        gl.expand_dims(xj, 0), 1
    )
    x_row = gl.expand_dims(gl.expand_dims(xm < M, 0), 2)  # tokens past M: no traffic
    x_ptrs = x_ptr + gl.expand_dims(gl.expand_dims(xm.to(gl.int64) * stride_xm, 0), 2) + xk

    acc = gl.zeros([NW, BN, BM], gl.float32, MMA)
    # no register prefetch: a loop-carried byte tensor is repacked byte by byte every
    # step (PRMT); the loads in flight come from the many warps an SM holds instead
    if PREFETCH > 0 or PDL:  # one address a thread and row: its 16 bytes of the step
        PL: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
        pw = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, PL)))
        pb = pw // RW
        pr = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        pc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PL)))
        pk = gl.expand_dims(gl.expand_dims((pid_k * KW + pb) * per * 64, 1), 2) + gl.expand_dims(
            gl.expand_dims(pc * 16, 0), 1
        )
        prow = _warp_rows(n0, pw, pr, N, BN, RW)
        p_ptrs = b_ptr + gl.expand_dims(prow.to(gl.int64) * k_half, 2) + pk
        pend = gl.minimum((pid_k * KW + pb) * per + per, k_steps) * 64
        pend = gl.expand_dims(gl.expand_dims(pend, 1), 2)
        if PDL:  # launched while the activations are written: fetch weights meanwhile
            for d in gl.static_range(PDL_STEPS):  # PREFETCH <= 4 = PDL_STEPS
                _prefetch_l2(p_ptrs + d * 64, pk + d * 64 < pend)
            pdl.gdc_wait()  # the kernel before (`expand_rows`) has written the activations
        else:
            for d in gl.static_range(PREFETCH):
                _prefetch_l2(p_ptrs + d * 64, pk + d * 64 < pend)
    # UNROLL steps' loads issued together before their expansion: more bytes in flight a
    # warp (the latency chain of a warp with few steps, small shapes); the second of a
    # pair past the warp's range is masked off
    for i in range(0, per, UNROLL):
        if PREFETCH > 0:
            kp = (i + PREFETCH) * 64
            _prefetch_l2(p_ptrs + kp, pk + kp < pend)
        w, s, xv = _load_step(w_ptrs, s_ptrs, x_ptrs, i * 128, wk, sk, xk, x_row, k_half, K,
                              True, EVEN, False)  # fmt: skip
        if UNROLL == 2:
            w2, s2, x2 = _load_step(w_ptrs, s_ptrs, x_ptrs, i * 128 + 128, wk, sk, xk, x_row,
                                    k_half, K, i + 1 < per, EVEN, True)  # fmt: skip
            if PREFETCH > 0:
                _prefetch_l2(p_ptrs + kp + 64, pk + kp + 64 < pend)
        acc = _step(w, s, xv, acc, NW, BN, BM, L4, A_L, B_L)
        if UNROLL == 2:
            acc = _step(w2, s2, x2, acc, NW, BN, BM, L4, A_L, B_L)
    # the KW K ranges summed (through shared memory, once); rows: RW groups of BN
    return gl.sum(acc.reshape([KW, RW * BN, BM]), axis=0)


# ---- host side ------------------------------------------------------------------------

BLOCK_N_CHOICES = (16, 32)  # weight rows per warp: one or two of the MMA's 16-row tiles
BLOCK_M_CHOICES = (8, 16)
WARPS_CHOICES = (1, 2, 4, 8)
ROW_WARPS_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class MmaConfig:
    """Compile-time knobs: ``block_m`` tokens per CTA (the MMA's N: 8 or 16); ``block_n``
    weight rows a warp (16 or 32); ``warps`` groups of warps a CTA, each reducing its own
    range of K steps (summed once at the end), of ``row_warps`` warps that share the
    range (and its activations, through L1) and take ``block_n`` rows apiece: a CTA
    covers ``block_n * row_warps`` rows with ``warps * row_warps`` warps; ``split_k``
    CTAs per output tile along K (the workspace protocol of `splitk`); ``prefetch``
    steps of L2 prefetch ahead; ``unroll`` steps whose loads issue together."""

    block_m: int = 8
    warps: int = 4
    split_k: int = 1
    block_n: int = 16
    prefetch: int = 0
    unroll: int = 1
    row_warps: int = 1

    block_k: ClassVar[int] = 128

    def __post_init__(self) -> None:
        for name, choices in (
            ("block_m", BLOCK_M_CHOICES),
            ("warps", WARPS_CHOICES),
            ("block_n", BLOCK_N_CHOICES),
            ("prefetch", (0, 1, 2, 3, 4)),
            ("unroll", (1, 2)),
            ("row_warps", ROW_WARPS_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)}")
        if self.split_k < 1:
            raise ValueError(f"split_k: expected >= 1, got {self.split_k}")
        if self.warps * self.row_warps > 8:
            raise ValueError(
                f"warps x row_warps: expected <= 8 warps a CTA, got "
                f"{self.warps} x {self.row_warps} = {self.warps * self.row_warps}"
            )


def even_steps(cfg: MmaConfig, k: int) -> bool:
    """Whether every warp's K range is whole 128-wide steps inside K (``EVEN``: no masks),
    for `cfg`'s splits and K ranges."""
    return k % 128 == 0 and (k // 128) % (cfg.split_k * cfg.warps) == 0


@dataclass
class W4A16MmaKernel(DenseKernel):
    """A built kernel: ``kernel(operands, out)``; ``out = alpha * a @ dequant(b).T`` plus
    ``operands.bias`` (fp32, before the one rounding). Workspace and grid are
    `gemm_w4a16.DenseKernel`'s; it reads the natural weight bytes (a prepared copy beside
    them is ignored; prepared bytes alone run the direct kernel)."""

    cfg: MmaConfig
    #: not stated for torch.compile: a Gluon kernel, and Inductor recompiles a user
    #: kernel from its source as ``@triton.jit`` (torch 2.11); compiled calls keep the op
    trace: ClassVar = None
    #: launched with PDL (`fp4_dispatch.backends.pdl`): only where a kernel of the same
    #: call writes the activations first (`W4A4MmaKernel`); a W4A16 call is one launch
    pdl: bool = False

    @property
    def tile_rows(self) -> int:
        """Weight rows of a CTA: ``row_warps`` groups of ``block_n``."""
        return self.cfg.block_n * self.cfg.row_warps

    def __call__(self, operands: W4A16Operands, out: torch.Tensor) -> None:
        if getattr(operands, "prepared", False):
            _direct_fallback()(operands, out)
            return
        m, n, k = operands.a.shape[0], operands.b_data.shape[0], operands.a.shape[1]
        grid, ws, cnt = self.launch_space(m, n, out)
        bound = self._binding(k, False, operands.a.dtype)
        launch_dense(bound, grid, operands, out, ws, cnt, operands.b_data)
        self.compiled = bound.last_compiled

    def even(self, k: int) -> bool:
        """`even_steps` of this kernel's config."""
        return even_steps(self.cfg, k)

    def _binding(self, k: int, prepared: bool, act_dtype: torch.dtype):
        del prepared, act_dtype  # natural bytes only; the dtype is Triton's own key
        even = self.even(k)
        bound = self._bound.get((even, self.pdl))
        if bound is None:
            cfg, options = self.cfg, pdl.launch_options(self.pdl)
            meta = {"BN": cfg.block_n, "BM": cfg.block_m, "KW": cfg.warps, "RW": cfg.row_warps,
                    "SPLIT_K": cfg.split_k, "EVEN": even, "PREFETCH": cfg.prefetch,
                    "UNROLL": cfg.unroll, "PDL": bool(options)}  # fmt: skip
            bound = _MMA_LAUNCH.bind(meta, cfg.warps * cfg.row_warps, **options)
            self._bound[(even, self.pdl)] = bound
        return bound


_MMA_LAUNCH = CachedLauncher(_w4a16_mma_kernel)


@dataclass
class W4A4MmaKernel(W4A16MmaKernel):
    """W4A4 through this kernel: ``kernel(operands, out)`` on `GemmOperands` (``a``: M
    tokens, ``b``: the weight; never swapped), ``out = alpha * alpha_b * dequant(a) @
    dequant(b).T``. The activations are expanded first, exactly, into a kept buffer of
    ``out``'s dtype (`expand_rows`: one short launch over M x K values, which also
    multiplies the two global scales), then multiplied as W4A16 operands. The buffer
    holds whole token tiles, is made outside CUDA-graph pools on the first call of a
    tile count and reused after (run that call outside capture, as for split-K). The
    GEMM launches with PDL (`fp4_dispatch.backends.pdl`): its CTAs prefetch their first
    `PDL_STEPS` weight steps to L2 while the expansion runs."""

    pdl: bool = True

    #: the GEMM takes alpha as two factors (`GemmOperands.alpha_b`): `expand_rows`
    #: multiplies them on the way
    alpha_factors: ClassVar[bool] = True
    _rows: Scratch = field(default_factory=Scratch, repr=False)
    #: (M, K, dtype, device index) -> `buffers` (kept: no slicing on the hot path)
    _views: dict = field(default_factory=dict, repr=False)

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:  # type: ignore[override]
        a = operands.a_data
        key = (a.shape[0], a.shape[1] * 2, out.dtype, out.get_device())
        views = self._views.get(key)
        if views is None:  # once per (M, K, dtype, device): an eager call's host time
            views = self._views[key] = self.buffers(out.device, *key[:3])
        alpha, rows, rows_m = views
        alpha_b = one_like(a) if operands.alpha_b is None else operands.alpha_b
        expand_rows.expand(a, operands.a_scale, rows, (operands.alpha, alpha_b, alpha))
        super().__call__(W4A16Operands(rows_m, operands.b_data, operands.b_scale, alpha), out)

    def buffers(
        self, device: torch.device, m: int, k: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha product [1] fp32, activations [tiles x block_m, K] of ``dtype``, their
        first M rows): views of one fp32 scratch buffer, the activations 16 bytes in."""
        rows = -(-m // self.cfg.block_m) * self.cfg.block_m
        buf, _ = self._rows.get(device, 4 + rows * k // 2, 0)
        acts = buf[4:].view(dtype).view(rows, k)
        return buf[:1], acts, acts[:m]

    def precompile(self, m: int, n: int, k: int, dtype: torch.dtype, prepared: bool = False
                   ) -> object:  # fmt: skip
        """Compile both launches of a call (`expand_rows` and the GEMM), launching none."""
        expand_rows.precompile(k, dtype)
        return super().precompile(m, n, k, dtype, prepared)


@functools.cache
def _direct_fallback() -> DenseKernel:
    """The direct kernel for prepared weight bytes (16 tokens, 64 rows)."""
    return gemm_w4a16.build(gemm_w4a16.W4A16Config(block_n=64, block_m=16, num_stages=4))


def build(cfg: MmaConfig) -> W4A16MmaKernel:
    """A kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A16MmaKernel(cfg)


def build_w4a4(cfg: MmaConfig) -> W4A4MmaKernel:
    """A W4A4 kernel object for `cfg` (`W4A4MmaKernel`)."""
    return W4A4MmaKernel(cfg)
