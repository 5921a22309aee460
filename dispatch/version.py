"""The installed fp4-dispatch version (a module of its own so any layer may read it)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("fp4-dispatch")
except metadata.PackageNotFoundError:  # imported from a tree that was never installed
    __version__ = "0+unknown"
