"""Ranking: one cost model for every family, a re-validating merge, a diversity cap.

Why: FlashInfer's cut to 32 tactics silently dropped a whole kernel family (ties kept
enumeration order; the budget counted groups, not tactics). Here every candidate of
every family is scored on one scale (estimated microseconds), ties break on content,
and each family with a valid candidate is guaranteed a floor of slots.

Cost model (`estimate_us`), per tactic, on any `DeviceInfo` (real or simulated)::

    Mk, Nk   = (N, M) if swap_ab else (M, N)             # the kernel's orientation
    c        = CTAs per tile, as the tactic declares it (`Tactic.ctas_per_tile`: 2 for
               a Blackwell 2-CTA MMA, else 1; the family knows its hardware)
    tiles    = ceil(Mk / tile_m) * ceil(Nk / tile_n)     # M/N padding lives here
    CTAs     = roundup(ceil(Mk/tile_m) * c, cluster_m) * roundup(ceil(Nk/tile_n), cluster_n)
    slots    = floor(SMs / cluster) * cluster             # whole clusters only
    waves    = ceil(CTAs / slots)                         # wave quantization
    eff      = 1 / (1 + FEED_COST * (1/tile_n + 1/tile_m))  # operand feed per flop: a
               CTA loads tile_m/c rows of A and tile_n/c of B (2-CTA: half of B each)
               per k for (tile_m/c)*tile_n MACs: ratio 1/tile_n + 1/tile_m
    t_wave   = 2 * (tile_m / c) * tile_n * K / (peak_per_SM * eff) + WAVE_OVERHEAD_US
    compute  = waves * t_wave * (1 + CLUSTER_PENALTY * (cluster - 1) if tiles > 1)
    memory   = min_bytes / (mem_bw * min(1, active_CTAs / (BW_SATURATION * SMs)))
    t        = max(compute, memory) + OVERLAP * min(compute, memory) + LAUNCH_US
    t       *= SWAP_PENALTY  if M <= 8192 and swap_ab != preferred_swap(problem)

Two optional tactic fields, read by name from any family (absent = the values below,
which leave the formula above unchanged; added for FlashInfer's split-K and deep-K
kernels, whose advantage the plain model could not see):

    split_k  (default 1): S CTAs share one output tile's K range. CTAs *= S, each CTA
             walks K/S (t_wave uses K/S), and the partial sums cost
             SPLIT_K_REDUCE_US * (S - 1) plus 8 bytes (fp32 out + in) per extra slice
             per output element in `memory`. Why: at decode a narrow tile grid covers
             a fraction of the SMs and so of DRAM bandwidth (bw_frac < 1); splitting K
             is how a kernel buys more loading CTAs, and the model must credit it.
    tile_k   (default 256, the FP4 K tile of the Blackwell kernels here): K elements
             per pipeline stage. Above 256, each stage fetches longer rows (tile_k / 2
             bytes), which streams DRAM slightly better: `memory` *= eff(256) /
             eff(tile_k), eff(t) = (t/2) / (t/2 + ROW_OVERHEAD_BYTES), and the longer
             fill/drain costs WAVE_OVERHEAD_US * tile_k / 256 per wave. Only tile_k >
             256 changes anything (Hopper tactics that declare a smaller tile_k keep
             their own estimate_us).

All in microseconds: FEED_COST 8, WAVE_OVERHEAD_US 0.5, LAUNCH_US 2, OVERLAP 0.1,
BW_SATURATION 0.5, CLUSTER_PENALTY 0.01, SWAP_PENALTY 1.05. The model is a ranking
heuristic, not a prediction: it orders tactics for measurement, and measurement decides.

`peak_per_SM` is the device's dense FP4 rate (BF16 where the chip has no FP4 MMA) over
its SM count. `preferred_swap` is True iff ``M <= 32 and N > M and N % 8 == 0``. Above
M = 8192 both orientations are neutral, so measurement decides (at M = 32768 swap was
7-66% faster under an M-major persistent scheduler, measured on an SM107 part).

A backend refines the estimate by returning a number from its own ``estimate_us``; that
number replaces the shared one for its tactic (None keeps the shared one). Every call
into a backend goes through `fp4_dispatch.guard.Guard`: a refinement that raises or
returns anything but None or a finite float >= 0 (a str, NaN, inf, a negative number)
is a recorded fault, and the shared estimate is used for the rest of that backend's
tactics; ``tactics()`` that raises, returns a non-iterable, or yields tactics of the
wrong type or of another backend is a recorded fault too (its valid tactics are kept).
In strict mode each of these raises `fp4_dispatch.guard.PluginFault`.

Re-validation (the merge): each tactic must be an instance of its backend's
``tactic_type`` with ``tactic.backend == backend.name``, and must survive
``tactic_type.model_validate(tactic.model_dump())``. That round trip and the canonical
JSON cost ~5-10 us per tactic and would dominate a 2,000-candidate ranking, so (1) both
are memoized per tactic value (tactics are frozen and hashable; equal values validate
equally) in a bounded process-wide table, looked up by object identity first (plugins
cache their tactic objects; pydantic's hash costs ~0.5 us), and (2) for tactic classes
with no custom serialization, whose ``model_dump()`` is just ``__dict__``, the validator
and the canonical JSON read ``__dict__`` directly (same input, same text). The type and
backend-name checks run on every call. Measured in benchmarks/bench_ranking.py.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii as _encode_str
from typing import Any

from pydantic import ValidationError

from .backend import Backend
from .buckets import m_bucket
from .device import DeviceInfo
from .guard import Guard, PluginFault
from .tactics import Problem, Tactic

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 32
#: operand-feed cost per (1/tile_n + 1/tile_m): 128x256 -> 0.91 efficiency, 128x8 -> 0.49
FEED_COST = 8.0
#: per-wave pipeline fill and epilogue, microseconds
WAVE_OVERHEAD_US = 0.5
#: fixed launch cost, microseconds (equal for all: it only keeps absolute numbers honest)
LAUNCH_US = 2.0
#: fraction of the smaller roofline term that does not overlap with the larger one
OVERLAP = 0.1
#: fraction of the SMs that must be loading to saturate DRAM bandwidth
BW_SATURATION = 0.5
#: cost per extra CTA of a cluster when the grid has more than one tile
CLUSTER_PENALTY = 0.01
#: the non-preferred orientation costs this factor through M = SWAP_NEUTRAL_ABOVE_M
SWAP_PENALTY = 1.05
SWAP_NEUTRAL_ABOVE_M = 8192
#: fixed cost of reducing one extra K slice of a split-K tile, microseconds
SPLIT_K_REDUCE_US = 0.5
#: the K tile the base formula assumes (FP4 Blackwell kernels: 2 x 128-element MMAs)
BASE_TILE_K = 256
#: per-row-fetch overhead in bytes: a 128-byte row streams at 128/(128+4) = 97.0% and a
#: 256-byte one at 98.5%, the 1-2% FlashInfer reports for its deep-K variant
ROW_OVERHEAD_BYTES = 4.0
#: memo tables are cleared when they grow past this many entries
_MEMO_LIMIT = 1 << 17


def preferred_swap(problem: Problem) -> bool:
    """At decode sizes the swapped orientation is preferred: ``M <= 32 < ... N > M, N % 8 == 0``."""
    return problem.m <= 32 and problem.n > problem.m and problem.n % 8 == 0


def ctas_per_tile(tactic: Tactic, device: DeviceInfo | None = None) -> int:
    """SMs one output tile occupies: what the tactic says (`Tactic.ctas_per_tile`).

    The family knows its own hardware (a 2-CTA MMA on Blackwell-class parts spans two
    SMs); the core applies no per-architecture rule. `device` is accepted for callers
    that pass it and is not used.
    """
    return tactic.ctas_per_tile


@lru_cache(maxsize=1 << 16)
def _shared_us(
    m: int,
    n: int,
    k: int,
    sms: int,
    peak_tflops: float,
    bw_gbps: float,
    tile_m: int,
    tile_n: int,
    cluster_m: int,
    cluster_n: int,
    swap: bool,
    cpt: int,
    split_k: int = 1,
    tile_k: int = BASE_TILE_K,
) -> float:
    """The shared formula (module docstring) on plain numbers, memoized by geometry."""
    mk, nk = (n, m) if swap else (m, n)
    tiles_m = -(-mk // tile_m)
    tiles_n = -(-nk // tile_n)
    ctas_m = -(-(tiles_m * cpt) // cluster_m) * cluster_m
    ctas_n = -(-tiles_n // cluster_n) * cluster_n
    cluster = cluster_m * cluster_n
    slots = max(cluster, (sms // cluster) * cluster)
    ctas = ctas_m * ctas_n * split_k
    waves = -(-ctas // slots)
    eff = 1.0 / (1.0 + FEED_COST * (1.0 / tile_n + 1.0 / tile_m))
    per_sm_flops_us = peak_tflops * 1e6 / sms
    deep = max(1.0, tile_k / BASE_TILE_K)
    t_wave = (
        2.0 * (tile_m / cpt) * tile_n * (k / split_k) / (per_sm_flops_us * eff)
        + WAVE_OVERHEAD_US * deep
    )
    compute = waves * t_wave
    if tiles_m * tiles_n > 1:
        compute *= 1.0 + CLUSTER_PENALTY * (cluster - 1)
    min_bytes = (m + n) * k * (0.5 + 1.0 / 16) + 2.0 * m * n + 8.0 * m * n * (split_k - 1)
    active = min(ctas, slots)
    bw_frac = min(1.0, active / (BW_SATURATION * sms))
    memory = min_bytes / (bw_gbps * 1e3 * bw_frac)
    if tile_k > BASE_TILE_K:  # longer row fetches stream better than the base K tile's
        memory *= _row_efficiency(BASE_TILE_K) / _row_efficiency(tile_k)
    t = max(compute, memory) + OVERLAP * min(compute, memory) + LAUNCH_US
    t += SPLIT_K_REDUCE_US * (split_k - 1)
    if m <= SWAP_NEUTRAL_ABOVE_M and swap != (m <= 32 and n > m and n % 8 == 0):
        t *= SWAP_PENALTY
    return t


def _row_efficiency(tile_k: int) -> float:
    """DRAM streaming efficiency of FP4 row fetches of ``tile_k / 2`` bytes."""
    row = tile_k / 2
    return row / (row + ROW_OVERHEAD_BYTES)


def _peak_tflops(device: DeviceInfo) -> float:
    return device.fp4_tflops if device.fp4_tflops is not None else device.bf16_tflops


def estimate_us(problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
    """The shared cost model: estimated microseconds of `tactic` on `problem` (see module)."""
    return _shared_us(
        problem.m,
        problem.n,
        problem.k,
        device.sm_count,
        _peak_tflops(device),
        device.mem_bw_gbps,
        tactic.tile_m,
        tactic.tile_n,
        tactic.cluster_m,
        tactic.cluster_n,
        bool(tactic.swap_ab),
        ctas_per_tile(tactic, device),
        *_k_fields(tactic),
    )


def _k_fields(tactic: Tactic) -> tuple[int, int]:
    """(split_k, tile_k) of a tactic: its optional fields of those names, else (1, 256)."""
    d = tactic.__dict__
    split_k, tile_k = d.get("split_k", 1), d.get("tile_k", BASE_TILE_K)
    return (
        split_k if type(split_k) is int and split_k >= 1 else 1,
        tile_k if type(tile_k) is int and tile_k >= 1 else BASE_TILE_K,
    )


# ---- results --------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One kept tactic: who offers it, its estimate, and why the cap kept it."""

    backend: str
    family: str
    tactic: Tactic
    est_us: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "family": self.family,
            "tactic": self.tactic.model_dump(mode="json"),
            "est_us": self.est_us,
            "reason": self.reason,
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


