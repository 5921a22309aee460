"""The split-K epilogue the sm90 GEMM kernels share (Triton).

Each split stores its fp32 partial tile into the kept workspace
(`fp4_dispatch.backends.workspace`), then bumps the tile's counter (acq_rel, after a CTA
barrier); the split that arrives last sums the partials in fixed split order
(deterministic), writes the output and resets the counter to zero, so the next call needs
no memset. With one split the tile is stored directly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k_tile_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, pid_k):
    """``(kt0, kt1)``: the K tiles split ``pid_k`` of ``SPLIT_K`` reduces (equal shares
    of ``cdiv(K, BLOCK_K)`` tiles; the last split's may be shorter or empty)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    return kt0, tl.minimum(kt0 + per_split, k_tiles)


@triton.jit
def store_tile(
    acc,
    scale,
    out_ptrs,
    out_mask,
    ws_ptr,
    cnt_ptr,
    pid,
    pid_k,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    bias,
    ADD_BIAS: tl.constexpr,
):
    """Write ``acc * scale`` ([ROWS, COLS] fp32) to ``out_ptrs``, reducing over splits;
    with ``ADD_BIAS`` plus ``bias`` (fp32, broadcast to the tile) before the one rounding
    to the output dtype (``bias`` is unused otherwise: pass any scalar)."""
    if SPLIT_K == 1:
        v = acc * scale
        if ADD_BIAS:
            v += bias
        tl.store(out_ptrs, v.to(out_ptrs.dtype.element_ty), mask=out_mask)
    else:
        tile_elems: tl.constexpr = ROWS * COLS
        offs_t = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        ws_tile = ws_ptr + pid.to(tl.int64) * (SPLIT_K * tile_elems)
        tl.store(ws_tile + pid_k * tile_elems + offs_t, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((ROWS, COLS), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_tile + s * tile_elems + offs_t, cache_modifier=".cg")
            total = total * scale
            if ADD_BIAS:
                total += bias
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for next call
