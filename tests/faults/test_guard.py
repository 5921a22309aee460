"""The guard itself: what it catches, what it lets through, what it checks."""

from __future__ import annotations

import pytest

from fp4_dispatch.contracts.backend import Support
from fp4_dispatch.loading.guard import MAX_FAULTS, Guard, PluginFault, contain


class Hostile(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class Fake:
    name = "fake-b"

    def __init__(self, supports):
        self._supports = supports

    def supports(self, device):
        return self._supports()


def test_contain_catches_system_exit_not_ctrl_c():
    def leave():
        raise SystemExit(3)

    value, exc = contain(leave)
    assert value is None and isinstance(exc, SystemExit) and exc.code == 3

    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        contain(interrupt)


def test_hostile_str_does_not_escape():
    def boom():
        raise Hostile

    g = Guard(plugin_of={"fake-b": "fake"})
    got = g.supports(Fake(boom), None)
    assert isinstance(got, PluginFault)
    assert "str() of the exception raised RuntimeError" in got.fault.message


def test_supports_type_checked_and_attributed():
    g = Guard(plugin_of={"fake-b": "fake"})
    assert g.supports(Fake(lambda: Support(True, "ok")), None) == Support(True, "ok")
    got = g.supports(Fake(lambda: 1), None)
    assert isinstance(got, PluginFault) and got.fault.plugin == "fake"
    assert got.fault.what == "supports() returned int 1, expected an fp4_dispatch.Support"
    with pytest.raises(PluginFault, match="plugin 'fake' backend 'fake-b': supports"):
        Guard(strict=True, plugin_of={"fake-b": "fake"}).supports(Fake(lambda: 1), None)


def test_faults_deduplicated_and_bounded():
    g = Guard()
    for _ in range(3):
        g.fault("b", "tactics()", ValueError("same"))
    assert len(g.faults) == 1
    for i in range(MAX_FAULTS + 10):
        g.fault("b", "tactics()", ValueError(f"varying {i}"))
    assert len(g.faults) == MAX_FAULTS