# ---- merge: enumerate, re-validate, score ---------------------------------------------

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))

# What the merge needs of a re-validated tactic: its canonical JSON and the geometry the
# shared model reads, (tile_m, tile_n, cluster_m, cluster_n, swap_ab, ctas_per_tile,
# split_k, tile_k), where split_k / tile_k come from `_k_fields`.
_Info = tuple[str, tuple[int, int, int, int, bool, int, int, int]]
#: tactic value -> _Info; presence means "re-validated once already"
_CHECKED: dict[Tactic, _Info] = {}
#: id(tactic) -> (tactic, _Info): skips pydantic's hash for the very same object (plugins
#: cache their tactic objects). Holding the tactic keeps its id from being reused.
_BY_ID: dict[int, tuple[Tactic, _Info]] = {}


def _canonical(tactic: Tactic) -> str:
    """`Tactic.canonical_json` without rebuilding an encoder each call (same text)."""
    if type(tactic).canonical_json is not Tactic.canonical_json:
        return tactic.canonical_json()
    return _ENCODER.encode(tactic.model_dump(mode="json"))


@lru_cache(maxsize=1024)
def _plain_model(cls: type[Tactic]) -> bool:
    """True when ``model_dump()`` of `cls` is just its field values (nothing customised).

    Then a tactic whose values are JSON scalars can skip `model_dump`: its canonical JSON
    and its re-validation input are read straight from ``__dict__`` (same text, same
    outcome; 3-4x cheaper, which is most of a first ranking's cost).
    """
    deco = cls.__pydantic_decorators__
    return (
        cls.canonical_json is Tactic.canonical_json
        and cls.model_dump is Tactic.model_dump
        and not (deco.field_serializers or deco.model_serializers or deco.computed_fields)
        and not any(f.exclude for f in cls.model_fields.values())
    )


