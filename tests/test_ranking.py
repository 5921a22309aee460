"""Ranking: cost model, merge, diversity cap, buckets, Ranker memo, explain.

Synthetic backends (their own Tactic subclasses with a prefetch knob and diversity axes)
stand in for the real families, so these tests pin the cap itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import Counter
from collections.abc import Iterable
from functools import cache
from typing import Literal

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import Field, create_model, field_serializer

from fp4_dispatch.cli import explain
from fp4_dispatch.contracts.backend import Backend, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.policy import ranking
from fp4_dispatch.policy.ranking import (
    Candidate,
    Ranker,
    Shortlist,
    default_floor,
    estimate_us,
    m_bucket,
    preferred_swap,
    shortlist,
)

SM107 = simulated("sm107")
SM100 = simulated("sm100")
SM90 = simulated("sm90")


class _TwoCtaAware(Tactic):
    """Like the CuTe families: an instruction M of 256 is a 2-CTA MMA (two SMs a tile)."""

    @property
    def ctas_per_tile(self) -> int:
        return 2 if self.inst_m == 256 else 1


@cache
def tactic_class(name: str) -> type[Tactic]:
    """A tactic model for backend `name`: a Literal discriminator plus family knobs."""
    return create_model(
        f"Tactic_{name.replace('-', '_')}",
        __base__=_TwoCtaAware,
        backend=(Literal[name], name),  # type: ignore[valid-type]
        prefetch=(Literal[(0, 2, 4, *range(5, 45))], 0),  # type: ignore[misc]
        inst_m=(Literal[128, 256], 128),
    )


Geom = tuple[int, int, int, int, bool, int, int]  # tile_m, tile_n, cm, cn, swap, prefetch, inst_m


class Synth(Backend):
    """A synthetic backend: fixed tactic geometries, optionally problem-dependent."""

    version = "0"

    def __init__(
        self,
        name: str,
        family: str,
        geoms: Iterable[Geom] = (),
        axes: tuple[str, ...] = ("swap_ab", "prefetch"),
        *,
        fail: Exception | None = None,
        swap_needs_m8: bool = False,
    ) -> None:
        self.name = name  # type: ignore[misc]
        self.family = family  # type: ignore[misc]
        self.tactic_type = tactic_class(name)  # type: ignore[misc]
        self.diversity_axes = axes  # type: ignore[misc]
        self.fail = fail
        self.swap_needs_m8 = swap_needs_m8
        self.calls = 0
        self.validates = 0
        self.extra: list[object] = []
        self.items = [self.make(*g) for g in geoms]

    def make(self, tm, tn, cm=1, cn=1, swap=False, prefetch=0, inst_m=128) -> Tactic:
        return self.tactic_type(
            tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, swap_ab=swap,
            prefetch=prefetch, inst_m=inst_m,
        )  # fmt: skip

    def supports(self, device: DeviceInfo) -> Support:
        return Support(True)

    def tactics(self, problem: Problem, device: DeviceInfo) -> list:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        out = [t for t in self.items if not (self.swap_needs_m8 and t.swap_ab and problem.m % 8)]
        return out + self.extra

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        self.validates += 1
        return super().validate(tactic, problem, device)

    def build(self, tactic, problem, device):
        raise NotImplementedError("synthetic")


# ---- strategies ----------------------------------------------------------------------

geoms = st.tuples(
    st.sampled_from([128, 256]),
    st.sampled_from([8, 64, 128, 192, 256]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.booleans(),
    st.sampled_from([0, 2, 4]),
    st.sampled_from([128, 256]),
)
backend_specs = st.lists(
    st.tuples(
        st.sampled_from(["fa", "fb", "fc", "fd"]),
        st.lists(geoms, min_size=0, max_size=30),
        st.sampled_from([(), ("swap_ab",), ("swap_ab", "prefetch"), ("prefetch", "inst_m")]),
    ),
    min_size=1,
    max_size=5,
)
problems = st.builds(
    Problem,
    m=st.sampled_from([1, 7, 32, 100, 4096, 8192, 8193, 32768]),
    n=st.sampled_from([256, 4096, 7168]),
    k=st.sampled_from([256, 7168]),
)
devices = st.sampled_from([SM107, SM100, SM90])


def build(specs) -> list[Synth]:
    return [Synth(f"b{i}-{fam}", fam, g, axes) for i, (fam, g, axes) in enumerate(specs)]


def key_of(problem: Problem, device: DeviceInfo, b: Synth, t: Tactic) -> tuple:
    """The documented tie order, computed independently of the module's internals."""
    return (estimate_us(problem, device, t), b.name, t.canonical_json())


