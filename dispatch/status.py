"""What ``list-backends`` shows: one `BackendStatus` row per backend, or per plugin that gave none.

The rows come from the registry's load reports (plugins that loaded, failed, were
disabled or registered nothing) and the dispatcher's support check of each backend on
its device; run-time faults of a backend's plugin code are attached to its row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from . import registry
from .guard import Fault

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

    def to_json(self) -> dict:
        row = asdict(self)
        row["error"] = None if self.error is None else asdict(self.error)
        row["faults"] = [f.to_json() for f in self.faults]
        return row


def backend_rows(
    reg: registry.Registry, status: Mapping[str, tuple[Status, str]]
) -> list[BackendStatus]:
    """Every backend of `reg` with its (status, reason) on the device, then every plugin
    that failed, was disabled or registered nothing, as rows (plugins in load order)."""
    rows = []
    for report in reg.plugins:
        rows += _backend_rows(reg, report, status)
        rows += _plugin_rows(report)
    return rows


def _backend_rows(
    reg: registry.Registry, report: registry.PluginReport, status: Mapping[str, tuple[Status, str]]
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
                faults=faults, load_s=report.load_s,
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
