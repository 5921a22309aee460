"""Conformance results: one `Check` per outcome, a `ConformanceReport` per plugin and device.

What `fp4_dispatch.integrations.conformance` fills in and `fp4_dispatch.testing` hands to users and
pytest (summary text, JSON, `raise_for_failures`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

Status = Literal["PASS", "FAIL", "SKIP"]
CATEGORIES = ("load", "backend", "tactics", "json", "validity", "dispatcher", "build", "numerics")


@dataclass(frozen=True)
class Check:
    """One conformance check's outcome."""

    category: str
    name: str
    status: Status
    message: str = ""
    backend: str = ""

    def __str__(self) -> str:
        who = f"[{self.backend}] " if self.backend else ""
        return f"{self.status:4} {self.category}/{self.name} {who}{self.message}".rstrip()


class ConformanceError(AssertionError):
    """Raised by `ConformanceReport.raise_for_failures`; carries the report."""

    def __init__(self, report: ConformanceReport) -> None:
        super().__init__(report.summary(failures_only=True))
        self.report = report


@dataclass
class ConformanceReport:
    """Every check run for one plugin (or backend) on one device."""

    plugin: str
    device: str
    checks: list[Check] = field(default_factory=list)

    def add(
        self, category: str, name: str, status: Status, message: str = "", backend: str = ""
    ) -> Check:
        check = Check(category, name, status, message, backend)
        self.checks.append(check)
        (log.warning if status == "FAIL" else log.debug)("conformance %s: %s", self.plugin, check)
        return check

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    @property
    def passed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "PASS"]

    @property
    def skipped(self) -> list[Check]:
        return [c for c in self.checks if c.status == "SKIP"]

    @property
    def ok(self) -> bool:
        """No failure, and at least one check passed."""
        return not self.failures and bool(self.passed)

    def of(self, category: str) -> list[Check]:
        if category not in CATEGORIES:
            raise ValueError(f"category: expected one of {CATEGORIES}, got {category!r}")
        return [c for c in self.checks if c.category == category]

    def summary(self, failures_only: bool = False) -> str:
        shown = self.failures if failures_only else self.checks
        head = (
            f"fp4-dispatch conformance of {self.plugin!r} on {self.device}: "
            f"{len(self.passed)} passed, {len(self.failures)} failed, "
            f"{len(self.skipped)} skipped"
        )
        return "\n".join([head, *(f"  {c}" for c in shown)])

    def __str__(self) -> str:
        return self.summary()

    def raise_for_failures(self) -> ConformanceReport:
        """Raise `ConformanceError` if any check failed or none passed; else return self."""
        if not self.ok:
            raise ConformanceError(self)
        return self

    def to_json(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "device": self.device,
            "ok": self.ok,
            "checks": [c.__dict__ for c in self.checks],
        }
