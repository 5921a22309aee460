"""Tactic specs are frozen, strict and round-trip JSON exactly; device detection never raises."""

from __future__ import annotations

import pydantic
import pytest

from fp4_dispatch.contracts import device as device_mod
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.loading import profiles as profiles_mod
from fp4_dispatch.loading.registry import load

SIM_FOR_FAMILY = {"sm90": "sm90", "sm100": "sm100", "sm103": "sm103", "sm107": "sm107"}
PROBLEMS = [Problem(m=1, n=4096, k=4096), Problem(m=4096, n=8192, k=8192, out_dtype="float16")]


def builtin_tactics():
    """(backend name, tactic) for every built-in backend on a device it supports."""
    reg = load(strict=False)
    found = []
    for name, backend in reg.backends.items():
        if not reg.plugin_of[name].builtin:
            continue
        dev = profiles_mod.simulated(SIM_FOR_FAMILY.get(backend.family, "sm90"))
        if backend.family == "portable":
            dev = device_mod.CPU
        if not backend.supports(dev).ok:
            continue  # e.g. an extra that is not installed: covered by the plugin's tests
        for problem in PROBLEMS:
            found += [(name, t) for t in list(backend.tactics(problem, dev))[:40]]
    return found


TACTICS = builtin_tactics()


def test_some_builtin_tactics_were_found():
    assert {name for name, _ in TACTICS} >= {"torch-reference", "triton-sm90"}


@pytest.mark.parametrize(("name", "tactic"), TACTICS[::7], ids=lambda v: str(v)[:60])
def test_json_round_trip_is_exact(name, tactic):
    assert tactic.backend == name
    again = type(tactic).model_validate_json(tactic.model_dump_json())
    assert again == tactic and hash(again) == hash(tactic)
    assert again.canonical_json() == tactic.canonical_json()


def test_tactics_are_frozen_and_strict():
    _, tactic = TACTICS[0]
    with pytest.raises(pydantic.ValidationError):
        tactic.tile_m = 999  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="extra"):
        type(tactic).model_validate({**tactic.model_dump(), "surprise": 1})
    with pytest.raises(pydantic.ValidationError):
        Tactic(backend="x", tile_m=0, tile_n=128)


def test_problem_validation_and_swap():
    p = Problem(m=3, n=5, k=32)
    assert p.swapped() == Problem(m=5, n=3, k=32)
    with pytest.raises(pydantic.ValidationError):
        Problem(m=0, n=1, k=32)
    with pytest.raises(pydantic.ValidationError):
        Problem(m=1, n=1, k=32, out_dtype="float32")


def test_detection_never_raises(monkeypatch):
    def broken(index: int):
        raise OSError("libcuda.so: cannot open shared object file")

    monkeypatch.setattr(device_mod, "_read_cuda_device", broken)
    device_mod.detect.cache_clear()
    try:
        dev = device_mod.detect()
    finally:
        device_mod.detect.cache_clear()
    # a missing driver library is one short line (its loader's text goes to the debug log)
    assert dev.kind == "cpu" and dev.note == "no CUDA driver (CPU only)"


SIMULATED = [("sm90", 132, 90), ("sm100", 148, 100), ("sm103", 160, 103), ("sm107", 212, 107)]


@pytest.mark.parametrize(("name", "sms", "cc"), SIMULATED)
def test_simulated_devices(name, sms, cc):
    dev = profiles_mod.simulated(name)
    assert (dev.sm_count, dev.cc, dev.kind) == (sms, cc, "simulated")
    assert dev.arch == f"sm_{cc}a"
    smaller = profiles_mod.simulated(name, sm_count=sms // 2)
    assert smaller.sm_count == sms // 2
    assert smaller.bf16_tflops == pytest.approx(dev.bf16_tflops / 2, rel=0.02)


def test_resolve_rejects_unknown_names():
    with pytest.raises(ValueError, match="device: expected one of"):
        profiles_mod.resolve("h100")


def test_profiles_come_from_the_families_not_the_core():
    """Every simulated part is a family's `device_profiles` entry (no core table)."""
    from fp4_dispatch.engine.dispatcher import Dispatcher

    d = Dispatcher(device="cpu")
    declared = {p.alias: b.family for b in d.registry.backends.values() for p in b.device_profiles}
    assert declared == {"sm90": "sm90", "sm100": "sm100", "sm103": "sm103", "sm107": "sm107"}
    assert not hasattr(device_mod, "SIMULATED") and not hasattr(device_mod, "simulated")


@pytest.mark.parametrize(("cc", "expect"), [(90, 90), (100, 100), (103, 103), (107, 107),
                                            (101, 100), (120, 107), (89, None)])  # fmt: skip
def test_real_devices_take_the_rates_of_the_nearest_profile(cc, expect):
    real = device_mod.DeviceInfo(
        name="some gpu", kind="cuda", compute_capability=(cc // 10, cc % 10), sm_count=100
    )
    out = profiles_mod.rated(real)
    if expect is None:  # nothing at or below 8.9: placeholder rates, said so
        assert out.bf16_tflops == real.bf16_tflops and "placeholder" in out.note
        return
    ref = profiles_mod.simulated(f"sm{expect}")
    assert out.bf16_tflops == pytest.approx(ref.bf16_tflops * 100 / ref.sm_count)
    assert (out.fp4_tflops is None) == (cc < 100)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_sm_count_is_validated(bad):
    with pytest.raises((ValueError, TypeError), match="sm_count"):
        profiles_mod.simulated("sm100", sm_count=bad)


def test_cuda_index_must_be_a_number():
    with pytest.raises(ValueError, match="cuda:N"):
        profiles_mod.resolve("cuda:x")
