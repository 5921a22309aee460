"""Hopper (sm90) grouped W4A16 GEMM for a few rows per expert: the register-only decode
kernel of `gemm_w4a16_mma` run per (expert, token tile), in one launch (Gluon).

``out[r] = alpha[e] * A[r] @ dequant(W[e]).T`` for the rows ``r`` of each expert ``e``,
with the operands of `gemm_grouped` (`GroupedOperands`: bf16/fp16 rows sorted by expert,
stacked NVFP4 weights ``[E, N, K]``, ``offsets`` int32 cumulative row ends on the device,
``alpha`` fp32 ``[E]``).

Why a second grouped kernel. At 16 tokens of a 128-expert, top-8 layer (128 rows over
~80 experts, 1-2 rows each) the Triton grouped kernel's best tactic took 143.8 µs on an
H100 at N=1536, K=2048, where the touched experts' NVFP4 bytes take ~43 µs
(`benchmarks/RESULTS.md`, "Mixture of experts", run 2): its one-row tiles expand every
expert's weight once per row, its 16-row tiles run ``tl.dot`` on a dequantized fp32 tile
reshaped through ``tl.join``. The dense decode kernel of `gemm_w4a16_mma` expands each
weight value once into ``mma.sync``'s registers for up to 16 tokens, with no shared
memory in its loop; here it runs unchanged (`gemm_w4a16_mma.mma_tile`) on one expert's
weight rows and that expert's token tile.

Scheduling is `gemm_grouped`'s, with no host synchronisation (CUDA-graph safe): a grid of
``(N tiles, M-tile bound, split_k)``; each CTA reads the E offsets, finds its (expert,
token tile) by a running sum over the experts' tile counts (`_expert_tile`) and does
nothing past the routing's last tile. Split-K uses the dense kernel's workspace protocol
(`epilogue_gluon.store_tile`: partials, a counter, the last split sums in order) with
one slot per (N tile, M-tile slot) of the grid (`gemm_grouped.GroupedKernel.workspace`).

W4A16 only (dense rows; `GroupedMmaKernel` refuses NVFP4 activations, whose grouped path
is `gemm_grouped`). Shapes: any T, N >= 1, ``K % 32 == 0``. Gluon has no interpreter: CI
compiles this kernel for sm_90 (tests/test_grouped_mma.py), the numerics are checked on
a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp4_dispatch.backends.sm90.epilogue_gluon import store_tile
from fp4_dispatch.backends.sm90.gemm_grouped import GroupedKernel
from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig, even_steps, mma_tile
from fp4_dispatch.backends.triton_launch import CachedLauncher
from fp4_dispatch.contracts.backend import GroupedOperands

__all__ = ["GroupedMmaKernel", "build"]


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_tile(off_ptr, E, tile, E_PAD: gl.constexpr, BM: gl.constexpr):
    """(expert, first row, row end, live) of token tile ``tile`` of ``BM`` rows, from the
    offsets: the experts' tile counts, their running sum, the expert whose range holds
    ``tile`` (empty experts stepped over); ``live`` is False past the last tile."""
    EL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    ex = gl.arange(0, E_PAD, layout=EL)
    in_e = ex < E
    ends = gl.load(off_ptr + ex, mask=in_e, other=0)
    starts = gl.load(off_ptr + ex - 1, mask=in_e & (ex > 0), other=0)
    tiles = gl.where(in_e, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0)
    # inclusive running sum; gl.cumsum is not in Triton 3.6's Gluon, associative_scan is
    csum = gl.associative_scan(tiles, 0, _add)
    e = gl.sum((csum <= tile).to(gl.int32), axis=0)
    first = gl.sum(gl.where(ex == e, csum - tiles, 0), axis=0)  # expert e's first tile
    row0 = gl.sum(gl.where(ex == e, starts, 0), axis=0) + (tile - first) * BM
    row_end = gl.sum(gl.where(ex == e, ends, 0), axis=0)
    return e, row0, row_end, tile < gl.sum(tiles, axis=0)


@gluon.jit(do_not_specialize=["T", "N"])
def _grouped_mma_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, off_ptr, out_ptr, ws_ptr,
                        cnt_ptr, T, N, K, E, stride_am, stride_om, stride_on, a_sblk, b_sblk,
                        b_eslab, E_PAD: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
                        KW: gl.constexpr, RW: gl.constexpr, SPLIT_K: gl.constexpr,
                        EVEN: gl.constexpr, PREFETCH: gl.constexpr,
                        UNROLL: gl.constexpr):  # fmt: skip
    # the arguments are `gemm_grouped._grouped_kernel`'s (one host launch path);
    # as_ptr and a_sblk (NVFP4 activations) are unused here
    pid_n = gl.program_id(0)
    tile = gl.program_id(1)
    pid_k = gl.program_id(2)
    e, row0, row_end, live = _expert_tile(off_ptr, E, tile, E_PAD, BM)
    if live:  # every split of a dead slot skips its counter too
        e64 = e.to(gl.int64)
        n0 = pid_n * (BN * RW)
        acc = mma_tile(a_ptr, b_ptr + e64 * N * (K // 2), bs_ptr + e64 * b_eslab, row_end, N,
                       K, stride_am, b_sblk, n0, row0, pid_k, BN, BM, KW, RW, SPLIT_K, EVEN,
                       PREFETCH, UNROLL, False)  # fmt: skip
        slot = pid_n * gl.num_programs(1) + tile
        store_tile(acc, n0, row0, alpha_ptr + e, alpha_ptr, 0, out_ptr, ws_ptr, cnt_ptr,
                   row_end, N, stride_om, stride_on, slot, pid_k, SPLIT_K)  # fmt: skip


def why_not_dense_rows(ops: GroupedOperands) -> str | None:
    """Why `ops` are not grouped W4A16 operands (NVFP4 rows), else None: the per-expert
    Gluon kernels take dense rows only."""
    if ops.a_scale is None:
        return None
    return ("a: expected dense bf16/fp16 rows (grouped W4A16), got NVFP4 activations; "
            "grouped W4A4 runs the Triton grouped kernel (gemm_grouped)")  # fmt: skip


@dataclass
class GroupedMmaKernel(GroupedKernel):
    """A built kernel: ``kernel(operands, out)`` with `GroupedOperands` of dense rows.
    Launch, workspace, driver-API record and precompile are `GroupedKernel`'s; a program
    covers ``block_m`` rows of one expert and ``block_n x row_warps`` weight rows with
    ``warps x row_warps`` warps (`gemm_w4a16_mma.MmaConfig`)."""

    cfg: MmaConfig  # type: ignore[assignment]
    launcher: ClassVar[CachedLauncher] = CachedLauncher(_grouped_mma_kernel)

    def __call__(self, ops: GroupedOperands, out: torch.Tensor) -> None:
        why = why_not_dense_rows(ops)
        if why is not None:
            raise ValueError(why)
        super().__call__(ops, out)

    @property
    def tile_shape(self) -> tuple[int, int]:
        return self.cfg.block_m, self.cfg.block_n * self.cfg.row_warps

    @property
    def threads_warps(self) -> int:
        return self.cfg.warps * self.cfg.row_warps

    def meta(self, k: int, a_fp4: bool) -> dict:
        """The Gluon kernel's constexprs (beside ``E_PAD``): `gemm_w4a16_mma`'s knobs,
        ``EVEN`` when every warp's K range is whole 128-wide steps."""
        del a_fp4  # dense rows only (`__call__`)
        cfg = self.cfg
        return {"BN": cfg.block_n, "BM": cfg.block_m, "KW": cfg.warps, "RW": cfg.row_warps,
                "SPLIT_K": cfg.split_k, "EVEN": even_steps(cfg, k), "PREFETCH": cfg.prefetch,
                "UNROLL": cfg.unroll}  # fmt: skip


def build(cfg: MmaConfig) -> GroupedMmaKernel:
    """A kernel object for `cfg` (Triton compiles on the first call)."""
    return GroupedMmaKernel(cfg)
