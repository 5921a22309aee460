"""The layout rules of issue 10 that import-linter does not check by itself.

import-linter (run by scripts/test.sh) proves the contracts hold for the modules they
name; these tests prove every core module IS named (a new module left out of
pyproject.toml would be checked by nothing), that the architecture page lists it, and
that each module states its job in its docstring's first line. pyproject.toml and
docs/ are not in the wheel: they are read from ``FP4_DISPATCH_SOURCE_ROOT``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from pathlib import Path

import pytest

import fp4_dispatch

ROOT = os.environ.get("FP4_DISPATCH_SOURCE_ROOT")
#: subpackages of the installed package that are not the core (families, kernels)
NOT_CORE = {"plugins", "backends"}


def core_modules() -> list[str]:
    """The core's top-level packages and modules (what the layer contract must name)."""
    return sorted(
        f"fp4_dispatch.{m.name}"
        for m in pkgutil.iter_modules(fp4_dispatch.__path__)
        if m.name not in NOT_CORE
    )


def all_core_modules() -> list[str]:
    """Every core module, sub-package modules included (each states its job)."""
    found = []
    for top in core_modules():
        module = importlib.import_module(top)
        found.append(top)
        if hasattr(module, "__path__"):
            found += [m.name for m in pkgutil.walk_packages(module.__path__, f"{top}.")]
    return sorted(found)


def _source(relative: str) -> Path:
    if not ROOT:
        pytest.skip("FP4_DISPATCH_SOURCE_ROOT is not set (scripts/test.sh sets it)")
    return Path(ROOT) / relative


def _contracts() -> dict[str, dict]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads(_source("pyproject.toml").read_text(encoding="utf-8"))
    return {c["name"]: c for c in data["tool"]["importlinter"]["contracts"]}


def test_the_core_is_found():
    mods = core_modules()
    assert "fp4_dispatch.engine" in mods and "fp4_dispatch.autotune" in mods
    assert not any(m.split(".")[1] in NOT_CORE for m in mods)


def test_the_core_is_sub_packages_that_are_the_layers():
    """At least four layer packages besides the CLI, at most eight modules loose in the
    package root: ``ls`` shows the layers."""
    tops = [importlib.import_module(m) for m in core_modules()]
    packages = [t.__name__ for t in tops if hasattr(t, "__path__")]
    loose = [t.__name__ for t in tops if not hasattr(t, "__path__")]
    assert len([p for p in packages if p != "fp4_dispatch.cli"]) >= 4, packages
    assert len(loose) + 1 <= 8, f"modules directly in fp4_dispatch (plus __init__): {loose}"


def test_every_core_module_is_in_a_layer_and_in_the_no_family_contract():
    contracts = _contracts()
    layers = contracts["core layers import only downwards"]["layers"]
    in_layers = [name.strip() for layer in layers for name in re.split(r"[:|]", layer)]
    assert len(in_layers) == len(set(in_layers)), "a module is named in two layers"
    missing = [m for m in core_modules() if m not in in_layers]
    assert not missing, f"core modules in no import-linter layer: {missing}"
    sources = contracts["the core knows no family"]["source_modules"]
    unguarded = [m for m in core_modules() if m not in sources]
    assert not unguarded, f"core modules the no-family contract does not cover: {unguarded}"


def test_the_architecture_page_lists_every_core_module():
    text = _source("docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    table = text[text.index("| layer | modules | job |") :].split("\n\n", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_]+)/?`", table))
    missing = [m for m in core_modules() if m.split(".")[1] not in listed]
    assert not missing, f"docs/ARCHITECTURE.md's layer table does not list: {missing}"


@pytest.mark.parametrize("name", all_core_modules())
def test_module_states_its_job_in_one_line(name):
    doc = importlib.import_module(name).__doc__ or ""
    lines = doc.strip().splitlines()
    assert lines and lines[0].strip(), f"{name} has no docstring"
    first = lines[0].strip()
    assert len(first) <= 100 and first.endswith((".", "?")), f"{name}: {first!r}"
