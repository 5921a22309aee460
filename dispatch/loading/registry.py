"""Loading plugins from entry points, one by one, recording every failure.

This module exists because of a swallowed ``ImportError`` that hid a whole kernel
family for months. Every entry point of the ``fp4_dispatch`` group is loaded on its
own; a plugin that raises on import, raises inside the hook, registers something that
is not a `Backend`, or registers a duplicate name is recorded in a `LoadError`
(plugin, distribution, version, stage, exception type, message, traceback) and the
others still load. ``strict=True`` raises `PluginLoadError` instead.

Everything a plugin can raise is contained (`fp4_dispatch.loading.guard.contain`: SystemExit
too, only Ctrl-C passes). A hook that raises contributes nothing: its registrations are
rolled back. Each plugin's load time is measured (`PluginReport.load_s`) so that a slow
plugin is visible in ``list-backends``. Disabled entry points are blocked in the
registry's pluggy `PluginManager` (``pm.is_blocked(name)``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Literal

import pluggy

from fp4_dispatch.contracts import hookspecs
from fp4_dispatch.contracts.backend import Backend
from fp4_dispatch.contracts.tactics import Tactic
from fp4_dispatch.loading.guard import Fault, contain, describe

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
    #: seconds spent importing the module and running its hook
    load_s: float = 0.0
    #: backends this plugin registered that an environment variable disabled -> why
    disabled_backends: dict[str, str] = field(default_factory=dict)

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
    #: run-time faults of plugin code (`fp4_dispatch.loading.guard.Guard` appends here)
    faults: list[Fault] = field(default_factory=list)
    pm: pluggy.PluginManager = field(default_factory=lambda: _plugin_manager())

    @property
    def errors(self) -> list[LoadError]:
        return [e for p in self.plugins for e in p.errors]


def strict_default() -> bool:
    """`FP4_DISPATCH_STRICT` as a boolean (1/true/yes/on)."""
    return os.environ.get("FP4_DISPATCH_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}


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


def _plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _error(report: PluginReport, stage: Stage, exc: BaseException) -> LoadError:
    error_type, message, trace = describe(exc)
    err = LoadError(
        plugin=report.name,
        distribution=report.distribution,
        version=report.version,
        stage=stage,
        error_type=error_type,
        message=message,
        traceback=trace,
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


def _call_hook(report: PluginReport, module: object, registry: Registry) -> list[Backend] | None:
    """Run one plugin's hook alone; its backends, or None when it raised (nothing kept).

    Registrations are staged and committed only when the hook returns: a hook that
    registers a backend and then raises contributes nothing.
    """
    pm = registry.pm
    others = [p for p in pm.get_plugins() if p is not module]
    if not pm.is_registered(module):  # two entry points may name one module: register once
        # a second distribution's entry point of the same name gets a distinct pluggy name
        name = report.name if pm.get_plugin(report.name) is None else report.target
        _, exc = contain(pm.register, module, name=name)
        if exc is not None:
            _error(report, "hook", exc)
            return None
    impls = [
        i for i in pm.hook.fp4_dispatch_register_backends.get_hookimpls() if i.plugin is module
    ]
    if not impls:
        _, exc = contain(_no_hook, report.target)
        _error(report, "hook", exc)
        return None
    staged: dict[str, Backend] = {}

    def register(obj: object) -> None:
        try:
            check_backend(obj)
            if obj.name in registry.backends or obj.name in staged:
                owner = (
                    registry.plugin_of[obj.name].name
                    if obj.name in registry.plugin_of
                    else report.name
                )
                raise ValueError(f"duplicate backend name {obj.name!r} (already from {owner!r})")
        except (TypeError, ValueError) as exc:
            _error(report, "register", exc)
            return
        staged[obj.name] = obj

    # only this plugin's implementation runs (pluggy's subset caller, earlier plugins removed)
    call = pm.subset_hook_caller("fp4_dispatch_register_backends", remove_plugins=others)
    _, exc = contain(call, register=register)
    if exc is not None:
        _error(report, "hook", exc)
        if staged:
            log.warning("plugin %r: hook raised after registering %s: none of them is kept",
                        report.name, ", ".join(sorted(staged)))  # fmt: skip
        return None
    return list(staged.values())


def _no_hook(target: str) -> None:
    """Raised (not just built) so that the recorded error has a traceback."""
    raise TypeError(f"{target} defines no fp4_dispatch_register_backends hook")


#: why a plugin or backend is left out, by the variable that left it out
DISABLED_REASON = "listed in FP4_DISPATCH_DISABLE"
NOT_ALLOWED_REASON = "not listed in FP4_DISPATCH_PLUGINS"


@dataclass(frozen=True)
class Selection:
    """Which plugins and backends the user asked for: ``FP4_DISPATCH_PLUGINS`` (`allow`)
    and ``FP4_DISPATCH_DISABLE`` (`disable`), parsed once.

    Two separate questions, answered by two pure methods: which entry points the loader
    imports (`skip_plugin`, plugin names only: an import runs a plugin's code, so nothing
    is imported to look for a backend name) and which of the loaded backends are kept
    (`skip_backend`, the one filter that acts on backend names). ``allow`` is None when
    the variable is unset (no limit); an empty set keeps the built-ins only. It limits
    third-party plugins only; ``disable`` applies to built-ins too.
    """

    allow: frozenset[str] | None = None
    disable: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Selection:
        """Parse both variables (comma lists, blanks ignored) from `environ` (os.environ)."""
        env = os.environ if environ is None else environ
        disable = _names(env.get("FP4_DISPATCH_DISABLE")) or frozenset()
        return cls(_names(env.get("FP4_DISPATCH_PLUGINS")), disable)

    @property
    def picked(self) -> dict[str, frozenset[str]]:
        """``plugin:backend`` entries of `allow`: plugin -> the backends named with it."""
        out: dict[str, set[str]] = {}
        for name in self.allow or ():
            plugin, sep, backend = name.partition(":")
            if sep:
                out.setdefault(plugin, set()).add(backend)
        return {plugin: frozenset(names) for plugin, names in out.items()}

    def skip_plugin(self, plugin: str, builtin: bool) -> str | None:
        """Why entry point `plugin` is not imported at all, or None to import it."""
        if plugin in self.disable:
            return DISABLED_REASON
        if self.allow is None or builtin or plugin in self.allow or plugin in self.picked:
            return None
        return NOT_ALLOWED_REASON

    def skip_backend(self, plugin: str, builtin: bool, backend: str) -> str | None:
        """Why `backend`, registered by entry point `plugin`, is left out, or None."""
        if backend in self.disable:
            return DISABLED_REASON
        if self.allow is None or builtin or plugin in self.allow:
            return None
        return None if f"{plugin}:{backend}" in self.allow else NOT_ALLOWED_REASON


def filter_backends(
    selection: Selection, plugin: str, builtin: bool, names: Iterable[str]
) -> dict[str, str]:
    """The backends of `names` (registered by entry point `plugin`) that `selection` leaves
    out -> why. Pure: the loader applies it to each plugin's registrations as they are
    committed, and tests call it with no plugin installed."""
    return {
        name: why
        for name in names
        if (why := selection.skip_backend(plugin, builtin, name)) is not None
    }


def _names(raw: str | None) -> frozenset[str] | None:
    """A comma list as a set of names (``plugin : backend`` written ``plugin:backend``)."""
    if raw is None:
        return None
    parts = (part.strip() for part in raw.split(","))
    return frozenset(":".join(p.strip() for p in part.split(":", 1)) for part in parts if part)


_WARNED: set[tuple[str, str]] = set()


def _warn_unmatched(
    var: str, names: Iterable[str], eps: set[str], backends: set[str], hint: str = ""
) -> None:
    """One warning per process for each name of `var` that matched no plugin or backend."""
    for name in sorted(set(names) - eps - backends):
        if (var, name) in _WARNED:
            continue
        _WARNED.add((var, name))
        log.warning(
            "%s: %r matches no plugin (entry point) and no backend; plugins: %s; backends: "
            "%s%s", var, name, ", ".join(sorted(eps)) or "none",
            ", ".join(sorted(backends)) or "none", f" ({hint})" if hint else "",
        )  # fmt: skip


def load(strict: bool | None = None) -> Registry:
    """Load every plugin of the ``fp4_dispatch`` entry-point group.

    ``FP4_DISPATCH_PLUGINS`` (comma list; empty = built-ins only) limits third-party
    plugins; ``FP4_DISPATCH_DISABLE`` (comma list) skips any plugin, built-ins too. The
    loader acts on entry-point names only: a disabled or unlisted plugin is never
    imported. Backend names (``plugin:backend`` in ``FP4_DISPATCH_PLUGINS``, a backend's
    name in ``FP4_DISPATCH_DISABLE``) are one filter over what the imported plugins
    registered (`filter_backends`): the plugin loads, the named backends are left out or
    kept. No name makes an unlisted plugin be imported to look for it: a plugin's import
    runs its code, so ``FP4_DISPATCH_PLUGINS=typo`` must not run every installed plugin.
    A name that matches nothing is warned about once per process.
    """
    strict = strict_default() if strict is None else strict
    selection = Selection.from_env()
    registry = Registry()
    eps = _entry_points()
    for ep in eps:
        report = _report_for(ep)
        registry.plugins.append(report)
        why = selection.skip_plugin(ep.name, report.builtin)
        if why is not None:
            _block(registry, report, why)
            continue
        _load_one(ep, report, registry, selection)
        if strict and report.errors:
            raise PluginLoadError(report.errors[0])
    _warn_unmatched_names(selection, registry, {ep.name for ep in eps})
    return registry


def _warn_unmatched_names(selection: Selection, registry: Registry, ep_names: set[str]) -> None:
    """Warn (once) about each name of either variable that matched nothing loaded."""
    every = set(registry.backends) | {b for p in registry.plugins for b in p.disabled_backends}
    if selection.allow:
        qualified = {f"{p.name}:{b}" for p in registry.plugins
                     for b in (*p.backends, *p.disabled_backends)}  # fmt: skip
        _warn_unmatched("FP4_DISPATCH_PLUGINS", selection.allow, ep_names, qualified,
                        hint="to keep one backend of a plugin, write plugin:backend")  # fmt: skip
    if selection.disable:
        _warn_unmatched("FP4_DISPATCH_DISABLE", selection.disable, ep_names, every)


def _block(registry: Registry, report: PluginReport, reason: str) -> None:
    """A disabled entry point: blocked in pluggy (never imported), shown as disabled."""
    report.status, report.reason = "disabled", reason
    registry.pm.set_blocked(report.name)


def _load_one(
    ep: metadata.EntryPoint, report: PluginReport, registry: Registry, selection: Selection
) -> None:
    """Import one entry point and run its hook, each contained; commit what it registered,
    less what `selection` leaves out (`filter_backends`), which is shown as disabled."""
    start = time.perf_counter()
    try:
        module, exc = contain(ep.load)
        if exc is not None:
            _error(report, "import", exc)
            return
        backends = _call_hook(report, module, registry)
    finally:
        report.load_s = time.perf_counter() - start
        if report.load_s > SLOW_LOAD_S:
            # a built-in's first import also pays for torch itself: not worth a warning
            # on every command (list-backends still shows the time)
            level = logging.INFO if report.builtin else logging.WARNING
            log.log(level, "plugin %r took %.1f s to load", report.name, report.load_s)
    backends = backends or []
    left_out = filter_backends(selection, report.name, report.builtin, [b.name for b in backends])
    report.disabled_backends.update(left_out)
    for b in backends:
        if b.name not in left_out:
            registry.backends[b.name] = b
            registry.plugin_of[b.name] = report
            report.backends.append(b.name)


#: a plugin slower than this (seconds, import + hook) is shown with its load time
SLOW_LOAD_S = 0.5
