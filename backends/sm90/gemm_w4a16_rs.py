"""Hopper (sm90) W4A16 GEMM for 64-256 tokens: weights expanded in registers feed ``wgmma``.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T`` with the operands of `gemm_w4a16`
(bf16 or fp16 activations, NVFP4 weight bytes in natural order, 128x4-swizzled e4m3
scales).

Why a fourth kernel. `gemm_w4a16_ws` expands the weights in dequant warps, stores the
bf16 tile to shared memory and hands it to an MMA warpgroup through mbarriers; its
tensor pipe stayed ~59% busy at 256x8192² (RESULTS.md "Hopper W4A16" run 6). Here the
warps that expand a weight tile multiply it themselves: ``wgmma`` takes its A operand
(the weights, swapped into the MMA's M) from registers and its B operand (the tokens)
from shared memory, so the expanded tile never goes through shared memory and no
partition waits on another.

- A CTA covers 128 weight rows (two warpgroups of 64: one 512-byte scale chunk of the
  128x4 swizzle per 64 K) and ``BT`` tokens, in 128-wide K steps. One TMA ring of
  ``STAGES`` slots carries each step's weight bytes [128, 64], its two scale chunks and
  the activation tile (two [BT, 64] boxes: the 128-byte swizzle holds 64 bf16 a row).
- Warp ``w`` reads rows ``16w .. 16w + 15`` of the weight bytes from shared memory in
  the register layout of `gemm_w4a16_mma` (thread ``(g, c)``: bytes 16c..16c+15 of rows
  g, g + 8) and expands them with its dequantizer (`expand_dot_order`). The A operand of
  ``wgmma`` is, per warp, the fragment of ``mma.sync``, so the expanded values need no
  data movement - but they are in the dot's K order, not natural order. The B operand
  must be in the same order: the activations are permuted once per call
  (`gemm_w4a16_mma.dot_order`; `RsKernel` holds the buffer), which every CTA then reads
  by TMA.
- Two variants. One partition of 8 warps: the expansion of step ``i + 1`` is written
  while step ``i``'s ``wgmma`` are in flight, then the CTA waits and refills their slot
  (one CTA barrier a step). ``specialized`` (`_w4a16_rs_ws_kernel`, what the backend
  runs): each warpgroup is a partition of its own and a TMA warp fills the ring, slots
  released through ``empty`` mbarriers, so the warpgroups drift apart and one's
  expansion overlaps the other's MMA. Within a warpgroup they do not overlap: ptxas
  takes a ``wgmma``'s A registers for free once it is issued, gives them to the next
  expansion and waits first. Run 10 kept them (a store after the wait that never
  executes): half the next expansion then ran under the MMA and nothing got faster
  (RESULTS.md "Hopper W4A16" runs 9-10).
- ``ctas_per_sm=2`` (specialized, 64 tokens): a register budget (`SM_REGISTERS`) under
  which two CTAs share an SM, so a grid of up to two CTAs an SM runs in one wave.
- The activations' pass (`_dot_order_pass`) is plain Triton and a launch of its own. At
  one CTA an SM the GEMM launches with PDL and loads the ring's first weight steps while
  the pass runs (`_fill_ring`, `RsKernel.launches_with_pdl`).

Epilogue: ``alpha * 2**14``, bias in fp32, one rounding, masked store through ``out``'s
strides; split-K (``SPLIT_K`` CTAs a tile) through the workspace protocol of `splitk`.

Shapes: any M and N >= 1 (TMA zero-fills rows past M and N; rows past N are never
stored), ``K % 128 == 0`` (whole steps: no K masks); other inputs run the direct kernel
(`why_unsupported`). Gluon has no interpreter: CI compiles this kernel for sm_90, the
numerics are checked on the H200.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4_dispatch.backends import pdl
from fp4_dispatch.backends.sm90 import gemm_w4a16_ws
from fp4_dispatch.backends.sm90.epilogue_gluon import (
    cta_barrier,
    split_steps,
    store_tile,
    tile_origin,
)
from fp4_dispatch.backends.sm90.gemm_w4a16 import DenseKernel, W4A16Operands
from fp4_dispatch.backends.sm90.gemm_w4a16_mma import expand_dot_order
from fp4_dispatch.backends.sm90.gemm_w4a16_ws import _descriptor, _tma_load, _x_layout
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher, launch_aligned
from fp4_dispatch.backends.workspace import Scratch

STEP_K = 128
BLOCK_N = 128  # weight rows per CTA: two warpgroups of 64, one 128-row scale block
BLOCK_M_CHOICES = (64, 128, 256)
STAGES_CHOICES = (2, 3, 4)
#: the specialized kernel's registers a thread by (CTAs an SM, tokens a tile): (at launch,
#: the second consumer warpgroup's, the TMA warpgroup's), moved by setmaxnreg; the default
#: partition (the first consumer) gets what the other two leave. Three warpgroups a CTA,
#: 65536 registers an SM, a consumer's accumulator is BT/2 registers a thread.
#: - One CTA, up to 128 tokens: launch at 152 (the first consumer may use up to 248, the
#:   second 152, the TMA warp 56).
#: - One CTA, 256 tokens: launch at 168 (384 x 168 <= 65536), both consumers 240 (a
#:   128-register accumulator plus the expansion; the main loop does not spill), the TMA
#:   warp 24. Shared memory: three slots of 73 KiB.
#: - Two CTAs, 64 tokens: launch at 80 (2 x 384 x 80 <= 65536), consumers 104 and 112 from
#:   a TMA warp at 24; shared memory holds two at 4 stages (2 x 100 KiB).
SM_REGISTERS = {
    (1, 64): (152, 152, 56),
    (1, 128): (152, 152, 56),
    (1, 256): (168, 240, 24),
    (2, 64): (80, 112, 24),
}
CTAS_PER_SM_CHOICES = tuple(sorted({ctas for ctas, _ in SM_REGISTERS}))

#: a consumer warpgroup's register layouts: its weight bytes [4, 16, 64] (warp w's rows
#: 16w.., thread (g, c) bytes 16c..16c+15 of rows g and g + 8), and their [4, 16, 8, 8]
#: view by scale block (the dequantizers' packs of 4 bytes along the last dim)
WG_BYTES = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 8, 4], [4, 1, 1], [2, 1, 0]))
WG_BLOCKS = gl.constexpr(gl.BlockedLayout([1, 1, 2, 8], [1, 8, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0]))

#: weight bytes are read by threads, never by an MMA: no swizzle (a warp's 128-bit
#: loads of 8 rows x 64 bytes are 512 contiguous bytes, conflict-free)
_W_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


@gluon.jit
def _scales(chunks, NW: gl.constexpr):
    """The [4, 256] smem slot of two 512-byte scale chunks (K steps 2i, 2i + 1 of one
    128-row block) as [NW, 16, 8]: warp w's 16 rows, 8 blocks of 16 K. Byte ``512 kc +
    (r % 32) * 16 + (r // 32) * 4 + g`` is row r's scale of block ``4 kc + g``."""
    v = chunks.reshape([2, 2, 16, 4, 4])  # (kc, (r % 32) // 16, r % 16, r // 32, g)
    return v.permute((3, 1, 2, 0, 4)).reshape([NW, 16, 8])


@gluon.jit
def _issue(w_desc, s_desc, x_desc, bar, w_buf, s_buf, x_bufs, slot, n0, s_row0, m0, kt, ok):
    """TMA loads of K step ``kt`` into ring slot ``slot`` (when ``ok``)."""
    _issue_weights(w_desc, s_desc, x_desc, bar, w_buf, s_buf, n0, s_row0, kt, ok)
    _issue_acts(x_desc, bar, x_bufs, slot, m0, kt, ok)


@gluon.jit
def _issue_weights(w_desc, s_desc, x_desc, bar, w_buf, s_buf, n0, s_row0, kt, ok):
    """The first half of `_issue`: the slot's expected bytes (all of the step's), then
    the TMA loads of its weight bytes and scale chunks."""
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + s_desc.block_type.nbytes
                            + 2 * x_desc.block_type.nbytes)  # fmt: skip
    mbarrier.expect(bar, nbytes, pred=ok)
    _tma_load(w_desc, [n0, kt * 64], bar, w_buf, pred=ok)
    _tma_load(s_desc, [s_row0 + 4 * kt, 0], bar, s_buf, pred=ok)


