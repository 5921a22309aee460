"""`backends.sm90.swizzle`: the offsets the sm90 Triton kernels read the 128x4-swizzled
e4m3 scales with, under TRITON_INTERPRET=1, against the layout `nvfp4.swizzle_scales`
writes (the format's own definition)."""

from __future__ import annotations

import torch
from conftest import run_interpreted

from fp4_dispatch.format.nvfp4 import swizzle_scales

_OFFSETS = r"""
import json, sys
import torch
import triton
import triton.language as tl
from fp4_dispatch.backends.sm90.swizzle import scale_group_offset, scale_row_offset


@triton.jit
def offsets(out_ptr, blk, BR: tl.constexpr, BG: tl.constexpr):
    r = tl.arange(0, BR)[:, None]
    g = tl.arange(0, BG)[None, :]
    tl.store(out_ptr + r * BG + g, scale_row_offset(r, blk) + scale_group_offset(g))


res = []
for rows, groups in json.loads(sys.argv[1]):
    out = torch.full((rows, groups), -1, dtype=torch.int64)
    offsets[(1,)](out, groups * 128, BR=rows, BG=groups)
    res.append(out.tolist())
print(json.dumps(res))
"""

#: (scale rows, scale groups): one and several 128-row blocks, one and several 4-groups
CASES = [(128, 4), (256, 8), (512, 16)]


def _where(rows: int, groups: int) -> torch.Tensor:
    """Where each linear scale (r, g) lands in the swizzled storage, read off
    `swizzle_scales` itself: the index of every entry is swizzled as two bytes."""
    idx = torch.arange(rows * groups).view(rows, groups)
    lo, hi = ((idx >> s) & 255 for s in (0, 8))
    e4m3 = torch.float8_e4m3fn
    lo_s, hi_s = (swizzle_scales(b.to(torch.uint8).view(e4m3)).view(torch.uint8).long()
                  for b in (lo, hi))  # fmt: skip
    flat = (lo_s + 256 * hi_s).flatten()  # swizzled position -> linear index
    where = torch.empty(rows * groups, dtype=torch.int64)
    where[flat] = torch.arange(rows * groups)
    return where.view(rows, groups)


def test_offsets_are_the_formats_swizzled_layout():
    got = run_interpreted(_OFFSETS, CASES)
    for (rows, groups), offsets in zip(CASES, got, strict=True):
        assert torch.equal(torch.tensor(offsets), _where(rows, groups)), (rows, groups)


def test_the_reference_positions_are_a_permutation():
    """The check above can fail: `_where` is a bijection that is not the identity."""
    where = _where(256, 8)
    assert sorted(where.flatten().tolist()) == list(range(256 * 8))
    assert not torch.equal(where, torch.arange(256 * 8).view(256, 8))
