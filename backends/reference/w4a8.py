"""W4A8 in plain torch: the exact emulation of every rounding the FP8 kernels make.

W4A8 (``precision="fp8"``, docs/PRECISION.md) computes ``alpha * x @ dequant(W).T`` with
both operands rounded to FP8 E4M3 so that Hopper's FP8 tensor cores can multiply them:

- **activations**, per token (row) ``m``: ``xq[m] = e4m3(x[m] / sa[m])`` with
  ``sa[m] = 2**ea[m]``, the smallest power of two with ``amax|x[m]| <= 448 * sa[m]``;
- **weights**, per output channel (row) ``n``: ``wq[n] = e4m3(e2m1 * s / sw[n])`` with
  ``sw[n] = 2**ew[n]``, the smallest power of two with ``6 * max(s[n]) <= 448 * sw[n]``
  (``s``: the row's e4m3 block scales; 6 is the largest e2m1 magnitude);
- the product ``(xq @ wq.T) * sa[:, None] * sw[None, :] * alpha`` (+ bias) with fp32
  accumulation, rounded once to the output dtype.

Why powers of two: dividing by one is exact, so the only rounding of an element is the
one to E4M3 (round to nearest even), and that rounding is the same whatever the scale
(E4M3 is a floating-point format: relative precision does not depend on the scale)
except at the bottom of the range (below 2**-6, where E4M3 has subnormals, and 2**-10,
where values flush to zero). A scale chosen as ``amax / 448`` exactly would use at most
one more binade of that range and cost an inexact division per element (and a
division whose rounding differs between Triton's GPU code and its interpreter). The
scale never lets a value exceed 448, E4M3's largest finite value: nothing saturates.

Why per output channel for the weights: a row whose block scales are all small gets a
small ``sw[n]`` and keeps its small values out of E4M3's subnormal range; a per-tensor
scale (``sw = 8`` covers every NVFP4 weight: 6 * 448 / 8 = 336) would flush the values of
such rows first. The scale needs only the row's largest block scale (``K/16`` bytes), so
the GEMM kernels compute it themselves: no persistent copy, the weight stays NVFP4.

The products ``e4m3 x e4m3`` are exact in fp32 and the kernels accumulate in fp32, so
`gemm_w4a8` (float64 products and sums, one final rounding) differs from them only by
fp32 accumulation order: that is what the tests compare at tight tolerance.
"""

from __future__ import annotations

import torch

from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.format.nvfp4 import as_uint8_data, e2m1_to_float, unpack_e2m1, unswizzle_scales

#: E4M3's largest finite magnitude (float8_e4m3fn: no infinities)
E4M3_MAX = 448.0
#: the largest e2m1 magnitude
E2M1_MAX = 6.0
#: exponent range of the power-of-two scales: 2**e and 2**-e both normal float32
MIN_EXP, MAX_EXP = -126, 127


def pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``e``, the smallest with ``amax <= 448 * 2**e``, clamped to [-126, 127].

    Read off the float32 bits, exactly (no log2): ``amax = 1.f * 2**E`` and ``448 = 1.75 *
    2**8``, so ``e = E - 8`` when ``1.f <= 1.75`` (mantissa bits <= 0x600000), else ``E - 7``.
    Zero and float32 subnormals clamp to -126 (their row is zero or flushes anyway)."""
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    e = exp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return e.clamp(MIN_EXP, MAX_EXP).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2**e`` for int32 ``e`` in [-126, 127] (built from its bits: exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``xq`` float8_e4m3fn ``[M, K]``, ``sa`` float32 ``[M]``): per-token E4M3 (module
    docstring); ``x`` is bf16/fp16/fp32 ``[M, K]``."""
    xf = x.to(torch.float32)
    e = pow2_exponent(xf.abs().amax(dim=1))
    return (xf * pow2(-e)[:, None]).to(torch.float8_e4m3fn), pow2(e)


def weight_exponents(scale: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """int32 ``ew[n]`` of each weight row from its e4m3 block scales (module docstring)."""
    s = unswizzle_scales(scale, rows, k).to(torch.float32).abs()
    return pow2_exponent(E2M1_MAX * s.amax(dim=1))


def weight_to_fp8(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``wq`` float8_e4m3fn ``[N, K]``, ``sw`` float32 ``[N]``): an NVFP4 weight (natural
    byte order, swizzled scales, global scale left out) in E4M3 per output channel."""
    data = as_uint8_data(data)
    rows, k = data.shape[0], data.shape[1] * 2
    e = weight_exponents(scale, rows, k)
    s = unswizzle_scales(scale, rows, k).to(torch.float32) * pow2(-e)[:, None]
    vals = e2m1_to_float(unpack_e2m1(data)).to(torch.float32).view(rows, k // 16, 16)
    return (vals * s[:, :, None]).view(rows, k).to(torch.float8_e4m3fn), pow2(e)


def gemm_w4a8(operands: DenseOperands, out: torch.Tensor) -> None:
    """``out`` = the W4A8 result of `operands` (module docstring), float64 products and
    sums, one rounding to ``out``'s dtype; ``operands.bias`` added before it."""
    xq, sa = quantize_activations(operands.a)
    wq, sw = weight_to_fp8(operands.b_data, operands.b_scale)
    acc = xq.to(torch.float64) @ wq.to(torch.float64).T
    acc = acc * sa.to(torch.float64)[:, None] * sw.to(torch.float64)[None, :]
    acc = acc * operands.alpha.to(torch.float64).reshape(())
    if operands.bias is not None:
        acc = acc + operands.bias.to(torch.float64)
    out.copy_(acc)