@gluon.jit
def _issue_acts(x_desc, bar, x_bufs, slot, m0, kt, ok):
    """The second half of `_issue`: the TMA loads of the step's two activation boxes."""
    _tma_load(x_desc, [m0, kt * 128], bar, x_bufs.index(2 * slot), pred=ok)
    _tma_load(x_desc, [m0, kt * 128 + 64], bar, x_bufs.index(2 * slot + 1), pred=ok)


@gluon.jit
def _fill_ring(w_desc, s_desc, x_desc, ready, w_bufs, s_bufs, x_bufs, n0, s_row0, m0, kt0,
               n_steps, PDL: gl.constexpr):  # fmt: skip
    """The loads of the ring's first ``STAGES`` steps. With ``PDL`` (the kernel launched
    while `_dot_order_pass` runs: `fp4_dispatch.backends.pdl`) the weight bytes and
    scales of every slot go first, then the wait for the pass, then the activations."""
    STAGES: gl.constexpr = w_bufs.shape[0]
    for j in gl.static_range(STAGES):
        _issue_weights(w_desc, s_desc, x_desc, ready.index(j), w_bufs.index(j),
                       s_bufs.index(j), n0, s_row0, kt0 + j, j < n_steps)  # fmt: skip
        if not PDL:
            _issue_acts(x_desc, ready.index(j), x_bufs, j, m0, kt0 + j, j < n_steps)
    if PDL:
        pdl.gdc_wait()
        for j in gl.static_range(STAGES):
            _issue_acts(x_desc, ready.index(j), x_bufs, j, m0, kt0 + j, j < n_steps)


