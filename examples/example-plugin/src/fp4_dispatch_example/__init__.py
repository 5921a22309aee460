"""An example third-party fp4-dispatch plugin.

It registers one backend, ``example-rowblock``, that dequantizes B once and walks A in
row blocks of ``tile_m`` rows — a different (real) kernel strategy from the reference, so
the dispatcher has a third-party family to rank. Copy this package to start your own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

import fp4_dispatch
from fp4_dispatch import Backend, DeviceInfo, GemmOperands, Problem, Support, Tactic
from fp4_dispatch.format.nvfp4 import e2m1_to_float, unpack_e2m1, unswizzle_scales


class RowBlockTactic(Tactic):
    """Row-block size is the only knob; tile_n is nominal."""

    backend: Literal["example-rowblock"] = "example-rowblock"
    tile_m: Literal[16, 64, 256] = 64
    tile_n: Literal[256] = 256


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, k = data.shape[0], data.shape[1] * 2
    values = e2m1_to_float(unpack_e2m1(data)).view(rows, k // 16, 16)
    return (values * unswizzle_scales(scale, rows, k).float().unsqueeze(-1)).view(rows, k)


def _gemm(ops: GemmOperands, out: torch.Tensor, tile_m: int) -> None:
    b = _dequant(ops.b_data, ops.b_scale)
    a = _dequant(ops.a_data, ops.a_scale)
    alpha = ops.alpha.reshape(())
    for start in range(0, a.shape[0], tile_m):
        block = a[start : start + tile_m] @ b.T
        out[start : start + tile_m].copy_(block * alpha)


class RowBlockBackend(Backend):
    name = "example-rowblock"
    family = "example"
    version = "0.1.0"
    tactic_type = RowBlockTactic
    diversity_axes = ("tile_m",)

    def supports(self, device: DeviceInfo) -> Support:
        if device.is_simulated:
            return Support(False, "runs real torch ops only (cpu or cuda)")
        return Support(True, f"torch {torch.__version__}, fp4-dispatch {fp4_dispatch.__version__}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[RowBlockTactic]:
        for tile_m in (16, 64, 256):
            if tile_m <= max(16, problem.m):
                yield RowBlockTactic(tile_m=tile_m)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        blocks = -(-problem.m // tactic.tile_m)
        return 80.0 + 10.0 * blocks + problem.flops / 40e9 * 1e6

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo):
        def kernel(ops: GemmOperands, out: torch.Tensor) -> None:
            _gemm(ops, out, tactic.tile_m)

        return kernel


@fp4_dispatch.hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(RowBlockBackend())
