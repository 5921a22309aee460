"""Verify before trusting: a third-party kernel's first use is checked against the reference.

Each wrong kernel (zeros, NaN rows, ignoring strides) comes from a plugin that is not
built in and ranks first. An untuned call must still return the right result (the
fallback rewrites ``out``), name the backend, mark the tactic broken so that the
heuristic never picks it again, check only once per process, and raise in strict mode.
"""

from __future__ import annotations

import logging
from typing import Literal

import pytest
import torch

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Backend, Dispatcher, Problem, Support, Tactic, quantize_nvfp4
from fp4_dispatch.engine import firstuse
from fp4_dispatch.format.nvfp4 import reference_gemm
from fp4_dispatch.loading.guard import PluginFault

M, N, K = 24, 96, 128


class ExtTactic(Tactic):
    backend: Literal["ext"] = "ext"
    tile_m: Literal[128] = 128
    tile_n: Literal[128] = 128


def _right(operands, out):
    from fp4_dispatch.backends.reference import gemm

    gemm(operands, out, compute_dtype="float32", k_chunk=0)


def _zeros(operands, out):
    out.zero_()


def _nan_rows(operands, out):
    _right(operands, out)
    out[::2] = float("nan")


def _ignores_strides(operands, out):
    tmp = torch.empty(out.shape[1], out.shape[0], dtype=out.dtype)
    _right(operands, tmp.T)  # right values...
    out.view(-1).copy_(tmp.reshape(-1))  # ...written as if out were column-major


KERNELS = {"zeros": _zeros, "nan-rows": _nan_rows, "ignores-strides": _ignores_strides}
RUNS: list[str] = []


class Ext(Backend):
    name = "ext"
    family = "ext"
    version = "1"
    tactic_type = ExtTactic
    kernel = staticmethod(_right)

    def supports(self, device) -> Support:
        return Support(True, "third-party")

    def tactics(self, problem: Problem, device):
        yield ExtTactic()

    def estimate_us(self, problem, device, tactic) -> float:
        return 0.001  # ranks first

    def build(self, tactic, problem, device):
        def kernel(operands, out):
            RUNS.append("ext")
            type(self).kernel(operands, out)

        return kernel


@pytest.fixture
def install(monkeypatch):
    """`install(kernel, builtin=False)`: the real registry plus `Ext` running `kernel`."""
    real_load = registry_mod.load
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")  # built-ins only (CI installs examples)
    firstuse.forget()
    RUNS.clear()

    def make(kernel, builtin: bool = False):
        monkeypatch.setattr(Ext, "kernel", staticmethod(kernel))

        def load(strict=None):
            reg = real_load(strict=strict)
            reg.backends["ext"] = Ext()
            reg.plugin_of["ext"] = registry_mod.PluginReport("ext-plugin", "ext-dist", "pypi",
                                                             "1.0", builtin=builtin)  # fmt: skip
            return reg

        monkeypatch.setattr(registry_mod, "load", load)

    yield make
    firstuse.forget()


def _operands():
    g = torch.Generator().manual_seed(11)
    qa = quantize_nvfp4(torch.randn(M, K, generator=g))
    qb = quantize_nvfp4(torch.randn(N, K, generator=g))
    return qa, qb, reference_gemm(qa, qb)