@gluon.jit
def _refill(w_desc, s_desc, x_desc, ready, w_bufs, s_bufs, x_bufs, i, n0, s_row0, m0, kt0,
            n_steps):  # fmt: skip
    """Step ``i``'s MMA has finished in every warp: load step ``i + STAGES`` into its slot
    (one CTA barrier: both warpgroups are done with the slot)."""
    STAGES: gl.constexpr = w_bufs.shape[0]
    slot = i % STAGES
    cta_barrier()
    nxt = i + STAGES
    _issue(w_desc, s_desc, x_desc, ready.index(slot), w_bufs.index(slot), s_bufs.index(slot),
           x_bufs, slot, n0, s_row0, m0, kt0 + nxt, nxt < n_steps)  # fmt: skip


@gluon.jit
def _expand_slot(w_bufs, s_bufs, x_bufs, ready, i, STAGES: gl.constexpr, NW: gl.constexpr,
                 WL: gl.constexpr, L4: gl.constexpr, A_L: gl.constexpr):  # fmt: skip
    """Wait for step ``i``'s slot and expand its weights: the two K halves of the A
    operand ([128, 64] each, in `A_L`)."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    w = w_bufs.index(slot).reshape([NW, 16, 64]).load(WL)
    s = _scales(s_bufs.index(slot), NW).load(gl.SliceLayout(3, L4))
    a = expand_dot_order(w, s, x_bufs.dtype, NW, 16, L4)  # [NW, 16, 128]: kd's top bit is i1
    a = a.reshape([NW * 16, 2, 64]).permute((0, 2, 1))
    a0, a1 = gl.split(a)
    return gl.convert_layout(a0, A_L), gl.convert_layout(a1, A_L)


@gluon.jit
def _mma_step(a0, a1, x_bufs, slot, acc):
    """The two async ``wgmma`` of one step (K halves of 64)."""
    acc = warpgroup_mma(a0, x_bufs.index(2 * slot).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(a1, x_bufs.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)


@gluon.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_rs_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                     M, N, K, stride_om, stride_on, has_bias, s_chunks,
                     SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                     PDL: gl.constexpr):  # fmt: skip
    # s_chunks: 512-byte scale chunks per 128-row block (padded K / 64); the scale
    # descriptor views the swizzled scales as rows of 256 bytes, two rows a chunk
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    NW: gl.constexpr = BN // 16
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)

    pid, pid_k, pid_n, n0, m0 = tile_origin(N, BN, BT)
    kt0, n_steps = split_steps(K // 128, pid_k, SPLIT_K)
    s_row0 = pid_n * s_chunks * 2

    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 64], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, 256], s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BT, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    fence_async_shared()
    _fill_ring(w_desc, s_desc, x_desc, ready, w_bufs, s_bufs, x_bufs, n0, s_row0, m0, kt0,
               n_steps, PDL)  # fmt: skip

    acc = gl.zeros([BN, BT], gl.float32, ACC)
    if n_steps > 0:
        a0, a1 = _expand_slot(w_bufs, s_bufs, x_bufs, ready, 0, STAGES, NW, WL, L4, A_L)
        for i in range(n_steps - 1):
            acc = _mma_step(a0, a1, x_bufs, i % STAGES, acc)
            b0, b1 = _expand_slot(w_bufs, s_bufs, x_bufs, ready, i + 1, STAGES, NW, WL, L4, A_L)
            acc = warpgroup_mma_wait(0, deps=(acc, a0, a1))[0]
            a0, a1 = b0, b1
            _refill(w_desc, s_desc, x_desc, ready, w_bufs, s_bufs, x_bufs, i, n0, s_row0, m0,
                    kt0, n_steps)  # fmt: skip
        acc = _mma_step(a0, a1, x_bufs, (n_steps - 1) % STAGES, acc)
        acc = warpgroup_mma_wait(0, deps=(acc, a0, a1))[0]

    store_tile(acc, n0, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, pid, pid_k, SPLIT_K)  # fmt: skip


@gluon.jit
def _consumer(p, WG: gl.constexpr, SPLIT_K: gl.constexpr):
    """Warpgroup ``WG``: rows ``64 WG .. 64 WG + 63`` of the CTA's weights, every step:
    expand (registers) -> two ``wgmma`` -> release the slot; then its own epilogue."""
    (w_bufs, s_bufs, x_bufs, ready, empty, n_steps, n0, m0, alpha_ptr, bias_ptr, has_bias,
     out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, stride_on, pid, pid_k) = p  # fmt: skip
    STAGES: gl.constexpr = w_bufs.shape[0]
    BT: gl.constexpr = x_bufs.shape[1]
    WL: gl.constexpr = WG_BYTES
    L4: gl.constexpr = WG_BLOCKS
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    acc = gl.zeros([64, BT], gl.float32, ACC)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        w = w_bufs.index(slot).reshape([8, 16, 64]).slice(4 * WG, 4).load(WL)
        # all 128 rows' scales (a 4-warp layout holds row groups w and w + 4 per warp),
        # then this warpgroup's half
        sc = _scales(s_bufs.index(slot), 8).load(gl.SliceLayout(3, L4))
        s_lo, s_hi = gl.split(sc.reshape([2, 4, 16, 8]).permute((1, 2, 3, 0)))
        sc = gl.convert_layout(s_lo if WG == 0 else s_hi, gl.SliceLayout(3, L4))
        a = expand_dot_order(w, sc, x_bufs.dtype, 4, 16, L4).reshape([64, 2, 64])
        a0, a1 = gl.split(a.permute((0, 2, 1)))
        a0 = gl.convert_layout(a0, A_L)
        a1 = gl.convert_layout(a1, A_L)
        acc = _mma_step(a0, a1, x_bufs, slot, acc)
        acc = warpgroup_mma_wait(0, deps=(acc, a0, a1))[0]
        mbarrier.arrive(empty.index(slot), count=1)
    store_tile(acc, n0 + 64 * WG, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr,
               M, N, stride_om, stride_on, 2 * pid + WG, pid_k, SPLIT_K)  # fmt: skip
    return ()


@gluon.jit
def _producer(p, PDL: gl.constexpr):
    """One warp: the TMA loads of every step, each into a slot both warpgroups released
    (the first ``STAGES`` free: `_fill_ring`, which waits for the pass under ``PDL``)."""
    (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, s_row0, m0, kt0,
     n_steps) = p  # fmt: skip
    STAGES: gl.constexpr = w_bufs.shape[0]
    _fill_ring(w_desc, s_desc, x_desc, ready, w_bufs, s_bufs, x_bufs, n0, s_row0, m0, kt0,
               n_steps, PDL)  # fmt: skip
    for i in range(STAGES, n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a new barrier: passes
        _issue(w_desc, s_desc, x_desc, ready.index(slot), w_bufs.index(slot),
               s_bufs.index(slot), x_bufs, slot, n0, s_row0, m0, kt0 + i, True)  # fmt: skip


@gluon.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_rs_ws_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                        M, N, K, stride_om, stride_on, has_bias, s_chunks,
                        SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                        REGS: gl.constexpr, TMA_REGS: gl.constexpr,
                        PDL: gl.constexpr):  # fmt: skip
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid, pid_k, pid_n, n0, m0 = tile_origin(N, BN, BT)
    kt0, n_steps = split_steps(K // 128, pid_k, SPLIT_K)
    rs_ws_tile(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, has_bias, n0, n0, pid_n * s_chunks * 2, m0, kt0, n_steps,
               pid, pid_k, SPLIT_K, STAGES, REGS, TMA_REGS, PDL)  # fmt: skip


@gluon.jit
def ring_buffers(x_desc, w_desc, s_desc, STAGES: gl.constexpr):
    """The specialized kernels' TMA ring (`_producer` fills it): ``STAGES`` slots of a K
    step's weight bytes [BN, 64], its two scale chunks and two activation boxes [BT, 64]
    (of ``x_desc``'s dtype), with a ``ready`` barrier (the TMA's bytes) and an ``empty``
    one (both consumer warpgroups released the slot) each."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 64], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, 256], s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BT, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)
    fence_async_shared()
    return w_bufs, s_bufs, x_bufs, ready, empty


