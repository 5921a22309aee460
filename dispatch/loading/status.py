"""What ``list-backends`` shows: one `BackendStatus` row per backend, or per plugin that gave none.

The rows come from the registry's load reports (plugins that loaded, failed, were
disabled or registered nothing) and the dispatcher's support check of each backend on
its device; run-time faults of a backend's plugin code are attached to its row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

from fp4_dispatch.loading import registry
from fp4_dispatch.loading.guard import Fault

Status = Literal["available", "unsupported", "failed", "disabled", "empty"]


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``list-backends``: a backend, or a plugin that failed to give one."""

    name: str
    family: str
    origin: str
    version: str
    status: Status
    reason: str
    plugin: str
    error: registry.LoadError | None = None
    #: run-time faults of this backend's plugin code (or of the plugin's hook)
    faults: tuple[Fault, ...] = ()
    #: the plugin's import + hook time in seconds
    load_s: float = 0.0
    #: time in this backend's guarded calls: ``{call: {"calls", "seconds", "max_s"}}``
    hooks: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        row = asdict(self)
        row["error"] = None if self.error is None else asdict(self.error)
        row["faults"] = [f.to_json() for f in self.faults]
        row["hooks"] = {call: dict(v) for call, v in self.hooks.items()}
        return row


def backend_rows(
    reg: registry.Registry,
    status: Mapping[str, tuple[Status, str]],
    hooks: Callable[[str], Mapping[str, Mapping[str, float]]] | None = None,
) -> list[BackendStatus]:
    """Every backend of `reg` with its (status, reason) on the device, then every plugin
    that failed, was disabled or registered nothing, as rows (plugins in load order).
    ``hooks(name)``: the backend's hook times (`Guard.hook_summary`)."""
    rows = []
    for report in reg.plugins:
        rows += _backend_rows(reg, report, status, hooks or (lambda name: {}))
        rows += _plugin_rows(report)
    return rows


def _backend_rows(
    reg: registry.Registry,
    report: registry.PluginReport,
    status: Mapping[str, tuple[Status, str]],
    hooks: Callable[[str], Mapping[str, Mapping[str, float]]],
) -> list[BackendStatus]:
    """The backends one plugin registered (with their faults), then those it had disabled."""
    rows = []
    for name in report.backends:
        b = reg.backends[name]
        state, reason = status[name]
        faults = tuple(f for f in reg.faults if f.backend == name)
        rows.append(
            BackendStatus(
                name, b.family, report.origin, b.version, state, reason, report.name,
                faults=faults, load_s=report.load_s, hooks=hooks(name),
            )
        )  # fmt: skip
    for name, why in report.disabled_backends.items():
        rows.append(
            BackendStatus(
                name, "?", report.origin, report.version, "disabled", why, report.name,
                load_s=report.load_s,
            )
        )  # fmt: skip
    return rows


def _plugin_rows(report: registry.PluginReport) -> list[BackendStatus]:
    """Rows for a plugin as a whole: it registered nothing, failed to load, or is disabled."""
    rows = []
    who = f"<{report.name}>"
    if report.status == "loaded" and not report.backends and not report.disabled_backends:
        rows.append(
            BackendStatus(
                who, "?", report.origin, report.version, "empty",
                "the plugin's hook registered no backend", report.name, load_s=report.load_s,
            )
        )  # fmt: skip
    for err in report.errors:
        rows.append(
            BackendStatus(
                who, "?", report.origin, report.version, "failed",
                f"{err.stage}: {err.error_type}: {err.message}", report.name, error=err,
                load_s=report.load_s,
            )
        )  # fmt: skip
    if report.status == "disabled":
        rows.append(
            BackendStatus(
                who, "?", report.origin, report.version, "disabled", report.reason, report.name
            )
        )
    return rows
