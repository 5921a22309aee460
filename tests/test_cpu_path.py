"""The CPU path a newcomer uses: the reference backend's fast dequantization and its weight
cache, the Dispatcher's repr, and the conformance kit asked for "cuda" without a GPU."""

from __future__ import annotations

import pytest
import torch

from fp4_dispatch import Dispatcher, GemmOperands, quantize_nvfp4, reference_gemm
from fp4_dispatch.backends import reference
from fp4_dispatch.format.nvfp4 import e2m1_to_float, unpack_e2m1, unswizzle_scales


def _arithmetic_dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The element-wise float32 decode the table lookup replaced (independent path)."""
    rows, k = data.shape[0], data.shape[1] * 2
    values = e2m1_to_float(unpack_e2m1(data)).view(rows, k // 16, 16)
    return (values * unswizzle_scales(scale, rows, k).float().unsqueeze(-1)).view(rows, k)


def test_table_dequantization_is_exact_in_every_compute_dtype():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 256, generator=gen) * torch.logspace(-6, 6, 300).unsqueeze(1)
    q = quantize_nvfp4(x)
    want = _arithmetic_dequant(q.data, q.scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = reference.dequantize_operand(q.data, q.scale, dtype)
        assert got.dtype == dtype and torch.equal(got.float(), want), dtype


def _ops(qa, qb) -> GemmOperands:
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    return GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)


def test_cached_weight_follows_in_place_changes(monkeypatch):
    monkeypatch.setenv(reference.CACHE_ENV, "64")
    reference.clear_cache()
    gen = torch.Generator().manual_seed(4)
    qa = quantize_nvfp4(torch.randn(8, 128, generator=gen))
    qb = quantize_nvfp4(torch.randn(32, 128, generator=gen))
    for dtype in ("float32", "bfloat16"):
        out = torch.empty(8, 32, dtype=torch.bfloat16)
        reference.gemm(_ops(qa, qb), out, dtype, 0)
        first = out.clone()
        reference.gemm(_ops(qa, qb), out, dtype, 0)  # served from the cache
        assert torch.equal(out, first)
        assert len(reference._cache) >= 1
    qb.data[:16] ^= 0x11  # flip a bit in both nibbles of half the rows, in place
    out = torch.empty(8, 32, dtype=torch.bfloat16)
    reference.gemm(_ops(qa, qb), out, "float32", 0)
    ref = reference_gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    assert not torch.equal(out, first)
    reference.clear_cache()
    assert not reference._cache


def test_cache_off_keeps_nothing(monkeypatch):
    monkeypatch.setenv(reference.CACHE_ENV, "0")
    reference.clear_cache()
    gen = torch.Generator().manual_seed(5)
    qa = quantize_nvfp4(torch.randn(4, 64, generator=gen))
    qb = quantize_nvfp4(torch.randn(16, 64, generator=gen))
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    reference.gemm(_ops(qa, qb), out, "bfloat16", 0)
    assert not reference._cache


def test_cpu_tactics_offer_bf16_and_fp32_and_rank_by_m(monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")
    d = Dispatcher(device="cpu", cache=False)
    dtypes = {c.tactic.compute_dtype for c in d.candidates(64, 4096, 4096).candidates}
    assert dtypes == {"bfloat16", "float32"}
    assert d.select(1, 8192, 8192).tactic.compute_dtype == "float32"  # matrix-vector
    assert d.select(1024, 4096, 4096).tactic.compute_dtype == "bfloat16"  # compute bound


def test_dispatcher_repr_names_device_backends_budget_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")
    d = Dispatcher(device="cpu", budget=7, cache=tmp_path / "t.json")
    text = repr(d)
    assert "device='cpu' (cpu)" in text and "torch-reference" in text
    assert "budget=7" in text and str(tmp_path / "t.json") in text
    assert "cache='memory only'" in repr(Dispatcher(device="cpu", cache=False))


def test_check_plugin_on_cuda_without_a_gpu_skips():
    from fp4_dispatch.testing import check_plugin

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cuda checks really run")
    report = check_plugin("reference", device="cuda")
    assert not report.failures and report.skipped, str(report)
    assert "no CUDA device" in report.skipped[0].message