@lru_cache(maxsize=1024)
def _key_prefixes(cls: type[Tactic]) -> tuple[tuple[str, str], ...]:
    """Sorted field names of `cls` with their JSON prefixes (``"name":``)."""
    return tuple((k, _encode_str(k) + ":") for k in sorted(cls.model_fields))


def _fast_canonical(tactic: Tactic) -> str | None:
    """``json.dumps(model_dump(mode="json"), sort_keys=True, ...)`` read from ``__dict__``.

    Only when every value is a plain JSON scalar (bool, int, str, None, finite float) and
    ``__dict__`` holds exactly the fields; None otherwise (the caller takes the slow path).
    """
    d = tactic.__dict__
    keys = _key_prefixes(type(tactic))
    if len(d) != len(keys):
        return None
    parts = []
    for key, prefix in keys:
        v = d.get(key, _MISSING)
        t = type(v)
        if t is int:
            parts.append(prefix + int.__repr__(v))
        elif t is bool:
            parts.append(prefix + ("true" if v else "false"))
        elif t is str:
            parts.append(prefix + _encode_str(v))
        elif v is None:
            parts.append(prefix + "null")
        elif t is float and math.isfinite(v):
            parts.append(prefix + float.__repr__(v))
        else:
            return None
    return "{" + ",".join(parts) + "}"


