"""Portable reference kernels (W4A4, W4A16 and grouped): plain torch, runs on CPU and CUDA.

Dequantizes both operands to ``compute_dtype`` and multiplies with torch's own GEMM
(fp32 accumulation), optionally in K chunks, then applies ``alpha`` (the product of the
global scales) in fp32. Block-scaled e2m1 values, ``e2m1 * e4m3``, have at most 6
significant bits and lie in [2^-10, 2688], so they are exact in fp16, bf16 and fp32: the
only rounding is the GEMM's own. It is the yardstick every other backend is compared
with, and the fallback when nothing faster runs. (The float64 ground truth of the tests
is `fp4_dispatch.reference_gemm`, not this.)

Speed on a CPU (measured in benchmarks/bench_first_contact.py):

- dequantization is one table lookup per packed byte (two values at once) and one
  multiply by the block scale, in the compute dtype;
- the dequantized B operand (in practice a weight) is kept in a small LRU keyed on the
  packed tensor's storage, shape, strides and version counter, so repeated calls with the
  same weight cost one dequantization of A plus a dense GEMM. The cache holds a
  reference to the packed tensors, so their memory cannot be reused while an entry lives
  (a stale hit is impossible), and an in-place change bumps the version counter (a miss).
  ``FP4_DISPATCH_REFERENCE_CACHE_MB`` bounds it (default 1024; 0 turns it off).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict

import torch

from fp4_dispatch.backend import DenseOperands, GemmOperands, GroupedOperands
from fp4_dispatch.checks import TORCH_DTYPES
from fp4_dispatch.nvfp4 import as_uint8_data, e2m1_to_float, unswizzle_scales

log = logging.getLogger(__name__)

#: the output dtypes (their one home, `fp4_dispatch.checks.TORCH_DTYPES`) and float32
COMPUTE_DTYPES = {"float32": torch.float32, **TORCH_DTYPES}
CACHE_ENV = "FP4_DISPATCH_REFERENCE_CACHE_MB"
DEFAULT_CACHE_MB = 1024

_Key = tuple
_cache: OrderedDict[_Key, tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]] = OrderedDict()


@functools.cache
def _pair_table(dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[256]``: the (low nibble, high nibble) e2m1 values of every packed byte, the two
    values' bits packed into one integer (int32 for 2-byte dtypes, int64 for fp32).

    One `index_select` of whole pairs is the fastest CPU decode we measured (advanced
    indexing of a ``[256, 2]`` table is ~5x slower). Built once per dtype and device
    (never a per-call host-to-device copy).
    """
    codes = torch.arange(256, dtype=torch.int32)
    pairs = torch.stack([codes & 0xF, codes >> 4], dim=-1).to(torch.uint8)
    values = e2m1_to_float(pairs).to(dtype).contiguous()
    packed = torch.int32 if values.element_size() == 2 else torch.int64
    return values.view(packed).reshape(256).to(device)


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``e2m1(data) * block_scale`` (no global scale) as `dtype`, shape [rows, K]."""
    data = as_uint8_data(data)
    rows, k = data.shape[0], data.shape[1] * 2
    table = _pair_table(dtype, str(data.device))
    pairs = table.index_select(0, data.reshape(-1).to(torch.int32))
    values = pairs.view(dtype).view(rows, k // 16, 16)  # low nibble first: memory order
    scales = unswizzle_scales(scale, rows, k).to(dtype)
    return (values * scales.unsqueeze(-1)).view(rows, k)


def _cache_limit_bytes() -> int:
    raw = os.environ.get(CACHE_ENV, "").strip()
    try:
        return int(float(raw) * 2**20) if raw else DEFAULT_CACHE_MB * 2**20
    except ValueError:
        log.warning("%s=%r is not a number of MiB; using %d", CACHE_ENV, raw, DEFAULT_CACHE_MB)
        return DEFAULT_CACHE_MB * 2**20


def _key(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> _Key:
    return (data.data_ptr(), data.storage_offset(), tuple(data.shape), tuple(data.stride()),
            data.dtype, str(data.device), scale.data_ptr(), tuple(scale.shape), dtype)  # fmt: skip


def dequantize_cached(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_operand`, remembered for the same packed tensors (see the module)."""
    limit = _cache_limit_bytes()
    if limit <= 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return dequantize_operand(data, scale, dtype)
    try:
        versions = (data._version, scale._version)
    except RuntimeError:  # inference-mode tensors have no version counter: never cached
        log.debug("reference: operand B has no version counter; not caching it")
        return dequantize_operand(data, scale, dtype)
    key = _key(data, scale, dtype)
    hit = _cache.get(key)
    if hit is not None and (hit[2], hit[3]) == versions:
        _cache.move_to_end(key)
        return hit[4]
    value = dequantize_operand(data, scale, dtype)
    size = value.numel() * value.element_size()
    if size > limit:
        return value
    _cache[key] = (data, scale, *versions, value)
    while sum(e[4].numel() * e[4].element_size() for e in _cache.values()) > limit:
        _cache.popitem(last=False)
    return value


