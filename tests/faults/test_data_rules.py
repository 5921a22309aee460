"""Data rules shared by every entry point: the SM count and the GEMM's K rule."""

from __future__ import annotations

import pytest
import torch

from fp4_dispatch import quantize_nvfp4
from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.loading.profiles import resolve


@pytest.mark.parametrize("bad", [0, -4, True, 1.5, "132"])
def test_sm_count_is_validated(bad):
    with pytest.raises(ValueError, match="sm_count: expected a positive int"):
        resolve("sm90", bad)
    with pytest.raises(ValueError, match="sm_count"):
        Dispatcher("cpu", sm_count=bad, cache=False)


def test_sm_count_valid_scales_rates():
    dev = resolve("sm90", 66)
    assert dev.sm_count == 66 and dev.bf16_tflops == pytest.approx(691.0 / 2)


@pytest.fixture(scope="module")
def d():
    return Dispatcher("cpu", cache=False)


@pytest.mark.parametrize("k", [48, 0, -32, 40])
def test_k_rule_is_the_same_everywhere(d, k):
    rule = "K must be a positive multiple of 32|K: expected a positive int"
    with pytest.raises(ValueError, match=rule):
        d.select(4, 64, k)
    with pytest.raises(ValueError, match=rule):
        d.candidates(4, 64, k)
    with pytest.raises(ValueError, match=rule):
        d.tune([(4, 64, k)], save=False, progress=False)


def test_k_rule_gemm_and_explain(d):
    from fp4_dispatch.cli import main

    qa, qb = quantize_nvfp4(torch.randn(4, 48)), quantize_nvfp4(torch.randn(64, 48))
    with pytest.raises(ValueError, match="K must be a positive multiple of 32"):
        d.gemm(qa, qb)
    # the CLI applies the same rule while parsing: a usage error (exit 2), one line
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "4", "64", "48", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert d.select(4, 64, 64).backend  # the rule accepts what the GEMM accepts


@pytest.mark.parametrize(("m", "n"), [(0, 64), (4, 0), (4.0, 64), (True, 64)])
def test_m_n_must_be_positive_ints_for_ranking(d, m, n):
    with pytest.raises(ValueError, match="expected a positive int"):
        d.candidates(m, n, 64)
