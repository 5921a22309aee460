"""Hopper (sm90) grouped W4A16 GEMM for tens to hundreds of rows per expert: the
warp-specialized wgmma kernel of `gemm_w4a16_rs` run per (expert, token tile), in one
launch (Gluon).

``out[r] = alpha[e] * A[r] @ dequant(W[e]).T`` for the rows ``r`` of each expert ``e``,
with the operands of `gemm_grouped` (`GroupedOperands`: bf16/fp16 rows sorted by expert,
stacked NVFP4 weights ``[E, N, K]``, ``offsets`` int32 cumulative row ends on the device,
``alpha`` fp32 ``[E]``).

Why a third grouped kernel. At 4,096 tokens of a 128-expert, top-8 layer (~256 rows an
expert) the Triton grouped kernel's ``tl.dot`` path took 0.37-0.68x the time of bf16
``torch._grouped_mm`` on an H100 (`benchmarks/RESULTS.md`, "Mixture of experts", run 1):
its weight tiles are dequantized to fp32, joined and reshaped before every dot. The
dense rs kernel expands the weights straight into ``wgmma``'s A registers and takes the
tokens from a TMA ring; here it runs unchanged (`gemm_w4a16_rs.rs_ws_tile`) on one
expert's 128 weight rows (rows ``e N + n0`` of the stacked bytes viewed as ``[E N, K/2]``,
its scale chunks likewise) and a tile of that expert's tokens.

Scheduling is `gemm_grouped`'s: a grid of ``(N tiles, M-tile bound, split_k)``, each CTA
finds its (expert, token tile) from the offsets (`gemm_grouped_mma._expert_tile`). A slot
past the routing's last tile runs no K step and stores nothing (its ``M`` is its first
row), so every partition of the specialized kernel takes the same path. The token tile
is read by TMA from the expert's first row: rows past the expert's end belong to the next
expert (or are zero-filled past T) and are multiplied but never stored; a weight tile's
rows past N likewise. Each call first writes the activations in the dot's K order
(`gemm_w4a16_rs.dot_order_into`, a kept buffer: make the first call of a T outside a
CUDA-graph capture).

W4A16 only, ``K % 128 == 0``, bf16/fp16 rows with unit stride along K. Gluon has no
interpreter: CI compiles this kernel for sm_90 (tests/test_grouped_rs.py), the numerics
are checked on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp4_dispatch.backends.sm90 import gemm_w4a16_rs, gemm_w4a16_ws
from fp4_dispatch.backends.sm90.epilogue_gluon import split_steps
from fp4_dispatch.backends.sm90.gemm_grouped import GroupedKernel
from fp4_dispatch.backends.sm90.gemm_grouped_mma import _expert_tile, why_not_dense_rows
from fp4_dispatch.backends.sm90.gemm_w4a16_rs import (
    _W_LAYOUT,
    BLOCK_N,
    SM_REGISTERS,
    RsConfig,
    dot_order_kept,
    rs_ws_tile,
)
from fp4_dispatch.backends.sm90.gemm_w4a16_ws import _descriptor, _x_layout
from fp4_dispatch.backends.triton_launch import CachedLauncher
from fp4_dispatch.backends.workspace import Scratch
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

__all__ = ["GroupedRsKernel", "build", "why_unsupported"]


@gluon.jit(do_not_specialize=["T", "N"])
def _grouped_rs_kernel(x_desc, w_desc, s_desc, alpha_ptr, off_ptr, out_ptr, ws_ptr, cnt_ptr,
                       T, N, K, E, stride_om, stride_on, s_chunks, s_blocks,
                       E_PAD: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                       REGS: gl.constexpr, TMA_REGS: gl.constexpr):  # fmt: skip
    # s_chunks: 512-byte scale chunks per 128-row block; s_blocks: 128-row blocks an expert
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    tile = gl.program_id(1)
    pid_k = gl.program_id(2)
    e, row0, row_end, live = _expert_tile(off_ptr, E, tile, E_PAD, BT)
    kt0, n_steps = split_steps(K // 128, pid_k, SPLIT_K)
    n_steps = gl.where(live, n_steps, 0)  # a dead slot: no K step,
    row_end = gl.where(live, row_end, row0)  # no row stored,
    e = gl.where(live, e, 0)  # an expert in range
    n0 = pid_n * BN
    slot = pid_n * gl.num_programs(1) + tile
    rs_ws_tile(x_desc, w_desc, s_desc, alpha_ptr + e, alpha_ptr, out_ptr, ws_ptr, cnt_ptr,
               row_end, N, stride_om, stride_on, 0, e * N + n0, n0,
               (e * s_blocks + pid_n) * s_chunks * 2, row0, kt0, n_steps, slot, pid_k, SPLIT_K,
               STAGES, REGS, TMA_REGS, False)  # fmt: skip


def why_unsupported(ops: GroupedOperands) -> str | None:
    """Why this kernel cannot run `ops` (None if it can): dense rows
    (`gemm_grouped_mma.why_not_dense_rows`) the dense rs kernel can read
    (`gemm_w4a16_rs.why_unsupported`: bf16/fp16, unit stride along K, ``K % 128 == 0``)."""
    return why_not_dense_rows(ops) or gemm_w4a16_rs.why_unsupported(ops)


@dataclass
class GroupedRsKernel(GroupedKernel):
    """A built kernel: ``kernel(operands, out)`` with `GroupedOperands` of dense rows
    (`why_unsupported` raises ValueError otherwise). Workspace and record are
    `GroupedKernel`'s; a program covers ``block_m`` rows of one expert and 128 weight
    rows (two warpgroups and a TMA warp, `gemm_w4a16_rs.RsConfig` specialized)."""

    cfg: RsConfig  # type: ignore[assignment]
    launcher: ClassVar[CachedLauncher] = CachedLauncher(_grouped_rs_kernel)
    _acts: Scratch = field(default_factory=Scratch, repr=False)
    _views: dict = field(default_factory=dict, repr=False)

    def __call__(self, ops: GroupedOperands, out: torch.Tensor) -> None:
        why = why_unsupported(ops)
        if why is not None:
            raise ValueError(why)
        if ops.m == 0 or ops.n == 0:
            return
        x = self.permute_activations(ops.a)
        grid, args, meta = self._launch(dataclasses.replace(ops, a=x), out)
        self._binding(meta)(grid, args)

    @property
    def tile_shape(self) -> tuple[int, int]:
        return self.cfg.block_m, BLOCK_N

    @property
    def threads_warps(self) -> int:
        return 4  # the default partition; the specialized kernel adds its own warps

    @property
    def counters_per_tile(self) -> int:
        """Each warpgroup stores its 64-row half as a split-K tile of its own."""
        return 2

    def permute_activations(self, a: torch.Tensor) -> torch.Tensor:
        """``a`` in the dot's K order, in this object's kept buffer (`dot_order_kept`)."""
        return dot_order_kept(a, self._acts, self._views)

    def launch_args(self, ops, out, ws, cnt) -> list:
        """The kernel's arguments: TMA descriptors of the dot-ordered rows, the stacked
        weight bytes ``[E N, K/2]`` and scale chunks, then `GroupedKernel`'s scalars."""
        t, n, k, e = ops.m, ops.n, ops.k, ops.groups
        bm = self.cfg.block_m
        x_desc = _descriptor(ops.a, [t, k], [k, 1], [bm, 64], _x_layout(bm))
        b = ops.b_data.view(e * n, k // 2)
        w_desc = _descriptor(b, [e * n, k // 2], [k // 2, 1], [BLOCK_N, 64], _W_LAYOUT)
        s = ops.b_scale
        s_desc = gemm_w4a16_ws.scale_descriptor(s, 2)
        return [x_desc, w_desc, s_desc, ops.alpha, ops.offsets, out, ws, cnt, t, n, k, e,
                out.stride(0), out.stride(1), s.shape[2] // 4, s.shape[1] // 128]  # fmt: skip

    def meta(self, k: int, a_fp4: bool) -> dict:
        """The kernel's constexprs (beside ``E_PAD``): split, stages and the register
        budget of the specialized kernel (`gemm_w4a16_rs.SM_REGISTERS`)."""
        del k, a_fp4
        cfg = self.cfg
        _, consumer, tma = SM_REGISTERS[cfg.ctas_per_sm, cfg.block_m]
        return {"SPLIT_K": cfg.split_k, "STAGES": cfg.stages, "REGS": consumer,
                "TMA_REGS": tma}  # fmt: skip

    def precompile(
        self, t: int, n: int, k: int, e: int, out_dtype: torch.dtype, a_fp4: bool
    ) -> object:
        """Compile (``warmup``, nothing launched) what a call with T rows of `out_dtype`,
        E experts of ``[N, K]`` and a contiguous output runs: the descriptors are built
        on meta tensors (Triton specializes on their dtype, block and layout, not on
        their values)."""
        if a_fp4:
            raise ValueError("a_fp4: this kernel takes dense rows (grouped W4A16) only")
        dev = torch.device("meta")
        ops = GroupedOperands(
            torch.empty((t, k), dtype=out_dtype, device=dev),
            torch.empty((e, n, k // 2), dtype=torch.uint8, device=dev),
            torch.empty((e, *swizzled_scale_shape(n, k)), dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(e, device=dev),
            torch.empty(e, dtype=torch.int32, device=dev),
        )
        out = torch.empty((t, n), dtype=out_dtype, device=dev)
        ws = cnt = out
        if self.cfg.split_k > 1:
            ws, cnt = (torch.empty(16, dtype=dt, device=dev) for dt in (torch.float32, torch.int32))
        args = self.launch_args(ops, out, ws, cnt)
        return self._binding(self.constexprs(k, e, False)).warmup(self.grid(t, n, e), args)

    def bind_options(self) -> dict:
        """The launch's register cap (`gemm_w4a16_rs.SM_REGISTERS`: at launch)."""
        return {"maxnreg": SM_REGISTERS[self.cfg.ctas_per_sm, self.cfg.block_m][0]}


def build(cfg: RsConfig) -> GroupedRsKernel:
    """A kernel object for `cfg` (specialized; Triton compiles on the first call)."""
    if not cfg.specialized:
        raise ValueError("cfg: expected specialized=True (the grouped kernel runs the "
                         f"warp-specialized rs kernel), got {cfg}")  # fmt: skip
    return GroupedRsKernel(cfg)