def clear_cache() -> None:
    """Drop every remembered dequantized operand (frees their memory)."""
    _cache.clear()


def gemm(operands: GemmOperands, out: torch.Tensor, compute_dtype: str, k_chunk: int) -> None:
    """``out = alpha * A @ B.T`` with fp32 accumulation over K chunks of `k_chunk` (0 = all)."""
    dtype = COMPUTE_DTYPES[compute_dtype]
    a = dequantize_operand(operands.a_data, operands.a_scale, dtype)
    b = dequantize_cached(operands.b_data, operands.b_scale, dtype)
    _accumulate(a, b, operands.alpha, out, k_chunk)


def gemm_dense(
    operands: DenseOperands, out: torch.Tensor, compute_dtype: str, k_chunk: int
) -> None:
    """W4A16: ``out = alpha * a @ dequant(B).T``, the dense ``a`` cast to `compute_dtype`."""
    dtype = COMPUTE_DTYPES[compute_dtype]
    b = dequantize_cached(operands.b_data, operands.b_scale, dtype)
    _accumulate(operands.a.to(dtype), b, operands.alpha, out, k_chunk)


def gemm_grouped(
    operands: GroupedOperands, out: torch.Tensor, compute_dtype: str, k_chunk: int
) -> None:
    """Grouped W4A16/W4A4 (docs/grouped.md): for each expert with rows, its rows of A
    (dense, or dequantized NVFP4) times its dequantized weight, alpha[e] in fp32.

    Eagerly it reads the offsets on the host (one synchronisation per call) and
    multiplies only each expert's rows: the CPU path and the GPU correctness fallback.
    Inside a CUDA-graph capture, where nothing may be read, every expert multiplies all
    rows and keeps its own (each row's expert found on the device by a search of the
    offsets): E times the work, but capturable. Rows past the last offset are not
    written. Each expert's dequantized weight goes through the same LRU as a dense
    weight (a slab of the stack is a view with its own storage offset)."""
    dtype = COMPUTE_DTYPES[compute_dtype]
    ops = operands
    dense = ops.a_scale is None
    a = ops.a.to(dtype) if dense else dequantize_operand(ops.a, ops.a_scale, dtype)
    if a.is_cuda and torch.cuda.is_current_stream_capturing():
        _grouped_on_device(ops, a, out, dtype, k_chunk)
        return
    start = 0
    for e, end in enumerate(ops.offsets.tolist()):
        end = max(start, min(int(end), a.shape[0]))
        if end > start:
            b = dequantize_cached(ops.b_data[e], ops.b_scale[e], dtype)
            _accumulate(a[start:end], b, ops.alpha[e], out[start:end], k_chunk)
        start = end


def _grouped_on_device(
    ops: GroupedOperands, a: torch.Tensor, out: torch.Tensor, dtype: torch.dtype, k_chunk: int
) -> None:
    """`gemm_grouped` without reading the offsets: row r belongs to the first expert whose
    row end exceeds r (`torch.searchsorted` on the device); each expert's product of all
    rows is kept where the row is its own."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=ops.offsets.dtype)
    owner = torch.searchsorted(ops.offsets, rows, right=True)  # E: past the last offset
    y = torch.empty_like(out)
    for e in range(ops.b_data.shape[0]):
        b = dequantize_cached(ops.b_data[e], ops.b_scale[e], dtype)
        _accumulate(a, b, ops.alpha[e], y, k_chunk)
        out.copy_(torch.where((owner == e)[:, None], y, out))


def _accumulate(
    a: torch.Tensor, b: torch.Tensor, alpha_t: torch.Tensor, out: torch.Tensor, k_chunk: int
) -> None:
    """``out = alpha * a @ b.T``, fp32 accumulation over K chunks of `k_chunk` (0 = all)."""
    k = a.shape[1]
    alpha = alpha_t.to(torch.float32).reshape(())
    if k_chunk == 0 or k_chunk >= k:
        acc = torch.matmul(a, b.T)
        out.copy_(acc * alpha if acc.dtype == torch.float32 else acc.to(torch.float32) * alpha)
        return
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for start in range(0, k, k_chunk):
        acc += (a[:, start : start + k_chunk] @ b[:, start : start + k_chunk].T).to(torch.float32)
    acc *= alpha
    out.copy_(acc)
