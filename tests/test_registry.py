"""The registry records every plugin failure and keeps loading the others."""

from __future__ import annotations

import pytest
from conftest import good_plugin

from fp4_dispatch import registry
from fp4_dispatch.registry import PluginLoadError, load

RAISES_ON_IMPORT = "raise RuntimeError('boom at import')\n"
RAISES_IN_HOOK = """
import fp4_dispatch
@fp4_dispatch.hookimpl
def fp4_dispatch_register_backends(register):
    raise ValueError('boom in hook')
"""
NOT_A_BACKEND = """
import fp4_dispatch
@fp4_dispatch.hookimpl
def fp4_dispatch_register_backends(register):
    register(object())
"""
NO_HOOK = "x = 1\n"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("FP4_DISPATCH_PLUGINS", "FP4_DISPATCH_DISABLE", "FP4_DISPATCH_STRICT"):
        monkeypatch.delenv(var, raising=False)


def report(reg, name):
    (rep,) = [p for p in reg.plugins if p.name == name]
    return rep


def test_builtins_load_from_entry_points():
    reg = load()
    ref = report(reg, "reference")
    assert ref.builtin and ref.status == "loaded" and ref.distribution == "fp4-dispatch"
    assert "torch-reference" in reg.backends


@pytest.mark.parametrize(
    ("source", "stage", "error_type", "text"),
    [
        (RAISES_ON_IMPORT, "import", "RuntimeError", "boom at import"),
        (RAISES_IN_HOOK, "hook", "ValueError", "boom in hook"),
        (NOT_A_BACKEND, "register", "TypeError", "expects an fp4_dispatch.Backend"),
        (NO_HOOK, "hook", "TypeError", "defines no fp4_dispatch_register_backends"),
    ],
)
def test_failure_is_recorded_and_others_load(plugin_dist, source, stage, error_type, text):
    plugin_dist("bad-dist", {"bad": source, "good": good_plugin("good-backend")}, "9.9")
    reg = load()
    bad = report(reg, "bad")
    assert bad.status == "failed"
    (err,) = bad.errors
    assert (err.plugin, err.distribution, err.version) == ("bad", "bad-dist", "9.9")
    assert (err.stage, err.error_type) == (stage, error_type)
    assert text in err.message
    assert "Traceback" in err.traceback
    assert "good-backend" in reg.backends and report(reg, "good").status == "loaded"


def test_duplicate_name_is_recorded_first_one_kept(plugin_dist):
    plugin_dist("dup-dist", {"dup": good_plugin("torch-reference")})
    reg = load()
    assert type(reg.backends["torch-reference"]).__module__ == "fp4_dispatch.plugins.reference"
    (err,) = report(reg, "dup").errors
    assert err.stage == "register" and "duplicate backend name 'torch-reference'" in err.message


@pytest.mark.parametrize("how", ["argument", "env"])
def test_strict_raises(plugin_dist, monkeypatch, how):
    plugin_dist("bad-dist", {"bad": RAISES_ON_IMPORT})
    if how == "env":
        monkeypatch.setenv("FP4_DISPATCH_STRICT", "1")
    with pytest.raises(PluginLoadError, match="boom at import") as info:
        load(strict=True if how == "argument" else None)
    assert info.value.error.plugin == "bad"


def test_explicit_strict_false_wins_over_env(plugin_dist, monkeypatch):
    plugin_dist("bad-dist", {"bad": RAISES_ON_IMPORT})
    monkeypatch.setenv("FP4_DISPATCH_STRICT", "1")
    assert report(load(strict=False), "bad").status == "failed"


def test_allowlist_empty_means_builtins_only(plugin_dist, monkeypatch):
    plugin_dist("tp-dist", {"tp": good_plugin("tp-backend")})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")
    reg = load()
    assert "tp-backend" not in reg.backends and "torch-reference" in reg.backends
    assert report(reg, "tp").status == "disabled"


def test_allowlist_names_a_plugin(plugin_dist, monkeypatch):
    plugin_dist("tp-dist", {"tp": good_plugin("tp-backend"), "tq": good_plugin("tq-backend")})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "tq")
    reg = load()
    assert "tq-backend" in reg.backends and "tp-backend" not in reg.backends


def test_blocklist_disables_builtins_too(plugin_dist, monkeypatch):
    plugin_dist("tp-dist", {"tp": good_plugin("tp-backend")})
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "reference, tp")
    reg = load()
    assert "torch-reference" not in reg.backends and "tp-backend" not in reg.backends
    assert report(reg, "reference").status == "disabled"


def test_check_backend_rejects_bad_attributes():
    from fp4_dispatch.plugins.reference import ReferenceBackend

    class NoName(ReferenceBackend):
        name = ""

    with pytest.raises(TypeError, match="name must be a non-empty str"):
        registry.check_backend(NoName())
