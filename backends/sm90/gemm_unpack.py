"""Hopper (sm90) NVFP4 GEMM for large M: unpack each operand once, then cuBLAS bf16.

Why: the direct kernel (`gemm_direct`) re-expands every A and B tile in every CTA (32x
redundant at 4096 x 8192 x 8192) and runs at ~half of cuBLAS bf16 for M >= 1024
(benchmarks/RESULTS.md, "Hopper"). Here each operand is expanded exactly once by a
memory-bound Triton pass (`unpack_nvfp4_kernel`) into a bf16 workspace, cuBLAS multiplies
the two bf16 matrices (``torch.matmul``/``torch.mm``), and one elementwise pass applies
alpha and writes ``out``.

Exactness. ``e2m1 * e4m3`` has at most 6 significant bits and lies in [2**-10, 2688]
in magnitude (or is zero), so it is exact in bf16: the unpacked operands are the
dequantized values bit for bit (without the global scale, which alpha carries). The
decoders below build float32 bit patterns with integer ops (no fp8 type is needed, so
the same code runs under TRITON_INTERPRET=1 and on the GPU); the product is formed in
fp32 (exact) and cast to bf16 (exact).

Precision of the product: cuBLAS accumulates in fp32. For a bf16 ``out`` the product is
written in bf16 and alpha applied in fp32 on top, so the result is rounded twice (bf16
product, then bf16 ``alpha * product``): at most ~1 bf16 ulp, versus 1/2 ulp for the
direct kernel. For an fp16 ``out`` a bf16 product would limit the result to bf16's 8
significant bits, so the product is kept in fp32 (``torch.mm(..., out_dtype=float32)``,
CUDA, torch >= 2.8) and rounded once to fp16 after the alpha multiply. A bf16 (or fp32)
product also has fp32's exponent range, so the unscaled product cannot overflow before
alpha is applied, which an fp16 product could.

Bytes per call (R = M + N operand rows; t = 2 for bf16 out, 4 for fp16 out; o = 2):
unpack reads ``R * K * (1/2 + 1/16)`` and writes ``R * K * 2``; cuBLAS reads the
``R * K * 2`` bf16 operands (at least once) and writes ``M * N * t``; the alpha pass
reads ``M * N * t`` and writes ``M * N * o``. At 4096 x 8192 x 8192 (bf16 out): 257 MB
unpack + 134 MB alpha pass, ~95 us at the H200's ~4.2 TB/s on top of the bf16 GEMM.
Four launches (two unpacks, GEMM, alpha).

Workspaces (bf16 operands, the product) come from ``torch.empty`` on every call: the
caching allocator makes that cheap, and under CUDA-graph capture it allocates from the
graph's private pool, so the launcher is capture-safe (the Triton kernel must have
compiled before capture, as for any Triton kernel: run one call first).

Shapes: any rows >= 1; ``K % 32 == 0`` (the project's rule); K need not be a multiple
of ``BLOCK_K`` and rows need not be a multiple of ``BLOCK_R`` (tails are masked; scale
padding is never read for a stored element). ``out`` may have any strides: a
column-major ``out`` (what the dispatcher passes for swap_ab) gets the product computed
as ``B @ A.T`` so that the alpha pass reads and writes in the same order.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

log = logging.getLogger(__name__)

#: Block sizes the launcher accepts (the tactic space uses a subset).
BLOCK_R_CHOICES = (16, 32, 64, 128)
BLOCK_K_CHOICES = (32, 64, 128, 256)


@triton.jit
def _e2m1_to_f32(n):
    """e2m1 codes (integers 0..15, sign in bit 3) -> float32, exactly.

    Magnitude code m >= 2 is ``(1 + (m & 1) / 2) * 2**((m >> 1) - 1)``: the fp32 bits
    ``(m << 22) + (126 << 23)`` (m's low bit lands in the top mantissa bit, m >> 1 adds to
    the exponent). Code 1 is 0.5 (``126 << 23``) and code 0 is zero.
    """
    n32 = n.to(tl.uint32)
    m = n32 & 7
    mag = tl.where(m >= 2, (m << 22) + (126 << 23), tl.where(m == 1, 126 << 23, 0))
    bits = mag.to(tl.uint32) | ((n32 & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_f32(b):
    """float8_e4m3fn bit patterns (uint8) -> float32, exactly (subnormals, NaN, -0).

    Normal: exponent e (bias 7) becomes fp32 exponent e + 120, the 3 mantissa bits the top
    3 of fp32's. Subnormal (e == 0): mantissa * 2**-9. 0x7F / 0xFF are NaN.
    """
    b32 = b.to(tl.uint32)
    e = (b32 >> 3) & 15
    mnt = b32 & 7
    normal = ((e + 120) << 23) | (mnt << 20)
    sub = (mnt.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    bits = tl.where(e == 0, sub, normal)
    bits = tl.where((b32 & 0x7F) == 0x7F, 0x7FC00000, bits).to(tl.uint32)
    bits = bits | ((b32 & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def unpack_nvfp4_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    alpha_ptr,
    R,
    K,
    s_blk,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ALPHA: tl.constexpr = False,
):
    """out[r, k] = e2m1(data)[r, k] * scale[r, k // 16] for one BLOCK_R x BLOCK_K tile.

    With ``HAS_ALPHA`` the float32 ``*alpha_ptr`` multiplies every value before the cast
    (one rounding per element; the W4A16 unpack path folds the global scale in here).

    ``data``: uint8 [R, K/2] (low nibble = even k); ``scale``: the swizzled 128x4 e4m3
    storage viewed as uint8, read in place at the offsets of
    `fp4_dispatch.backends.sm90.swizzle` with ``s_blk = ceil4(K/16) * 128``. Bytes are
    loaded contiguously (KB per row), low and high nibbles decoded separately and
    interleaved with ``tl.join`` so the store is a contiguous BLOCK_K run per row.
    """
    KB: tl.constexpr = BLOCK_K // 2  # packed bytes per row of the tile
    KG: tl.constexpr = BLOCK_K // 16  # block scales per row of the tile
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)

    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    k_half = tl.multiple_of(K // 2, 16)  # K % 32 == 0 (check_operands): 16-byte rows

    bcol = pid_k * KB + tl.arange(0, KB)
    x = tl.load(
        data_ptr + rows64[:, None] * k_half + bcol[None, :],
        mask=rmask[:, None] & (bcol < k_half)[None, :],
        other=0,
    )

    gcol = pid_k * KG + tl.arange(0, KG)
    s_row = scale_row_offset(rows, s_blk)
    s_col = scale_group_offset(gcol)
    sb = tl.load(
        scale_ptr + s_row[:, None] + s_col[None, :],
        mask=rmask[:, None] & (gcol < K // 16)[None, :],
        other=0,
    )
    sc = _e4m3_to_f32(sb)[:, :, None]  # [BLOCK_R, KG, 1]

    lo = tl.reshape(tl.reshape(_e2m1_to_f32(x & 0xF), (BLOCK_R, KG, 8)) * sc, (BLOCK_R, KB))
    hi = tl.reshape(tl.reshape(_e2m1_to_f32(x >> 4), (BLOCK_R, KG, 8)) * sc, (BLOCK_R, KB))
    vals = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_K))  # (j, 0) -> 2j, (j, 1) -> 2j + 1
    if HAS_ALPHA:
        vals = vals * tl.load(alpha_ptr)

    kcol = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows64[:, None] * K + kcol[None, :],
        vals.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & (kcol < K)[None, :],
    )


def _num_warps(block_r: int, block_k: int) -> int:
    """About 32 outputs per thread, 4 to 16 warps (keeps the decode in registers)."""
    return max(4, min(16, block_r * block_k // 1024))


def unpack_nvfp4(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_r: int = 64,
    block_k: int = 128,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed e2m1 ``[R, K/2]`` + swizzled e4m3 scales -> ``[R, K]`` of ``e2m1 * scale``.

    ``dtype`` bf16 (default), fp16 or fp32 (all exact) when ``alpha`` is None. With
    ``alpha`` (a one-element float32 device tensor, read by the kernel) the values are
    ``e2m1 * scale * alpha``, rounded once to ``dtype``.
    """
    if block_r not in BLOCK_R_CHOICES or block_k not in BLOCK_K_CHOICES:
        raise ValueError(
            f"block_r/block_k: expected one of {BLOCK_R_CHOICES}/{BLOCK_K_CHOICES}, "
            f"got {block_r}/{block_k}"
        )
    if data.dtype != torch.uint8 or data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"data: expected contiguous uint8 [R, K/2], got {data.dtype} "
                         f"{tuple(data.shape)}")  # fmt: skip
    rows, k = data.shape[0], data.shape[1] * 2
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    padded = swizzled_scale_shape(rows, k)
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != padded:
        raise ValueError(f"scale: expected float8_e4m3fn {padded} (swizzled), got {scale.dtype} "
                         f"{tuple(scale.shape)}")  # fmt: skip
    if not scale.is_contiguous():
        raise ValueError("scale: the swizzled layout must be contiguous")
    if out is None:
        out = torch.empty((rows, k), dtype=dtype, device=data.device)
    elif tuple(out.shape) != (rows, k) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {(rows, k)}, got {tuple(out.shape)}")
    if alpha is not None and (alpha.dtype != torch.float32 or alpha.numel() != 1):
        raise TypeError(f"alpha: expected a one-element float32 tensor, got {alpha.dtype} "
                        f"{tuple(alpha.shape)}")  # fmt: skip
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    unpack_nvfp4_kernel[grid](
        data,
        scale.view(torch.uint8),
        out,
        out if alpha is None else alpha,
        rows,
        k,
        scale.shape[1] * 128,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        HAS_ALPHA=alpha is not None,
        num_warps=_num_warps(block_r, block_k),
    )
    return out