def _revalidate(tactic: Tactic, backend: Backend) -> _Info:
    """Full check of a tactic (type, name, model round trip); memoized by the caller."""
    ttype = backend.tactic_type
    if not isinstance(tactic, ttype):
        raise ValueError(f"got a {type(tactic).__name__}, expected a {ttype.__name__}")
    if tactic.backend != backend.name:
        raise ValueError(f"tactic.backend is {tactic.backend!r}, expected {backend.name!r}")
    try:
        hash(tactic)
    except TypeError as exc:  # tactics key caches: they must be hashable
        raise ValueError(f"tactic is not hashable (use tuples, not lists): {exc}") from exc
    canon = _fast_canonical(tactic) if _plain_model(type(tactic)) else None
    try:
        if canon is not None:  # model_dump() would be exactly this dict
            ttype.__pydantic_validator__.validate_python(tactic.__dict__)  # read, not kept
        else:
            ttype.model_validate(tactic.model_dump())
    except ValidationError as exc:
        first = str(exc).splitlines()
        raise ValueError(" ".join(line.strip() for line in first[:3])) from exc
    except Exception as exc:  # e.g. a model_construct'ed tactic that cannot even dump
        raise ValueError(f"cannot re-validate: {type(exc).__name__}: {exc}") from exc
    geom = (tactic.tile_m, tactic.tile_n, tactic.cluster_m, tactic.cluster_n,
            bool(tactic.swap_ab), _ctas(tactic), *_k_fields(tactic))  # fmt: skip
    info = (canon if canon is not None else _canonical(tactic), geom)
    _remember(tactic, info)
    return info


def _ctas(tactic: Tactic) -> int:
    cpt = tactic.ctas_per_tile
    if type(cpt) is not int or cpt < 1:
        raise ValueError(f"ctas_per_tile must be a positive int, got {cpt!r}")
    return cpt


def _remember(tactic: Tactic, info: _Info) -> None:
    if len(_CHECKED) >= _MEMO_LIMIT or len(_BY_ID) >= _MEMO_LIMIT:
        _CHECKED.clear()
        _BY_ID.clear()
    _CHECKED[tactic] = info
    _BY_ID[id(tactic)] = (tactic, info)


