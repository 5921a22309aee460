"""Hopper (sm90) NVFP4 GEMM in Triton: reads packed e2m1 + swizzled e4m3 scales directly.

Hopper has no FP4 tensor-core instruction, so each CTA loads the packed bytes and the
128x4-swizzled block scales of its A and B tiles, dequantizes them in registers to fp16
and runs ordinary fp16 tensor-core dots (wgmma where the tile allows) with fp32
accumulation. No unswizzle or dequantize pass touches memory: the kernel moves the
NVFP4 bytes once, which is what makes decode shapes fast (4.5 bits per weight instead
of bf16's 16).

Exactness. A nibble ``n`` (sign bit 3, magnitude bits 0-2) placed as fp16 bits
``(n & 7) << 9 | (n & 8) << 12`` is the fp16 number ``e2m1(n) * 2**-14`` (the two
codes with a zero exponent land on fp16 subnormals, which is what makes the one-shift
mapping exact). Multiplying it by the e4m3 block scale in fp16 is exact: ``e2m1 *
e4m3`` has at most 6 significant bits and is a multiple of ``2**-10``, so the product
is a multiple of ``2**-24`` no larger than ``2688 * 2**-14`` - every such number is an
fp16 (subnormals included). The dot accumulates in fp32 and the epilogue multiplies by
``alpha * 2**28`` (an exact power of two on top of alpha), so the kernel computes the
same function as Blackwell's FP4 MMA up to accumulation order.

Two dequantizers compute the same bits: on the GPU a packed PTX block (4 bytes -> 8 fp16
in 22 instructions, two values per instruction); under TRITON_INTERPRET=1 (CPU tests)
element-wise Triton ops, since the interpreter cannot run PTX.

K order. Low and high nibbles are dequantized separately and fed to two dots (even and
odd K of each tile); a sum over K does not care about the order, and both halves of a
16-element block share one scale.

Split-K (``SPLIT_K > 1``, for decode shapes that have fewer output tiles than SMs):
each split stores its fp32 partial tile into a workspace, then bumps a per-tile
counter (acq_rel atomic after a CTA barrier); the split that arrives last sums the
partials in fixed split order (deterministic), writes the output and resets the
counter to zero. One launch, no host sync, no memset, CUDA-graph capturable. The
workspace is owned by the kernel object (`backends.workspace`), so one kernel object
must not run on two streams concurrently.

Shapes: any M >= 1 and N >= 1 (rows past M/N inside a tile are masked loads, zero
filled, at wrapped in-bounds addresses; the store is masked); ``K % 32 == 0`` (whole bytes per
16-element block pair, as every backend of this project requires); K need not be a
multiple of the K tile (the tail is masked). The output may have any strides.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.driver_launch import record_launches
from fp4_dispatch.backends.sm90.splitk import k_tile_range, store_tile
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.backends.triton_launch import CachedLauncher, launch_aligned
from fp4_dispatch.backends.workspace import Scratch, one_like
from fp4_dispatch.contracts.backend import GemmOperands

log = logging.getLogger(__name__)

#: 2**28 undoes the 2**-14 carried by each dequantized operand (see module docstring).
_UNSCALE = float(2**28)

#: The packed PTX dequantizer on GPUs; the element-wise one under TRITON_INTERPRET=1.
_USE_ASM = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@dataclass(frozen=True)
class KernelConfig:
    """The compile-time knobs of one kernel variant (a tactic minus dispatch fields)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {v}")
        if self.block_k < 64:
            raise ValueError(
                f"block_k: expected >= 64 (whole 4-group scale tiles), got {self.block_k}"
            )
        if self.split_k < 1 or self.group_m < 1:
            raise ValueError("split_k and group_m must be >= 1")


