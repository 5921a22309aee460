"""Loading plugins from entry points, one by one, recording every failure.

This module exists because of a swallowed ``ImportError`` that hid a whole kernel
family for months. Every entry point of the ``fp4_dispatch`` group is loaded on its
own; a plugin that raises on import, raises inside the hook, registers something that
is not a `Backend`, or registers a duplicate name is recorded in a `LoadError`
(plugin, distribution, version, stage, exception type, message, traceback) and the
others still load. ``strict=True`` raises `PluginLoadError` instead.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Literal

import pluggy

from . import hookspecs
from .backend import Backend
from .tactics import Tactic

log = logging.getLogger(__name__)

GROUP = "fp4_dispatch"
DIST_NAME = "fp4-dispatch"
Stage = Literal["import", "hook", "register"]


@dataclass(frozen=True)
class LoadError:
    """One failure while loading a plugin, with everything needed to act on it."""

    plugin: str
    distribution: str
    version: str
    stage: Stage
    error_type: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return (
            f"plugin {self.plugin!r} ({self.distribution} {self.version}) failed at "
            f"{self.stage}: {self.error_type}: {self.message}"
        )


@dataclass
class PluginReport:
    """What happened to one entry point."""

    name: str
    target: str
    distribution: str
    version: str
    builtin: bool
    status: Literal["loaded", "failed", "disabled"] = "loaded"
    reason: str = ""
    backends: list[str] = field(default_factory=list)
    errors: list[LoadError] = field(default_factory=list)

    @property
    def origin(self) -> str:
        return "built-in" if self.builtin else self.distribution


class PluginLoadError(RuntimeError):
    """Raised in strict mode for the first plugin that failed to load."""

    def __init__(self, error: LoadError):
        super().__init__(f"{error}\n{error.traceback}")
        self.error = error


@dataclass
class Registry:
    """The result of loading: backends by name, and a report per plugin."""

    backends: dict[str, Backend] = field(default_factory=dict)
    plugin_of: dict[str, PluginReport] = field(default_factory=dict)
    plugins: list[PluginReport] = field(default_factory=list)

    @property
    def errors(self) -> list[LoadError]:
        return [e for p in self.plugins for e in p.errors]


def strict_default() -> bool:
    """`FP4_DISPATCH_STRICT` as a boolean (1/true/yes/on)."""
    return os.environ.get("FP4_DISPATCH_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_points() -> list[metadata.EntryPoint]:
    """Entry points of our group, deduplicated, built-ins first, then by name."""
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist else "?"
        seen.setdefault((ep.name, ep.value), ep)
        log.debug("found entry point %s = %s (%s)", ep.name, ep.value, dist)
    return sorted(seen.values(), key=lambda ep: (not _is_builtin(ep), ep.name, ep.value))


def _is_builtin(ep: metadata.EntryPoint) -> bool:
    return ep.dist is not None and _canonical(ep.dist.name) == DIST_NAME


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _report_for(ep: metadata.EntryPoint) -> PluginReport:
    dist = ep.dist.name if ep.dist else "unknown"
    version = ep.dist.version if ep.dist else "unknown"
    return PluginReport(ep.name, ep.value, dist, version, _is_builtin(ep))


def _error(report: PluginReport, stage: Stage, exc: BaseException) -> LoadError:
    err = LoadError(
        plugin=report.name,
        distribution=report.distribution,
        version=report.version,
        stage=stage,
        error_type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )
    report.errors.append(err)
    report.status = "failed"
    report.reason = f"{err.error_type}: {err.message}"
    log.warning("%s", err)
    return err


def check_backend(obj: object) -> None:
    """Raise TypeError unless `obj` is a usable `Backend` instance."""
    if not isinstance(obj, Backend):
        raise TypeError(
            f"register() expects an fp4_dispatch.Backend instance, got {type(obj).__qualname__}"
        )
    for attr in ("name", "family", "version"):
        value = getattr(obj, attr, None)
        if not isinstance(value, str) or not value:
            raise TypeError(f"backend {type(obj).__qualname__}.{attr} must be a non-empty str")
    tactic_type = getattr(obj, "tactic_type", None)
    if not (isinstance(tactic_type, type) and issubclass(tactic_type, Tactic)):
        raise TypeError(f"backend {obj.name!r}: tactic_type must be a subclass of Tactic")


def _call_hook(report: PluginReport, module: object, registry: Registry) -> None:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(module, name=report.name)
    if not pm.hook.fp4_dispatch_register_backends.get_hookimpls():
        raise TypeError(f"{report.target} defines no fp4_dispatch_register_backends hook")

    def register(obj: object) -> None:
        try:
            check_backend(obj)
            if obj.name in registry.backends:
                owner = registry.plugin_of[obj.name].name
                raise ValueError(f"duplicate backend name {obj.name!r} (already from {owner!r})")
        except (TypeError, ValueError) as exc:
            _error(report, "register", exc)
            return
        registry.backends[obj.name] = obj
        registry.plugin_of[obj.name] = report
        report.backends.append(obj.name)

    pm.hook.fp4_dispatch_register_backends(register=register)


def load(strict: bool | None = None) -> Registry:
    """Load every plugin of the ``fp4_dispatch`` entry-point group.

    ``FP4_DISPATCH_PLUGINS`` (comma list; empty = built-ins only) limits third-party
    plugins; ``FP4_DISPATCH_DISABLE`` (comma list) skips any plugin, built-ins too.
    """
    strict = strict_default() if strict is None else strict
    allow, disable = _env_list("FP4_DISPATCH_PLUGINS"), _env_list("FP4_DISPATCH_DISABLE")
    registry = Registry()
    for ep in _entry_points():
        report = _report_for(ep)
        registry.plugins.append(report)
        if disable is not None and ep.name in disable:
            report.status, report.reason = "disabled", "listed in FP4_DISPATCH_DISABLE"
            continue
        if allow is not None and not report.builtin and ep.name not in allow:
            report.status, report.reason = "disabled", "not listed in FP4_DISPATCH_PLUGINS"
            continue
        _load_one(ep, report, registry)
        if strict and report.errors:
            raise PluginLoadError(report.errors[0])
    return registry


def _load_one(ep: metadata.EntryPoint, report: PluginReport, registry: Registry) -> None:
    try:
        module = ep.load()
    except Exception as exc:  # a broken plugin must never stop the others: record it
        _error(report, "import", exc)
        return
    try:
        _call_hook(report, module, registry)
    except Exception as exc:  # raised inside the plugin's hook: record it
        _error(report, "hook", exc)
