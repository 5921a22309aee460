"""Offsets into the 128x4-swizzled e4m3 scale layout, for the sm90 Triton kernels.

The layout is the one `fp4_dispatch.format.nvfp4` defines (its module docstring); entry (r, g)
of a scale tensor lives at ``scale_row_offset(r, blk) + scale_group_offset(g)``, with
``blk`` the storage of one 128-row block (``scale.shape[1] * 128``). The fused quantizer
(`fp4_dispatch.backends.quantize`) keeps its own int32 version: it writes small tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_row_offset(r, blk):
    """The row part of the offset, in int64 (weights of any size)."""
    return (r // 128).to(tl.int64) * blk + (r % 32) * 16 + ((r % 128) // 32) * 4


@triton.jit
def scale_group_offset(g):
    """The part of the offset of scale group ``g`` (16 K elements each) within its rows."""
    return (g // 4) * 512 + g % 4
