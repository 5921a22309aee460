"""Portable reference kernels (W4A4 and W4A16): plain torch, runs on CPU and CUDA.

Dequantizes the NVFP4 operands to ``compute_dtype`` (e2m1 x e4m3 values are exact in
fp16/bf16/fp32), multiplies with fp32 accumulation, optionally in K chunks, and applies
``alpha`` (the product of the global scales) in fp32 at the end. It is the yardstick
every other backend is compared with, and the fallback when nothing faster runs.
"""

from __future__ import annotations

import torch

from fp4_dispatch.backend import DenseOperands, GemmOperands
from fp4_dispatch.nvfp4 import e2m1_to_float, unpack_e2m1, unswizzle_scales

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``e2m1(data) * block_scale`` (no global scale) as `dtype`, shape [rows, K]."""
    rows, k = data.shape[0], data.shape[1] * 2
    values = e2m1_to_float(unpack_e2m1(data))
    scales = unswizzle_scales(scale, rows, k).to(torch.float32)
    return (values.view(rows, k // 16, 16) * scales.unsqueeze(-1)).view(rows, k).to(dtype)


def gemm(operands: GemmOperands, out: torch.Tensor, compute_dtype: str, k_chunk: int) -> None:
    """``out = alpha * A @ B.T`` with fp32 accumulation over K chunks of `k_chunk` (0 = all)."""
    dtype = COMPUTE_DTYPES[compute_dtype]
    a = dequantize_operand(operands.a_data, operands.a_scale, dtype)
    b = dequantize_operand(operands.b_data, operands.b_scale, dtype)
    _accumulate(a, b, operands.alpha, out, k_chunk)


def gemm_dense(
    operands: DenseOperands, out: torch.Tensor, compute_dtype: str, k_chunk: int
) -> None:
    """W4A16: ``out = alpha * a @ dequant(B).T``, the dense ``a`` cast to `compute_dtype`."""
    dtype = COMPUTE_DTYPES[compute_dtype]
    b = dequantize_operand(operands.b_data, operands.b_scale, dtype)
    _accumulate(operands.a.to(dtype), b, operands.alpha, out, k_chunk)


def _accumulate(
    a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor, k_chunk: int
) -> None:
    """``out = alpha * a @ b.T``, fp32 accumulation over K chunks of `k_chunk` (0 = all)."""
    k = a.shape[1]
    step = k if k_chunk == 0 else k_chunk
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for start in range(0, k, step):
        part = a[:, start : start + step] @ b[:, start : start + step].T
        acc += part.to(torch.float32)
    acc *= alpha.to(torch.float32).reshape(())
    out.copy_(acc)
