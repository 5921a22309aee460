"""The grouped (mixture-of-experts) contract: Problem, bucket keys, the expert stack, the
float64 reference (docs/grouped.md)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fp4_dispatch import grouped
from fp4_dispatch.backend import GroupedOperands
from fp4_dispatch.buckets import bucket_key
from fp4_dispatch.grouped import Nvfp4Experts, quantize_experts
from fp4_dispatch.nvfp4 import quantize_nvfp4, reference_gemm
from fp4_dispatch.tactics import (
    GROUPED_OPERATIONS,
    OPERATIONS,
    Problem,
    computed_as,
    problem_operation,
)


def offsets_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


# ---- Problem --------------------------------------------------------------------------


def test_grouped_operations_are_operations():
    assert set(OPERATIONS) >= GROUPED_OPERATIONS
    for op in GROUPED_OPERATIONS:
        assert computed_as(op) == (op,)
        # no grouped w4a8: exact under both policies
        assert problem_operation(op, "fp8") == op
        assert problem_operation(op, "exact") == op


def test_problem_groups_required_for_and_only_for_grouped():
    p = Problem(m=8, n=1536, k=2048, operation="grouped_w4a16", groups=128)
    assert p.grouped and p.dense and p.groups == 128
    q = Problem(m=8, n=1536, k=2048, operation="grouped_w4a4", groups=128)
    assert q.grouped and not q.dense
    with pytest.raises(ValidationError, match="groups"):
        Problem(m=8, n=1536, k=2048, operation="grouped_w4a16")
    with pytest.raises(ValidationError, match="groups"):
        Problem(m=8, n=1536, k=2048, operation="w4a16", groups=4)
    with pytest.raises(ValidationError):
        Problem(m=8, n=1536, k=2048, operation="grouped_w4a16", groups=0)
    assert not Problem(m=8, n=16, k=32).grouped


def test_grouped_min_bytes_reads_only_touched_experts():
    fp4 = 0.5 + 1 / 16
    n, k, e = 1536, 2048, 128
    decode = Problem(m=8, n=n, k=k, operation="grouped_w4a16", groups=e)
    assert decode.touched_groups == 8
    want = 8 * k * 2 + 8 * n * k * fp4 + 2 * 8 * n + 8 * e
    assert decode.min_bytes == pytest.approx(want)
    prefill = Problem(m=4096, n=n, k=k, operation="grouped_w4a16", groups=e)
    assert prefill.touched_groups == e
    want = 4096 * k * 2 + e * n * k * fp4 + 2 * 4096 * n + 8 * e
    assert prefill.min_bytes == pytest.approx(want)
    assert prefill.flops == 2.0 * 4096 * n * k
    # a dense problem is unchanged: one weight
    dense = Problem(m=8, n=n, k=k, operation="w4a16")
    assert dense.min_bytes == pytest.approx(8 * k * 2 + n * k * fp4 + 2 * 8 * n)


def test_bucket_key_has_groups_only_for_grouped():
    assert bucket_key(5, 64, 128, "bfloat16", "w4a16") == (64, 128, 8, "bfloat16", "w4a16")
    assert bucket_key(5, 64, 128, "bfloat16") == (64, 128, 8, "bfloat16", "w4a4")
    g = bucket_key(5, 64, 128, "bfloat16", "grouped_w4a16", 128)
    assert g == (64, 128, 8, "bfloat16", "grouped_w4a16", 128)
    assert g != bucket_key(5, 64, 128, "bfloat16", "grouped_w4a16", 256)


# ---- the expert stack -------------------------------------------------------------------


def test_quantize_experts_matches_per_expert_quantization():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 64, generator=gen) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    b = quantize_experts(w)
    assert b.shape == (3, 40, 64) and b.experts == 3
    assert tuple(b.scale.shape) == (3, 128, 4) and tuple(b.global_scale.shape) == (3,)
    for e in range(3):
        q = quantize_nvfp4(w[e])
        assert torch.equal(b.data[e], q.data)
        assert torch.equal(b.scale[e].view(torch.uint8), q.scale.view(torch.uint8))
        assert b.global_scale[e] == q.global_scale
        assert torch.equal(b.expert(e).dequantize(), q.dequantize())
        assert torch.equal(b.dequantize()[e], q.dequantize())
    # per-expert scales differ (one scale for the stack would flush the small expert)
    assert len(set(b.global_scale.tolist())) == 3


def test_stack_accepts_linear_scales_and_checks_shapes():
    gen = torch.Generator().manual_seed(1)
    qs = [quantize_nvfp4(torch.randn(16, 32, generator=gen), layout="linear") for _ in range(2)]
    b = Nvfp4Experts.stack(qs)
    assert torch.equal(b.dequantize()[1], qs[1].dequantize())
    with pytest.raises(ValueError, match="one shape"):
        Nvfp4Experts.stack([qs[0], quantize_nvfp4(torch.randn(16, 64))])
    with pytest.raises(TypeError, match="Nvfp4Tensor"):
        Nvfp4Experts.stack([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"scale: expected shape \(2, 128, 4\)"):
        Nvfp4Experts(b.data, b.scale[:, :64].contiguous(), b.global_scale, b.shape)
    with pytest.raises(ValueError, match="global_scale: expected finite"):
        Nvfp4Experts(b.data, b.scale, torch.tensor([1.0, 0.0]), b.shape)
    with pytest.raises(IndexError, match="e: expected"):
        b.expert(2)


# ---- offsets ---------------------------------------------------------------------------


def test_check_offsets():
    off = offsets_of([1, 0, 3])
    assert grouped.check_offsets(off, 3) is off
    with pytest.raises(TypeError, match=r"offsets: expected dtype torch\.int32, got torch\.int64"):
        grouped.check_offsets(off.long(), 3)
    with pytest.raises(ValueError, match=r"offsets: expected shape \(4,\)"):
        grouped.check_offsets(off, 4)
    assert grouped.check_offset_values(off, 4) == [1, 1, 4]
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped.check_offset_values(torch.tensor([2, 1, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="last row end to be 5"):
        grouped.check_offset_values(off, 5)


def test_balanced_offsets():
    assert grouped.balanced_offsets(8, 4).tolist() == [2, 4, 6, 8]
    few = grouped.balanced_offsets(3, 8).tolist()
    sizes = [b - a for a, b in zip([0, *few], few, strict=False)]
    assert few[-1] == 3 and sorted(sizes) == [0] * 5 + [1] * 3  # one row per touched expert


# ---- the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 9, 0], [1, 1, 1, 1]])
def test_reference_is_the_per_expert_dense_reference(sizes):
    gen = torch.Generator().manual_seed(2)
    t, n, k = sum(sizes), 24, 64
    b = quantize_experts(torch.randn(len(sizes), n, k, generator=gen) * 0.02)
    a = (torch.randn(t, k, generator=gen) * 3).to(torch.bfloat16)
    off = offsets_of(sizes)
    ref = grouped.grouped_reference(a, b, off)
    assert ref.dtype == torch.float64 and ref.shape == (t, n)
    qa = quantize_nvfp4(a.float())
    ref4 = grouped.grouped_reference(qa, b, off)
    # float32 dequantization (the dense references) vs float64 global scales: 1e-6 of
    # the output's scale (a relative bound fails on cancellations near 0)
    atol = 1e-6 * float(ref.abs().max())
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        want = a[rows].double() @ b.expert(e).dequantize().double().T
        torch.testing.assert_close(ref[rows], want, rtol=0, atol=atol)
        if size:
            sub = quantize_nvfp4(a[rows].float(), qa.global_scale)
            torch.testing.assert_close(
                ref4[rows], reference_gemm(sub, b.expert(e)), rtol=0, atol=atol
            )
        start += size


def test_reference_output_of_raw_operands():
    gen = torch.Generator().manual_seed(3)
    sizes = [2, 0, 4]
    t, n, k = 6, 16, 32
    b = quantize_experts(torch.randn(3, n, k, generator=gen))
    qa = quantize_nvfp4(torch.randn(t, k, generator=gen))
    off = offsets_of(sizes)
    alpha = qa.global_scale * b.global_scale
    ops = GroupedOperands(qa.data, b.data, b.scale, alpha, off, a_scale=qa.scale)
    assert (ops.m, ops.n, ops.k, ops.groups) == (t, n, k, 3)
    got = grouped.reference_output(ops)
    want = grouped.grouped_reference(qa, b, off)  # alpha in float64, not float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    assert got[2:2].numel() == 0 and not torch.equal(got, torch.zeros_like(got))
    a16 = torch.randn(t, k, generator=gen).to(torch.float16)
    dense = GroupedOperands(a16, b.data, b.scale, b.global_scale, off)
    assert torch.equal(grouped.reference_output(dense), grouped.grouped_reference(a16, b, off))


def test_reference_output_of_selected_rows_and_columns():
    """The sampled form (tuning's and the first-use check's) is the full one, sliced."""
    gen = torch.Generator().manual_seed(4)
    b = quantize_experts(torch.randn(4, 40, 64, generator=gen))
    qa = quantize_nvfp4(torch.randn(12, 64, generator=gen))
    off = offsets_of([5, 0, 4, 3])
    for ops in (
        GroupedOperands(qa.data, b.data, b.scale, qa.global_scale * b.global_scale, off,
                        a_scale=qa.scale),
        GroupedOperands(torch.randn(12, 64, generator=gen).half(), b.data, b.scale,
                        b.global_scale, off),
    ):  # fmt: skip
        full = grouped.reference_output(ops)
        rows, cols = torch.tensor([0, 4, 5, 9, 11]), torch.tensor([1, 7, 39])
        assert torch.equal(grouped.reference_output(ops, rows, cols), full[rows][:, cols])