def _rel(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_wrong_untuned_kernel_is_caught_on_first_use(install, caplog, kind):
    install(KERNELS[kind])
    d = Dispatcher(device="cpu", cache=False)
    assert d.select(M, N, K).backend == "ext"  # the heuristic would run it
    qa, qb, ref = _operands()
    with caplog.at_level(logging.WARNING):
        out = d.gemm(qa, qb)
    assert _rel(out, ref) < 5e-3  # the fallback rewrote out
    assert ("ext", ExtTactic()) in d.guard.broken
    assert d.select(M, N, K).backend != "ext"  # excluded from the heuristic pick too
    assert "ext" in caplog.text and "first-use check" in caplog.text
    assert any(f.backend == "ext" and f.plugin == "ext-plugin" for f in d.faults)


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_wrong_kernel_raises_in_strict_mode(install, kind):
    install(KERNELS[kind])
    qa, qb, _ = _operands()
    with pytest.raises(PluginFault, match="first-use check"):
        Dispatcher(device="cpu", cache=False, strict=True).gemm(qa, qb)


def test_a_right_kernel_is_checked_once_then_trusted(install, monkeypatch):
    install(_right)
    calls = []
    real = firstuse.wrong_output
    monkeypatch.setattr(firstuse, "wrong_output", lambda *a: calls.append(1) or real(*a))
    qa, qb, ref = _operands()
    d = Dispatcher(device="cpu", cache=False)
    for _ in range(3):
        assert _rel(d.gemm(qa, qb), ref) < 5e-3
    Dispatcher(device="cpu", cache=False).gemm(qa, qb)  # once per process, not per dispatcher
    assert len(calls) == 1 and RUNS == ["ext"] * 4
    assert not d.guard.broken


def test_built_in_kernels_and_the_switch_are_not_checked(install, monkeypatch):
    calls = []
    monkeypatch.setattr(firstuse, "wrong_output", lambda *a: calls.append(1))
    install(_zeros, builtin=True)
    qa, qb, _ = _operands()
    Dispatcher(device="cpu", cache=False).gemm(qa, qb)
    install(_zeros)
    monkeypatch.setenv("FP4_DISPATCH_VERIFY_PLUGINS", "0")
    out = Dispatcher(device="cpu", cache=False).gemm(qa, qb)
    assert calls == [] and torch.count_nonzero(out) == 0  # switched off: trusted blindly
    out = Dispatcher(device="cpu", cache=False, verify_plugins=True).gemm(qa, qb)
    assert calls == [1]


def test_built_in_kernels_never_run_on_hardware_are_checked(install, monkeypatch, caplog):
    """A built-in backend whose kernels were compiled but never run on hardware
    (`Backend.compile_only_note`) is checked on first use like a plugin's: a wrong
    result falls back and marks the tactic broken."""
    install(_zeros, builtin=True)
    monkeypatch.setattr(Ext, "compile_only_note", "compiled, not run on hardware")
    qa, qb, ref = _operands()
    d = Dispatcher(device="cpu", cache=False)
    with caplog.at_level(logging.WARNING):
        out = d.gemm(qa, qb)
    assert _rel(out, ref) < 5e-3 and ("ext", ExtTactic()) in d.guard.broken
    assert "first-use check" in caplog.text


def test_verify_plugins_must_be_a_bool():
    with pytest.raises(TypeError, match="verify_plugins: expected a bool or None, got str"):
        Dispatcher(device="cpu", cache=False, verify_plugins="yes")


def test_cached_winner_failing_verification_is_not_the_heuristic_pick_either(
    install, tmp_path, caplog
):
    install(_right)
    path = tmp_path / "tuning.json"
    d = Dispatcher(device="cpu", cache=path)

    def timer(cand, launch, best):
        from fp4_dispatch.autotune.tuning import Timing

        us = 1.0 if cand.backend == "ext" else 50.0
        return Timing((us, us, us), "fake")

    (r,) = d.tune([(M, N, K)], timer=timer, progress=False)
    assert r.winner.backend == "ext"
    assert Dispatcher(device="cpu", cache=path).winners.entries()[r.bucket].verified == "tuning"
    install(_zeros)  # the plugin's kernel breaks after tuning (an upgrade)
    firstuse.forget()
    with caplog.at_level(logging.WARNING):
        d2 = Dispatcher(device="cpu", cache=path)
        pick = d2.select(M, N, K)
    assert pick.backend != "ext", pick
    assert "wrong result" in caplog.text


def test_the_check_costs_a_small_share_of_the_gemm():
    """Multiply-adds of the sampled reference against the GEMM's at 128x4096x4096."""
    m, n, k = 128, 4096, 4096
    sampled = firstuse.SAMPLE_ROWS * firstuse.SAMPLE_COLS * k
    dequant = (firstuse.SAMPLE_ROWS + firstuse.SAMPLE_COLS) * k
    assert (sampled + dequant) / (m * n * k) < 0.005
    rows = firstuse.sample(m, firstuse.SAMPLE_ROWS, 0)
    assert rows[0] == 0 and rows[-1] == m - 1 and len(set(rows.tolist())) == len(rows)