@gluon.jit
def rs_ws_tile(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, has_bias, w_row0, n0, s_row0, m0, kt0, n_steps, tile_id,
               pid_k, SPLIT_K: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr,
               TMA_REGS: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """One CTA's tile of the specialized kernel: ``n_steps`` K steps from ``kt0``, the
    weight bytes from descriptor row ``w_row0`` (scales from chunk row ``s_row0``), the
    tokens from row ``m0``; stored to output columns ``n0..`` and rows below ``M``
    (split-K tile ids ``2 tile_id + warpgroup``). Shared by the dense kernel and the
    grouped one (`gemm_grouped_rs`: one expert's rows of the stacked weights)."""
    w_bufs, s_bufs, x_bufs, ready, empty = ring_buffers(x_desc, w_desc, s_desc, STAGES)
    cons = (w_bufs, s_bufs, x_bufs, ready, empty, n_steps, n0, m0, alpha_ptr, bias_ptr, has_bias,
            out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, stride_on, tile_id, pid_k)  # fmt: skip
    prod = (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, w_row0, s_row0, m0,
            kt0, n_steps)  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (cons, 0, SPLIT_K)), (_consumer, (cons, 1, SPLIT_K)),
         (_producer, (prod, PDL))],
        [4, 1],
        [REGS, TMA_REGS],
    )  # fmt: skip