def universe(problem, device, backends) -> dict[str, list[tuple]]:
    """Family -> sorted distinct candidate keys (what the cap chooses from)."""
    fams: dict[str, set] = {}
    for b in backends:
        for t in b.tactics(problem, device):
            fams.setdefault(b.family, set()).add((*key_of(problem, device, b, t), t))
    return {f: sorted(v, key=lambda e: e[:3]) for f, v in fams.items()}


def fingerprint(sl: Shortlist) -> str:
    return json.dumps(sl.to_json(), sort_keys=True)


PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- buckets and the swap rule -------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "bucket"),
    [(1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192), (8193, 16384), (100000, 131072),
     (1 << 20, 1 << 20), ((1 << 20) + 1, 1 << 21)],
)  # fmt: skip
def test_m_bucket_is_next_power_of_two_uncapped(m, bucket):
    assert m_bucket(m) == bucket


@given(st.integers(1, 1 << 40))
@settings(max_examples=200, deadline=None)
def test_m_bucket_property(m):
    b = m_bucket(m)
    assert b >= m and b & (b - 1) == 0 and b < 2 * m


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_m_bucket_rejects_bad(bad):
    with pytest.raises(ValueError, match="positive int"):
        m_bucket(bad)


def test_preferred_swap_rule():
    assert preferred_swap(Problem(m=1, n=4096, k=256))
    assert preferred_swap(Problem(m=32, n=40, k=256))
    assert not preferred_swap(Problem(m=33, n=4096, k=256))
    assert not preferred_swap(Problem(m=16, n=16, k=256))  # N must exceed M
    assert not preferred_swap(Problem(m=16, n=4100, k=256))  # N % 8


@pytest.mark.parametrize(("m", "ratio"), [(8192, 1.05), (4096, 1.05), (8193, 1.0), (16384, 1.0),
                                          (32768, 1.0)])  # fmt: skip
def test_swap_penalty_through_8192_then_neutral(m, ratio):
    """Square problem and tile: the orientations differ only by the swap rule."""
    b = Synth("s", "f")
    p = Problem(m=m, n=m, k=4096)
    plain = estimate_us(p, SM107, b.make(128, 128))
    swapped = estimate_us(p, SM107, b.make(128, 128, swap=True))
    assert swapped / plain == pytest.approx(ratio, rel=1e-12)


def test_decode_prefers_swap():
    b = Synth("s", "f")
    p = Problem(m=16, n=16 + 8, k=4096)  # nearly square, so geometry barely differs
    # the non-preferred orientation (no swap) pays 5% on top of its geometry
    plain = estimate_us(p, SM107, b.make(128, 128))
    swapped = estimate_us(p, SM107, b.make(128, 128, swap=True))
    assert plain / swapped == pytest.approx(1.05, rel=1e-9)


def test_cost_model_features():
    b = Synth("s", "f")
    big = Problem(m=8192, n=8192, k=8192)
    # padding: tile 192 over N=8192 wastes columns compared with 256
    assert estimate_us(big, SM107, b.make(128, 256)) < estimate_us(big, SM107, b.make(128, 192))
    # wave quantization (compute-bound shape): 848 tiles on 212 SMs are 4 waves, 1060 are 5
    four = Problem(m=128 * 212, n=256 * 4, k=8192)
    five = Problem(m=128 * 212, n=256 * 4 + 1, k=8192)
    t = b.make(128, 256)
    assert estimate_us(five, SM107, t) > 1.2 * estimate_us(four, SM107, t)
    # a bigger device (same per-SM rate) is faster on a big problem
    assert estimate_us(big, SM107, t) < estimate_us(big, SM107.with_sm_count(106), t)
    # decode is memory-bound: time near bytes / bandwidth, far from the compute time
    dec = Problem(m=1, n=8192, k=8192)
    us = estimate_us(dec, SM107, b.make(128, 8, swap=True))
    assert dec.min_bytes / (SM107.mem_bw_gbps * 1e3) < us < 50
    # 2-CTA tiles count twice against the SMs - as the tactic declares: the core has no
    # per-architecture rule (a plain tactic is one CTA a tile, whatever the device)
    plain = Tactic(backend="p", tile_m=256, tile_n=128)
    assert ranking.ctas_per_tile(plain, SM107) == 1 == ranking.ctas_per_tile(plain, SM90)
    assert ranking.ctas_per_tile(b.make(256, 128, inst_m=256), SM107) == 2
    assert ranking.ctas_per_tile(b.make(256, 128, inst_m=128), SM107) == 1  # B reuse
    # a 2-CTA 256-row tile uses the SMs of two 128-row tiles but feeds B once for both
    p2 = Problem(m=16384, n=16384, k=8192)
    rows128 = estimate_us(p2, SM107, b.make(128, 128))
    two_cta = estimate_us(p2, SM107, b.make(256, 128, inst_m=256))
    assert two_cta < rows128
    assert all(x > 0 for x in [estimate_us(big, d, t) for d in (SM90, SM100, SM107)])