def _product(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ y.T`` with fp32 accumulation, result in `dtype` (bf16 or fp32)."""
    if dtype == x.dtype:
        return torch.matmul(x, y.t())
    if x.device.type == "cuda":
        # cuBLAS bf16 x bf16 -> fp32 output (aten::mm.dtype, torch >= 2.8)
        return torch.mm(x, y.t(), out_dtype=torch.float32)
    # CPU (interpreter tests): the same function - exact bf16 values, fp32 accumulation
    return torch.matmul(x.float(), y.float().t())


def gemm_unpack_cublas(
    operands: GemmOperands, out: torch.Tensor, block_r: int = 64, block_k: int = 128
) -> None:
    """``out = alpha * dequant(a) @ dequant(b).T``: unpack both, cuBLAS bf16, one alpha pass.

    ``alpha`` stays on the device (never read on the host). See the module docstring
    for the bytes moved and the rounding.
    """
    m, n = operands.a_data.shape[0], operands.b_data.shape[0]
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out: expected bfloat16 or float16, got {out.dtype}")
    if operands.a_data.shape[1] != operands.b_data.shape[1]:
        raise ValueError(
            f"K mismatch: a_data {tuple(operands.a_data.shape)} vs "
            f"b_data {tuple(operands.b_data.shape)}"
        )
    a16 = unpack_nvfp4(operands.a_data, operands.a_scale, block_r, block_k)
    b16 = unpack_nvfp4(operands.b_data, operands.b_scale, block_r, block_k)
    prod_dtype = torch.bfloat16 if out.dtype == torch.bfloat16 else torch.float32
    # a 1-dim alpha takes part in type promotion, so the multiply runs in fp32
    alpha = operands.alpha.reshape(1)
    column_major = out.dim() == 2 and out.stride(0) == 1 and out.stride(1) != 1
    if column_major:
        # out.T is row-major: compute B @ A.T so the alpha pass is a straight stream
        torch.mul(_product(b16, a16, prod_dtype).t(), alpha, out=out)
    else:
        torch.mul(_product(a16, b16, prod_dtype), alpha, out=out)


class UnpackGemmKernel:
    """A built kernel: ``kernel(operands, out)`` with fixed unpack block sizes."""

    def __init__(self, block_r: int, block_k: int) -> None:
        if block_r not in BLOCK_R_CHOICES or block_k not in BLOCK_K_CHOICES:
            raise ValueError(
                f"block_r/block_k: expected one of {BLOCK_R_CHOICES}/{BLOCK_K_CHOICES}, "
                f"got {block_r}/{block_k}"
            )
        self.block_r = block_r
        self.block_k = block_k

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:
        gemm_unpack_cublas(operands, out, self.block_r, self.block_k)

    def __repr__(self) -> str:
        return f"UnpackGemmKernel(block_r={self.block_r}, block_k={self.block_k})"


def build(block_r: int, block_k: int) -> UnpackGemmKernel:
    """A kernel object (Triton compiles the unpack pass on first call)."""
    return UnpackGemmKernel(block_r, block_k)
