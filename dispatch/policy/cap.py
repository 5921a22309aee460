"""The diversity cap: a shortlist of `budget` candidates that never starves a family.

Why: FlashInfer's cut to 32 tactics silently dropped a whole kernel family (ties kept
enumeration order; the budget counted groups, not tactics). Here each family with a
valid candidate is guaranteed a floor of slots, filled by diversity-axis coverage, and
every order is by content ``(est_us, backend name, canonical tactic JSON)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fp4_dispatch.contracts.backend import Backend
from fp4_dispatch.contracts.candidates import Candidate, Shortlist
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.loading.guard import Guard
from fp4_dispatch.policy.merge import _MISSING, _collect, _Entry

DEFAULT_BUDGET = 32


def default_floor(budget: int, families: int) -> int:
    """Slots each family is guaranteed: max(1, B // (2 * families))."""
    return max(1, budget // (2 * max(1, families)))


def _axes_of(backends: Iterable[Backend]) -> dict[str, tuple[str, ...]]:
    """Family -> ordered union of its backends' diversity axes (backends by name)."""
    axes: dict[str, list[str]] = {}
    for b in sorted(backends, key=lambda b: b.name):
        lst = axes.setdefault(b.family, [])
        lst.extend(a for a in b.diversity_axes if a not in lst)
    return {f: tuple(a) for f, a in axes.items()}


def _field(tactic: Tactic, axis: str) -> Any:
    """A tactic's value on an axis (_MISSING if it has none), skipping pydantic's slow path."""
    d = tactic.__dict__
    return d[axis] if axis in d else getattr(tactic, axis, _MISSING)


def _floor_picks(
    ranked: list[_Entry], members: list[int], axes: tuple[str, ...], floor: int
) -> list[tuple[int, str]]:
    """A family's floor, in priority order: axis coverage, then its best by score.

    For each axis (declared order), each value not yet covered by an earlier pick is
    covered by its best candidate; values come in the order of their best candidate, so
    a tight floor covers the most promising values first. Then the floor fills by score.
    """
    picks: list[tuple[int, str]] = []
    taken: set[int] = set()
    for axis in axes:
        if len(picks) >= floor:
            break
        best_of: dict[Any, int] = {}
        for i in members:
            d = ranked[i][3].__dict__
            v = d[axis] if axis in d else _field(ranked[i][3], axis)
            if v not in best_of:
                best_of[v] = i
        best_of.pop(_MISSING, None)
        covered = {_field(ranked[i][3], axis) for i in taken}
        for v, i in best_of.items():
            if len(picks) >= floor:
                break
            if v in covered:
                continue
            picks.append((i, f"axis {axis}={v}"))
            taken.add(i)
            covered.add(v)
    for i in members:
        if len(picks) >= floor:
            break
        if i not in taken:
            picks.append((i, "floor"))
            taken.add(i)
    return picks


def _cap(
    ranked: list[_Entry], axes: dict[str, tuple[str, ...]], budget: int, floor: int | None
) -> tuple[list[tuple[int, str]], dict[str, int], int]:
    """Indices kept (with reasons), the cut per family, and the floor used."""
    members: dict[str, list[int]] = {}
    for i, e in enumerate(ranked):  # families in order of their best candidate
        members.setdefault(e[4], []).append(i)
    floor_used = default_floor(budget, len(members)) if floor is None else floor
    per_family = [
        _floor_picks(ranked, idx, axes.get(fam, ()), min(floor_used, len(idx)))
        for fam, idx in members.items()
    ]
    kept: list[tuple[int, str]] = []
    kept_set: set[int] = set()
    # Floors round-robin in family order: when they do not all fit (budget < families,
    # or an explicit floor too large), each family gets its first pick before any gets
    # a second, and families whose best candidate ranks higher come first.
    rounds = max((len(p) for p in per_family), default=0)
    for r in range(rounds):
        for picks in per_family:
            if len(kept) >= budget:
                break
            if r < len(picks):
                kept.append(picks[r])
                kept_set.add(picks[r][0])
    for i in range(len(ranked)):
        if len(kept) >= budget:
            break
        if i not in kept_set:
            kept.append((i, "score"))
            kept_set.add(i)
    kept.sort()
    cut = {fam: len(idx) for fam, idx in members.items()}
    for i, _ in kept:
        cut[ranked[i][4]] -= 1
    return kept, dict(sorted(cut.items())), floor_used


def shortlist(
    problem: Problem,
    device: DeviceInfo,
    backends: Sequence[Backend],
    budget: int = DEFAULT_BUDGET,
    floor: int | None = None,
    guard: Guard | None = None,
) -> Shortlist:
    """Merge, score and cap every backend's tactics for `problem` to `budget` tactics.

    The cap: each family with candidates gets ``floor`` slots (default
    ``max(1, budget // (2 * families))``, never more than it has), filled first by the
    best candidate of each value of each diversity axis, then by score; the rest of the
    budget goes by score across all families. When the floors do not fit (budget <
    number of families), they are granted round-robin: one slot per family in the order
    of each family's best candidate, so the families with the best-scoring candidates
    get one slot each and the others are cut (and counted in ``cut``). Every order is
    (est_us, backend name, canonical tactic JSON): never registration or enumeration.
    """
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: expected a positive int, got {budget!r}")
    if floor is not None and (not isinstance(floor, int) or floor < 0):
        raise ValueError(f"floor: expected a non-negative int, got {floor!r}")
    entries, skipped, warnings = _collect(problem, device, backends, guard)
    entries.sort()  # (est_us, backend, canonical JSON) are unique: tactics never compared
    kept, cut, floor_used = _cap(entries, _axes_of(backends), budget, floor)
    candidates = [
        Candidate(entries[i][1], entries[i][4], entries[i][3], entries[i][0], reason, entries[i][5])
        for i, reason in kept
    ]
    return Shortlist(
        problem=problem,
        device=device.name,
        budget=budget,
        candidates=candidates,
        cut=cut,
        skipped=skipped,
        total=len(entries),
        floor=floor_used,
        warnings=warnings,
    )