@triton.jit
def _dot_order_pass(x_ptr, out_ptr, M, K, stride_xm, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """``out[r, 128 b + kd] = x[r, 128 b + nat(kd)]`` in the order of
    `gemm_w4a16_mma.expand_dot_order` (`gemm_w4a16_mma.dot_order` is the host twin): the
    order only permutes the seven bits of the index within a 128-wide block, so each
    block is loaded and stored contiguously and permuted in registers (a reshape to the
    bits and a permute). Plain Triton: runs under the interpreter. With ``PDL`` every
    program first lets the GEMM launch (`fp4_dispatch.backends.pdl`)."""
    if PDL:
        pdl.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None]
    r64 = rows[:, None].to(tl.int64)
    v = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask)
    v = tl.reshape(v, [BLOCK_R, 4, 2, 2, 2, 2, 2])  # natural (c, i1, i0, t, e, h)
    v = tl.reshape(tl.permute(v, (0, 2, 3, 4, 6, 1, 5)), [BLOCK_R, 128])  # (i1, i0, t, h, c, e)
    tl.store(out_ptr + r64 * K + cols[None, :], v, mask=mask)


#: rows per CTA of `_dot_order_pass` (128 K columns each)
PASS_ROWS = 16
_PASS_LAUNCH = CachedLauncher(_dot_order_pass)


