"""The plugin contract: one hook, in the style of llm's ``register_models(register)``."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT = "fp4_dispatch"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def fp4_dispatch_register_backends(register: Callable[[object], None]) -> None:
    """Call ``register(backend)`` once for each `fp4_dispatch.Backend` this plugin provides."""