# An entry: (est_us, backend name, canonical JSON, tactic, family). The first three are
# unique after de-duplication, so sorting (plain tuple order) never compares tactics.
_Entry = tuple[float, str, str, Tactic, str]


def _overrides_estimate(backend: Backend) -> bool:
    return getattr(type(backend), "estimate_us", None) is not Backend.estimate_us


def _collect(
    problem: Problem, device: DeviceInfo, backends: Iterable[Backend], guard: Guard | None = None
) -> tuple[list[_Entry], dict[str, str], list[str]]:
    """Every distinct valid tactic of every backend, scored; plus skipped and warnings.

    The per-tactic loop is the hot path (2,000 tactics in a few ms): the type and name
    checks run every time, the rest comes from the `_CHECKED` memo, and estimates are
    shared between tactics of equal geometry (prefetch variants and the like).
    """
    entries: list[_Entry] = []
    skipped: dict[str, str] = {}
    warnings: list[str] = []
    m, n, k = problem.m, problem.n, problem.k
    sms, peak, bw = device.sm_count, _peak_tflops(device), device.mem_bw_gbps
    by_geom: dict[tuple, float] = {}
    by_id, by_value = _BY_ID, _CHECKED
    dense = problem.operation == "w4a16"
    guard = Guard() if guard is None else guard
    broken = guard.broken
    for backend in sorted(backends, key=lambda b: b.name):
        name, family, ttype = backend.name, backend.family, backend.tactic_type
        if problem.operation not in backend.operations:
            continue  # families compete only within one operation
        tactics = guard.tactics(backend, problem, device)
        if isinstance(tactics, PluginFault):  # recorded (and raised in strict mode)
            skipped[name] = tactics.fault.what
            continue
        refine = _overrides_estimate(backend)
        seen: set[str] = set()
        invalid = failed_here = 0
        first_invalid = ""
        for t in tactics:
            info = None
            if isinstance(t, ttype) and t.backend == name:
                hit = by_id.get(id(t))
                if hit is not None and hit[0] is t:
                    info = hit[1]
                else:
                    try:
                        info = by_value.get(t)
                    except TypeError:  # unhashable field value: _revalidate says so
                        info = None
                    if info is not None:
                        _remember(t, info)
            if info is None:
                try:
                    info = _revalidate(t, backend)
                except ValueError as exc:
                    invalid += 1
                    first_invalid = first_invalid or str(exc)
                    continue
            canon, geom = info
            if dense and geom[4]:  # the dispatcher never exchanges dense and NVFP4 operands
                invalid += 1
                first_invalid = first_invalid or f"{canon}: swap_ab=True on a w4a16 problem"
                continue
            if canon in seen:
                continue
            seen.add(canon)
            if broken and (name, t) in broken:  # failed to build or run in this process
                failed_here += 1
                continue
            est = by_geom.get(geom)
            if est is None:
                tm, tn, cm, cn, swap, cpt, sk, tk = geom
                est = by_geom[geom] = _shared_us(
                    m, n, k, sms, peak, bw, tm, tn, cm, cn, swap, cpt, sk, tk
                )
            if refine:
                value = guard.estimate_us(backend, problem, device, t)
                if isinstance(value, PluginFault):  # recorded; shared model from now on
                    warnings.append(f"{value}; shared model used")
                    refine = False
                elif value is not None:
                    est = value
            entries.append((est, name, canon, t, family))
        if invalid:
            why = (
                f"{invalid} invalid tactic(s) dropped ({len(seen)} valid kept); "
                f"first: {first_invalid}"
            )
            log.warning("backend %s for %s: %s", name, problem, why)
            skipped[name] = why
            guard.bad_tactics(backend, invalid, first_invalid)
        if failed_here:
            why = f"{failed_here} tactic(s) left out: they failed to build or run in this process"
            skipped[name] = f"{skipped[name]}; {why}" if name in skipped else why
    return entries, skipped, warnings


# ---- the cap --------------------------------------------------------------------------


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


_MISSING = object()


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
        Candidate(entries[i][1], entries[i][4], entries[i][3], entries[i][0], reason)
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


def _sort_key(e: _Entry) -> tuple[float, str, str]:
    return (e[0], e[1], e[2])


# ---- the per-Dispatcher ranker with lazy bucket memo ----------------------------------