# ---- the merge -----------------------------------------------------------------------

GRID = [(tm, tn, cm, 1, s, pf, 128) for tm in (128, 256) for tn in (64, 128, 256)
        for cm in (1, 2) for s in (False, True) for pf in (0, 2)]  # fmt: skip


def test_raising_backend_is_skipped_and_reported(caplog):
    good = Synth("good", "fa", GRID[:4])
    bad = Synth("bad", "fb", GRID, fail=RuntimeError("kaboom"))
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.policy.ranking"):
        sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [bad, good])
    assert "kaboom" in sl.skipped["bad"] and "RuntimeError" in sl.skipped["bad"]
    assert {c.backend for c in sl.candidates} == {"good"}
    assert sl.total == 4 and "fb" not in sl.cut
    assert any("bad" in r.message and "kaboom" in r.getMessage() for r in caplog.records)


def test_invalid_tactics_are_dropped_and_reported(caplog):
    good = Synth("good", "fa", GRID[:6])
    other = Synth("other", "fb", GRID[:2])
    good.extra = [
        other.items[0],  # another backend's type
        good.tactic_type.model_construct(**{**good.items[0].model_dump(), "tile_m": 0}),
        "not a tactic",
    ]
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.policy.ranking"):
        sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [good, other])
    assert sl.skipped["good"].startswith("3 invalid tactic(s) dropped (6 valid kept)")
    assert "expected a Tactic_good" in sl.skipped["good"]
    assert sl.total == 8 and sl.cut == {"fa": 0, "fb": 0}
    assert all(c.tactic.tile_m > 0 for c in sl.candidates)
    assert any("invalid" in r.getMessage() for r in caplog.records)


def test_invalid_field_value_message():
    b = Synth("good", "fa", GRID[:1])
    b.extra = [b.tactic_type.model_construct(**{**b.items[0].model_dump(), "tile_m": 0})]
    sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [b])
    assert "tile_m" in sl.skipped["good"] and "greater than 0" in sl.skipped["good"]


def test_wrong_backend_name_is_invalid():
    b = Synth("good", "fa", GRID[:1])

    class Loose(Tactic):
        pass

    b.tactic_type = Tactic  # type: ignore[misc]  # accept any Tactic, so only the name can fail
    b.extra = [Loose(backend="someone-else", tile_m=128, tile_n=128)]
    sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [b])
    assert "tactic.backend is 'someone-else'" in sl.skipped["good"]
    assert sl.total == 1


class Listy(Tactic):
    backend: Literal["listy"] = "listy"
    stages: list[int] = Field(default_factory=lambda: [2])


def test_unhashable_tactic_is_invalid_not_fatal():
    b = Synth("listy", "fl", [])
    b.tactic_type = Listy  # type: ignore[misc]
    b.extra = [Listy(tile_m=128, tile_n=64)]
    ok = Synth("ok", "fa", GRID[:2])
    sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [b, ok])
    assert "not hashable" in sl.skipped["listy"] and sl.total == 2


def test_duplicates_are_merged():
    b = Synth("dup", "fa", GRID[:3] + GRID[:3])
    b.extra = [b.make(*GRID[0])]  # equal value, different object
    sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [b])
    assert sl.total == 3 and len(sl.candidates) == 3 and not sl.skipped


class Refined(Synth):
    def estimate_us(self, problem, device, tactic):
        if tactic.prefetch == 2:
            return 1.0
        if tactic.prefetch == 4:
            return float("nan")
        return None


class RefineRaises(Synth):
    def estimate_us(self, problem, device, tactic):
        raise ZeroDivisionError("oops")


