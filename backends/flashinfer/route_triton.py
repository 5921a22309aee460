"""The routed-tile layout of `fp4_dispatch.backends.flashinfer.grouped.route` in one launch.

Why: `route` in torch is ~24 small device kernels (a diff, a prefix sum, two
``searchsorted`` ...). At decode, where a grouped GEMM streams a few MB of weights in a
few microseconds, two dozen launches of ~2 us each would be most of the call (assumed,
not measured: no Blackwell part here). This kernel computes the same five tensors in one
launch: a grid over blocks of rows and of tiles; every program recomputes the per-expert
prefix sums from the E offsets (E <= `MAX_EXPERTS`, one register block), then finds each
row's expert and each tile's owner by counting ends (`searchsorted(right=True)` is the
number of ends <= the value). Integer arithmetic only: the results equal the torch
path's (tested under the Triton interpreter against it).

Triton compiles it on its first launch for the GPU it runs on (JIT, like the sm90
family's kernels); without Triton `route` stays in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

#: the largest expert count one program holds in registers (DeepSeek-V3: 256)
MAX_EXPERTS = 1024
BLOCK_ROWS = 64


@triton.jit
def _route_kernel(
    offsets_ptr, dest_ptr, valid_ptr, tile_expert_ptr, tile_limit_ptr, num_tiles_ptr,
    tokens, experts, slot_tiles,
    RT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    emask = e < experts
    ends = tl.load(offsets_ptr + e, mask=emask, other=0).to(tl.int64)
    ends = tl.minimum(tl.maximum(ends, 0), tokens)
    prev = tl.load(offsets_ptr + e - 1, mask=emask & (e > 0), other=0).to(tl.int64)
    prev = tl.minimum(tl.maximum(prev, 0), tokens)
    counts = tl.where(emask, ends - prev, 0)
    tiles = (counts + RT - 1) // RT
    tile_end = tl.cumsum(tiles, 0)
    pad_start = (tile_end - tiles) * RT
    shift = pad_start - (ends - counts)
    limit_e = pad_start + counts
    big = tokens + 1  # beyond every row: masked experts never count as "ended"
    ends_m = tl.where(emask, ends, big)
    tile_end_m = tl.where(emask, tile_end, slot_tiles + 1)

    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < tokens
    group = tl.sum((ends_m[None, :] <= r[:, None]).to(tl.int64), axis=1)
    valid = group < experts
    group = tl.minimum(group, experts - 1)
    pick = e[None, :] == group[:, None]
    dest = r + tl.sum(tl.where(pick, shift[None, :], 0), axis=1)
    tl.store(dest_ptr + r, dest, mask=rmask)
    tl.store(valid_ptr + r, valid, mask=rmask)

    j = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    jmask = j < slot_tiles
    owner = tl.sum((tile_end_m[None, :] <= j[:, None]).to(tl.int64), axis=1)
    owner = tl.minimum(owner, experts - 1)
    mine = e[None, :] == owner[:, None]
    limit = tl.sum(tl.where(mine, limit_e[None, :], 0), axis=1)
    tl.store(tile_expert_ptr + j, owner.to(tl.int32), mask=jmask)
    tl.store(tile_limit_ptr + j, limit.to(tl.int32), mask=jmask)
    total = tl.sum(tiles, axis=0)
    tl.store(num_tiles_ptr, total.to(tl.int32), mask=pid == 0)


def route_into(
    offsets: torch.Tensor,
    tokens: int,
    route_tile: int,
    slots: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Fill ``out = (dest int64 [T], valid bool [T], tile_expert int32 [slots/rt],
    tile_limit int32 [slots/rt], num_tiles int32 [1])`` from `offsets` in one launch."""
    experts = offsets.shape[0]
    if experts > MAX_EXPERTS:
        raise ValueError(f"offsets: at most {MAX_EXPERTS} experts in one program, got {experts}")
    slot_tiles = slots // route_tile
    blocks = max(triton.cdiv(tokens, BLOCK_ROWS), triton.cdiv(slot_tiles, BLOCK_ROWS), 1)
    _route_kernel[(blocks,)](
        offsets, *out, tokens, experts, slot_tiles,
        RT=route_tile, BLOCK_E=max(16, triton.next_power_of_2(experts)), BLOCK_R=BLOCK_ROWS,
    )  # fmt: skip
