"""Hopper (sm90) W4A16 GEMM with warp specialization (Gluon): dequantizing warps feed the MMA.

``out[M, N] = alpha * x[M, K] @ dequant(W)[N, K].T`` with the operands of `gemm_w4a16`
(bf16 activations, NVFP4 weight bytes in natural order, 128x4-swizzled e4m3 scales).

Why a second direct kernel. In `gemm_w4a16._w4a16_kernel` the same warps load, expand
the weights in registers and issue the MMA, in lock step with CTA-wide barriers; at 64-256
tokens its tensor pipe was busy 32-45% of the time on the H200 (Nsight Compute, RESULTS.md
"Hopper W4A16" run 6), where bf16 cuBLAS keeps it near 70%. Here each CTA runs
partitions that meet in shared memory:

- ``deq_parts`` **dequant partitions** (4 warps each; 3 measured best) take every
  ``deq_parts``-th 64-wide K step: each streams its steps' weight bytes and scale chunks
  by TMA into a ring of ``stages`` slots, expands them to bf16 with the packed PTX
  dequantizer of `gemm_w4a16` (``e2m1 * scale * 2**-14``, exact) and writes the tile, in
  natural K order, to its ring of ``deq_stages`` MMA-ready tiles. Several partitions,
  because one chain of expansion is latency-bound (its warps issued every ~8 cycles):
  at 64x8192² (split 2) one partition ran 44.9 µs, two 37.2, three 36.3, four 36.8
  (RESULTS.md run 6, exploration);
- the **MMA partition** (the default 4 warps, one warpgroup) streams the activation tile
  by TMA and issues ``wgmma`` with both operands in shared memory, one group in flight,
  then runs the epilogue (``alpha * 2**14``, bias in fp32, one rounding, masked store
  through ``out``'s strides; split-K through the workspace protocol of `splitk`).

No CTA-wide barrier in the main loops and no register permutation of the activations
(both operands are in natural K order). mbarriers hand the slots over (ready: filled;
empty: consumed), and each partition syncs only its own warps (one barrier a step, before
its hand-over). Per 64-wide step a dequant thread runs 296 SASS instructions for its 64
values (sm_90 cubin, Triton 3.6): 195 of them the expansion and the K interleave.

Host side: TMA descriptors are made per call without their checks (`_descriptor`), and
the launch goes through `triton_launch.CachedLauncher` (a warm call skips Triton's
argument binding; descriptors are part of its key).

Shapes: any M, N >= 1 (TMA zero-fills rows past M and N and K past the end; scale
groups past K are zeroed in-kernel; stores are masked); ``K % 32 == 0``; ``x`` bf16 with
unit stride along K, a row stride of a multiple of 8 elements and a 16-byte aligned base
(TMA), as `check_tma` says, and natural weight bytes; other inputs run the direct kernel
(`_direct_fallback`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4_dispatch.backends.sm90 import gemm_w4a16
from fp4_dispatch.backends.sm90.epilogue_gluon import (
    cta_barrier,
    split_steps,
    store_tile,
    tile_origin,
)
from fp4_dispatch.backends.sm90.gemm_w4a16 import _BF16_NATURAL, DenseKernel, W4A16Operands
from fp4_dispatch.backends.triton_launch import BoundLaunch, CachedLauncher, launch_aligned
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

#: K elements per pipeline step: 32 weight bytes a row (TMA needs 16+ bytes inner box)
#: and one 512-byte chunk of the swizzled scales (4 groups of 16) per 128-row block
STEP_K = 64
BLOCK_N = 128  # weight rows per CTA: one 128-row block of the scale layout
BLOCK_M_CHOICES = (16, 32, 64, 128)
STAGES_CHOICES = (2, 3, 4, 6)
DEQ_STAGES_CHOICES = (1, 2, 3)

_DEQUANT_ASM = gl.constexpr(_BF16_NATURAL)

#: the TMA load builtin: ``async_load`` since Triton 3.7, ``async_copy_global_to_shared``
#: before (the H200 image has 3.6, CI 3.9; same arguments)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@dataclass(frozen=True)
class WsConfig:
    """Compile-time knobs.

    ``block_m`` tokens per CTA (the MMA's N); ``split_k`` CTAs per output tile along K
    (the deterministic workspace reduction of `splitk`); ``stages`` slots of each TMA
    ring; ``deq_parts`` dequant partitions of 4 warps (each expands every
    ``deq_parts``-th K step: independent chains that share the SM's schedulers);
    ``deq_stages`` expanded tiles per partition; ``deq_regs`` the registers of each
    dequant warp (setmaxnreg; the MMA warps get the rest of ``maxnreg``).
    """

    block_m: int = 64
    split_k: int = 1
    stages: int = 4
    deq_parts: int = 3
    deq_stages: int = 1
    deq_regs: int = 80
    maxnreg: int = 104

    block_n: ClassVar[int] = BLOCK_N

    def __post_init__(self) -> None:
        for name, choices in (
            ("block_m", BLOCK_M_CHOICES),
            ("stages", STAGES_CHOICES),
            ("deq_parts", (2, 3)),
            ("deq_stages", DEQ_STAGES_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)}")
        if self.split_k < 1:
            raise ValueError(f"split_k: expected >= 1, got {self.split_k}")


@gluon.jit
def _dequant_step(w_bytes, s, k_left, BN: gl.constexpr, L3: gl.constexpr):
    """One K step of weights: bytes [BN, 32] and their scales [BN, 4] (raw e4m3 bytes) ->
    [BN, 64] bf16 in natural K order, each ``e2m1 * scale * 2**-14`` exactly. Scale groups
    at or past ``k_left`` K elements are zeroed: the padded scales may hold anything (NaN),
    and TMA's zero-filled bytes times NaN would be NaN."""
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    s = s.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 5.192296858534828e33  # 2**112
    s = gl.where(gl.expand_dims(g * 16 < k_left, 0), s, 0.0)
    w = gl.convert_layout(w_bytes.reshape([BN, 4, 8]), L3)
    s_b, w = gl.broadcast(gl.expand_dims(s.to(gl.bfloat16), 2), w)
    lo, hi = gl.inline_asm_elementwise(
        _DEQUANT_ASM,
        "=r,=r,=r,=r,r,r,r",
        [w, s_b],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )
    return gl.join(lo, hi).reshape([BN, 2 * 32])


@gluon.jit
def _scales_view(chunk, BN: gl.constexpr):
    """The [2, 256] smem view of a 512-byte scale chunk as [BN, 4]: byte
    ``(r % 32) * 16 + (r // 32) * 4 + g`` is row r's scale of group g."""
    return chunk.reshape([32, 4, 4]).permute((1, 0, 2)).reshape([BN, 4])


@gluon.jit
def _dequant_partition(p, NPART: gl.constexpr, PART: gl.constexpr):
    """Weights of every ``NPART``-th K step (from ``PART``): TMA ring of bytes and scale
    chunks -> expanded tiles for the MMA partition. ``p``: descriptors, rings, barriers
    and the tile's coordinates (`_w4a16_ws_kernel`)."""
    (w_desc, s_desc, w_bufs, s_bufs, w_ready, deq_bufs, deq_ready, deq_empty, n0, s_row0, kt0,
     n_steps, K) = p  # fmt: skip
    STAGES: gl.constexpr = w_bufs.shape[0] // NPART
    DEQ: gl.constexpr = deq_bufs.shape[0] // NPART
    BN: gl.constexpr = w_bufs.shape[1]
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
    n_mine = gl.cdiv(gl.maximum(n_steps - PART, 0), NPART)
    for i in gl.static_range(STAGES):
        kt = kt0 + PART + i * NPART
        ok = i < n_mine
        bar = w_ready.index(PART * STAGES + i)
        mbarrier.expect(bar, nbytes, pred=ok)
        _tma_load(w_desc, [n0, kt * 32], bar, w_bufs.index(PART * STAGES + i), pred=ok)
        _tma_load(s_desc, [s_row0 + 2 * kt, 0], bar, s_bufs.index(PART * STAGES + i), pred=ok)
    for j in range(n_mine):
        slot = PART * STAGES + j % STAGES
        mbarrier.wait(w_ready.index(slot), (j // STAGES) & 1)
        w_bytes = w_bufs.index(slot).load(w_layout)
        s = _scales_view(s_bufs.index(slot), BN).load(gl.SliceLayout(2, L3))
        kt = kt0 + PART + j * NPART
        v = _dequant_step(w_bytes, s, K - kt * 64, BN, L3)
        d = PART * DEQ + j % DEQ
        mbarrier.wait(deq_empty.index(d), ((j // DEQ) & 1) ^ 1)
        deq_bufs.index(d).store(v)
        fence_async_shared()
        # one barrier for both hand-overs: every warp has written its part of the tile
        # (for the MMA) and read the raw slot (before TMA refills it)
        cta_barrier()
        mbarrier.arrive(deq_ready.index(d), count=1)
        nxt = j + STAGES
        ok = nxt < n_mine
        kt_next = kt + STAGES * NPART
        bar = w_ready.index(slot)
        mbarrier.expect(bar, nbytes, pred=ok)
        _tma_load(w_desc, [n0, kt_next * 32], bar, w_bufs.index(slot), pred=ok)
        _tma_load(s_desc, [s_row0 + 2 * kt_next, 0], bar, s_bufs.index(slot), pred=ok)


@gluon.jit
def _mma_partition(p, NPART: gl.constexpr):
    """Activations: TMA ring -> wgmma against the expanded weights; returns the fp32
    accumulator [BN, BM] (weight rows x tokens)."""
    x_desc, x_bufs, x_ready, deq_bufs, deq_ready, deq_empty, m0, kt0, n_steps = p
    STAGES: gl.constexpr = x_bufs.shape[0]
    DEQ: gl.constexpr = deq_bufs.shape[0] // NPART
    BM: gl.constexpr = x_bufs.shape[1]
    BN: gl.constexpr = deq_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
    )
    nbytes: gl.constexpr = x_desc.block_type.nbytes
    for i in gl.static_range(STAGES):
        bar = x_ready.index(i)
        ok = i < n_steps
        mbarrier.expect(bar, nbytes, pred=ok)
        _tma_load(x_desc, [m0, (kt0 + i) * 64], bar, x_bufs.index(i), pred=ok)
    acc = gl.zeros([BN, BM], gl.float32, acc_layout)
    for kt in range(n_steps):
        slot = kt % STAGES
        j = kt // NPART
        d = (kt % NPART) * DEQ + j % DEQ
        mbarrier.wait(x_ready.index(slot), (kt // STAGES) & 1)
        mbarrier.wait(deq_ready.index(d), (j // DEQ) & 1)
        x_t = x_bufs.index(slot).permute((1, 0))  # [64, BM]: K-major, as loaded
        acc = warpgroup_mma(deq_bufs.index(d), x_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # step kt - 1 has finished: its expanded tile and activation slot are free
        prev = gl.maximum(kt - 1, 0)
        d_prev = (prev % NPART) * DEQ + (prev // NPART) % DEQ
        mbarrier.arrive(deq_empty.index(d_prev), count=1, pred=kt > 0)
        nxt = prev + STAGES
        ok = (kt > 0) & (nxt < n_steps)
        bar = x_ready.index(prev % STAGES)
        mbarrier.expect(bar, nbytes, pred=ok)
        _tma_load(x_desc, [m0, (kt0 + nxt) * 64], bar, x_bufs.index(prev % STAGES), pred=ok)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc,)),)  # a tuple: warp_specialize


@gluon.jit
def _barriers(n: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit(do_not_specialize=["M", "N", "has_bias"])
def _w4a16_ws_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                     M, N, K, stride_om, stride_on, has_bias, s_chunks, SPLIT_K: gl.constexpr,
                     STAGES: gl.constexpr, NPART: gl.constexpr, DEQ_STAGES: gl.constexpr,
                     DEQ_REGS: gl.constexpr):  # fmt: skip
    # s_chunks: 512-byte scale chunks per 128-row block (padded K / 64): the scale
    # descriptor views the swizzled scales as rows of 256 bytes, two rows a chunk
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid, pid_k, pid_n, n0, m0 = tile_origin(N, BN, BM)
    kt0, n_steps = split_steps(gl.cdiv(K, 64), pid_k, SPLIT_K)

    w_bufs = gl.allocate_shared_memory(gl.uint8, [NPART * STAGES, BN, 32], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [NPART * STAGES, 2, 256], s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 64], x_desc.layout)
    deq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
    deq_bufs = gl.allocate_shared_memory(gl.bfloat16, [NPART * DEQ_STAGES, BN, 64], deq_layout)
    w_ready = _barriers(NPART * STAGES)
    x_ready = _barriers(STAGES)
    deq_ready = _barriers(NPART * DEQ_STAGES)
    deq_empty = _barriers(NPART * DEQ_STAGES)
    fence_async_shared()

    mma = (x_desc, x_bufs, x_ready, deq_bufs, deq_ready, deq_empty, m0, kt0, n_steps)
    deq = (w_desc, s_desc, w_bufs, s_bufs, w_ready, deq_bufs, deq_ready, deq_empty, n0,
           pid_n * s_chunks * 2, kt0, n_steps, K)  # fmt: skip
    if NPART == 2:
        acc = gl.warp_specialize(
            [(_mma_partition, (mma, NPART)), (_dequant_partition, (deq, NPART, 0)),
             (_dequant_partition, (deq, NPART, 1))],
            [4, 4],
            [DEQ_REGS, DEQ_REGS],
        )[0]  # fmt: skip
    else:
        gl.static_assert(NPART == 3)
        acc = gl.warp_specialize(
            [(_mma_partition, (mma, NPART)), (_dequant_partition, (deq, NPART, 0)),
             (_dequant_partition, (deq, NPART, 1)), (_dequant_partition, (deq, NPART, 2))],
            [4, 4, 4],
            [DEQ_REGS, DEQ_REGS, DEQ_REGS],
        )[0]  # fmt: skip

    store_tile(acc, n0, m0, alpha_ptr, bias_ptr, has_bias, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, pid, pid_k, SPLIT_K)  # fmt: skip


# ---- host side ------------------------------------------------------------------------

_W_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 32], gl.uint8)
#: scale chunks are read whole, never by an MMA: no swizzle
_S_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


@functools.cache
def _x_layout(block_m: int) -> object:
    """The activation tile's shared layout (128-byte swizzle: 64 bf16 a row)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, STEP_K], gl.bfloat16)


def _descriptor(base: torch.Tensor, shape: list, strides: list, block: list, layout: object):
    """A host `TensorDescriptor` without its per-call checks: three of them took 14 µs of
    host time a call on the H200 host (run 6), more than a decode GEMM's GPU time. What they
    check holds by construction here: ``check_tma`` (base and row stride), natural weight
    bytes and scales of the `check_operands` shapes, this module's fixed blocks and layouts.
    Fields not set keep the dataclass defaults (zero padding)."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout = base, shape, strides, block, layout
    return d


def scale_descriptor(s: torch.Tensor, chunks: int):
    """The swizzled scales ``s`` as rows of 256 bytes (two a 512-byte chunk of the 128x4
    swizzle), in boxes of ``chunks`` chunks: one a 64-wide K step (ws), two a 128-wide
    one (`gemm_w4a16_rs`)."""
    rows = s.view(torch.uint8).view(-1, 256)
    return _descriptor(rows, list(rows.shape), [256, 1], [2 * chunks, 256], _S_LAYOUT)


def check_tma(a: torch.Tensor) -> str | None:
    """Why the activations cannot be read by TMA (None if they can): a 16-byte aligned
    base and a row stride of a multiple of 16 bytes (bf16: 8 elements)."""
    if a.dtype != torch.bfloat16:
        return f"a: expected bfloat16 activations, got {a.dtype}"
    if a.data_ptr() % 16:
        return "a: the base address must be 16-byte aligned (TMA)"
    if a.shape[0] > 1 and a.stride(0) % 8:
        return f"a: the row stride must be a multiple of 8 elements (TMA), got {a.stride(0)}"
    return None


@dataclass
class W4A16WsKernel(DenseKernel):
    """A built warp-specialized kernel: ``kernel(operands, out)``; ``out = alpha * a @
    dequant(b).T`` plus ``operands.bias`` (fp32, before the one rounding). The split-K
    workspace and grid are `gemm_w4a16.DenseKernel`'s."""

    cfg: WsConfig
    #: not stated for torch.compile: host TMA descriptors and ``maxnreg``; compiled calls
    #: keep the custom op
    trace: ClassVar = None

    def __call__(self, operands: W4A16Operands, out: torch.Tensor) -> None:
        a, b, s = operands.a, operands.b_data, operands.b_scale
        if check_tma(a) is not None or getattr(operands, "prepared", False):
            # what this kernel cannot read (fp16 activations with a bf16 output, a row
            # stride TMA refuses, prepared bytes) runs the direct kernel: a raised error
            # would mark this tactic broken for every later call of the dispatcher
            _direct_fallback()(operands, out)
            return
        m, k = a.shape
        n = b.shape[0]
        grid, ws, cnt = self.launch_space(m, n, out)
        bias = out if operands.bias is None else operands.bias
        so0, so1 = out.stride()
        args = (*self._descriptors(a, b, s), operands.alpha, bias, out, ws, cnt, m, n, k,
                so0, so1, int(operands.bias is not None), s.shape[1] // 4)  # fmt: skip
        key = (m, n, k, a.stride(0), so0, so1, out.dtype, bias.dtype)
        self._launch(grid, args, key, (operands.alpha, bias, out, ws, cnt))

    def _launch(self, grid: tuple[int, int], args: tuple, key: tuple, tensors: tuple) -> None:
        """Launch through the cached binding (`triton_launch`): a warm call skips
        Triton's argument binding; the descriptors' bases are aligned by construction."""
        bound = self._binding()
        launch_aligned(bound, key, grid, args, tensors)
        self.compiled = bound.last_compiled

    def _binding(self, *_: object) -> BoundLaunch:
        """The launcher binding of this config (its constexprs and ``maxnreg``), made
        once per kernel object: a call does no dict building or key sorting for it."""
        bound = self._bound.get(None)
        if bound is None:
            cfg = self.cfg
            meta = {"SPLIT_K": cfg.split_k, "STAGES": cfg.stages, "NPART": cfg.deq_parts,
                    "DEQ_STAGES": cfg.deq_stages, "DEQ_REGS": cfg.deq_regs}  # fmt: skip
            bound = self._bound[None] = _WS_LAUNCH.bind(meta, 4, maxnreg=cfg.maxnreg)
        return bound

    def _descriptors(self, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple:
        """TMA descriptors of the activations, weight bytes and scale chunks."""
        (m, k), n, bm = a.shape, b.shape[0], self.cfg.block_m
        x_desc = _descriptor(a, [m, k], [a.stride(0), 1], [bm, STEP_K], _x_layout(bm))
        w_desc = _descriptor(b, [n, k // 2], [k // 2, 1], [BLOCK_N, 32], _W_LAYOUT)
        return x_desc, w_desc, scale_descriptor(s, 1)

    def precompile(
        self, m: int, n: int, k: int, dtype: torch.dtype, prepared: bool = False
    ) -> object:
        """Compile what `__call__` launches for contiguous bf16 activations and a
        contiguous ``dtype`` output of these sizes, launching nothing. The descriptors
        are built on meta tensors (Triton specializes on their dtype, block and layout,
        and on the sizes' divisibility, not on their values); M and N are not
        specialized (``do_not_specialize``)."""
        if prepared:
            raise ValueError("prepared: the warp-specialized kernel reads natural weight bytes")
        return self._binding().warmup(self.grid(m, n), meta_launch_args(self, m, n, k, dtype))


def meta_launch_args(kernel, m: int, n: int, k: int, dtype: torch.dtype) -> tuple:
    """The launch arguments of a TMA kernel object (`W4A16WsKernel`, `gemm_w4a16_rs`'s
    `RsKernel`: ``_descriptors`` and ``cfg.split_k``) for contiguous bf16 activations, a
    contiguous ``dtype`` output and these sizes, on meta tensors: what ``precompile``
    compiles without launching."""
    meta = torch.device("meta")
    a = torch.empty((m, k), dtype=torch.bfloat16, device=meta)
    b = torch.empty((n, k // 2), dtype=torch.uint8, device=meta)
    s = torch.empty(swizzled_scale_shape(n, k), dtype=torch.uint8, device=meta)
    ws, cnt = (torch.float32, torch.int32) if kernel.cfg.split_k > 1 else (dtype, dtype)
    return (*kernel._descriptors(a, b, s), torch.float32, dtype, dtype, ws, cnt, m, n, k, n,
            1, 0, s.shape[1] // 4)  # fmt: skip


_WS_LAUNCH = CachedLauncher(_w4a16_ws_kernel)


@functools.cache
def _direct_fallback() -> DenseKernel:
    """The direct kernel for the inputs `W4A16WsKernel` cannot read: 128 weight rows x 64
    tokens, 8 warps (the measured best family at M = 64, RESULTS.md "Hopper W4A16" run 5);
    it takes fp16 or bf16, any row stride and either weight byte order."""
    return gemm_w4a16.build(gemm_w4a16.W4A16Config(block_n=128, block_m=64, num_warps=8,
                                                   num_stages=4, x_dot=True))  # fmt: skip


def build(cfg: WsConfig) -> W4A16WsKernel:
    """A warp-specialized kernel object for `cfg` (Triton compiles on the first call)."""
    return W4A16WsKernel(cfg)
