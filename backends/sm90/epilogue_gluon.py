"""The CTA tile, its split-K step range and the W4A16 epilogue of the sm90 Gluon kernels
(`gemm_w4a16_ws`, `gemm_w4a16_mma`, `gemm_w4a16_rs`).

`tile_origin` is the raster of `gemm_w4a16.DenseKernel.grid` (the launch grid both
kernel objects use) and gives the tile id `store_tile` indexes the split-K workspace
with. A Gluon kernel cannot call a ``@triton.jit`` function, so `store_tile` is the
Gluon twin of
`gemm_w4a16.store_dense` and `splitk.store_tile`: ``acc`` (weight rows x tokens, fp32)
times ``alpha * 2**14`` (the dequantizers' ``2**-14`` undone), plus the bias in fp32, one
rounding, a masked store of the transposed tile through ``out``'s strides; with split-K
the deterministic workspace protocol of `splitk` (partials, a counter, the last split
sums in split order and resets the counter); here the partials are stored token-major and
summed in a layout of their own (`_sum_splits`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: the barrier of the warps that run the code (a partition's, in a specialized region):
#: ``barrier`` since Triton 3.7, ``thread_barrier`` before (the H200 image has 3.6)
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def tile_origin(N, BN: gl.constexpr, BM: gl.constexpr):
    """(tile id, split, row-tile index, first weight row, first token) of this CTA of
    ``BN`` weight rows and ``BM`` tokens: consecutive CTAs walk N, so the token tile stays
    hot in L2 while the weights stream once."""
    pid = gl.program_id(0)
    grid_n = gl.cdiv(N, BN)
    pid_n = pid % grid_n
    return pid, gl.program_id(1), pid_n, pid_n * BN, (pid // grid_n) * BM


@gluon.jit
def split_steps(k_steps, pid_k, SPLIT_K: gl.constexpr):
    """(first step, steps) of split ``pid_k`` of ``SPLIT_K`` over ``k_steps`` K steps:
    ``cdiv(k_steps, SPLIT_K)`` each, the last ones short or empty."""
    per_split = gl.cdiv(k_steps, SPLIT_K)
    kt0 = pid_k * per_split
    return kt0, gl.maximum(gl.minimum(kt0 + per_split, k_steps) - kt0, 0)


@gluon.jit
def store_tile(acc, n0, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, tile_id, pid_k, SPLIT_K: gl.constexpr):  # fmt: skip
    """Store ``acc`` [BN, BM] (rows ``n0 + r``, tokens ``m0 + c``) as the module says;
    ``tile_id`` indexes the workspace and the counter of this output tile."""
    OL: gl.constexpr = acc.type.layout
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    r_o = gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
    c_o = gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
    scale = gl.load(alpha_ptr) * 16384.0  # alpha * 2**14
    if SPLIT_K == 1:
        _scale_store(acc, r_o, c_o, n0, m0, scale, bias_ptr, has_bias, out_ptr, M, N, stride_om,
                     stride_on)  # fmt: skip
    else:
        tile: gl.constexpr = BN * BM
        ws_tile = ws_ptr + tile_id.to(gl.int64) * (SPLIT_K * tile)
        # token-major partials (offset c * BN + r), summed in `_sum_splits`' layout
        offs_t = gl.expand_dims(c_o, 0) * BN + gl.expand_dims(r_o, 1)
        gl.store(ws_tile + pid_k * tile + offs_t, acc)
        cta_barrier()  # every thread's partial is written before the release below
        arrived = gl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            _sum_splits(ws_tile, n0, m0, scale, bias_ptr, has_bias, out_ptr, M, N, stride_om,
                        stride_on, BN, BM, SPLIT_K)  # fmt: skip
            gl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")  # for the next call


@gluon.jit
def _sum_splits(ws_tile, n0, m0, scale, bias_ptr, has_bias, out_ptr, M, N, stride_om, stride_on,
                BN: gl.constexpr, BM: gl.constexpr, SPLIT_K: gl.constexpr):  # fmt: skip
    """The last split of a tile: sum the ``SPLIT_K`` partials in split order, then
    `_scale_store`. Its own layout, four consecutive weight rows a thread: the loads are
    vectors at constant offsets from one address. In the accumulator's layout every value
    had an address of its own, and the 256-token tile spilled there (~810 spill
    instructions; 29 MB of local-memory traffic at 256x8192², RESULTS.md "Hopper W4A16"
    run 11)."""
    TR: gl.constexpr = BN // 4 if BN // 4 < 32 else 32
    RL: gl.constexpr = gl.BlockedLayout([4, 1], [TR, 32 // TR], [1, gl.num_warps()], [0, 1])
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, RL))
    c = gl.arange(0, BM, layout=gl.SliceLayout(0, RL))
    offs = gl.expand_dims(c, 0) * BN + gl.expand_dims(r, 1)
    total = gl.zeros([BN, BM], gl.float32, RL)
    for s in gl.static_range(SPLIT_K):
        total += gl.load(ws_tile + s * (BN * BM) + offs, cache_modifier=".cg")
    _scale_store(total, r, c, n0, m0, scale, bias_ptr, has_bias, out_ptr, M, N, stride_om,
                 stride_on)  # fmt: skip


@gluon.jit
def _scale_store(v, r, c, n0, m0, scale, bias_ptr, has_bias, out_ptr, M, N, stride_om,
                 stride_on):  # fmt: skip
    """``v * scale + bias`` (fp32, one rounding) stored to rows ``m0 + c``, columns ``n0 +
    r`` of ``out``, masked; ``r`` and ``c`` index ``v``'s two dims in its layout."""
    offs_n = n0 + r
    offs_m = m0 + c
    bias = gl.zeros_like(r).to(gl.float32)
    if has_bias != 0:
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
    ptrs = (out_ptr + gl.expand_dims(offs_m, 0).to(gl.int64) * stride_om
            + gl.expand_dims(offs_n, 1) * stride_on)  # fmt: skip
    mask = (gl.expand_dims(offs_m, 0) < M) & (gl.expand_dims(offs_n, 1) < N)
    out = v * scale + gl.expand_dims(bias, 1)
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
