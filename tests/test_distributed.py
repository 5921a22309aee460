"""Distributed tuning: gloo process groups on CPU, every rank agrees, one rank writes.

Each test spawns real processes (``torch.multiprocessing.spawn``, a ``file://`` rendezvous)
that tune with the reference backend plus two synthetic families (so a shortlist has
enough tactics to split over three ranks) and a deterministic fake timer whose noise
differs per rank. Each rank writes what it saw to a JSON file the test then compares.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Backend, Dispatcher, Problem, Support, Tactic, quantize_nvfp4
from fp4_dispatch.autotune.distributed import Fleet, RanksDisagree, fleet_of, merge_shares
from fp4_dispatch.autotune.tuning import Timing

SHAPES = [(100, 256, 128), (16, 256, 128)]
#: the truly fastest tactic of every bucket, by a margin far beyond any band
FASTEST = ("fd-b", 64, 64)


class DTacticA(Tactic):
    backend: Literal["fd-a"] = "fd-a"
    tile_m: Literal[64, 128] = 128
    tile_n: Literal[64, 128, 256] = 128


class DTacticB(Tactic):
    backend: Literal["fd-b"] = "fd-b"
    tile_m: Literal[64, 128] = 128
    tile_n: Literal[64, 128, 256] = 128


def _reference_kernel(operands, out):
    from fp4_dispatch.backends.reference import gemm

    gemm(operands, out, compute_dtype="float32", k_chunk=0)


class _Synthetic(Backend):
    version = "1"
    diversity_axes = ("tile_n",)

    def supports(self, device) -> Support:
        return Support(True, "synthetic")

    def tactics(self, problem: Problem, device):
        for tm in (64, 128):
            for tn in (64, 128, 256):
                yield self.tactic_type(tile_m=tm, tile_n=tn)

    def estimate_us(self, problem, device, tactic) -> float:
        return 50.0 - tactic.tile_n / 10 - tactic.tile_m / 100 + (self.name == "fd-b")

    def build(self, tactic, problem, device):
        return _reference_kernel


class SynthA(_Synthetic):
    name, family, tactic_type = "fd-a", "fda", DTacticA


class SynthB(_Synthetic):
    name, family, tactic_type = "fd-b", "fdb", DTacticB


def _registry(load) -> registry_mod.Registry:
    """The built-in reference backend (from the real `load`) and two synthetic families."""
    real = load(strict=False)
    reg = registry_mod.Registry()
    report = registry_mod.PluginReport("fleet-test", "tests", "tests", "0", builtin=False)
    backends = [real.backends["torch-reference"], SynthA(), SynthB()]
    for b in backends:
        reg.backends[b.name] = b
        reg.plugin_of[b.name] = report
        report.backends.append(b.name)
    reg.plugins.append(report)
    return reg


def _key(c) -> str:
    return f"{c.backend} {c.tactic.canonical_json()}"


class RankTimer:
    """True time 10 us for `FASTEST`, 30 us else; +-(0.5% x rank) deterministic noise.

    ``fail``: tactic keys whose measurement raises on this rank (a flaky GPU)."""

    def __init__(self, rank: int, fail: frozenset[str] = frozenset()) -> None:
        self.rank = rank
        self.fail = fail
        self.measured: list[str] = []
        self.paired_calls = 0

    def _true(self, cand) -> float:
        t = cand.tactic
        fast = (cand.backend, t.tile_m, getattr(t, "tile_n", 0)) == FASTEST
        return 10.0 if fast else 30.0

    def __call__(self, cand, launch, best_us) -> Timing:
        key = _key(cand)
        self.measured.append(key)
        if key in self.fail:
            raise RuntimeError(f"rank {self.rank}: illegal address (synthetic)")
        base = self._true(cand)
        noise = 0.005 * self.rank
        return Timing((base * (1 - noise), base, base * (1 + noise)), "fake")

    def paired(self, cands, launches, pairs):
        self.paired_calls += 1
        return [tuple(self._true(c) for c in cands) for _ in range(pairs)]


def _worker(rank: int, world: int, init: str, out: str, fail_on_rank1: bool) -> None:
    """One rank: tune SHAPES with the group, tune again (cache hits), autotune a dense
    call; write what it saw to ``out/rank<r>.json``."""
    os.environ["FP4_DISPATCH_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        real_load = registry_mod.load
        registry_mod.load = lambda strict=None: _registry(real_load)
        cache = Path(out) / "shared.json"
        d = Dispatcher(device="cpu", cache=cache)
        writes: list[int] = []
        put = d.winners.cache.put
        d.winners.cache.put = lambda *a, **kw: (writes.append(1), put(*a, **kw))[1]
        flaky: frozenset[str] = frozenset()
        if fail_on_rank1 and rank == 1:  # two tactics of this rank's share of bucket 1
            shortlist = d.ranker.shortlist(Problem(m=128, n=256, k=128)).candidates
            flaky = frozenset(_key(c) for c in shortlist[1::world][:2])
        timer = RankTimer(rank, flaky)
        group = dist.group.WORLD
        results = d.tune(SHAPES, timer=timer, group=group, force=True, progress=False)
        before = len(timer.measured)
        again = d.tune(SHAPES, timer=timer, group=group, progress=False)
        again_measured = len(timer.measured) - before
        d.tune = functools.partial(d.tune, timer=timer, progress=False)
        x = torch.randn(8, 128, dtype=torch.bfloat16)
        qb = quantize_nvfp4(torch.randn(256, 128))
        with d.autotuning(group=group):
            d.gemm(x, qb)
        dense = d.winners.results[(256, 128, 8, "bfloat16", "w4a16")]
        report = {
            "picks": [[_key(r.winner), r.kept_default, r.paired_ratio] for r in results],
            "tables": [[m.us if m.ok else None for m in r.measurements] for r in results],
            "shortlist": [[_key(m.candidate) for m in r.measurements] for r in results],
            "errors": [[m.error for m in r.measurements if not m.ok] for r in results],
            "measured": timer.measured,
            "paired_calls": timer.paired_calls,
            "again": [a is r for a, r in zip(again, results, strict=True)],
            "again_measured": again_measured,
            "dense": _key(dense.winner),
            "writes": len(writes),
            "flaky": sorted(flaky),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, world: int, fail_on_rank1: bool = False) -> list[dict]:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init, str(tmp_path), fail_on_rank1), nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, list[dict]]]:
    """One spawned job per group size (the 3-rank job's rank 1 fails some tactics)."""
    out = {}
    for world in (2, 3):
        where = tmp_path_factory.mktemp(f"world{world}")
        out[world] = where, _run(where, world, fail_on_rank1=world == 3)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_the_shortlist_and_agree(runs, world):
    tmp_path, reports = runs[world]
    first = reports[0]
    assert all(r["picks"] == first["picks"] for r in reports)  # the same winners everywhere
    assert all(r["tables"] == first["tables"] for r in reports)  # the same gathered table
    assert all(p[0].startswith("fd-b") and not p[1] for p in first["picks"])
    assert all(r["dense"] == first["dense"] for r in reports)  # autotuning(group=) agrees
    # each rank measured exactly its round-robin share of each bucket's shortlist
    for rank, rep in enumerate(reports):
        expected = [k for sl in first["shortlist"] for k in sl[rank::world]]
        assert rep["measured"][: len(expected)] == expected
    for sl in first["shortlist"]:
        assert len(sl) >= 2 * world  # every rank had a share
    # the paired check ran on rank 0 only; only rank 0 wrote the shared cache file
    assert reports[0]["paired_calls"] >= len(SHAPES)
    assert all(r["paired_calls"] == 0 for r in reports[1:])
    assert reports[0]["writes"] >= 1 and all(r["writes"] == 0 for r in reports[1:])
    entries = json.loads((tmp_path / "shared.json").read_text())["entries"]
    assert {e["operation"] for e in entries} == {"w4a4", "w4a16"}
    # tuning the same shapes again: every rank hits without measuring
    assert all(r["again"] == [True] * len(SHAPES) and r["again_measured"] == 0 for r in reports)


def test_a_rank_whose_measurement_fails_still_agrees(runs):
    _, reports = runs[3]
    assert reports[1]["flaky"] and not reports[0]["flaky"]  # rank 1 failed some of its own share
    assert all(r["picks"] == reports[0]["picks"] for r in reports)
    errors = reports[0]["errors"][0]
    assert any("illegal address" in e for e in errors)  # rank 0 sees rank 1's failures


def test_not_distributed_without_a_group():
    assert fleet_of(None) is None
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            Fleet(dist.group.WORLD)


def test_merge_shares_checks_the_split():
    assert merge_shares([[(0, "a"), (2, "c")], [(1, "b")]], 3) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="no rank measured"):
        merge_shares([[(0, "a")], []], 2)
    with pytest.raises(ValueError, match="twice"):
        merge_shares([[(0, "a")], [(0, "a")]], 1)


def test_disagreement_is_an_error():
    class Two(Fleet):
        def __init__(self, values):
            self.values, self.rank, self.size, self.root = values, 0, len(values), 0

        def gather(self, obj):
            return self.values

    Two([1, 1]).agree("x", 1)
    with pytest.raises(RanksDisagree, match="rank 1: 2"):
        Two([1, 2]).agree("the tuned picks", 1)
