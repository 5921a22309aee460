"""NVFP4 rows expanded to bf16/fp16 (``e2m1 * scale``, exact): the activations of a W4A4
GEMM that a W4A16 kernel then multiplies (`gemm_w4a16_mma.W4A4MmaKernel`).

Why expand first: at decode the activations are a few rows (M <= 16) and the weights
are the traffic. Expanding the activations once per call is one short kernel over
``M x K`` values; expanding them inside the GEMM repeats the work in every CTA of the
weight side (N / 16 of them: `gemm_w4a4_dense` pays it as a quarter of its main loop).

Exactness: an e2m1 value has at most 2 significant bits and an e4m3 scale at most 4, so
their product (at most 5, between ``2**-10`` and ``6 * 448``) is exact in bf16 and in
fp16 (normal range there too). The global scale is not applied: it stays in the GEMM's
``alpha``. Written in plain Triton: it runs under ``TRITON_INTERPRET=1`` (CI checks the
numerics on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4_dispatch.backends import pdl
from fp4_dispatch.backends.triton_launch import CachedLauncher, launch_aligned
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

#: K values a program expands (128 bytes of one row, 16 scale blocks)
BLOCK_K = 256


@triton.jit
def _e2m1(code):
    """The value of 4-bit e2m1 codes (int32 0..15): sign bit 3, exponent bits 1-2, one
    mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    mag = code & 7
    exp = mag >> 1
    man = (mag & 1).to(tl.float32)
    normal = (1.0 + 0.5 * man) * tl.exp2((exp - 1).to(tl.float32))
    value = tl.where(exp == 0, 0.5 * man, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _expand_kernel(data_ptr, scale_ptr, out_ptr, alpha_ptr, alpha_b_ptr, alpha_out_ptr, K,
                   stride_out, scale_rows_stride, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    """Row ``program_id(1)``, K ``BLOCK * program_id(0)`` onwards: bytes, their scales
    (the 128x4 swizzle of `fp4_dispatch.format.nvfp4`), one store of ``BLOCK`` values; the first
    program also stores ``alpha * alpha_b`` (fp32) for the GEMM that follows. With
    ``PDL`` every program first lets that GEMM launch (`fp4_dispatch.backends.pdl`)."""
    if PDL:
        pdl.gdc_launch_dependents()
    row = tl.program_id(1)
    kb = tl.program_id(0) * BLOCK
    if (row == 0) & (kb == 0):
        tl.store(alpha_out_ptr, tl.load(alpha_ptr) * tl.load(alpha_b_ptr))
    half = tl.arange(0, BLOCK // 2)
    mask = kb // 2 + half < K // 2
    byte = tl.load(data_ptr + row.to(tl.int64) * (K // 2) + kb // 2 + half, mask=mask, other=0)
    byte = byte.to(tl.int32)
    blk = (kb + 2 * half) // 16  # the 16-value block of both nibbles of a byte
    s_off = ((row // 128).to(tl.int64) * scale_rows_stride + (row % 32) * 16
             + ((row % 128) // 32) * 4 + (blk // 4) * 512 + blk % 4)  # fmt: skip
    scale = tl.load(scale_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    lo = _e2m1(byte & 15) * scale
    hi = _e2m1(byte >> 4) * scale
    vals = tl.interleave(lo, hi)  # low nibble first: K order
    k = kb + tl.arange(0, BLOCK)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + k, vals.to(out_ptr.dtype.element_ty),
             mask=k < K)  # fmt: skip


def expand(
    data: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    alphas: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """``out[:M] = e2m1(data) * scale`` for ``data`` uint8 ``[M, K/2]`` (low nibble first)
    and ``scale`` e4m3 in the 128x4 swizzled layout; ``out`` bf16 or fp16 with at least M
    rows of K values and unit stride along K. ``alphas`` = (alpha, alpha_b, product):
    one-element fp32 tensors, ``product = alpha * alpha_b`` is stored on the way (the two
    global scales of a W4A4 call meet here instead of in a launch of their own). Returns
    ``out``. No host sync; capturable."""
    m, k = data.shape[0], data.shape[1] * 2
    if out.shape[0] < m or out.shape[1] != k or out.stride(1) != 1:
        raise ValueError(f"out: expected >= {m} rows of {k} contiguous values, got shape "
                         f"{tuple(out.shape)}, strides {out.stride()}")  # fmt: skip
    args = (data, scale, out, *alphas, k, out.stride(0), _scale_rows_stride(k))
    launch_aligned(_BOUND, (k, out.stride(0), out.dtype), (triton.cdiv(k, BLOCK_K), m), args,
                   (data, scale, out, *alphas))  # fmt: skip
    return out


def precompile(k: int, dtype: torch.dtype) -> object:
    """Compile the variant `expand` launches for K and an output dtype, launching nothing."""
    f32 = torch.float32
    args = (torch.uint8, torch.float8_e4m3fn, dtype, f32, f32, f32, k, k, _scale_rows_stride(k))
    return _BOUND.warmup((triton.cdiv(k, BLOCK_K), 1), args)


def _scale_rows_stride(k: int) -> int:
    """Bytes between 128-row blocks of the swizzled scales (K decides it, not M)."""
    return swizzled_scale_shape(1, k)[1] * 128


_BOUND = CachedLauncher(_expand_kernel).bind({"BLOCK": BLOCK_K, "PDL": pdl.ENABLED}, num_warps=4)
