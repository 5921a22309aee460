"""``triton-sm90-rs``: the backend of the register-sourced wgmma W4A16 kernel.

The kernel's own tests (activation pass, sm_90 compile, GPU numerics) are in
tests/test_gemm_w4a16_rs.py; here the backend's rules, estimate and the conformance kit
(its static checks on the CPU, the numerics on an sm90 GPU with ``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

from fp4_dispatch import Dispatcher
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import rated, simulated
from fp4_dispatch.plugins.sm90.rs import (
    RS_MAX_M,
    RS_MIN_M,
    RS_STAGES,
    TritonSm90RsBackend,
    TritonSm90RsTactic,
    why_invalid,
)
from fp4_dispatch.testing import check_backend

SM90 = rated(simulated("sm90"))


def _w4a16(m: int, n: int, k: int, dtype: str = "bfloat16") -> Problem:
    return Problem(m=m, n=n, k=k, out_dtype=dtype, operation="w4a16")


def test_offered_for_64_to_256_tokens_within_one_wave():
    b = TritonSm90RsBackend()
    ts = list(b.tactics(_w4a16(64, 8192, 8192), SM90))
    assert ts and all(isinstance(t, TritonSm90RsTactic) for t in ts)
    assert {t.tile_m for t in ts} == {64}  # 128-token tiles only where M needs them
    assert {(t.tile_n, t.tile_k, t.num_stages) for t in ts} == {(128, 128, RS_STAGES[64])}
    # 64 tiles x 3 > one CTA an SM on 132 SMs: splits 3 and 4 only with two CTAs an SM,
    # which in turn are not offered where one CTA an SM holds the grid
    assert {(t.split_k, t.ctas_per_sm) for t in ts} == {(1, 1), (2, 1), (3, 2), (4, 2)}
    assert {t.tile_m for t in b.tactics(_w4a16(128, 8192, 8192), SM90)} == {64, 128}
    big = list(b.tactics(_w4a16(256, 8192, 8192), SM90))
    assert {t.tile_m for t in big} == {128, 256}  # 64-token tiles untimed at M = 256
    # 64 tiles of 256 tokens: split 2 is the largest within one wave of 132 SMs
    assert {t.split_k for t in big if t.tile_m == 256} == {1, 2}
    assert {t.num_stages for t in big if t.tile_m == 256} == {RS_STAGES[256]}
    assert 256 in {t.tile_m for t in b.tactics(_w4a16(129, 8192, 8192), SM90)}
    whole = TritonSm90RsTactic(tile_m=256, split_k=1, num_stages=3)
    assert "does not fit M=128" in why_invalid(whole, _w4a16(128, 8192, 8192), SM90)
    assert whole.kernel_config().block_m == 256
    assert list(b.tactics(_w4a16(100, 4096, 4096, "float16"), SM90))  # fp16 activations too
    assert not list(b.tactics(_w4a16(RS_MIN_M - 1, 8192, 8192), SM90))
    assert not list(b.tactics(_w4a16(RS_MAX_M + 1, 8192, 8192), SM90))
    t = ts[0]
    assert why_invalid(t, _w4a16(64, 256, 160), SM90) == "K=160 must be a multiple of 128"
    assert "measured range" in why_invalid(t, _w4a16(32, 8192, 8192), SM90)
    odd = TritonSm90RsTactic(tile_m=64, split_k=1, num_stages=3)
    assert why_invalid(odd, _w4a16(64, 8192, 8192), SM90) == "num_stages=3: tile_m=64 runs 4"
    wide = TritonSm90RsTactic(tile_m=128, split_k=1, num_stages=3)
    assert "does not fit M=64" in b.validate(wide, _w4a16(64, 8192, 8192), SM90)
    two = TritonSm90RsTactic(tile_m=128, split_k=1, num_stages=3, ctas_per_sm=2)
    assert why_invalid(two, _w4a16(256, 8192, 8192), SM90) == "ctas_per_sm=2: tile_m=128 runs (1,)"
    pair = TritonSm90RsTactic(tile_m=64, split_k=1, num_stages=4, ctas_per_sm=2)
    assert why_invalid(pair, _w4a16(64, 132 * 128, 4096), SM90) == (
        "ctas_per_sm=2: 132 CTAs fit one an SM (132 SMs)"
    )
    assert why_invalid(pair, _w4a16(64, 133 * 128, 4096), SM90) is None
    assert pair.kernel_config().ctas_per_sm == 2


def test_not_offered_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = TritonSm90RsBackend().supports(SM90)
    assert not s.ok and "TRITON_INTERPRET" in s.reason


def test_estimate_charges_a_second_wave_and_the_activation_pass():
    b = TritonSm90RsBackend()
    t = TritonSm90RsTactic(tile_m=128, split_k=1, num_stages=3)
    one = b.estimate_us(_w4a16(128, 132 * 128, 4096), SM90, t)
    two = b.estimate_us(_w4a16(128, 133 * 128, 4096), SM90, t)
    assert two > 1.5 * one, (one, two)
    small = b.estimate_us(_w4a16(128, 4096, 4096), SM90, t)
    wide_k = b.estimate_us(_w4a16(128, 4096, 8192), SM90, t)
    assert wide_k > small  # twice the steps, twice the activations to permute
    # two CTAs an SM: 133 tiles in one wave, each step slower by the fitted share
    p = _w4a16(64, 133 * 128, 4096)
    one_sm = b.estimate_us(p, SM90, TritonSm90RsTactic(tile_m=64, split_k=1, num_stages=4))
    shared = b.estimate_us(p, SM90, TritonSm90RsTactic(tile_m=64, split_k=1, num_stages=4,
                                                        ctas_per_sm=2))  # fmt: skip
    assert shared < one_sm, (shared, one_sm)


def test_the_dispatcher_ranks_it_beside_ws_at_m64():
    """Registered through the sm90 family's entry point, it competes within W4A16 and
    its estimate takes the issue's 64x8192² (measured 30.5 against ws's 36.3 µs)."""
    d = Dispatcher(device="sm90", cache=None)
    assert {"triton-sm90-rs", "triton-sm90-ws"} <= {b.name for b in d.backends()}
    assert d.select(64, 8192, 8192, operation="w4a16").backend == "triton-sm90-rs"
    assert d.select(64, 8192, 8192, operation="w4a4").backend != "triton-sm90-rs"


def test_passes_the_conformance_kit_on_the_simulated_part():
    problems = [_w4a16(m, n, k) for m, n, k in ((64, 4096, 4096), (200, 5120, 2048))]
    report = check_backend(TritonSm90RsBackend(), device="sm90", problems=problems)
    assert not report.failures, report.failures
    assert report.passed


@pytest.mark.gpu
def test_passes_the_conformance_kit_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    # 134 tiles at 64 tokens: the two-CTA tactic is offered too
    shapes = ((64, 4096, 4096), (200, 1536, 2176), (64, 134 * 128, 1024))
    problems = [_w4a16(m, n, k) for m, n, k in shapes]
    report = check_backend(TritonSm90RsBackend(), device="cuda", problems=problems)
    assert not report.failures, report.failures
    assert [c for c in report.of("numerics") if c.status == "PASS"], report.checks
