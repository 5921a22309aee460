"""W4A4 (both operands NVFP4) on Hopper through the W4A16 direct kernel.

Why a second W4A4 kernel: at decode the W4A4 kernel of `gemm_direct` expands both
operands with the fp16 dequantizer (2.75 instructions a value, against the bf16 one's
2.5). The W4A16 kernel (`gemm_w4a16`) was tuned for the decode case - weights on the
MMA's wide side, expanded in registers with the bf16 dequantizer in a fragment-matched
byte order, tokens on the narrow side - and it already
moves its small activation tile through registers to permute it. With ``A_NVFP4`` that
move becomes the activation's own dequantization (the same dequantizer, natural layout),
so a W4A4 decode step costs the W4A16 step plus the expansion of ``BLOCK_M x BLOCK_K``
activation values (a quarter of the weight tile's at 16 tokens and 64 weight rows;
342 against 306 SASS instructions in the 64x16x128 main loop). Measured on the H200:
RESULTS.md, "Hopper W4A16" run 5.

Numerics: both operands become ``e2m1 * scale * 2**-14`` in bf16, exactly (at most 6
significant bits, no smaller than ``2**-24``); the MMA accumulates their products in
fp32 and the epilogue multiplies by ``alpha * alpha_b * 2**28``: the W4A4 contract
``alpha * dequant(a) @ dequant(b).T`` with one rounding at the store.

Orientation: ``a`` (``GemmOperands.a_data``, M rows) is the token side and ``b`` the
weight side, as the dispatcher passes them unswapped; the tactics never set
``swap_ab``. The output is written through its strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4_dispatch.backends.sm90.gemm_w4a16 import (
    _USE_ASM,
    _W4A16_LAUNCH,
    W4A16Config,
    W4A16Kernel,
)
from fp4_dispatch.backends.triton_launch import BoundLaunch, launch_aligned
from fp4_dispatch.backends.workspace import one_like
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape


@dataclass
class W4A4DenseKernel(W4A16Kernel):
    """``kernel(operands, out)`` on `GemmOperands`: ``out = alpha * alpha_b *
    dequant(a) @ dequant(b).T``. Workspace, split-K and configs as `W4A16Kernel`.
    ``cfg.bf16_dequant == "native"`` (the default) multiplies in bf16 whatever ``out``'s
    dtype; ``"cast"`` selects fp16 products instead (the fp16 dequantizer: also exact,
    2.75 instructions a value against 2.5), as does the interpreter (`_bf16`)."""

    #: `GemmOperands.alpha_b` is multiplied in the epilogue (no product kernel eagerly)
    alpha_factors = True
    #: W4A4 has no bias operand (`fp4_dispatch.contracts.backend.DenseOperands` only)
    bias_epilogue = False

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:  # type: ignore[override]
        """Launch with the host work of `W4A16Kernel.__call__` (a launch key, integer
        ceil-divisions)."""
        a, sa, b, sb = operands.a_data, operands.a_scale, operands.b_data, operands.b_scale
        alpha = operands.alpha
        alpha_b = one_like(a) if operands.alpha_b is None else operands.alpha_b
        m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
        grid, ws, cnt = self.launch_space(m, n, out)
        so0, so1 = out.stride()
        # out stands in for the bias pointer (has_bias = 0: never read)
        args = (a, b, sb, alpha, out, out, ws, cnt, m, n, k, a.stride(0), so0, so1,
                sb.shape[1] * 128, 0, sa, sa.shape[1] * 128, alpha_b)  # fmt: skip
        bound = self._binding(k, False, out.dtype)
        key = (m, n, k, so0, so1, out.dtype)
        launch_aligned(bound, key, grid, args, (a, sa, b, sb, alpha, alpha_b, out))
        self.compiled = bound.last_compiled

    def precompile(  # type: ignore[override]
        self, m: int, n: int, k: int, out_dtype: torch.dtype, out_strides: tuple[int, int]
    ) -> object:
        """Compile what `__call__` launches for these sizes (tensors given by dtype, as
        `W4A16Kernel.precompile`), launching nothing; M and N are not specialized on."""
        cfg = self.cfg
        ws, cnt = (torch.float32, torch.int32) if cfg.split_k > 1 else (out_dtype, out_dtype)
        u8, e4m3, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        args = (u8, u8, e4m3, f32, out_dtype, out_dtype, ws, cnt, m, n, k, k // 2,
                *out_strides, swizzled_scale_shape(n, k)[1] * 128, 0,
                e4m3, swizzled_scale_shape(m, k)[1] * 128, f32)  # fmt: skip
        return self._binding(k, False, out_dtype).warmup(self.grid(m, n), args)

    def _binding(self, k: int, prepared: bool, act_dtype: torch.dtype) -> BoundLaunch:
        """The binding of (even K): natural weight bytes, NVFP4 activations, bf16 or fp16
        products by ``cfg.bf16_dequant`` (not by ``act_dtype``: the output dtype)."""
        cfg = self.cfg
        key = (k % cfg.block_k == 0,)
        bound = self._bound.get(key)
        if bound is None:
            meta = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k,
                    "SPLIT_K": cfg.split_k, "EVEN_K": key[0], "USE_ASM": _USE_ASM,
                    "PREPARED": False, "A_NVFP4": True, "BF16_NATIVE": self._bf16(),
                    "X_DOT": False,
                    "num_stages": cfg.num_stages}  # fmt: skip
            bound = self._bound[key] = _W4A16_LAUNCH.bind(meta, cfg.num_warps)
        return bound

    def _bf16(self) -> bool:
        """bf16 products: the "native" config on a GPU; fp16 under TRITON_INTERPRET=1,
        whose tl.dot mishandles bf16 operands (both exact: see the module docstring)."""
        return self.cfg.bf16_dequant == "native" and _USE_ASM


def build(cfg: W4A16Config) -> W4A4DenseKernel:
    """A W4A4 kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A4DenseKernel(cfg)
