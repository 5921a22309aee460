"""What ranking hands out: a `Candidate` (one kept tactic) and a `Shortlist` (one problem's).

Value types of the bottom layer, so that the tuner, the winner store, plans and the CLI
can hold candidates without importing the ranking policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fp4_dispatch.contracts.tactics import Problem, Tactic, is_lossy


@dataclass(frozen=True)
class Candidate:
    """One kept tactic: who offers it, its estimate, and why the cap kept it.

    ``operation``: what the tactic computes (`fp4_dispatch.contracts.tactics.computed_as` of the
    problem's operation): under ``precision="fp8"`` a dense problem's candidates are
    ``w4a16`` (exact) or ``w4a8`` (lossy, `lossy`)."""

    backend: str
    family: str
    tactic: Tactic
    est_us: float
    reason: str
    operation: str = "w4a4"

    @property
    def lossy(self) -> bool:
        """Whether this candidate rounds the caller's activations (`is_lossy`)."""
        return is_lossy(self.operation)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "family": self.family,
            "tactic": self.tactic.model_dump(mode="json"),
            "est_us": self.est_us,
            "reason": self.reason,
            "operation": self.operation,
            "lossy": self.lossy,
        }


@dataclass(frozen=True)
class Shortlist:
    """The capped shortlist of one problem, in rank order, with what was cut and skipped.

    ``cut``: family -> valid tactics left out (every family with candidates, 0 if none).
    ``skipped``: backend -> why it (or some of its tactics) was left out of the merge.
    ``total``: distinct valid candidates before the cut. ``floor``: slots per family.
    ``warnings``: non-fatal problems (e.g. a backend's estimate_us raised).
    """

    problem: Problem
    device: str
    budget: int
    candidates: list[Candidate]
    cut: dict[str, int]
    skipped: dict[str, str]
    total: int
    floor: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "problem": self.problem.model_dump(mode="json"),
            "device": self.device,
            "budget": self.budget,
            "floor": self.floor,
            "total": self.total,
            "candidates": [c.to_json() for c in self.candidates],
            "cut": dict(self.cut),
            "skipped": dict(self.skipped),
            "warnings": list(self.warnings),
        }
