"""Whose fault: a caller's bad argument never disables a backend for later callers.

Argument errors the checks can see (an ``out`` that requires grad, an inference tensor
outside inference mode) are raised before any kernel runs. A kernel failure that the
checks cannot foresee is re-run on fresh copies of the arguments: if it then runs, the
caller is told which argument (`ArgumentError`) and nothing is recorded against the
backend; if it fails again, the backend is marked broken and the call falls back.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Backend, Dispatcher, Problem, Support, Tactic, quantize_nvfp4
from fp4_dispatch.engine.blame import ArgumentError
from fp4_dispatch.format.nvfp4 import reference_gemm

M, N, K = 8, 64, 64
CALLS: list[str] = []


class PickyTactic(Tactic):
    backend: Literal["picky"] = "picky"
    tile_m: Literal[128] = 128
    tile_n: Literal[128] = 128


class Picky(Backend):
    """Ranks first; its kernel is the reference but needs a 16-byte-aligned ``out`` (as
    vectorized GPU stores do), and with ``always_fails`` it never runs at all."""

    name = "picky"
    family = "picky"
    version = "1"
    tactic_type = PickyTactic
    always_fails = False

    def supports(self, device) -> Support:
        return Support(True, "synthetic")

    def tactics(self, problem: Problem, device):
        yield PickyTactic()

    def estimate_us(self, problem, device, tactic) -> float:
        return 0.001

    def build(self, tactic, problem, device):
        def kernel(operands, out):
            from fp4_dispatch.backends.reference import gemm

            CALLS.append("picky")
            if self.always_fails:
                raise RuntimeError("picky kernel is broken")
            if out.data_ptr() % 16:
                raise RuntimeError("misaligned address")
            gemm(operands, out, compute_dtype="float32", k_chunk=0)

        return kernel


@pytest.fixture
def dispatcher(monkeypatch):
    real_load = registry_mod.load

    def load(strict=None):
        reg = real_load(strict=strict)
        b = Picky()
        reg.backends[b.name] = b
        reg.plugin_of[b.name] = registry_mod.PluginReport("picky", "tests", "tests", "0",
                                                          builtin=False)  # fmt: skip
        return reg

    monkeypatch.setattr(registry_mod, "load", load)
    CALLS.clear()
    return Dispatcher(device="cpu", cache=False)


def _operands():
    g = torch.Generator().manual_seed(5)
    qa = quantize_nvfp4(torch.randn(M, K, generator=g))
    qb = quantize_nvfp4(torch.randn(N, K, generator=g))
    return qa, qb, reference_gemm(qa, qb)


def _still_healthy(d: Dispatcher) -> None:
    """A later valid call runs on the same backend, and nothing was held against it."""
    qa, qb, ref = _operands()
    out = d.gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    assert d.select(M, N, K).backend == "picky"
    assert not d.guard.broken
    assert not [f for f in d.faults if f.backend == "picky"]


def test_out_requiring_grad_is_refused_before_any_kernel_runs(dispatcher):
    qa, qb, _ = _operands()
    out = torch.empty(M, N, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="out: expected a tensor that does not require grad"):
        dispatcher.gemm(qa, qb, out=out)
    assert CALLS == []
    _still_healthy(dispatcher)


def test_out_requiring_grad_is_fine_under_no_grad(dispatcher):
    qa, qb, ref = _operands()
    out = torch.empty(M, N, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        dispatcher.gemm(qa, qb, out=out)
    assert float((out.detach().double() - ref).norm() / ref.norm()) < 5e-3


def test_inference_tensor_outside_inference_mode_is_refused_first(dispatcher):
    qa, qb, _ = _operands()
    with torch.inference_mode():
        out = torch.empty(M, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="inference tensor"):
        dispatcher.gemm(qa, qb, out=out)
    assert CALLS == []
    _still_healthy(dispatcher)


def test_kernel_failing_on_a_callers_argument_blames_it_and_disables_nothing(dispatcher):
    qa, qb, _ = _operands()
    storage = torch.empty(M * N + 1, dtype=torch.bfloat16)
    out = storage[1:].view(M, N)  # contiguous, but 2 bytes off the allocation: misaligned
    with pytest.raises(ArgumentError, match=r"^out: backend picky") as err:
        dispatcher.gemm(qa, qb, out=out)
    assert err.value.argument == "out" and "storage offset 1" in str(err.value)
    assert "nothing was disabled" in str(err.value)
    _still_healthy(dispatcher)


def test_default_dispatcher_survives_a_bad_call_for_other_callers(dispatcher):
    """The shared case: one caller's bad call, then another caller's valid calls."""
    qa, qb, _ = _operands()
    bad = torch.empty(M * N + 1, dtype=torch.bfloat16)[1:].view(M, N)
    for _ in range(3):
        with pytest.raises(ArgumentError):
            dispatcher.gemm(qa, qb, out=bad)
    _still_healthy(dispatcher)


def test_kernel_failing_on_good_arguments_too_is_the_backends_fault(dispatcher, caplog):
    Picky.always_fails = True
    try:
        qa, qb, ref = _operands()
        out = dispatcher.gemm(qa, qb)  # falls back to the reference backend
    finally:
        Picky.always_fails = False
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    assert any(b == "picky" for b, _ in dispatcher.guard.broken)
    assert dispatcher.select(M, N, K).backend != "picky"
    assert "picky kernel is broken" in caplog.text