class Ranker:
    """Ranks for one device; memoizes the heuristic top-1 per (N, K, M bucket, out dtype).

    Buckets are powers of two, uncapped, filled on first use. The bucket's pick is
    computed for the representative problem ``(m_bucket(m), n, k)``. Validity rule for
    the actual M: a tactic valid at the bucket's M may not be valid at M (e.g. an
    alignment rule on the output's contiguous dimension when swapped), so the first
    call with a new exact M asks the owning backend's ``validate`` once; if it objects,
    the exact problem is ranked on its own. Either way the answer is memoized per exact
    (M, N, K, out dtype), so repeat calls are a single dict lookup.
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        device: DeviceInfo,
        budget: int = DEFAULT_BUDGET,
        guard: Guard | None = None,
    ) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget: expected a positive int, got {budget!r}")
        by_name: dict[str, Backend] = {}
        for b in backends:
            if b.name in by_name:
                raise ValueError(f"two backends are named {b.name!r}")
            by_name[b.name] = b
        self.backends: tuple[Backend, ...] = tuple(by_name[n] for n in sorted(by_name))
        self._by_name = by_name
        #: every call into a backend goes through it (faults recorded, strict raises)
        self.guard = Guard() if guard is None else guard
        self.device = device
        self.budget = budget
        self._buckets: dict[tuple[int, int, int, str, str], Candidate] = {}
        self._exact: dict[tuple[int, int, int, str, str], Candidate] = {}

    def shortlist(self, problem: Problem) -> Shortlist:
        """The full capped ranking for this exact problem (not memoized)."""
        return shortlist(problem, self.device, self.backends, self.budget, guard=self.guard)

    def pick(
        self, m: int, n: int, k: int, out_dtype: str = "bfloat16", operation: str = "w4a4"
    ) -> Candidate:
        """The heuristic top-1 for this shape: memoized per bucket, checked per exact M."""
        hit = self._exact.get((m, n, k, out_dtype, operation))
        if hit is not None:
            return hit
        return self._pick_slow(m, n, k, out_dtype, operation)

    def _pick_slow(self, m: int, n: int, k: int, out_dtype: str, operation: str) -> Candidate:
        bucket = m_bucket(m)
        bkey = (n, k, bucket, out_dtype, operation)
        top = self._buckets.get(bkey)
        if top is None:
            rep = Problem(m=bucket, n=n, k=k, out_dtype=out_dtype, operation=operation)
            top = self._buckets[bkey] = self._best(rep)
        if m != bucket:
            problem = Problem(m=m, n=n, k=k, out_dtype=out_dtype, operation=operation)
            why = self._invalid_for(top, problem)
            if why is not None:
                log.info("bucket %d pick %s invalid at M=%d (%s); ranking M itself",
                         bucket, top.backend, m, why)  # fmt: skip
                top = self._best(problem)
        if len(self._exact) >= _MEMO_LIMIT:
            self._exact.clear()
        self._exact[(m, n, k, out_dtype, operation)] = top
        return top

    def _invalid_for(self, cand: Candidate, problem: Problem) -> str | None:
        backend = self._by_name[cand.backend]
        return self.guard.validate(backend, cand.tactic, problem, self.device)

    def _best(self, problem: Problem) -> Candidate:
        entries, skipped, _ = _collect(problem, self.device, self.backends, self.guard)
        if not entries:
            raise RuntimeError(self._none_qualifies(problem, skipped))
        e = min(entries, key=_sort_key)
        return Candidate(e[1], e[4], e[3], e[0], "heuristic top-1")

    def _none_qualifies(self, problem: Problem, skipped: dict[str, str]) -> str:
        p = (f"{problem.operation} M={problem.m} N={problem.n} K={problem.k} "
             f"out={problem.out_dtype}")  # fmt: skip
        serving = [b for b in self.backends if problem.operation in b.operations]
        if not serving:
            return f"no NVFP4 GEMM backend is available on {self.device.name} for {p}"
        lines = [f"no backend has a valid tactic for {p} on {self.device.name}:"]
        for b in serving:
            lines.append(f"  {b.name} ({b.family}): {skipped.get(b.name, 'no valid tactic')}")
        return "\n".join(lines)

    def clear(self) -> None:
        """Forget every memoized pick (e.g. after backends or the device changed)."""
        self._buckets.clear()
        self._exact.clear()
