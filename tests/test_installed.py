"""The tests run against the installed wheel, and every built-in plugin loads from it."""

from __future__ import annotations

import os
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

import fp4_dispatch
from fp4_dispatch.loading.registry import GROUP, load

BUILTINS = {"reference", "sm90", "sm100", "sm103", "sm107", "flashinfer"}


def test_package_comes_from_site_packages_not_the_source_tree():
    here = Path(fp4_dispatch.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert site in here.parents, f"fp4_dispatch imported from {here}, not from {site}"
    source = os.environ.get("FP4_DISPATCH_SOURCE_ROOT")
    if source:
        assert Path(source).resolve() not in here.parents, f"imported from the source: {here}"
    assert fp4_dispatch.__version__ == metadata.version("fp4-dispatch")


def test_subpackages_are_mapped_into_fp4_dispatch():
    import fp4_dispatch.backends
    import fp4_dispatch.cli
    import fp4_dispatch.plugins

    for mod in (fp4_dispatch.backends, fp4_dispatch.plugins, fp4_dispatch.cli):
        assert Path(mod.__file__).parent.parent == Path(fp4_dispatch.__file__).parent


def test_no_generic_top_level_packages_installed():
    files = metadata.files("fp4-dispatch") or []
    tops = {f.parts[0] for f in files if f.suffix == ".py"}
    assert tops == {"fp4_dispatch"}, tops


def test_builtin_entry_points_are_declared():
    eps = {ep.name for ep in metadata.entry_points(group=GROUP) if ep.dist.name == "fp4-dispatch"}
    assert eps == BUILTINS


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_plugin_loads_from_the_wheel(name):
    (report,) = [p for p in load(strict=False).plugins if p.name == name]
    assert report.builtin
    assert report.status == "loaded", [str(e) + e.traceback for e in report.errors]
    assert report.backends, f"built-in plugin {name} registered no backend"
