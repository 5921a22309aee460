"""Optional code (Triton kernels) looked up on first use, once, with one log line if absent.

Why: Triton is an optional dependency, and the core calls two of its shared kernels (the
activation quantizer from `fp4_dispatch.format.nvfp4`, the MoE routing from
`fp4_dispatch.integrations.moe`). Each caller keeps its static ``from ... import`` inside
the loader it passes here, so import-linter still sees the dependency, and this class
keeps the look-up, the cache and the log line in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OptionalCode(Generic[T]):
    """``code()``: what ``load()`` returns, or False when it raises ImportError (logged at
    INFO once on the caller's `log`, naming `what`). ``load`` runs at most once per
    process."""

    __slots__ = ("_load", "_log", "_value", "what")

    def __init__(self, load: Callable[[], T], what: str, log: logging.Logger) -> None:
        self._load, self.what, self._log = load, what, log
        self._value: T | bool | None = None  # None: not looked up yet

    def __call__(self) -> T | bool:
        value = self._value
        if value is None:
            try:
                value = self._load()
            except ImportError as exc:  # Triton is optional: the torch path runs instead
                self._log.info("%s unavailable (%s); using the torch path", self.what, exc)
                value = False
            self._value = value
        return value
