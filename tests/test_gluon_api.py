"""The Gluon kernels use only what Triton 3.6's Gluon has.

The GPU images this project is measured on carry Triton 3.6, while the CPU compile tests
run with whatever Triton pip installs (3.9 on the development machine). Gluon's API grows
between releases: the grouped mma kernel once called ``gl.cumsum``, which 3.9 has and
3.6 does not, and its first GPU run failed to compile (benchmarks/RESULTS.md, MoE run 3).
This test reads the installed package's kernel sources and checks each Gluon name
they reach against the public names of Triton 3.6.0's Gluon modules, listed in
``gluon_api_triton36.json`` (``dir()`` of each module, Triton 3.6.0, cp311 wheel).
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import fp4_dispatch.backends

API = json.loads((Path(__file__).with_name("gluon_api_triton36.json")).read_text())
MODULES: dict[str, set[str]] = {m: set(names) for m, names in API["modules"].items()}


def _gluon_names(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, name) for every name a source reaches in a Gluon module: ``from M import
    n`` and ``alias.n`` where ``alias`` was bound to M by an import."""
    aliases: dict[str, str] = {}
    used: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for a in node.names:
            sub = f"{node.module}.{a.name}"
            if sub in MODULES:  # a module imported by name (``gluon``, ``gl``, ``tma``)
                aliases[a.asname or a.name] = sub
            elif node.module in MODULES:
                used.add((node.module, a.name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            used.add((aliases[node.value.id], node.attr))
    return used


@functools.cache
def _kernel_names() -> dict[str, set[tuple[str, str]]]:
    """File name -> `_gluon_names` of each module of the installed kernels' package that
    imports from ``triton.experimental`` (a package of its own in an editable install's
    mapping, hence ``fp4_dispatch.backends``)."""
    root = Path(fp4_dispatch.backends.__file__).parent
    texts = {p.name: p.read_text() for p in sorted(root.rglob("*.py"))}
    return {n: _gluon_names(ast.parse(t)) for n, t in texts.items() if "triton.experimental" in t}


def test_the_scan_sees_the_gluon_kernels():
    """The scan reaches the Gluon kernels (else the next test would pass on nothing)."""
    names = _kernel_names()
    assert {"gemm_grouped_mma.py", "gemm_grouped_rs.py", "gemm_w4a16_rs.py"} <= set(names), names
    used = set().union(*names.values())
    assert ("triton.experimental.gluon", "jit") in used
    assert ("triton.experimental.gluon.language", "associative_scan") in used
    assert (
        "triton.experimental.gluon.language.nvidia.hopper.tma",
        "async_copy_global_to_shared",
    ) in used


def test_every_gluon_name_exists_in_triton_36():
    missing = sorted(
        f"{file}: {mod}.{name}"
        for file, used in _kernel_names().items()
        for mod, name in used
        if name not in MODULES[mod]
    )
    assert not missing, f"not in Triton 3.6's Gluon: {missing}"


def test_a_name_only_newer_triton_has_is_caught():
    src = "from triton.experimental.gluon import language as gl\nx = gl.cumsum(y, axis=0)\n"
    used = _gluon_names(ast.parse(src))
    assert ("triton.experimental.gluon.language", "cumsum") in used
    assert "cumsum" not in MODULES["triton.experimental.gluon.language"]
