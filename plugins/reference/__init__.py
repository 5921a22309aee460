"""Built-in plugin: the portable torch reference backend (family ``portable``).

Its tactic space is small but real — compute dtype and K chunking change rounding and
speed — so the ranking and tuning machinery has something to choose between everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Literal

import torch

from fp4_dispatch import __version__
from fp4_dispatch.backend import Backend, Kernel, Support
from fp4_dispatch.backends import reference
from fp4_dispatch.backends.reference import w4a8
from fp4_dispatch.device import DeviceInfo
from fp4_dispatch.hookspecs import hookimpl
from fp4_dispatch.sources import SourceVersion
from fp4_dispatch.tactics import Problem, Tactic


class ReferenceTactic(Tactic):
    """Reference GEMM knobs. Tiles are nominal (torch picks its own blocking)."""

    backend: Literal["torch-reference"] = "torch-reference"
    tile_m: Literal[128] = 128
    tile_n: Literal[128] = 128
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    k_chunk: Literal[0, 512, 2048] = 0


class ReferenceBackend(Backend):
    name = "torch-reference"
    family = "portable"
    version = SourceVersion(__version__, "fp4_dispatch.backends.reference", plugin=__name__)
    tactic_type = ReferenceTactic
    diversity_axes = ("compute_dtype",)
    operations = ("w4a4", "w4a16", "grouped_w4a16", "grouped_w4a4")

    def supports(self, device: DeviceInfo) -> Support:
        if device.is_simulated:
            return Support(False, "simulated devices run no kernels; reference runs on cpu/cuda")
        return Support(True, f"plain torch {torch.__version__} on {device.kind}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[ReferenceTactic]:
        if device.kind != "cpu":
            # On a GPU the reference is a correctness fallback, not a contender: two tactics
            # keep its floor in the shortlist at two measurement slots.
            yield from (ReferenceTactic(compute_dtype=d) for d in ("bfloat16", "float32"))
            return
        # On a CPU it is the path people use: torch's bf16 GEMM wins at large M, fp32 at
        # small M (measured, benchmarks/bench_first_contact.py); K chunking only costs.
        yield from (ReferenceTactic(compute_dtype=d) for d in ("bfloat16", "float32"))

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """Dequantize, then a dense torch GEMM: a roofline per compute dtype.

        CPU: rates of torch 2.13's CPU GEMM on a 2-core x86 machine (bench_first_contact):
        fp32 ~70 GFLOP/s and ~20 GB/s of weight streaming, bf16 ~125 GFLOP/s and ~7 GB/s
        (its matrix-vector path is slow), plus A's dequantization (~2 ns per element; B's
        is cached across calls with the same weight). GPU: calibrated on an H200
        (naive NVFP4: 1.68 ms at 1x8192x8192, 3.13 ms at 4096x8192x8192): the passes
        move ~100 bytes per operand element.
        """
        # grouped: the touched experts' weights, one GEMM each (docs/grouped.md); the
        # per-expert launch cost is the dense one (NOT fitted for the grouped loop)
        weights, gemms = problem.touched_groups, problem.touched_groups
        if device.kind == "cpu":
            bf16 = tactic.compute_dtype != "float32"
            rate, bw, size = (125e9, 7e9, 2) if bf16 else (70e9, 20e9, 4)
            gemm_s = max(problem.flops / rate, weights * problem.n * problem.k * size / bw)
            return 50.0 * gemms + gemm_s * 1e6 + problem.m * problem.k * 2e-3
        elems = (problem.m + weights * problem.n) * problem.k
        rate_tflops = device.bf16_tflops if tactic.compute_dtype != "float32" else 60.0
        chunks = 1 if tactic.k_chunk == 0 else problem.k // tactic.k_chunk
        return (
            30.0 * chunks * gemms
            + elems * 100.0 / (device.mem_bw_gbps * 1e3)
            + problem.flops / (rate_tflops * 1e6)
        )

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, ReferenceTactic)
        if problem.grouped:
            fn = reference.gemm_grouped
        else:
            fn = reference.gemm_dense if problem.dense else reference.gemm
        return functools.partial(fn, compute_dtype=tactic.compute_dtype, k_chunk=tactic.k_chunk)


class ReferenceW4A8Tactic(Tactic):
    """The W4A8 emulation has no knobs (tiles nominal)."""

    backend: Literal["torch-reference-w4a8"] = "torch-reference-w4a8"
    tile_m: Literal[128] = 128
    tile_n: Literal[128] = 128


class ReferenceW4A8Backend(Backend):
    """W4A8 (lossy, ``precision="fp8"`` only) in plain torch: the exact emulation of the
    FP8 kernels' roundings (`fp4_dispatch.backends.reference.w4a8`), float64 products.

    A correctness twin, not a contender: its estimate is the W4A16 reference's times
    `SLOWDOWN` (it quantizes both operands and multiplies in float64), so the heuristic
    never prefers it over the exact reference; tuning or a test may still pick it."""

    name = "torch-reference-w4a8"
    family = "portable"
    version = SourceVersion(__version__, "fp4_dispatch.backends.reference.w4a8", plugin=__name__)
    tactic_type = ReferenceW4A8Tactic
    operations = ("w4a8",)
    #: estimate relative to the W4A16 reference's float32 tactic (float64 GEMM, two
    #: quantization passes)
    SLOWDOWN = 4.0

    def supports(self, device: DeviceInfo) -> Support:
        if device.is_simulated:
            return Support(False, "simulated devices run no kernels; reference runs on cpu/cuda")
        return Support(True, f"plain torch {torch.__version__} on {device.kind}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[ReferenceW4A8Tactic]:
        yield _w4a8_tactic()

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        dense = problem.as_operation("w4a16")
        base = ReferenceBackend().estimate_us(dense, device, ReferenceTactic())
        return base * self.SLOWDOWN

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, ReferenceW4A8Tactic)
        return w4a8.gemm_w4a8


@functools.cache
def _w4a8_tactic() -> ReferenceW4A8Tactic:
    """One cached tactic object (the ranking memoizes validation by identity)."""
    return ReferenceW4A8Tactic()


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(ReferenceBackend())
    register(ReferenceW4A8Backend())
