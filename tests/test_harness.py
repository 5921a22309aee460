"""The harness's numerics and host clocks, on the CPU (the GPU clock runs in benchmarks).

One rule for "random NVFP4 inputs, float64 reference, compare" serves the tuner, the
conformance kit and the benchmarks; these tests pin what each piece promises.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp4_dispatch.autotune import harness
from fp4_dispatch.contracts.backend import DenseOperands, GemmOperands
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.loading.profiles import resolve


def test_compare_passes_a_close_result_and_names_what_is_wrong():
    ref = torch.randn(8, 16, dtype=torch.float64)
    err, why = harness.compare(ref.to(torch.bfloat16), ref, 1e-2)
    assert why == "" and 0 < err < 1e-2
    unwritten = ref.clone()
    unwritten[3, 5] = math.nan
    err, why = harness.compare(unwritten, ref, 1e-2)
    assert math.isnan(err) and why.startswith("1 of 128 output elements not written")
    err, why = harness.compare(torch.zeros_like(ref), ref, 1e-2)
    assert err == pytest.approx(1.0) and "relative error 1 >= 0.01" in why


def test_relative_error_is_infinite_for_non_finite_output():
    ref = torch.ones(4, 4)
    assert harness.relative_error(ref, ref) == 0.0
    assert harness.relative_error(torch.full((4, 4), math.inf), ref) == math.inf


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_random_operands_come_with_their_reference(out_dtype):
    p = Problem(m=37, n=96, k=128, out_dtype=out_dtype)
    ops, ref = harness.random_operands(p, "cpu", seed=3)
    assert isinstance(ops, GemmOperands) and ref.dtype == torch.float64
    # the same product up to float32 roundings: alpha is the float32 product of the global
    # scales, and `reference_gemm` dequantizes each operand in float32 (~6e-8 measured)
    assert harness.relative_error(harness.reference_output(ops), ref) < 1e-6
    again, _ = harness.random_operands(p, "cpu", seed=3)
    assert torch.equal(again.a_data, ops.a_data)  # the seed decides, on any device


def test_random_operands_of_a_dense_problem():
    p = Problem(m=5, n=64, k=64, out_dtype="float16", operation="w4a16")
    ops, ref = harness.random_operands(p, "cpu", seed=0)
    assert isinstance(ops, DenseOperands) and ops.a.dtype == torch.float16
    assert ref.shape == (5, 64)


def test_stress_operands_poison_the_scale_padding_and_dequantize_exactly():
    gen = torch.Generator().manual_seed(1)
    ops = harness.stress_operands(3, 40, 96, torch.device("cpu"), gen)
    assert tuple(ops.a_scale.shape) == swizzled_scale_shape(3, 96) == (128, 8)
    raw = ops.a_scale.view(torch.uint8)
    assert int((raw == 0x7F).sum()) >= (128 - 3) * 8  # padding rows (and columns) are NaN
    a64 = harness.dequant(ops.a_data, ops.a_scale, torch.float64)
    b64 = harness.dequant(ops.b_data, ops.b_scale, torch.float64)
    want = (a64 @ b64.T) * float(ops.alpha)
    assert torch.isfinite(a64).all() and torch.equal(harness.reference_output(ops), want)


def test_make_inputs_rotates_copies_within_the_memory_cap():
    dev = resolve("cpu", None)
    inputs = harness.make_inputs(Problem(m=8, n=64, k=64), dev, copies=3)
    assert len(inputs.copies) == 3 and inputs.out.dtype == torch.bfloat16
    assert torch.equal(inputs.copies[0].a_data, inputs.copies[2].a_data)
    assert inputs.copies[0].a_data.data_ptr() != inputs.copies[2].a_data.data_ptr()
    assert harness.n_copies(1 << 20, 50 << 20) == harness.MAX_REPEAT + 1
    assert harness.n_copies(harness.COPY_MEMORY_CAP, 50 << 20) == 1


def test_call_wall_us_resets_before_every_timed_call():
    resets, calls = [], []
    us = harness.call_wall_us(lambda: calls.append(1), runs=4, before=lambda: resets.append(1))
    assert len(resets) == len(calls) == 4 and us >= 0
    best = harness.call_wall_us(lambda: sum(range(20000)), runs=3, best=True)
    assert 0 < best < 1e6


def test_time_us_falls_back_to_wall_time_off_a_gpu():
    ran = []
    us = harness.time_us(lambda: ran.append(1), "cpu", calls=8)
    assert us > 0 and math.isfinite(us) and len(ran) == 1 + 2  # warm-up + 8 // 4 calls