def test_backend_estimate_replaces_shared_one():
    b = Refined("ref", "fa", [(128, 128, 1, 1, False, pf, 128) for pf in (0, 2, 4)])
    p = Problem(m=4096, n=4096, k=4096)
    sl = shortlist(p, SM107, [b])
    by_pf = {c.tactic.prefetch: c.est_us for c in sl.candidates}
    assert by_pf[2] == 1.0 and sl.candidates[0].tactic.prefetch == 2
    shared = estimate_us(p, SM107, b.items[0])
    assert by_pf[0] == shared and by_pf[4] == shared  # None keeps it; NaN is ignored
    assert any("nan" in w for w in sl.warnings)


def test_raising_estimate_falls_back_to_shared():
    b = RefineRaises("ref", "fa", GRID[:4])
    p = Problem(m=4096, n=4096, k=4096)
    sl = shortlist(p, SM107, [b])
    assert len(sl.candidates) == 4 and "oops" in sl.warnings[0]
    assert all(c.est_us == estimate_us(p, SM107, c.tactic) for c in sl.candidates)


@given(geoms)
@settings(max_examples=50, deadline=None)
def test_fast_canonical_json_matches_tactic_method(g):
    t = Synth("x", "f").make(*g)
    assert ranking._canonical(t) == t.canonical_json()


class Knobby(Tactic):
    backend: Literal["knobby"] = "knobby"
    label: str = ""
    ratio: float = 0.5
    note: str | None = None


class Serialized(Tactic):
    backend: Literal["ser"] = "ser"
    level: int = 1

    @field_serializer("level")
    def _double(self, v: int) -> int:
        return v * 2


@given(st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False),
       st.none() | st.text(max_size=3))  # fmt: skip
@settings(max_examples=100, deadline=None)
def test_fast_canonical_json_on_strings_and_floats(label, ratio, note):
    t = Knobby(tile_m=128, tile_n=64, label=label, ratio=ratio, note=note)
    assert ranking._plain_model(Knobby)
    assert ranking._fast_canonical(t) == t.canonical_json()


def test_customised_serialization_takes_the_documented_path():
    assert not ranking._plain_model(Serialized)
    t = Serialized(tile_m=128, tile_n=64, level=3)

    class SerBackend(Synth):
        pass

    b = SerBackend("ser", "fs", [])
    b.tactic_type = Serialized  # type: ignore[misc]
    b.extra = [t]
    sl = shortlist(Problem(m=128, n=4096, k=4096), SM107, [b])
    # model_dump doubles `level` (6); re-validating that is still valid, and the tie key
    # is the tactic's own canonical JSON
    assert sl.total == 1 and ranking._CHECKED[t][0] == t.canonical_json()


# ---- the cap: properties over random candidate sets ----------------------------------


