"""Backend versions that know their kernels' source: an edited kernel is a cache miss.

Why: a tuning-cache entry is adopted only when its ``backend_version`` equals the
installed backend's `Backend.version`. Hand-bumped versions were never bumped (every sm90
backend said ``"1"`` through dozens of kernel edits), so a winner measured before a
kernel changed was still adopted after it. Like Triton's cache keys (which hash a
kernel's source and that of the functions it calls), `SourceVersion` appends a digest of
the source of the module a backend launches and of every module of the kernel packages
it imports, transitively: ``"1+src.3fa9c2d1e0b4"``.

The digest reads files (``importlib.util.find_spec``, no import of the kernel module, so
no Triton), parses their imports with `ast`, and is computed on first read of the
attribute, once per process.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: modules under these packages are followed (kernel code); others (torch, the core) not
FOLLOW = ("fp4_dispatch.backends",)
#: hex digits of the sha256 kept in a version (48 bits: a collision needs ~16M edits)
DIGITS = 12


def _origin(module: str) -> Path | None:
    """The source file of `module`, found without importing it or its parents
    (``find_spec`` of a dotted name imports the parent packages, and a kernel module's
    parent may import Triton): the top-level package's spec, then the file system.
    None when it is not a module (an attribute of one)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin)
    for part in rest:
        if path.name != "__init__.py":
            return None  # a name inside a module file, not a module
        folder = path.parent
        path = folder / part / "__init__.py"
        if not path.is_file():
            path = folder / f"{part}.py"
        if not path.is_file():
            return None
    return path if path.suffix == ".py" else None


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


@functools.cache
def _module(name: str) -> tuple[bytes, frozenset[str]]:
    """(source, imported module names) of `name`, read and parsed once per process;
    (b"", empty) when it is not a module."""
    path = _origin(name)
    if path is None:
        return b"", frozenset()
    source = path.read_bytes()
    return source, frozenset(_imports(name, path, source))


def _imports(module: str, path: Path, source: bytes) -> set[str]:
    """Modules `source` imports (relative imports resolved; ``from p import m`` gives
    ``p`` and, where it is a module, ``p.m``). Only top-level and function-level import
    statements matter, so only lines that start one are parsed (a whole kernel file
    through `ast` costs tens of milliseconds)."""
    found: set[str] = set()
    for statement in _import_statements(source):
        for node in ast.walk(ast.parse(statement)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = _package(module, path).split(".")
                    parent = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{parent}.{base}" if base else parent
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _import_statements(source: bytes) -> list[str]:
    """Each ``import``/``from ... import`` statement of `source`, dedented, with its
    parenthesized continuation lines."""
    out: list[str] = []
    lines = source.decode("utf-8", "replace").splitlines()
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        i += 1
        if not (text.startswith("import ") or (text.startswith("from ") and " import " in text)):
            continue
        text = text.split("#", 1)[0].rstrip()
        if text.endswith("(") or ("(" in text and ")" not in text):
            while i < len(lines) and ")" not in text:
                text += " " + lines[i].split("#", 1)[0].strip()
                i += 1
        text = text.replace("\\", " ")
        try:
            ast.parse(text)
        except SyntaxError:  # not an import after all (text in a docstring): skip it
            continue
        out.append(text)
    return out


def _followed(name: str, follow: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in follow)


@functools.cache
def source_digest(
    *modules: str, shallow: tuple[str, ...] = (), follow: tuple[str, ...] | None = None
) -> str:
    """sha256 (first `DIGITS` hex) of `modules`' source and of every module under
    `follow` (default `FOLLOW`) they import, transitively, plus the source alone of the
    `shallow` modules (a plugin module: its tactic-to-kernel mapping counts, the other
    kernels it imports do not), in name order. A module that cannot be found contributes
    its name only (so a missing kernel still gives a stable digest)."""
    follow = FOLLOW if follow is None else follow
    seen: dict[str, bytes] = {name: _module(name)[0] for name in shallow}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        source, imported = _module(name)
        seen[name] = source
        todo += [m for m in imported if _followed(m, follow) and m not in seen]
    h = hashlib.sha256()
    for name in sorted(seen):
        if seen[name] or name in modules or name in shallow:
            h.update(name.encode() + b"\0" + seen[name] + b"\0")
    return h.hexdigest()[:DIGITS]


class SourceVersion:
    """A `Backend.version` class attribute: ``f"{base}+src.{digest}"``, computed lazily.

    ``version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_direct",
    plugin=__name__)``: the kernel modules (followed through their imports) and the
    plugin module (its own source only). Reading ``Backend.version`` (on the class or an
    instance) gives the string.
    """

    def __init__(self, base: str, *modules: str, plugin: str | None = None) -> None:
        if not modules:
            raise ValueError("modules: expected at least one kernel module, got none")
        self.base = base
        self.modules = modules
        self.shallow = (plugin,) if plugin else ()

    def __get__(self, obj: object, owner: type | None = None) -> str:
        return f"{self.base}+src.{source_digest(*self.modules, shallow=self.shallow)}"

    def __repr__(self) -> str:
        return f"SourceVersion({self.base!r}, {', '.join(map(repr, self.modules))})"