def dot_order_into(a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous, ``a``'s shape and dtype) = ``a`` in the dot's K order, one
    launch (`_dot_order_pass`); ``a`` needs K % 128 == 0 and unit stride along K."""
    m, k = a.shape
    bound = _pass_binding()
    args = (a, out, m, k, a.stride(0))
    launch_aligned(bound, (m, k, a.stride(0), a.dtype), (-(-m // PASS_ROWS), k // 128), args,
                   (a, out))  # fmt: skip
    return out


def dot_order_kept(a: torch.Tensor, acts: Scratch, views: dict) -> torch.Tensor:
    """``a`` in the dot's K order (`dot_order_into`) in a buffer kept in `acts`: a view per
    (M, K, dtype, device) made once and kept in `views`, so no slicing on the hot path
    (the first call of a shape allocates, outside CUDA-graph pools: make it outside
    capture)."""
    key = (*a.shape, a.dtype, a.get_device())
    x = views.get(key)
    if x is None:
        m, k = a.shape
        buf, _ = acts.get(a.device, m * k // 2, 0)
        x = views[key] = buf.view(a.dtype)[: m * k].view(m, k)
    return dot_order_into(a, x)


@functools.cache
def _pass_binding() -> BoundLaunch:
    return _PASS_LAUNCH.bind({"BLOCK_R": PASS_ROWS, "PDL": pdl.ENABLED}, 4)


# ---- host side ------------------------------------------------------------------------


def why_unsupported(operands: W4A16Operands) -> str | None:
    """Why this kernel cannot run ``operands`` (None if it can): bf16 or fp16
    activations with unit stride along K, K % 128 == 0, natural weight bytes."""
    a = operands.a
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"a: expected bfloat16 or float16 activations, got {a.dtype}"
    if a.shape[1] % STEP_K:
        return f"a: expected K % {STEP_K} == 0, got K={a.shape[1]}"
    if a.shape[1] > 1 and a.stride(1) != 1:
        return f"a: expected unit stride along K, got strides {tuple(a.stride())}"
    if getattr(operands, "prepared", False):
        return "b_data: expected natural weight bytes, got the sm90-prepared layout"
    return None


def check_ring_knobs(cfg: object, block_m_choices: tuple[int, ...]) -> None:
    """A specialized rs config's ``block_m`` (one of `block_m_choices`), ``stages`` (one of
    `STAGES_CHOICES`) and ``split_k`` (>= 1), or a ValueError naming the knob."""
    for name, choices in (("block_m", block_m_choices), ("stages", STAGES_CHOICES)):
        if getattr(cfg, name) not in choices:
            raise ValueError(f"{name}: expected one of {choices}, got {getattr(cfg, name)}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k: expected >= 1, got {cfg.split_k}")


@dataclass(frozen=True)
class RsConfig:
    """Compile-time knobs: ``block_m`` tokens per CTA (the MMA's N); ``split_k`` CTAs per
    output tile along K (the workspace protocol of `splitk`); ``stages`` TMA ring slots;
    ``specialized`` the warp-specialized kernel; ``ctas_per_sm`` (specialized, 64 tokens)
    the CTAs one SM holds at once: 2 launches with the register budget of `SM_REGISTERS`
    that lets two reside (a grid over one wave then runs in one)."""

    block_m: int = 128
    split_k: int = 1
    stages: int = 3
    specialized: bool = False
    ctas_per_sm: int = 1

    block_n: ClassVar[int] = BLOCK_N
    block_k: ClassVar[int] = STEP_K

    def __post_init__(self) -> None:
        check_ring_knobs(self, BLOCK_M_CHOICES)
        if self.ctas_per_sm not in CTAS_PER_SM_CHOICES:
            raise ValueError(f"ctas_per_sm: expected one of {CTAS_PER_SM_CHOICES}, got "
                             f"{self.ctas_per_sm}")  # fmt: skip
        budgets = tuple(bm for ctas, bm in SM_REGISTERS if ctas == self.ctas_per_sm)
        if self.ctas_per_sm > 1 and not (self.specialized and self.block_m in budgets):
            got = f"specialized={self.specialized}, block_m={self.block_m}"
            raise ValueError(f"ctas_per_sm={self.ctas_per_sm}: expected specialized=True and "
                             f"block_m in {budgets} (the register budgets of SM_REGISTERS), "
                             f"got {got}")  # fmt: skip


@dataclass
class RsKernel(DenseKernel):
    """A built kernel: ``kernel(operands, out)``; ``out = alpha * a @ dequant(b).T`` plus
    ``operands.bias``. Each call first writes the activations in the dot's K order into a
    kept buffer (`dot_order_into`; made outside CUDA-graph pools on the first call of a
    shape: run that call outside capture), then launches the GEMM. Inputs it cannot read
    run the direct kernel (`why_unsupported`)."""

    cfg: RsConfig
    #: the GEMM launches with PDL (`fp4_dispatch.backends.pdl`) where it holds one CTA an
    #: SM (`launches_with_pdl`): the TMA warp loads the ring's first weight steps while
    #: the activations' pass runs (False: after it)
    pdl: bool = True
    _acts: Scratch = field(default_factory=Scratch, repr=False)
    _views: dict = field(default_factory=dict, repr=False)
    #: not stated for torch.compile: host TMA descriptors, ``maxnreg`` and the kept
    #: activation views (`dot_order_kept`); compiled calls keep the custom op
    trace: ClassVar = None

    def __call__(self, operands: W4A16Operands, out: torch.Tensor) -> None:
        if why_unsupported(operands) is not None:
            # what this kernel cannot read runs the direct kernel: a raised error would
            # mark the tactic broken for every later call of the dispatcher
            _direct_fallback()(operands, out)
            return
        a = self.permute_activations(operands.a)
        self.launch(a, operands, out, with_pdl=self.launches_with_pdl)

    @property
    def launches_with_pdl(self) -> bool:
        """`pdl`, for one CTA an SM only. Measured on the H200 (RESULTS.md "Hopper
        W4A16" run 12, the removed ``bench_pdl.py``): PDL took every one-CTA pick's call to
        0.955-0.999x its time (20 shapes, M 64-256) and three of the four two-CTA picks'
        to 1.016-1.036x. The suspected cause: a pass CTA still on an SM leaves room for
        one GEMM CTA there, not two, so the grid spreads unevenly."""
        return self.pdl and self.cfg.ctas_per_sm == 1

    def permute_activations(self, a: torch.Tensor) -> torch.Tensor:
        """``a`` in the dot's K order (`dot_order`), in this kernel object's kept buffer
        (`dot_order_kept`)."""
        return dot_order_kept(a, self._acts, self._views)

    def launch(
        self, x: torch.Tensor, operands: W4A16Operands, out: torch.Tensor, with_pdl: bool = False
    ) -> None:
        """The GEMM on activations ``x`` already in the dot's K order; ``with_pdl`` only
        right after the kernel that wrote ``x`` (`dot_order_into`: the contract of
        `fp4_dispatch.backends.pdl`)."""
        b, s = operands.b_data, operands.b_scale
        m, k = x.shape
        n = b.shape[0]
        grid, ws, cnt = self.launch_space(m, n, out)
        bias = out if operands.bias is None else operands.bias
        so0, so1 = out.stride()
        args = (*self._descriptors(x, b, s), operands.alpha, bias, out, ws, cnt, m, n, k,
                so0, so1, int(operands.bias is not None), s.shape[1] // 4)  # fmt: skip
        key = (m, n, k, so0, so1, out.dtype, bias.dtype)
        bound = self._binding(with_pdl)
        launch_aligned(bound, key, grid, args, (operands.alpha, bias, out, ws, cnt))
        self.compiled = bound.last_compiled

    def _binding(self, with_pdl: bool) -> BoundLaunch:
        bound = self._bound.get(with_pdl)
        if bound is None:
            options = pdl.launch_options(with_pdl)
            meta = {"SPLIT_K": self.cfg.split_k, "STAGES": self.cfg.stages, "PDL": bool(options)}
            if self.cfg.specialized:
                launch, consumer, tma = SM_REGISTERS[self.cfg.ctas_per_sm, self.cfg.block_m]
                meta |= {"REGS": consumer, "TMA_REGS": tma}
                bound = _RS_WS_LAUNCH.bind(meta, 4, maxnreg=launch, **options)
            else:
                bound = _RS_LAUNCH.bind(meta, BLOCK_N // 16, **options)
            self._bound[with_pdl] = bound
        return bound

    @property
    def counters_per_tile(self) -> int:
        """The specialized kernel's warpgroups store their 64-row halves as two split-K
        tiles (ids ``2 * tile + warpgroup``): two counters a tile."""
        return 2 if self.cfg.specialized else 1

    def _descriptors(self, x: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple:
        """TMA descriptors of the dot-ordered activations, weight bytes and scale chunks."""
        (m, k), n, bm = x.shape, b.shape[0], self.cfg.block_m
        x_desc = _descriptor(x, [m, k], [k, 1], [bm, 64], _x_layout(bm))
        w_desc = _descriptor(b, [n, k // 2], [k // 2, 1], [BLOCK_N, 64], _W_LAYOUT)
        return x_desc, w_desc, gemm_w4a16_ws.scale_descriptor(s, 2)

    def precompile(
        self, m: int, n: int, k: int, dtype: torch.dtype, prepared: bool = False
    ) -> object:
        """Compile the GEMM for these sizes and a ``dtype`` output, launching nothing."""
        if prepared:
            raise ValueError("prepared: this kernel reads natural weight bytes")
        args = gemm_w4a16_ws.meta_launch_args(self, m, n, k, dtype)
        return self._binding(self.launches_with_pdl).warmup(self.grid(m, n), args)


_RS_LAUNCH = CachedLauncher(_w4a16_rs_kernel)
_RS_WS_LAUNCH = CachedLauncher(_w4a16_rs_ws_kernel)


def _direct_fallback() -> DenseKernel:
    """The direct kernel for inputs `RsKernel` cannot read (`why_unsupported`): the ws
    kernel's fallback (128 weight rows x 64 tokens), any K % 32, either byte order."""
    return gemm_w4a16_ws._direct_fallback()


def build(cfg: RsConfig) -> RsKernel:
    """A kernel object for `cfg` (Triton compiles on the first call)."""
    return RsKernel(cfg)