@PROP
@given(backend_specs, problems, devices, st.integers(1, 40), st.randoms(use_true_random=False))
def test_cap_properties(specs, problem, device, budget, rnd):
    backends = build(specs)
    sl = shortlist(problem, device, backends, budget)
    fams = universe(problem, device, backends)
    total = sum(len(v) for v in fams.values())
    nf = len(fams)
    # size, totals, no duplicates, rank order
    assert sl.total == total
    assert len(sl.candidates) == min(budget, total)
    ids = [(c.backend, c.tactic.canonical_json()) for c in sl.candidates]
    assert len(set(ids)) == len(ids)
    keys = [(c.est_us, c.backend, c.tactic.canonical_json()) for c in sl.candidates]
    assert keys == sorted(keys)
    by_name = {b.name: b for b in backends}
    assert all(c.est_us == estimate_us(problem, device, c.tactic) for c in sl.candidates)
    assert all(c.family == by_name[c.backend].family for c in sl.candidates)
    # cut accounting
    kept = Counter(c.family for c in sl.candidates)
    assert sl.cut == {f: len(v) - kept[f] for f, v in sorted(fams.items())}
    # the floor (the design's default, computed here rather than trusted)
    floor = max(1, budget // (2 * max(nf, 1)))
    assert sl.floor == floor == default_floor(budget, nf)
    if budget >= nf:
        for f, v in fams.items():
            assert kept[f] >= min(floor, len(v)), (f, kept, floor)
    else:  # one slot each for the `budget` families whose best candidate ranks first
        order = sorted(fams, key=lambda f: fams[f][0][:3])
        assert dict(kept) == dict.fromkeys(order[:budget], 1)
    # axis coverage whenever the floor allows it
    axes = {}
    for b in backends:
        axes.setdefault(b.family, [])
        axes[b.family] += [a for a in b.diversity_axes if a not in axes[b.family]]
    for f, v in fams.items():
        need = sum(len({getattr(e[3], a) for e in v}) for a in axes[f])
        if budget >= nf and min(floor, len(v)) >= need:
            event("axis coverage checked")
            for a in axes[f]:
                have = {getattr(c.tactic, a) for c in sl.candidates if c.family == f}
                assert have == {getattr(e[3], a) for e in v}, (f, a)
    # everything kept "by score" beats everything cut
    kept_ids = set(ids)
    cut_keys = [e[:3] for v in fams.values() for e in v if (e[1], e[2]) not in kept_ids]
    score_keys = [k for k, c in zip(keys, sl.candidates, strict=True) if c.reason == "score"]
    if cut_keys and score_keys:
        assert max(score_keys) < min(cut_keys)
    assert all(c.reason == "score" or c.reason == "floor" or c.reason.startswith("axis ")
               for c in sl.candidates)  # fmt: skip
    # determinism and order independence (registration and enumeration)
    again = shortlist(problem, device, backends, budget)
    assert fingerprint(again) == fingerprint(sl)
    shuffled = build(specs)
    for b in shuffled:
        rnd.shuffle(b.items)
    rnd.shuffle(shuffled)
    assert fingerprint(shortlist(problem, device, shuffled, budget)) == fingerprint(sl)


@PROP
@given(backend_specs, problems, st.integers(1, 40), st.integers(0, 12))
def test_explicit_floor(specs, problem, budget, floor):
    backends = build(specs)
    sl = shortlist(problem, SM107, backends, budget, floor=floor)
    fams = universe(problem, SM107, backends)
    kept = Counter(c.family for c in sl.candidates)
    assert len(sl.candidates) == min(budget, sum(len(v) for v in fams.values()))
    if sum(min(floor, len(v)) for v in fams.values()) <= budget:
        assert all(kept[f] >= min(floor, len(v)) for f, v in fams.items())
    else:  # round-robin: family counts differ by at most one below their floors
        short = [min(floor, len(v)) - kept[f] for f, v in fams.items()]
        assert all(s >= 0 for s in short) or len(sl.candidates) == budget


@PROP
@given(
    st.lists(geoms, min_size=5, max_size=40),
    st.lists(st.tuples(st.sampled_from([2, 4]), st.sampled_from([8, 64])), min_size=1,
             max_size=4),
    st.integers(1, 3),
    st.integers(4, 40),
    problems,
)  # fmt: skip
def test_rare_axis_values_are_covered_when_the_floor_allows(good, rare, rivals, budget, p):
    """Values held only by poorly scoring tactics still reach the shortlist via the floor."""
    good = [(tm, tn, cm, cn, False, 0, im) for tm, tn, cm, cn, _, _, im in good]
    rare_geo = [(128, tn, 4, 4, True, pf, 128) for pf, tn in rare]  # tiny tile, big cluster
    target = Synth("t-target", "target", good + rare_geo, axes=("swap_ab", "prefetch"))
    others = [Synth(f"r{i}", f"rival{i}", GRID) for i in range(rivals)]
    backends = [*others, target]
    nf = rivals + 1
    need = 2 + len({pf for pf, _ in rare})  # swap {F, T}, prefetch {0, rare values}
    for floor in (None, need):
        sl = shortlist(p, SM107, backends, budget, floor=floor)
        used = max(1, budget // (2 * nf)) if floor is None else floor
        mine = [c for c in sl.candidates if c.family == "target"]
        if budget >= used * nf and used >= need:
            event("coverage required")
            assert {c.tactic.swap_ab for c in mine} == {False, True}
            assert {c.tactic.prefetch for c in mine} == {0} | {pf for pf, _ in rare}
            assert any(c.reason.startswith("axis ") for c in mine if c.tactic.swap_ab)


def test_budget_below_family_count_keeps_best_families():
    # four families, each with one tactic of a different size: cost orders them
    sizes = {"fa": 256, "fb": 128, "fc": 64, "fd": 8}
    backends = [Synth(f"x-{f}", f, [(128, tn, 1, 1, False, 0, 128)]) for f, tn in sizes.items()]
    p = Problem(m=8192, n=8192, k=8192)
    sl = shortlist(p, SM107, backends, budget=2)
    assert [c.family for c in sl.candidates] == ["fa", "fb"]
    assert all(c.reason == "axis swap_ab=False" for c in sl.candidates)
    assert sl.cut == {"fa": 0, "fb": 0, "fc": 1, "fd": 1}


def test_total_below_budget_keeps_everything():
    b = Synth("only", "fa", GRID[:5])
    sl = shortlist(Problem(m=64, n=4096, k=4096), SM107, [b], budget=32)
    assert len(sl.candidates) == 5 and sl.cut == {"fa": 0}


def test_bad_budget_and_floor():
    b = Synth("only", "fa", GRID[:5])
    p = Problem(m=64, n=4096, k=4096)
    with pytest.raises(ValueError, match="budget"):
        shortlist(p, SM107, [b], budget=0)
    with pytest.raises(ValueError, match="floor"):
        shortlist(p, SM107, [b], floor=-1)


# ---- regressions of the original failures --------------------------------------------


def test_family_enumerated_last_with_tied_scores_gets_its_floor():
    """FlashInfer: SM107 tactics tied with SM100's and, enumerated last, got no slot."""
    grid = [(128, tn, cm, cn, s, pf, 128) for tn in (64, 128, 256) for cm in (1, 2)
            for cn in (1, 2) for s in (False, True) for pf in (0, 2)]  # fmt: skip
    sm100 = Synth("a-sm100", "sm100", grid)
    sm107 = Synth("z-sm107", "sm107", grid)  # same geometry: every score ties
    p = Problem(m=4096, n=7168, k=7168)
    for order in ([sm100, sm107], [sm107, sm100]):
        sl = shortlist(p, SM107, order, budget=32)
        kept = Counter(c.family for c in sl.candidates)
        assert kept["sm107"] >= 32 // (2 * 2) == 8
        assert len(sl.candidates) == 32
        assert {c.tactic.swap_ab for c in sl.candidates if c.family == "sm107"} == {False, True}
        assert {c.tactic.prefetch for c in sl.candidates if c.family == "sm107"} == {0, 2}


def test_forty_prefetch_variants_budget_32_yield_exactly_32():
    """FlashInfer assumed two prefetch variants per group; the budget counts tactics."""
    pf = [0, 2, 4, *range(5, 42)]
    b = Synth("one", "sm100", [(128, 256, 1, 1, False, p, 128) for p in pf], axes=())
    sl = shortlist(Problem(m=4096, n=7168, k=7168), SM107, [b], budget=32)
    assert len(sl.candidates) == 32 and sl.total == 40 and sl.cut == {"sm100": 8}
    # ties on score resolve on canonical JSON: the same 32 whatever the enumeration order
    b2 = Synth("one", "sm100", [(128, 256, 1, 1, False, p, 128) for p in reversed(pf)], axes=())
    sl2 = shortlist(Problem(m=4096, n=7168, k=7168), SM107, [b2], budget=32)
    assert fingerprint(sl) == fingerprint(sl2)


def test_sm107_large_m_keeps_both_swap_orientations():
    """At M=32768 swap won by 7-66% on SM107: both orientations must reach measurement."""
    p = Problem(m=32768, n=4096, k=8192)
    geo = [(tm, tn, cm, cn, False, pf, im) for tm in (128, 256) for tn in (128, 192, 256)
           for cm in (2, 4) for cn in (1, 2) for pf in (0, 2) for im in (128, 256)]  # fmt: skip
    # sm107's swapped tactics use a small tile: far down the ranking at this size
    swapped = [(128, 64, 1, 1, True, pf, 128) for pf in (0, 2)]
    sm107 = Synth("cute-sm107", "sm107", geo + swapped)
    sm100 = Synth("cute-sm100", "sm100", geo)
    sm103 = Synth("cute-sm103", "sm103", geo)
    assert SM107.cc == 107
    sl = shortlist(p, SM107, [sm100, sm103, sm107], budget=32)
    ranked_swapped = min(estimate_us(p, SM107, t) for t in sm107.items if t.swap_ab)
    ahead = [t for b in (sm100, sm103, sm107) for t in b.items
             if estimate_us(p, SM107, t) < ranked_swapped]  # fmt: skip
    assert len(ahead) > 32  # score alone would never keep a swapped tactic
    orient = {c.tactic.swap_ab for c in sl.candidates if c.family == "sm107"}
    assert orient == {False, True}
    (swap_kept,) = [c for c in sl.candidates if c.tactic.swap_ab]
    assert swap_kept.reason == "axis swap_ab=True"
    # and at M=32768 the model adds no swap penalty: a square tile estimates the same
    sq = Synth("sq", "f")
    assert estimate_us(p, SM107, sq.make(128, 128)) == estimate_us(
        p, SM107, sq.make(128, 128, swap=True)
    )


# ---- Ranker: lazy uncapped buckets ---------------------------------------------------


def ranker_backends(**kw) -> list[Synth]:
    return [Synth("r-a", "fa", GRID, **kw), Synth("r-b", "fb", GRID[::3], **kw)]


def test_pick_memoizes_per_bucket_and_exact_m():
    backends = ranker_backends()
    r = Ranker(backends, SM107)
    c1 = r.pick(100000, 4096, 4096)
    assert isinstance(c1, Candidate) and c1.reason == "heuristic top-1"
    calls = [b.calls for b in backends]
    assert r.pick(100000, 4096, 4096) is c1 and [b.calls for b in backends] == calls
    best = r.shortlist(Problem(m=131072, n=4096, k=4096)).candidates[0]
    assert (best.backend, best.tactic) == (c1.backend, c1.tactic)  # bucket 131072
    # M=100000 is not the bucket's M: the owner's validate() ran once, for that M
    assert sum(b.validates for b in backends) == 1
    # another M of the same bucket: no re-ranking, only the owner's validate() once
    calls = [b.calls for b in backends]
    c2 = r.pick(70000, 4096, 4096)
    assert c2 is c1 and sum(b.validates for b in backends) == 2
    assert sum(b.calls for b in backends) == sum(calls) + 1  # validate's membership check
    r.pick(70000, 4096, 4096)
    assert sum(b.validates for b in backends) == 2
    # the bucket M itself needs no validation
    r.pick(131072, 4096, 4096)
    assert sum(b.validates for b in backends) == 2
    r.clear()
    r.pick(100000, 4096, 4096)
    assert sum(b.calls for b in backends) > sum(calls) + 1


def test_pick_large_m_is_not_capped_at_4096():
    r = Ranker(ranker_backends(), SM107)
    small = r.pick(4096, 4096, 4096)
    big = r.pick(100000, 4096, 4096)
    assert r._buckets.keys() >= {
        (4096, 4096, 4096, "bfloat16", "w4a4"),
        (4096, 4096, 131072, "bfloat16", "w4a4"),
    }
    assert big.est_us > small.est_us  # ranked for its own bucket, not M=4096's


def test_pick_revalidates_for_actual_m():
    """Bucket 8 prefers a swapped tactic; at M=5 swapped ones are invalid (M % 8)."""
    geo = [(128, 64, 1, 1, False, 0, 128), (64, 8, 1, 1, True, 0, 128)]
    b = Synth("al", "fa", geo, swap_needs_m8=True)
    r = Ranker([b], SM107)
    at8 = r.pick(8, 4096, 4096)
    assert at8.tactic.swap_ab  # decode prefers swap
    at5 = r.pick(5, 4096, 4096)
    assert not at5.tactic.swap_ab
    assert at5.tactic in b.tactics(Problem(m=5, n=4096, k=4096), SM107)
    assert r.pick(5, 4096, 4096) is at5


def test_pick_none_qualifies_lists_every_reason():
    empty = Synth("empty", "fa", [])
    broken = Synth("broken", "fb", GRID, fail=OSError("no compiler"))
    r = Ranker([empty, broken], SM107)
    with pytest.raises(RuntimeError) as info:
        r.pick(64, 4096, 4096)
    msg = str(info.value)
    assert "empty (fa): no valid tactic" in msg and "no compiler" in msg and "M=64" in msg
    with pytest.raises(RuntimeError, match="no NVFP4 GEMM backend is available"):
        Ranker([], SM107).pick(64, 4096, 4096)


def test_ranker_rejects_duplicate_names_and_is_order_independent():
    with pytest.raises(ValueError, match="two backends"):
        Ranker([Synth("same", "fa"), Synth("same", "fb")], SM107)
    a, b = ranker_backends(), ranker_backends()
    p = Problem(m=300, n=7168, k=2048)
    assert fingerprint(Ranker(a, SM107).shortlist(p)) == fingerprint(
        Ranker(b[::-1], SM107).shortlist(p)
    )
    assert Ranker(a, SM107, budget=5).shortlist(p).budget == 5


# ---- explain -------------------------------------------------------------------------


def sample_shortlist() -> Shortlist:
    backends = [Synth("cute-sm100", "sm100", GRID), Synth("cute-sm107", "sm107", GRID[::2]),
                Synth("bad", "sm90", GRID, fail=RuntimeError("import failed"))]  # fmt: skip
    return shortlist(Problem(m=4096, n=7168, k=7168), SM107, backends, budget=8)


def test_explain_table():
    sl = sample_shortlist()
    text = explain.render(sl, 212)
    lines = text.splitlines()
    assert lines[0] == f"explain M=4096 N=7168 K=7168 (bfloat16) on {SM107.name}, 212 SMs"
    assert "kept 8 of 72 valid tactics (budget 8, floor 2 per family)" in text
    ranked = [ln for ln in lines if ln.split()[:1] and ln.split()[0].isdigit()]
    assert [ln.split()[0] for ln in ranked] == [str(i) for i in range(1, 9)]
    assert [ln.split()[1] for ln in ranked] == [c.backend for c in sl.candidates]
    assert "prefetch=" in text and "inst_m=" in text and "kept because" in text
    assert "bad: tactics() raised RuntimeError: import failed" in text
    fam = lines[lines.index("per family:") + 2 :]
    for fam_name, cut in sl.cut.items():
        kept = sum(c.family == fam_name for c in sl.candidates)
        assert any(ln.split()[:4] == [fam_name, str(kept), str(cut), str(kept + cut)]
                   for ln in fam), (fam_name, fam)  # fmt: skip


def test_explain_json_shape():
    data = sample_shortlist().to_json()
    assert set(data) >= {"candidates", "cut", "skipped", "problem", "device", "budget"}
    c = data["candidates"][0]
    assert set(c) == {"backend", "family", "tactic", "est_us", "reason", "operation", "lossy"}
    assert (c["operation"], c["lossy"]) == ("w4a4", False)
    assert c["tactic"]["backend"] == c["backend"]
    json.dumps(data)  # plain JSON
    assert data["cut"] == {
        "sm100": 48 - sum(x["family"] == "sm100" for x in data["candidates"]),
        "sm107": 24 - sum(x["family"] == "sm107" for x in data["candidates"]),
    }


def test_explain_knobs_are_compact():
    cls = create_model(
        "Tactic_knobs",
        __base__=Tactic,
        backend=(Literal["knobs"], "knobs"),
        fallback_cluster_m=(int, 2),
        fallback_cluster_n=(int, 1),
        b_reuse=(bool, True),
        inst_m=(int, 256),
    )
    c = Candidate("knobs", "f", cls(tile_m=256, tile_n=128), 1.0, "score")
    assert explain._extra(c) == "fallback_cluster=2x1 b_reuse=on inst_m=256"


class FakeDispatcher:
    def __init__(self, sl: Shortlist) -> None:
        self.sl = sl
        self.device = SM107
        self.asked: tuple = ()

    def candidates(self, m, n, k, out_dtype="bfloat16", operation="w4a4"):
        self.asked = (m, n, k, out_dtype, operation)
        return self.sl


@pytest.mark.parametrize("as_json", [False, True])
def test_explain_cli(monkeypatch, capsys, as_json):
    sl = sample_shortlist()
    fake = FakeDispatcher(sl)
    seen = {}

    def make(args, **kw):
        seen.update(kw, device=args.device)
        return fake

    monkeypatch.setattr(explain.common, "make_dispatcher", make)
    parser = argparse.ArgumentParser()
    explain.register(parser.add_subparsers(dest="command"))
    argv = ["explain", "4096", "7168", "7168", "--device", "sm107", "--budget", "8"]
    args = parser.parse_args(argv + (["--json"] if as_json else []))
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert fake.asked == (4096, 7168, 7168, "bfloat16", "w4a4")
    assert seen == {"budget": 8, "device": "sm107"}
    if as_json:
        assert json.loads(out)["cut"] == sl.cut
    else:
        # the ranking, then the bucket's tuned entry (the fake has no winner store)
        assert out.strip() == explain.render(sl, 212) + "\n\n" + explain.render_tuned(None)


def test_explain_cli_rejects_bad_sizes(capsys):
    parser = argparse.ArgumentParser()
    explain.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["explain", "0", "8", "32"])
    assert (
        exc.value.code == 2 and "argument M: expected a positive integer" in capsys.readouterr().err
    )


def test_shuffled_enumeration_is_stable_on_a_large_set():
    """A bigger, hand-checked case of order independence (2 families x 96 tactics)."""
    rnd = random.Random(7)
    a = [Synth("p-sm100", "sm100", GRID * 2), Synth("q-sm107", "sm107", GRID[::-1])]
    b = [Synth("p-sm100", "sm100", GRID * 2), Synth("q-sm107", "sm107", GRID[::-1])]
    for x in b:
        rnd.shuffle(x.items)
    p = Problem(m=2048, n=4096, k=4096)
    assert fingerprint(shortlist(p, SM107, a, 10)) == fingerprint(shortlist(p, SM107, b[::-1], 10))
