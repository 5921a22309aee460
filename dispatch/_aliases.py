"""Old import paths, kept working for one release with a `DeprecationWarning`.

Until 0.x the core was one flat folder (``fp4_dispatch.dispatcher``,
``fp4_dispatch.nvfp4``, ...). It is now sub-packages that are the import layers
(docs/ARCHITECTURE.md, "Layers"). A plugin or script that imports an old path gets the
same module object as the new path (so ``mock.patch`` and ``isinstance`` keep working),
plus one warning naming the new path. Public names are best imported from
``fp4_dispatch`` itself (``from fp4_dispatch import Dispatcher``), which never moved.

The table is the one record of the move; remove this module (and its `install` call in
``fp4_dispatch/__init__.py``) in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: old flat module -> the module it became
MOVED: dict[str, str] = {
    f"fp4_dispatch.{old}": f"fp4_dispatch.{package}.{old}"
    for package, olds in {
        "format": ("nvfp4", "checks"),
        "contracts": ("backend", "tactics", "candidates", "device", "buckets", "hookspecs"),
        "support": ("progress", "safefs", "sources"),
        "loading": ("registry", "guard", "status", "profiles"),
        "policy": ("costmodel", "ranking", "merge", "cap"),
        "autotune": (
            "tuning",
            "timers",
            "harness",
            "precompile",
            "precompile_worker",
            "distributed",
        ),
        "store": ("cache", "winners"),
        "engine": ("dispatcher", "plans", "torch_ops", "blame", "firstuse"),
        "integrations": (
            "nn",
            "convert",
            "checkpoints",
            "ckpt_formats",
            "ckpt_sources",
            "ckpt_save",
            "hf",
            "conformance",
            "conformance_report",
        ),
    }.items()
    for old in olds
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (one object under two names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes in the release after next",
            DeprecationWarning,
            stacklevel=3,
        )
        module = importlib.import_module(self.new)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already executed. The import
        system has just stamped the alias spec on it; its own spec goes back."""
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in `MOVED`; every other name is left to the normal finders."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder on `sys.meta_path` once (idempotent: re-imports add nothing)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