def smem_estimate(cfg: KernelConfig) -> int:
    """Shared memory a variant needs, in bytes (an upper estimate, used for validity).

    Pipelined raw loads (packed bytes + scales of A and B per stage) plus the dequantized
    fp16 operand tiles staged for the tensor cores, plus the epilogue's layout shuffle.
    """
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    raw = (bm + bn) * (bk // 2 + bk // 16)
    dequant = (bm + bn) * bk * 2
    epilogue = bm * bn * 4
    return max(cfg.num_stages * raw + dequant, epilogue)


# Packed-word dequantization (GPU): one PTX block turns 4 packed bytes (8 nibbles) into
# 4 fp16 of the low nibbles and 4 of the high nibbles, two fp16 per 32-bit register:
# PRMT spreads bytes (b0, b1) into the two halves of a word, then per half
# ``(t << 9) & 0x0E00 | (t << 12) & 0x8000`` (low nibble) or ``<< 5`` / ``<< 8`` (high
# nibble) builds the fp16 bits of e2m1 * 2**-14, two values per instruction. About 2.3
# instructions per element instead of ~7 for the element-wise Triton version.
_E2M1X4_TO_F16_ASM = tl.constexpr("""
{
.reg .b32 t, p, q;
prmt.b32 t, $4, 0, 0x4140;
shl.b32 p, t, 9;
and.b32 p, p, 0x0E000E00;
shl.b32 q, t, 12;
and.b32 q, q, 0x80008000;
or.b32 $0, p, q;
shl.b32 p, t, 5;
and.b32 p, p, 0x0E000E00;
shl.b32 q, t, 8;
and.b32 q, q, 0x80008000;
or.b32 $2, p, q;
prmt.b32 t, $4, 0, 0x4342;
shl.b32 p, t, 9;
and.b32 p, p, 0x0E000E00;
shl.b32 q, t, 12;
and.b32 q, q, 0x80008000;
or.b32 $1, p, q;
shl.b32 p, t, 5;
and.b32 p, p, 0x0E000E00;
shl.b32 q, t, 8;
and.b32 q, q, 0x80008000;
or.b32 $3, p, q;
}
""")


@triton.jit
def _dequant_halves(
    x,
    s,
    ROWS: tl.constexpr,
    KB: tl.constexpr,
    KG: tl.constexpr,
    USE_ASM: tl.constexpr,
    DOT_ORDER: tl.constexpr,
):
    """Packed bytes [ROWS, KB] + e4m3 scales [ROWS, KG] -> (even K, odd K) fp16 * 2**-14.

    USE_ASM selects the packed PTX path (GPU); the element-wise path computes the same
    bits and runs under TRITON_INTERPRET=1.
    """
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_F16_ASM,
            "=r,=r,=r,=r,r",
            [x],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        x16 = x.to(tl.uint16)
        lo = (((x16 & 0x7) << 9) | ((x16 & 0x8) << 12)).to(tl.float16, bitcast=True)
        hi = (((x16 & 0x70) << 5) | ((x16 & 0x80) << 8)).to(tl.float16, bitcast=True)
    if DOT_ORDER:  # bytes in the dot's order (`_dot_order`): (g, h, q, e) has scale 2g + q // 2
        sc = tl.reshape(s.to(tl.float16), (ROWS, KB // 16, 1, 2, 1, 1))
        lo = tl.reshape(tl.reshape(lo, (ROWS, KB // 16, 2, 2, 2, 2)) * sc, (ROWS, KB))
        hi = tl.reshape(tl.reshape(hi, (ROWS, KB // 16, 2, 2, 2, 2)) * sc, (ROWS, KB))
    else:
        sc = s.to(tl.float16)[:, :, None]
        lo = tl.reshape(tl.reshape(lo, (ROWS, KG, 8)) * sc, (ROWS, KB))
        hi = tl.reshape(tl.reshape(hi, (ROWS, KG, 8)) * sc, (ROWS, KB))
    return lo, hi


@triton.jit
def _dot_order(x, ROWS: tl.constexpr, KB: tl.constexpr):
    """Packed bytes [ROWS, KB] in memory order -> the order both dot operands use.

    Memory byte ``16g + 4q + 2h + e`` becomes tensor position ``(g, h, q, e)``: the MMA
    operand fragment gives lane q the positions ``{2q, 2q+1, 2q+8, 2q+9}`` of each 16, so
    in this order each lane's 4 bytes are one 32-bit word of memory (no byte repacking)
    and share one scale block. A and B are relabelled alike, so the sum over K is
    unchanged; Triton folds the relabelling into the register layout.
    """
    g = tl.reshape(x, (ROWS, KB // 16, 4, 2, 2))
    return tl.reshape(tl.permute(g, (0, 1, 3, 2, 4)), (ROWS, KB))


@triton.jit(do_not_specialize=["M", "N"])
def _nvfp4_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    alpha_ptr,
    alpha_b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_om,
    stride_on,
    a_sblk,
    b_sblk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    KB: tl.constexpr = BLOCK_K // 2  # packed bytes per row of a K tile
    KG: tl.constexpr = BLOCK_K // 16  # block scales per row of a K tile
    # wgmma tiles (A from registers, M >= 64): both operands in the dot's byte order, which
    # drops the byte repacking (sm_90 SASS, 128x16x128: 5.1 -> 4.0 instructions per
    # element); the mma.sync tiles (M < 64) compile worse that way (4.8 -> 5.4), so not.
    # K tiles of 64 stay in natural order: Triton 3.6 and 3.9 fail to compile the dot
    # order there (TritonGPUOptimizeDotOperands; tests/test_precompile.py pins it)
    DOT_ORDER: tl.constexpr = BLOCK_M >= 64 and BLOCK_K >= 128

    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Group-M raster: GROUP_M row-tiles share each column of B tiles while it is hot.
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    k_half = tl.multiple_of(K // 2, 16)  # K % 32 == 0 (check_operands): 16-byte rows
    kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = offs_m % M  # in-bounds addresses for the masked rows past M / N; never stored
    rn = offs_n % N
    rb = tl.arange(0, KB)
    rg = tl.arange(0, KG)

    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * k_half + (kt0 * KB + rb)[None, :]
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * k_half + (kt0 * KB + rb)[None, :]
    a_row = scale_row_offset(rm, a_sblk)
    b_row = scale_row_offset(rn, b_sblk)
    g_off = scale_group_offset(rg) + kt0 * (KG // 4) * 512
    as_ptrs = as_ptr + a_row[:, None] + g_off[None, :]
    bs_ptrs = bs_ptr + b_row[:, None] + g_off[None, :]

    # rows past M / N (decode: the token tile) are zero-filled with no memory traffic;
    # wrapped rows re-read real ones (a few % slower at M <= 16 in the exploratory H200
    # timings behind RESULTS.md "Hopper W4A16" run 4)
    arow = (offs_m < M)[:, None]
    brow = (offs_n < N)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt0, kt1):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=arow, other=0)
            b = tl.load(b_ptrs, mask=brow, other=0)
            sa = tl.load(as_ptrs, mask=arow, other=0.0)
            sb = tl.load(bs_ptrs, mask=brow, other=0.0)
        else:
            kmask = (kt * KB + rb) < k_half
            gmask = (kt * KG + rg) < K // 16
            a = tl.load(a_ptrs, mask=arow & kmask[None, :], other=0)
            b = tl.load(b_ptrs, mask=brow & kmask[None, :], other=0)
            sa = tl.load(as_ptrs, mask=arow & gmask[None, :], other=0.0)
            sb = tl.load(bs_ptrs, mask=brow & gmask[None, :], other=0.0)
        if DOT_ORDER:
            a = _dot_order(a, BLOCK_M, KB)
            b = _dot_order(b, BLOCK_N, KB)
        a_lo, a_hi = _dequant_halves(a, sa, BLOCK_M, KB, KG, USE_ASM, DOT_ORDER)
        b_lo, b_hi = _dequant_halves(b, sb, BLOCK_N, KB, KG, USE_ASM, DOT_ORDER)
        acc = tl.dot(a_lo, tl.trans(b_lo), acc)
        acc = tl.dot(a_hi, tl.trans(b_hi), acc)
        a_ptrs += KB
        b_ptrs += KB
        as_ptrs += (KG // 4) * 512
        bs_ptrs += (KG // 4) * 512

    # alpha's two factors (`GemmOperands.alpha_b`; a kept 1.0 when there is only one), times
    # 2**28: the float32 product is the one torch computes, the power of two exact
    scale = tl.load(alpha_ptr) * tl.load(alpha_b_ptr) * 268435456.0
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    store_tile(acc, scale, out_ptrs, out_mask, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_M, BLOCK_N,
               SPLIT_K, 0.0, False)  # fmt: skip


_GEMM_LAUNCH = CachedLauncher(_nvfp4_gemm_kernel)


class Nvfp4GemmKernel:
    """A built kernel: ``kernel(operands, out)``; ``out = alpha * A @ B.T``.

    Takes alpha as two factors (``alpha_factors``: `GemmOperands.alpha_b` is multiplied
    in the epilogue), so an eager ``gemm`` needs no separate product kernel.

    Split-K tactics keep their workspace (fp32 partial tiles + self-resetting int32 tile
    counters) for the kernel's life, made outside CUDA-graph pools (`backends.workspace`):
    no allocation or memset per call. Run one call before capturing, as with any Triton
    kernel, so that compilation and the workspace happen outside the capture.
    """

    alpha_factors = True
    #: records a call's launches for the plan's driver-API replays (`fp4_dispatch.engine.plans`)
    record = staticmethod(record_launches)

    def __init__(self, cfg: KernelConfig) -> None:
        self.cfg = cfg
        meta = {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m,
            "SPLIT_K": cfg.split_k,
            "USE_ASM": _USE_ASM,
            "num_stages": cfg.num_stages,  # a launch option: part of the binding's key
        }
        # one binding per EVEN_K: after the first call of a specialization the compiled
        # kernel is launched directly (`backends.triton_launch`), not via JITFunction.run
        self._bound = {
            even: _GEMM_LAUNCH.bind({**meta, "EVEN_K": even}, cfg.num_warps)
            for even in (False, True)
        }
        self._scratch = Scratch()

    def _workspace(self, device: torch.device, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-K partials and tile counters, kept per tile count (`backends.workspace`).

        The kernel's last split resets each counter to zero, so no call needs a memset.
        """
        tile_elems = self.cfg.block_m * self.cfg.block_n
        return self._scratch.get(device, tiles * self.cfg.split_k * tile_elems, tiles)

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:
        """Launch on `operands`; the host work is kept to what a decode step can afford
        (plain integer ceil-divisions: ``triton.cdiv`` is a JIT'd constexpr function in
        Triton 3.6, ~6 µs a call on the H200 host; a launch key instead of Triton's
        specialization key, see `backends.triton_launch.BoundLaunch.launch_keyed`)."""
        a, b, sa, sb, alpha = (operands.a_data, operands.b_data, operands.a_scale,
                               operands.b_scale, operands.alpha)  # fmt: skip
        # the neutral second factor, fetched on every call (a dict look-up) so that the
        # eager call before a capture has made it whichever path the capture takes
        ones = one_like(a)
        alpha_b = ones if operands.alpha_b is None else operands.alpha_b
        m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
        cfg = self.cfg
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        if cfg.split_k > 1:
            ws, cnt = self._workspace(a.device, tiles)
        else:
            ws = cnt = out  # unused by the SPLIT_K == 1 variant
        so0, so1 = out.stride()
        grid = (tiles, cfg.split_k)
        args = (a, sa, b, sb, alpha, alpha_b, out, ws, cnt, m, n, k, so0, so1,
                sa.shape[1] * 128, sb.shape[1] * 128)  # fmt: skip
        bound = self._bound[k % cfg.block_k == 0]
        # what the compiled variant depends on beyond the fixed constexprs, given aligned
        # pointers: the sizes and the output's dtype and strides (operand dtypes are fixed
        # by the kernel contract; the workspace is ours)
        key = (m, n, k, so0, so1, out.dtype)
        launch_aligned(bound, key, grid, args, (a, sa, b, sb, alpha, alpha_b, out))

    def precompile(self, m: int, n: int, k: int, out_dtype: torch.dtype,
                   out_strides: tuple[int, int]) -> object:  # fmt: skip
        """Compile the variant that a call of these sizes would launch, launching nothing.

        The arguments mirror `__call__` with each tensor given by its dtype (Triton
        takes placeholders as 16-byte aligned, as every allocation is): the specialization
        depends on K, the output strides and the dtypes, not on M or N
        (``do_not_specialize``), so one compile serves every M of a problem.
        """
        cfg = self.cfg
        if cfg.split_k > 1:
            ws, cnt = torch.float32, torch.int32
        else:
            ws = cnt = out_dtype
        sblk = -(-(k // 16) // 4) * 4 * 128  # a_scale.shape[1] * 128 of the swizzled scales
        fp4, e4m3 = torch.uint8, torch.float8_e4m3fn
        args = (fp4, e4m3, fp4, e4m3, torch.float32, torch.float32, out_dtype, ws, cnt, m, n, k,
                out_strides[0], out_strides[1], sblk, sblk)  # fmt: skip
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        return self._bound[k % cfg.block_k == 0].warmup((tiles, cfg.split_k), args)


def check_operands(operands: GemmOperands, out: torch.Tensor) -> None:
    """Raise with a clear message if operands or out do not fit this kernel's contract."""
    a, b = operands.a_data, operands.b_data
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise TypeError(f"a_data/b_data: expected uint8, got {a.dtype}/{b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"K mismatch: a_data {tuple(a.shape)} vs b_data {tuple(b.shape)}")
    if (2 * a.shape[1]) % 32:
        raise ValueError(f"K must be a multiple of 32, got {2 * a.shape[1]}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a_data and b_data must be contiguous [rows, K/2]")
    if out.shape != (a.shape[0], b.shape[0]):
        raise ValueError(f"out: expected shape {(a.shape[0], b.shape[0])}, got {tuple(out.shape)}")
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out: expected bfloat16 or float16, got {out.dtype}")


def build(cfg: KernelConfig) -> Nvfp4GemmKernel:
    """A kernel object for `cfg` (Triton compiles on first call per specialization)."""
    return Nvfp4GemmKernel(cfg)
