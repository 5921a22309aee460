"""The registry records every plugin failure and keeps loading the others."""

from __future__ import annotations

import sys
import textwrap

import pytest
from conftest import good_plugin

from fp4_dispatch.loading import registry
from fp4_dispatch.loading.registry import PluginLoadError, load

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


def test_disable_takes_a_backend_name(plugin_dist, monkeypatch):
    from fp4_dispatch.engine.dispatcher import Dispatcher

    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "torch-reference, triton-sm90")
    reg = load()
    assert "torch-reference" not in reg.backends and "triton-sm90" not in reg.backends
    assert "triton-sm90-unpack" in reg.backends  # same plugin, not named: kept
    assert report(reg, "reference").disabled_backends == {
        "torch-reference": "listed in FP4_DISPATCH_DISABLE"
    }
    rows = {r.name: r for r in Dispatcher("cpu", cache=False).backends()}
    assert rows["torch-reference"].status == "disabled" and rows["torch-reference"].plugin == (
        "reference"
    )


def test_allowlist_takes_plugin_colon_backend(plugin_dist, monkeypatch):
    plugin_dist("tp-dist", {"tp": good_plugin("tp-backend"), "tq": good_plugin("tq-backend")})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "tq:tq-backend")
    reg = load()
    assert "tq-backend" in reg.backends and "tp-backend" not in reg.backends
    assert "torch-reference" in reg.backends  # built-ins are not limited by the allowlist
    assert report(reg, "tp").status == "disabled" and "fakeplug_tp" not in sys.modules


def test_unknown_allowlist_name_imports_no_unlisted_plugin(plugin_dist, monkeypatch, caplog):
    """FP4_DISPATCH_PLUGINS=typo: no third-party plugin's code runs to look for it."""
    plugin_dist("tp-dist", {"tp": good_plugin("tp-backend"), "tq": good_plugin("tq-backend")})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "nosuch,tq")
    with caplog.at_level("WARNING", logger="fp4_dispatch.loading.registry"):
        reg = load()
    assert "fakeplug_tp" not in sys.modules and report(reg, "tp").status == "disabled"
    assert "tq-backend" in reg.backends and not report(reg, "tq").disabled_backends
    assert "'nosuch' matches no plugin" in caplog.text and "plugin:backend" in caplog.text


@pytest.mark.parametrize("var", ["FP4_DISPATCH_DISABLE", "FP4_DISPATCH_PLUGINS"])
def test_unmatched_name_warns_once_with_known_names(monkeypatch, caplog, var):
    name = f"no-such-thing-{var[-7:].lower()}"
    monkeypatch.setenv(var, f"sm100,{name}")
    with caplog.at_level("WARNING", logger="fp4_dispatch.loading.registry"):
        load()
        load()
    hits = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(hits) == 1, hits
    assert var in hits[0] and "torch-reference" in hits[0] and "sm90" in hits[0]


def test_disabled_plugin_is_blocked_in_pluggy(monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "sm100")
    reg = load()
    assert reg.pm.is_blocked("sm100") and not reg.pm.is_blocked("reference")
    assert report(reg, "sm100").status == "disabled"


def test_hook_that_registers_then_raises_contributes_nothing(plugin_dist):
    src = good_plugin("half-backend").replace(
        "register(B())", "register(B())\n        raise RuntimeError('late')"
    )
    plugin_dist("half-dist", {"half": src})
    reg = load()
    assert "half-backend" not in reg.backends
    (err,) = report(reg, "half").errors
    assert err.stage == "hook" and "late" in err.message


def test_same_entry_point_name_in_two_distributions_both_load(plugin_dist, tmp_path):
    plugin_dist("one-dist", {"same": good_plugin("one-backend")})
    # a second distribution whose entry point has the same name, another module
    info = tmp_path / "two_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: two-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[fp4_dispatch]\nsame = fakeplug_same_two\n")
    (tmp_path / "fakeplug_same_two.py").write_text(textwrap.dedent(good_plugin("two-backend")))
    try:
        reg = load()
    finally:
        sys.modules.pop("fakeplug_same_two", None)
    assert {"one-backend", "two-backend"} <= set(reg.backends), [str(e) for e in reg.errors]


# ---- the backend filter: a pure function of the two variables, nothing installed ----------


@pytest.mark.parametrize(
    ("env", "plugin", "builtin", "backends", "left_out"),
    [
        ({}, "tp", False, ["a", "b"], {}),  # neither variable: everything stays
        ({"FP4_DISPATCH_DISABLE": "b"}, "tp", False, ["a", "b"], {"b": "DISABLE"}),
        ({"FP4_DISPATCH_DISABLE": " b , a"}, "reference", True, ["a", "b"],
         {"a": "DISABLE", "b": "DISABLE"}),  # built-ins too
        ({"FP4_DISPATCH_PLUGINS": "tp : a"}, "tp", False, ["a", "b"], {"b": "PLUGINS"}),
        ({"FP4_DISPATCH_PLUGINS": "tp:a,tp"}, "tp", False, ["a", "b"], {}),  # whole plugin
        ({"FP4_DISPATCH_PLUGINS": ""}, "reference", True, ["a"], {}),  # built-ins not limited
        ({"FP4_DISPATCH_PLUGINS": "tq:a"}, "tp", False, ["a"], {"a": "PLUGINS"}),
        ({"FP4_DISPATCH_PLUGINS": "tp:a", "FP4_DISPATCH_DISABLE": "a"}, "tp", False, ["a"],
         {"a": "DISABLE"}),  # disabling wins
    ],
)  # fmt: skip
def test_filter_backends_is_a_pure_function_of_the_variables(
    env, plugin, builtin, backends, left_out
):
    selection = registry.Selection.from_env(env)
    got = registry.filter_backends(selection, plugin, builtin, backends)
    assert got == {name: f"{'listed' if v == 'DISABLE' else 'not listed'} in FP4_DISPATCH_{v}"
                   for name, v in left_out.items()}  # fmt: skip


@pytest.mark.parametrize(
    ("env", "plugin", "builtin", "why"),
    [
        ({}, "tp", False, None),
        ({"FP4_DISPATCH_DISABLE": "tp"}, "tp", False, "listed in FP4_DISPATCH_DISABLE"),
        ({"FP4_DISPATCH_DISABLE": "tp"}, "reference", True, None),
        ({"FP4_DISPATCH_DISABLE": "reference"}, "reference", True,
         "listed in FP4_DISPATCH_DISABLE"),
        ({"FP4_DISPATCH_PLUGINS": ""}, "tp", False, "not listed in FP4_DISPATCH_PLUGINS"),
        ({"FP4_DISPATCH_PLUGINS": "tp:a"}, "tp", False, None),  # imported, then filtered
        ({"FP4_DISPATCH_PLUGINS": "a"}, "tp", False, "not listed in FP4_DISPATCH_PLUGINS"),
    ],
)  # fmt: skip
def test_the_loader_acts_on_plugin_names_only(env, plugin, builtin, why):
    """A backend name never makes the loader import (or skip) a plugin: only the filter
    reads backend names, after the import."""
    assert registry.Selection.from_env(env).skip_plugin(plugin, builtin) == why


def test_selection_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "x:y")
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "z")
    selection = registry.Selection.from_env()
    assert selection == registry.Selection(frozenset({"x:y"}), frozenset({"z"}))
    assert selection.picked == {"x": frozenset({"y"})}
