"""The merge: every backend's tactics enumerated, re-validated (memoized) and scored.

What `fp4_dispatch.ranking` builds its shortlist and its heuristic pick from: a flat list
of distinct valid tactics with their estimates (`_collect`), plus which backends were
skipped and why.

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
from collections.abc import Iterable
from functools import lru_cache
from json.encoder import encode_basestring_ascii as _encode_str

from pydantic import ValidationError

from .backend import Backend
from .costmodel import _k_fields, _peak_tflops, _shared_us
from .device import DeviceInfo
from .guard import Guard, PluginFault
from .tactics import Problem, Tactic, computed_as

log = logging.getLogger(__name__)

#: memo tables are cleared when they grow past this many entries
_MEMO_LIMIT = 1 << 17

#: "this tactic has no such field" (equal to no value; the cap reads it too)
_MISSING = object()


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


# An entry: (est_us, backend name, canonical JSON, tactic, family, operation computed).
# The first three are unique after de-duplication, so sorting (plain tuple order) never
# compares tactics.
_Entry = tuple[float, str, str, Tactic, str, str]


def operation_for(backend: Backend, problem: Problem) -> str | None:
    """The operation `backend` computes `problem` with: the first of the problem's
    `computed_as` that it serves, or None (it does not serve the problem)."""
    return next((op for op in computed_as(problem.operation) if op in backend.operations), None)


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
    dense = problem.dense or problem.grouped  # neither is ever swapped by the dispatcher
    asked = problem
    guard = Guard() if guard is None else guard
    broken = guard.broken
    for backend in sorted(backends, key=lambda b: b.name):
        name, family, ttype = backend.name, backend.family, backend.tactic_type
        op = operation_for(backend, asked)
        if op is None:
            continue  # families compete only within one problem operation
        problem = asked.as_operation(op)  # what the backend computes, as it sees it
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
            if dense and geom[4]:  # never exchanged: dense and NVFP4 operands, expert stacks
                invalid += 1
                first_invalid = first_invalid or f"{canon}: swap_ab=True on a dense problem"
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
            entries.append((est, name, canon, t, family, op))
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
