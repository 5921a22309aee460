"""Tuning: measurement, deterministic winners, failures, re-validated cache, autotuning.

Runs on CPU. Synthetic backends (their kernels are the torch reference, so `gemm` stays
correct) and fake timers with seeded jitter make the measurements deterministic.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import time
from typing import Literal

import pytest
import torch

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Backend, Dispatcher, Problem, Support, Tactic, reference_gemm
from fp4_dispatch.autotune.tuning import (
    NOISE_CAP,
    NOISE_FLOOR,
    Measurement,
    Timing,
    Tuner,
    WallClockTimer,
    make_inputs,
    n_copies,
    noise_band,
    pick_winner,
    race_list,
)
from fp4_dispatch.contracts.buckets import m_bucket
from fp4_dispatch.store.cache import TuningCache


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Never touch the user's cache."""
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "tuning.json"))


# ---- synthetic backends -----------------------------------------------------------------


class FakeATactic(Tactic):
    backend: Literal["fake-a"] = "fake-a"
    tile_m: Literal[64, 128] = 128
    tile_n: Literal[32, 64, 128, 256] = 128


class FakeBTactic(Tactic):
    backend: Literal["fake-b"] = "fake-b"
    tile_m: Literal[64, 128] = 128
    tile_n: Literal[32, 64, 128, 256] = 128


def _reference_kernel(operands, out):
    from fp4_dispatch.backends.reference import gemm

    gemm(operands, out, compute_dtype="float32", k_chunk=0)


class FakeBackend(Backend):
    """Tiles (64|128) x (32..256) with tile_n <= N; ``fail`` maps (tm, tn) -> stage."""

    family = "fa"
    version = "1"
    tactic_type = FakeATactic
    diversity_axes = ("tile_n",)

    def __init__(self, fail: dict[tuple[int, int], str] | None = None) -> None:
        self.fail = fail or {}

    def supports(self, device) -> Support:
        return Support(True, "synthetic")

    def tactics(self, problem: Problem, device):
        for tm in (64, 128):
            for tn in (32, 64, 128, 256):
                if tn <= problem.n:
                    yield self.tactic_type(tile_m=tm, tile_n=tn)

    def estimate_us(self, problem, device, tactic) -> float:
        # deterministic, distinct: bigger tiles "look" faster to the model
        return 100.0 - tactic.tile_n / 10 - tactic.tile_m / 100 + (self.name == "fake-b")

    def build(self, tactic, problem, device):
        stage = self.fail.get((tactic.tile_m, tactic.tile_n))
        if stage == "build":
            raise RuntimeError(f"cannot compile {tactic.tile_m}x{tactic.tile_n}")
        if stage == "run":

            def broken(operands, out):
                raise RuntimeError("illegal instruction (synthetic)")

            return broken
        return _reference_kernel


class FakeA(FakeBackend):
    name = "fake-a"


class FakeB(FakeBackend):
    name = "fake-b"
    family = "fb"
    tactic_type = FakeBTactic


def make_registry(*backends: Backend) -> registry_mod.Registry:
    reg = registry_mod.Registry()
    report = registry_mod.PluginReport("fake", "tests", "tests", "0", builtin=False)
    for b in backends:
        reg.backends[b.name] = b
        reg.plugin_of[b.name] = report
        report.backends.append(b.name)
    reg.plugins.append(report)
    return reg


@pytest.fixture
def make_dispatcher(monkeypatch, tmp_path):
    """``make_dispatcher(*backends, cache=path)``: a CPU Dispatcher over synthetic backends."""

    def make(*backends: Backend, cache=None, budget: int = 32) -> Dispatcher:
        backends = backends or (FakeA(), FakeB())
        monkeypatch.setattr(registry_mod, "load", lambda strict=None: make_registry(*backends))
        return Dispatcher(device="cpu", budget=budget, cache=cache or tmp_path / "tuning.json")

    return make


class FakeTimer:
    """True times by (backend, tile_m, tile_n), with seeded multiplicative jitter."""

    def __init__(self, times: dict[tuple[str, int, int], float], jitter: float = 0.0, seed=0):
        self.times = times
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.calls: list[tuple[str, int, int]] = []
        self.pair_calls: list[tuple] = []

    def __call__(self, cand, launch, best_us) -> Timing:
        key = (cand.backend, cand.tactic.tile_m, cand.tactic.tile_n)
        self.calls.append(key)
        true = self.times.get(key, 1000.0)
        samples = tuple(true * (1 + self.rng.uniform(-self.jitter, self.jitter)) for _ in range(3))
        return Timing(samples, "fake")

    def paired(self, cands, launches, pairs):
        """The never-loses check's pairs (recorded apart from `calls`)."""
        keys = [(c.backend, c.tactic.tile_m, c.tactic.tile_n) for c in cands]
        self.pair_calls.append(tuple(keys))
        return [tuple(self.times.get(key, 1000.0) * (1 + self.rng.uniform(-self.jitter,
                self.jitter)) for key in keys) for _ in range(pairs)]  # fmt: skip


M, N, K = 100, 256, 128  # bucket M=128: 8 tactics per backend, 16 in all


# ---- the winner -------------------------------------------------------------------------


def test_clear_winner_is_found(make_dispatcher):
    d = make_dispatcher()
    timer = FakeTimer({("fake-b", 64, 32): 50.0}, jitter=0.005)
    (r,) = d.tune([(M, N, K)], timer=timer, progress=False)
    assert r.source == "measured" and r.problem.m == 128
    assert (r.winner.backend, r.winner.tactic.tile_m, r.winner.tactic.tile_n) == ("fake-b", 64, 32)
    assert len(r.measurements) == 16 and len(timer.calls) == 16  # both families measured
    assert r.winner_us == pytest.approx(50.0, rel=0.01)
    assert r.runner_up_us == pytest.approx(1000.0, rel=0.01)
    # the heuristic pick (best estimate: fake-a 128x256) took 1000 us: regret ~ +1900%
    assert (r.heuristic.backend, r.heuristic.tactic.tile_n) == ("fake-a", 256)
    assert r.regret == pytest.approx(19.0, rel=0.02)
    assert d.select(M, N, K) == r.winner
    assert d.select(M, N, K).reason.startswith("tuned")


@pytest.mark.parametrize("seed", range(20))
def test_near_ties_resolve_by_content_not_noise(make_dispatcher, seed):
    """Two tactics 0.5% apart, jitter +-0.8%: every 'process' (seed) picks the same one.

    fake-b 64x32 is truly the fastest by 0.5%, but both are inside the noise band, so the
    tie order (est_us, backend, tactic JSON) decides: fake-a 128x128 has the lower estimate.
    """
    d = make_dispatcher()
    times = {("fake-a", 128, 128): 60.3, ("fake-b", 64, 32): 60.0}
    (r,) = d.tune([(M, N, K)], timer=FakeTimer(times, jitter=0.008, seed=seed), progress=False)
    assert NOISE_FLOOR <= r.noise_band <= NOISE_CAP
    assert (r.winner.backend, r.winner.tactic.tile_m, r.winner.tactic.tile_n) == (
        "fake-a",
        128,
        128,
    )


def test_pick_winner_rules():
    from fp4_dispatch.policy.ranking import Candidate

    def meas(est, name, tn, us, method="fake"):
        c = Candidate(name, "f", FakeATactic(tile_n=tn) if name == "fake-a" else FakeBTactic(
            tile_n=tn), est, "score")  # fmt: skip
        return Measurement(c, us, method, (us, us))

    a = meas(10.0, "fake-a", 128, 103.0)  # best estimate, 3% slower than the best
    b = meas(12.0, "fake-b", 64, 100.0)
    c = meas(11.0, "fake-b", 32, math.inf, "failed")
    assert pick_winner([a, b, c], band=0.02)[0] is b  # 3% is outside a 2% band
    winner, runner = pick_winner([b, c, a], band=0.05)
    assert winner is a and runner is b  # inside 5%: the tie order wins, order-independent
    assert pick_winner([c], band=0.02) == (None, None)


def test_noise_band_is_measured_and_clamped():
    from fp4_dispatch.policy.ranking import Candidate

    c = Candidate("fake-a", "f", FakeATactic(), 1.0, "score")
    quiet = [Measurement(c, 100.0, "fake", (99.9, 100.0, 100.1))] * 3
    assert noise_band(quiet) == NOISE_FLOOR
    mid = [Measurement(c, 100.0, "fake", (97.0, 100.0, 103.0))] * 3
    assert noise_band(mid) == pytest.approx(0.06)
    loud = [Measurement(c, 100.0, "fake", (50.0, 100.0, 150.0))] * 3
    assert noise_band(loud) == NOISE_CAP
    assert noise_band([Measurement(c, 100.0, "pruned", (100.0,))]) == NOISE_FLOOR


# ---- failures -----------------------------------------------------------------------------


def test_failures_are_reported_and_do_not_stop_tuning(make_dispatcher, caplog):
    fail = {(128, 256): "build", (128, 128): "run"}
    d = make_dispatcher(FakeA(fail), FakeB())
    timer = FakeTimer({("fake-a", 64, 64): 40.0, ("fake-b", 64, 64): 45.0})
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.autotune.tuning"):
        (r,) = d.tune([(M, N, K)], timer=timer, progress=False)
    errors = {(m.candidate.tactic.tile_m, m.candidate.tactic.tile_n): m.error for m in r.failures}
    assert errors == {
        (128, 256): "build: RuntimeError: cannot compile 128x256",
        (128, 128): "run: RuntimeError: illegal instruction (synthetic)",
    }
    assert all(math.isinf(m.us) for m in r.failures)
    assert len(r.measurements) == 16  # everything after the failures was still measured
    assert (r.winner.backend, r.winner.tactic.tile_n) == ("fake-a", 64)
    assert "cannot compile" in caplog.text and "illegal instruction" in caplog.text
    # the heuristic pick (fake-a 128x256) failed to build: its time is infinite
    assert math.isinf(r.heuristic_us)


def test_everything_failing_keeps_the_heuristic(make_dispatcher, tmp_path):
    every = {(tm, tn): "build" for tm in (64, 128) for tn in (32, 64, 128, 256)}
    d = make_dispatcher(FakeA(every), cache=tmp_path / "c.json")
    (r,) = d.tune([(M, N, K)], timer=FakeTimer({}), progress=False)
    assert r.winner is None and len(r.failures) == 8
    assert d.select(M, N, K).reason == "heuristic top-1"
    assert TuningCache(tmp_path / "c.json").entries() == []  # nothing cached


def test_timer_returning_nonsense_counts_as_failure(make_dispatcher):
    d = make_dispatcher(FakeA())
    (r,) = d.tune(
        [(M, N, K)], timer=lambda c, launch, best: Timing((float("nan"),), "fake"), progress=False
    )
    assert r.winner is None and all("timer returned" in m.error for m in r.failures)


# ---- the cache, re-validated --------------------------------------------------------------


def test_winner_persists_across_dispatchers(make_dispatcher, tmp_path):
    path = tmp_path / "shared.json"
    timer = FakeTimer({("fake-b", 128, 64): 30.0})
    (r,) = make_dispatcher(cache=path).tune([(M, N, K)], timer=timer, progress=False)
    assert len(TuningCache(path).entries()) == 1

    d2 = make_dispatcher(cache=path)
    pick = d2.select(M, N, K)
    assert (pick.backend, pick.tactic) == (r.winner.backend, r.winner.tactic)
    assert pick.reason.startswith("tuned")
    again = FakeTimer({})
    (r2,) = d2.tune([(M + 1, N, K)], timer=again, progress=False)  # same bucket: cached
    assert r2.source == "cache" and again.calls == []
    assert r2.heuristic_us == pytest.approx(r.heuristic_us)
    (r3,) = d2.tune([(M, N, K)], timer=again, force=True, progress=False)
    assert r3.source == "measured" and len(again.calls) == 16


def _tune_and_edit(make_dispatcher, tmp_path, edit) -> Dispatcher:
    """Tune one bucket into a cache file, edit its entry, return a fresh dispatcher."""
    path = tmp_path / "edit.json"
    make_dispatcher(cache=path).tune(
        [(M, N, K)], timer=FakeTimer({("fake-b", 128, 256): 30.0}), progress=False
    )
    raw = json.loads(path.read_text())
    edit(raw["entries"][0])
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda e: e.update(backend="gone", tactic={**e["tactic"], "backend": "gone"}),
         "not installed"),
        (lambda e: e.update(backend_version="0.9"), "version '0.9'"),
        (lambda e: e["tactic"].update(prefetch=2), "no longer parses"),
        (lambda e: e["tactic"].update(tile_n=48), "no longer parses"),
        (lambda e: e["tactic"].update(backend="fake-a"), "no longer parses"),
        (lambda e: e.update(n=200), "no longer valid"),  # tile_n=256 > N=200
    ],
    ids=["backend-gone", "version", "unknown-field", "bad-value", "wrong-backend", "shape"],
)  # fmt: skip
def test_stale_entries_are_ignored_with_a_warning(make_dispatcher, tmp_path, caplog, edit, why):
    path = _tune_and_edit(make_dispatcher, tmp_path, edit)
    d = make_dispatcher(cache=path)
    entry = TuningCache(path).entries()[0]
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.engine.runner"):
        pick = d.select(M, entry["n"], K)
    assert pick.reason == "heuristic top-1"
    assert "ignoring stale entry" in caplog.text and why in caplog.text


def test_backend_unavailable_on_this_device_is_stale(make_dispatcher, tmp_path, caplog):
    path = _tune_and_edit(make_dispatcher, tmp_path, lambda e: None)

    class Unavailable(FakeB):
        def supports(self, device):
            return Support(False, "not here")

    d = make_dispatcher(FakeA(), Unavailable(), cache=path)
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.engine.runner"):
        assert d.select(M, N, K).backend == "fake-a"
    assert "not available" in caplog.text


def test_tuned_pick_checked_at_the_exact_m(make_dispatcher, tmp_path):
    """A winner valid for the bucket but not for a smaller exact M falls back."""

    class SwapRule(FakeA):
        def validate(self, tactic, problem, device):
            return "needs M >= 100" if problem.m < 100 else None

    d = make_dispatcher(SwapRule(), cache=tmp_path / "x.json")
    d.tune([(128, N, K)], timer=FakeTimer({("fake-a", 64, 32): 5.0}), progress=False)
    assert d.select(120, N, K).reason.startswith("tuned")
    assert d.select(70, N, K).reason == "heuristic top-1"


def test_corrupt_cache_does_not_break_the_dispatcher(make_dispatcher, tmp_path, caplog):
    path = tmp_path / "bad.json"
    path.write_text("{ truncated")
    d = make_dispatcher(cache=path)
    with caplog.at_level(logging.WARNING):
        assert d.select(M, N, K).reason == "heuristic top-1"
    assert "moved it aside" in caplog.text


def test_untuned_bucket_logged_once(make_dispatcher, caplog):
    d = make_dispatcher()
    with caplog.at_level(logging.INFO, logger="fp4_dispatch.engine.runner"):
        for m in (65, 100, 128, 100):
            d.select(m, N, K)
    assert caplog.text.count("is not tuned") == 1


# ---- gemm and autotuning ------------------------------------------------------------------


def test_autotuning_tunes_each_new_bucket_once(make_dispatcher, operands, monkeypatch):
    d = make_dispatcher()
    timer = FakeTimer({("fake-b", 64, 128): 20.0})
    monkeypatch.setattr(d, "tune", functools.partial(d.tune, timer=timer, progress=False))
    qa, qb = operands(M, N, K)
    d.gemm(qa, qb)
    assert timer.calls == []  # outside autotuning(): never tunes on the hot path
    with d.autotuning():
        out = d.gemm(qa, qb)
        assert len(timer.calls) == 16
        qa2, _ = operands(90, N, K)
        d.gemm(qa2, qb)  # same bucket: no second tuning
        assert len(timer.calls) == 16
    assert d.select(M, N, K).tactic == FakeBTactic(tile_m=64, tile_n=128)
    ref = reference_gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    assert len(TuningCache().entries()) == 1  # saved to $FP4_DISPATCH_CACHE


def test_autotuning_remeasures_a_winner_of_the_other_policy(make_dispatcher, operands,
                                                             monkeypatch):  # fmt: skip
    """A bucket tuned eagerly is measured again under ``autotuning(measure="graph")``
    (as `tune` does): a winner is used only under the policy it was measured with."""
    from fp4_dispatch.autotune import tuning

    monkeypatch.setattr(tuning, "policy_of", lambda device, measure: measure)  # as on CUDA
    d = make_dispatcher()
    timer = FakeTimer({("fake-b", 64, 128): 20.0})
    monkeypatch.setattr(d, "tune", functools.partial(d.tune, timer=timer, progress=False))
    qa, qb = operands(M, N, K)
    d.tune([(M, N, K)], measure="eager")
    first = len(timer.calls)
    with d.autotuning(measure="eager"):
        d.gemm(qa, qb)  # same policy: the winner is a hit
    assert len(timer.calls) == first
    with d.autotuning(measure="graph"):
        d.gemm(qa, qb)
    assert len(timer.calls) > first
    bkey = (N, K, m_bucket(M), "bfloat16", "w4a4")
    assert d.winners.cached_result(bkey, (M, N, K), "graph") is not None


def test_autotuning_never_tunes_during_graph_capture(
    make_dispatcher, operands, monkeypatch, caplog
):
    d = make_dispatcher()
    timer = FakeTimer({})
    monkeypatch.setattr(d, "tune", functools.partial(d.tune, timer=timer, progress=False))
    monkeypatch.setattr(d, "_capturing", lambda: True)
    qa, qb = operands(M, N, K)
    with d.autotuning(), caplog.at_level(logging.WARNING, logger="fp4_dispatch.engine.runner"):
        d.gemm(qa, qb)
        d.gemm(qa, qb)
    assert timer.calls == []
    assert caplog.text.count("inside CUDA-graph capture") == 1
    monkeypatch.setattr(d, "_capturing", lambda: False)
    with d.autotuning():
        d.gemm(qa, qb)  # outside capture: tuned now
    assert len(timer.calls) == 16


def test_tune_rejects_bad_shapes(make_dispatcher):
    d = make_dispatcher()
    with pytest.raises(ValueError, match="positive int"):
        d.tune([(0, 64, 64)])
    with pytest.raises(ValueError, match=r"\(M, N, K\)"):
        d.tune([(1, 2)])
    with pytest.raises(ValueError, match="out_dtype"):
        d.tune([(1, 64, 64)], out_dtype="float32")


def test_simulated_device_cannot_tune():
    with pytest.raises(RuntimeError, match="simulated"):
        Dispatcher(device="sm90", cache=False).tune([(1, 64, 64)])


# ---- real measurement on the CPU ----------------------------------------------------------


def test_wall_clock_tuning_with_the_reference_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")  # built-ins only
    d = Dispatcher(device="cpu", cache=tmp_path / "w.json")
    (r,) = d.tune([(16, 64, 128)], progress=False)
    assert r.winner is not None and r.winner.backend == "torch-reference"
    ok = [m for m in r.measurements if m.ok]
    assert ok and all(m.method in ("wall-clock", "pruned") for m in ok)
    assert all(m.us > 0 for m in ok)
    assert d.select(16, 64, 128).reason.startswith("tuned")


def test_inputs_rotate_and_are_nonzero():
    from fp4_dispatch.contracts.device import CPU

    p = Problem(m=200, n=96, k=64)
    inp = make_inputs(p, CPU.model_copy(update={"l2_bytes": 100_000}))
    assert len(inp.copies) == n_copies(inp.bytes_per_copy, 100_000) > 2
    first, second = inp.copies[0], inp.copies[1]
    assert first.a_data.shape == (200, 32) and first.b_data.shape == (96, 32)
    assert first.a_scale.shape == (256, 4)
    assert torch.equal(first.a_data, second.a_data)
    assert first.a_data.data_ptr() != second.a_data.data_ptr()
    assert first.a_data.count_nonzero() > first.a_data.numel() // 2
    assert inp.out.shape == (200, 96) and inp.out.dtype == torch.bfloat16


def test_tall_operands_repeat_whole_scale_blocks():
    """Rows beyond the quantized base repeat it; the scale swizzle must still decode."""
    from fp4_dispatch.contracts.device import CPU
    from fp4_dispatch.format.nvfp4 import unswizzle_scales

    inp = make_inputs(Problem(m=1300, n=16, k=64), CPU)
    a = inp.copies[0]
    lin = unswizzle_scales(a.a_scale, 1300, 64).float()
    assert torch.equal(lin[1024:1300], lin[:276]) and torch.equal(a.a_data[1024:], a.a_data[:276])


def test_wall_clock_timer_prunes_slow_tactics():
    from fp4_dispatch.policy.ranking import Candidate

    calls = []
    timer = WallClockTimer(replays=2, target_replay_us=10.0)
    c = Candidate("fake-a", "f", FakeATactic(), 1.0, "score")
    t = timer(c, calls.append, best_us=1e-3)  # anything is > 1.5x a nanosecond
    assert t.method == "pruned" and len(calls) == 1
    t = timer(c, calls.append, best_us=math.inf)
    assert t.method == "wall-clock" and len(t.samples_us) == 2 and len(calls) > 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timer_on_the_reference_backend(tmp_path):  # pragma: no cover - GPU only
    d = Dispatcher(cache=tmp_path / "g.json")
    tuner = Tuner(d)
    (r,) = d.tune([(128, 1024, 1024)], progress=False)
    assert r.winner is not None
    assert {m.method for m in r.measurements if m.ok} <= {"cuda-graph", "cuda-eager", "pruned"}
    assert tuner.timer.__class__.__name__ == "CudaTimer"


class _FakeEvent:
    """Stands in for torch.cuda.Event on a CPU: stamps from `now` (wall clock unless a
    test sets a fake one)."""

    now = staticmethod(time.perf_counter)

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = self.now()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("capture_fails", [False, True])
def test_cuda_timer_control_flow(monkeypatch, capture_fails):
    """Probe, prune, the harness's graph clock (or the eager fallback): fake CUDA API."""
    from fp4_dispatch.autotune import harness
    from fp4_dispatch.autotune.tuning import CudaTimer
    from fp4_dispatch.policy.ranking import Candidate

    graphs: list[int] = []  # ``calls`` of each gpu_clock asked for

    def fake_gpu_clock(fn, calls=20, cold_l2=True, device=None):
        assert cold_l2  # the tuner's graph policy is the benchmarks' cold-L2 clock
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        graphs.append(calls)
        return lambda: 7.0

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(harness, "gpu_clock", fake_gpu_clock)
    c = Candidate("fake-a", "f", FakeATactic(), 1.0, "score")
    copies: list[int] = []
    clock_s = [0.0]  # the events' clock: each launch takes 200 us of it, whatever the load
    monkeypatch.setattr(_FakeEvent, "now", staticmethod(lambda: clock_s[0]))

    def launch(i: int) -> None:
        copies.append(i)
        clock_s[0] += 2e-4
        time.sleep(2e-4)  # what the eager fallback's host clock sees

    # 10 ms per sample / 200 us per launch (the events' clock): 50 calls, and both clocks
    # cap them at 20. With the probe on wall time a loaded 2-core CI machine once
    # measured repeat = 1
    timer = CudaTimer(replays=3, target_replay_us=10_000.0)
    assert timer(c, launch, best_us=1.0).method == "pruned"  # 200 us probe > 1.5 us
    assert copies == [1]

    copies.clear()
    t = timer(c, launch, best_us=math.inf)
    assert len(t.samples_us) == 3
    if capture_fails:  # probe, one warm-up, then 3 eager samples of `repeat` launches
        repeat = (len(copies) - 2) // 3
        assert t.method == "cuda-eager" and "capturing" in t.note
        assert copies == [1, *range(1 + 3 * repeat)]  # eager launches rotate the copies
        assert all(s > 100 for s in t.samples_us)  # host wall time of ~200 us launches
    else:
        (repeat,) = graphs
        assert t.method == "cuda-graph" and t.samples_us == (7.0, 7.0, 7.0)
        assert copies == [1]  # everything else ran inside the (fake) graph clock
    assert repeat == 20  # `CudaTimer.graph_calls`, the eager fallback too

    eager = CudaTimer(measure="eager", replays=3, target_replay_us=2000.0)
    copies.clear()
    t = eager(c, launch, best_us=math.inf)
    assert t.method == "cuda-eager" and t.note == "" and len(t.samples_us) == 3
    with pytest.raises(ValueError, match="measure"):
        CudaTimer(measure="lazy")


def test_paired_samples_alternate_and_flip_order(monkeypatch):
    """The check's samples alternate winner and default, flipping the order each pair."""
    from fp4_dispatch.autotune.tuning import WallClockTimer, alternate, paired_samples
    from fp4_dispatch.policy.ranking import Candidate

    order: list[str] = []
    pairs = alternate(lambda: order.append("a") or 1.0, lambda: order.append("b") or 2.0, 4)
    assert pairs == [(1.0, 2.0)] * 4 and "".join(order) == "abbaabba"

    a = Candidate("fake-a", "f", FakeATactic(), 1.0, "score")
    b = Candidate("fake-b", "f", FakeBTactic(), 2.0, "score")
    seen: list[str] = []

    def plain(cand, launch, best):  # no `paired` method: the timer itself is alternated
        seen.append(cand.backend)
        return Timing((10.0 if cand is a else 20.0,), "fake")

    got = paired_samples(plain, (a, b), (lambda i: None, lambda i: None), 5)
    assert got == [(10.0, 20.0)] * 5 and len(seen) == 10
    ran: list[str] = []
    wall = WallClockTimer(target_replay_us=10.0)
    got = paired_samples(wall, (a, b), (lambda i: ran.append("a"), lambda i: ran.append("b")), 5)
    assert len(got) == 5 and all(x > 0 and y > 0 for x, y in got)
    assert ran.count("a") == ran.count("b")  # same number of launches for both


def test_harness_eager_samples_and_clock():
    """`eager_wall_us` keeps its signature; the samples form gives one value per block."""
    from fp4_dispatch.autotune import harness

    calls: list[int] = []
    samples = harness.eager_wall_samples(lambda: calls.append(1), calls=7, warmup=2, replays=3)
    assert len(samples) == 3 and len(calls) == 2 + 3 * 7 and all(s >= 0 for s in samples)
    calls.clear()
    assert harness.eager_wall_us(lambda: calls.append(1), calls=5, warmup=1) >= 0
    assert len(calls) == 6


# ---- CLI ----------------------------------------------------------------------------------


def test_cli_tune_table_and_json(capsys, monkeypatch, tmp_path):
    from fp4_dispatch.cli import main

    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")  # built-ins only: the reference on CPU
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "cli.json"))
    args = ["tune", "--shapes", "16,64,256", "9,64,256", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "M<=16" in text and "torch-reference" in text and "regret" in text
    assert text.count("M<=16") == 1  # both shapes are in one bucket: tuned once
    assert len(TuningCache(tmp_path / "cli.json").entries()) == 1

    assert main([*args, "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["source"] == "cache"  # second run: the cached winner is reused
    assert main([*args, "--json", "--force", "--budget", "2"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["source"] == "measured" and r["winner"]["backend"] == "torch-reference"
    assert r["winner_us"] > 0 and r["measured"] >= 1


def test_cli_tune_rejects_bad_shapes_and_simulated_devices(capsys, monkeypatch):
    from fp4_dispatch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["tune", "--shapes", "16,64", "--device", "cpu"])
    assert exc.value.code == 2 and "M,N,K" in capsys.readouterr().err
    assert main(["tune", "--shapes", "16,64,128", "--device", "sm100"]) == 2
    assert "simulated" in capsys.readouterr().err


def test_measure_stops_at_the_deadline(make_dispatcher):
    d = make_dispatcher(FakeA())
    p = Problem(m=128, n=N, k=K)
    cands = d.candidates(128, N, K).candidates
    timer = FakeTimer({})
    got = Tuner(d, timer=timer).measure(p, cands, deadline=time.monotonic() - 1)
    assert [m.method for m in got] == ["skipped"] * len(cands) and timer.calls == []
    assert all(math.isinf(m.us) and "deadline" in m.error for m in got)


# ---- results are checked before they are trusted -----------------------------------------


def _zeros(operands, out):
    out.zero_()


def _nans(operands, out):
    out.fill_(float("nan"))


def _unwritten(operands, out):
    """Returns without writing: the NaN the tuner poisoned ``out`` with stays."""


def _ignores_strides(operands, out):
    """Computes the right numbers but writes them as if ``out`` were contiguous."""
    res = torch.empty(out.shape, dtype=out.dtype)
    _reference_kernel(operands, res)
    torch.as_strided(out, res.shape, (res.shape[1], 1)).copy_(res)


def _misses_tail(operands, out):
    """Skips the last partial 64-column tile (as a kernel with a bad grid would)."""
    res = torch.empty(out.shape, dtype=out.dtype)
    _reference_kernel(operands, res)
    full = out.shape[1] // 64 * 64
    out[:, :full].copy_(res[:, :full])


class Sloppy(FakeB):
    """fake-b whose 64x32 kernel (swapped when ``swap``) is wrong in one way: ``bad``."""

    def __init__(self, bad, swap: bool = False) -> None:
        super().__init__()
        self.bad, self.swap = bad, swap

    def tactics(self, problem, device):
        for t in super().tactics(problem, device):
            yield t.model_copy(update={"swap_ab": self.swap and (t.tile_m, t.tile_n) == (64, 32)})

    def build(self, tactic, problem, device):
        if (tactic.tile_m, tactic.tile_n) == (64, 32) and self.bad is not None:
            return self.bad
        return _reference_kernel


@pytest.mark.parametrize(
    ("bad", "swap", "n", "why"),
    [
        (_zeros, False, N, "relative error 1"),
        (_nans, False, N, "NaN/inf"),
        (_unwritten, False, N, "NaN/inf"),
        (_ignores_strides, True, N, "relative error"),
        (_misses_tail, False, 200, "NaN/inf"),
    ],
    ids=["zeros", "nan", "unwritten", "swap-ignores-strides", "misses-tail-tile"],
)
def test_a_fast_wrong_kernel_is_never_adopted(make_dispatcher, operands, tmp_path, bad, swap, n,
                                              why, caplog):  # fmt: skip
    path = tmp_path / "wrong.json"
    d = make_dispatcher(FakeA(), Sloppy(bad, swap), cache=path)
    times = {("fake-b", 64, 32): 1.0, ("fake-a", 64, 64): 40.0}  # the wrong one is fastest
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.autotune.tuning"):
        (r,) = d.tune([(M, n, K)], timer=FakeTimer(times), progress=False)
    wrong = [m for m in r.measurements if m.method == "wrong"]
    assert len(wrong) == 1 and wrong[0].candidate.tactic.tile_n == 32
    assert wrong[0].error.startswith("wrong result") and why in wrong[0].error
    assert math.isinf(wrong[0].us) and wrong[0] in r.failures
    assert (r.winner.backend, r.winner.tactic.tile_m, r.winner.tactic.tile_n) == ("fake-a", 64, 64)
    assert "gives a wrong result, never adopted" in caplog.text
    (saved,) = TuningCache(path).entries()
    assert saved["backend"] == "fake-a"
    qa, qb = operands(M, n, K)
    ref = reference_gemm(qa, qb)
    assert float((d.gemm(qa, qb).double() - ref).norm() / ref.norm()) < 5e-3


def test_a_correct_swapped_kernel_passes_the_check(make_dispatcher):
    d = make_dispatcher(FakeA(), Sloppy(None, swap=True))
    (r,) = d.tune([(M, N, K)], timer=FakeTimer({("fake-b", 64, 32): 1.0}), progress=False)
    assert not [m for m in r.measurements if m.method == "wrong"]
    assert r.winner.tactic.swap_ab and r.winner.tactic.tile_n == 32


def test_sampled_check_sees_the_tail_and_zeros(monkeypatch):
    import fp4_dispatch.autotune.harness as harness
    import fp4_dispatch.autotune.tuning as tuning
    from fp4_dispatch.loading.profiles import resolve

    # the check lives in the harness (the tuner imports it from there)
    monkeypatch.setattr(harness, "CHECK_FULL_MACS", 0)  # force sampling on a small problem
    monkeypatch.setattr(harness, "CHECK_HEAD", 8)
    monkeypatch.setattr(harness, "CHECK_TAIL", 16)
    monkeypatch.setattr(harness, "CHECK_INTERIOR", 8)
    inputs = make_inputs(Problem(m=256, n=192, k=64), resolve("cpu", None), copies=1)
    rows, cols = tuning.check_indices(256, 192, 64, torch.device("cpu"))
    assert len(rows) == 32 and len(cols) == 32
    assert rows[:8].tolist() == list(range(8)) and rows[-16:].tolist() == list(range(240, 256))
    good = torch.empty(256, 192, dtype=torch.bfloat16)
    _reference_kernel(inputs.copies[0], good)
    assert tuning.check_output(good, inputs) is None
    tail = good.clone()
    tail[-5:] = float("nan")  # a missed last row tile, left at the poison value
    assert "NaN/inf" in tuning.check_output(tail, inputs)
    assert "relative error 1" in tuning.check_output(torch.zeros_like(good), inputs)


def _tune_then_break(make_dispatcher, tmp_path):
    """A cache whose fake-b 64x32 winner was right when tuned."""
    path = tmp_path / "v.json"
    make_dispatcher(FakeA(), Sloppy(None), cache=path).tune(
        [(M, N, K)], timer=FakeTimer({("fake-b", 64, 32): 1.0}), progress=False
    )
    assert TuningCache(path).entries()[0]["tactic"]["tile_n"] == 32
    return path


def test_a_wrong_cached_winner_is_ignored_once(make_dispatcher, tmp_path, caplog, operands):
    path = _tune_then_break(make_dispatcher, tmp_path)
    d = make_dispatcher(FakeA(), Sloppy(_zeros), cache=path)  # same version, now broken
    with caplog.at_level(logging.WARNING):
        assert d.select(M, N, K).reason == "heuristic top-1"
        assert d.select(M + 1, N, K).reason == "heuristic top-1"
    assert caplog.text.count("gives a wrong result") == 1 and str(path) in caplog.text
    qa, qb = operands(M, N, K)
    ref = reference_gemm(qa, qb)
    assert float((d.gemm(qa, qb).double() - ref).norm() / ref.norm()) < 5e-3


def test_a_wrong_cached_winner_is_retuned_under_autotuning(make_dispatcher, tmp_path, operands,
                                                          monkeypatch):  # fmt: skip
    path = _tune_then_break(make_dispatcher, tmp_path)
    d = make_dispatcher(FakeA(), Sloppy(_zeros), cache=path)
    timer = FakeTimer({("fake-b", 64, 32): 1.0, ("fake-a", 128, 32): 9.0})
    monkeypatch.setattr(d, "tune", functools.partial(d.tune, timer=timer, progress=False))
    qa, qb = operands(M, N, K)
    with d.autotuning():
        out = d.gemm(qa, qb)
    assert len(timer.calls) == 15  # re-tuned; the wrong 64x32 failed its check, not timed
    assert d.select(M, N, K).tactic == FakeATactic(tile_m=128, tile_n=32)
    ref = reference_gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    assert TuningCache(path).entries()[0]["backend"] == "fake-a"


@pytest.mark.parametrize("how", ["argument", "env"])
def test_cache_verification_opt_out(make_dispatcher, tmp_path, monkeypatch, how):
    path = _tune_then_break(make_dispatcher, tmp_path)
    backends = (FakeA(), Sloppy(_zeros))
    monkeypatch.setattr(registry_mod, "load", lambda strict=None: make_registry(*backends))
    if how == "env":
        monkeypatch.setenv("FP4_DISPATCH_VERIFY_CACHE", "0")
        d = Dispatcher(device="cpu", cache=path)
    else:
        d = Dispatcher(device="cpu", cache=path, verify_cache=False)
    assert d.select(M, N, K).reason.startswith("tuned")  # trusted without a check


# ---- environment metadata -----------------------------------------------------------------


def test_entries_record_the_environment(make_dispatcher, tmp_path):
    import importlib.metadata

    path = tmp_path / "env.json"
    make_dispatcher(cache=path).tune([(M, N, K)], timer=FakeTimer({}), progress=False)
    env = TuningCache(path).entries()[0]["env"]
    assert env["torch"] == importlib.metadata.version("torch")
    assert env["triton"] == importlib.metadata.version("triton")
    assert env["fp4_dispatch"] == importlib.metadata.version("fp4-dispatch")
    assert set(env) >= {"cutlass_dsl", "cutlass_operators", "cuda_driver", "gpu", "sm_count"}
    assert env["cuda_driver"] is None  # a CPU device has no driver to record


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda e: e["env"].update(triton="0.0.1"), "triton '0.0.1' ->"),
        (lambda e: e["env"].update(cuda_driver="11.8"), "cuda_driver '11.8' -> None"),
        (lambda e: e["env"].update(sm_count=7), "sm_count 7 ->"),
        (lambda e: e.pop("env"), "no environment record"),
    ],
    ids=["triton", "driver", "sm-count", "old-entry"],
)
def test_an_entry_of_another_environment_is_stale(make_dispatcher, tmp_path, caplog, edit, why):
    path = _tune_and_edit(make_dispatcher, tmp_path, edit)
    d = make_dispatcher(cache=path)
    with caplog.at_level(logging.WARNING):
        assert d.select(M, N, K).reason == "heuristic top-1"
        d.select(M, N, K)
    assert caplog.text.count("ignoring stale entry") == 1 and why in caplog.text


# ---- caches that travel -------------------------------------------------------------------


def test_fleet_workflow_tune_export_import(make_dispatcher, tmp_path, monkeypatch, capsys):
    """Tune on one machine, export, import on another with a cache of its own."""
    from fp4_dispatch.cli import main

    tuned = tmp_path / "tuned.json"
    d = make_dispatcher(cache=tuned)
    d.tune([(M, N, K), (1, N, K)], timer=FakeTimer({("fake-b", 64, 32): 5.0}), progress=False)
    foreign = dict(TuningCache(tuned).entries()[0], device="Other GPU|10.0|148")
    stale = dict(TuningCache(tuned).entries()[0], m_bucket=512)
    stale["env"] = {**stale["env"], "triton": "0.0.1"}
    gone = dict(TuningCache(tuned).entries()[0], m_bucket=1024, backend="gone")
    TuningCache(tuned).put([foreign, stale, gone])

    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tuned))
    assert main(["cache", "export", str(tmp_path / "fleet.json"), "--device", "cpu"]) == 0
    assert "exported 4 entries" in capsys.readouterr().out  # not the other GPU's

    other = tmp_path / "other-machine.json"
    mine = dict(TuningCache(tuned).entries()[0], n=512, us=1.5)  # a bucket only it has
    TuningCache(other).put([mine])
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(other))
    assert main(["cache", "import", str(tmp_path / "fleet.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["taken"]) == 2 and len(report["skipped"]) == 2
    why = " ".join(s["reason"] for s in report["skipped"])
    assert "another environment" in why and "not installed" in why
    assert len(TuningCache(other).entries()) == 3  # its own entry kept
    d2 = make_dispatcher(cache=other)
    assert d2.select(M, N, K).tactic == FakeBTactic(tile_m=64, tile_n=32)

    assert main(["cache", "import", str(tmp_path / "fleet.json")]) == 0  # table; again
    text = capsys.readouterr().out
    assert "0 taken, 4 skipped" in text and "already has an entry" in text

    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tuned))
    assert main(["cache", "import", str(tmp_path / "fleet.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["taken"] == []  # importing its own export changes nothing


def test_import_skips_other_devices(make_dispatcher, tmp_path):
    src = tmp_path / "src.json"
    make_dispatcher(cache=src).tune([(M, N, K)], timer=FakeTimer({}), progress=False)
    e = dict(TuningCache(src).entries()[0], device="NVIDIA H200|9.0|132")
    TuningCache(tmp_path / "gpu.json").put([e])
    d = make_dispatcher(cache=tmp_path / "dst.json")
    report = d.winners.import_from(tmp_path / "gpu.json")
    assert report.taken == [] and "tuned on NVIDIA H200|9.0|132" in report.skipped[0][1]


# ---- one owner for cache entries ----------------------------------------------------------


def test_cache_entry_model_is_lenient_and_keeps_unknown_fields():
    from fp4_dispatch.store.winners import CacheEntry

    old = {"device": "cpu|-|1", "n": 256, "k": 128, "m_bucket": 128, "out_dtype": "bfloat16",
           "backend": "fake-a", "backend_version": "1", "tactic": {"backend": "fake-a"},
           "us": 3, "runner_up": None, "heuristic": [1], "est_us": "fast", "timestamp": 7,
           "from_the_future": {"x": 1}}  # fmt: skip
    e = CacheEntry.model_validate(old)
    assert e.bucket == (256, 128, 128, "bfloat16", "w4a4") and e.us == 3.0  # no op: w4a4
    assert e.policy == "graph" and e.kept_default is None
    assert e.heuristic is None and e.est_us is None and e.timestamp is None and e.env is None
    out = e.to_json()
    assert out["from_the_future"] == {"x": 1} and "heuristic" not in out
    with pytest.raises(ValueError, match="n"):
        CacheEntry.model_validate({**old, "n": "many"})


def test_tuner_takes_parts_not_a_dispatcher(make_dispatcher):
    d = make_dispatcher()
    built = []

    def kernel_for(cand, problem):
        built.append(cand.tactic)
        return d.kernel_for(cand, problem)

    tuner = Tuner(d.device, kernel_for, d.ranker, timer=FakeTimer({("fake-a", 64, 64): 9.0}))
    assert not hasattr(tuner, "dispatcher")
    r = tuner.tune(Problem(m=M, n=N, k=K))
    assert r.winner.tactic == FakeATactic(tile_m=64, tile_n=64) and len(set(built[:16])) == 16
    assert built[16:] == [r.winner.tactic, r.heuristic.tactic]  # the paired check's pair
    with pytest.raises(TypeError, match="kernel_for and ranker"):
        Tuner(d.device)


# ---- a tuned pick never loses to the default ------------------------------------------------

DEFAULT = ("fake-a", 128, 256)  # the heuristic pick of (M, N, K): the best estimate
CHALLENGER = ("fake-b", 64, 32)


class NoisyFirstPass(FakeTimer):
    """The first pass sees ``first`` times (a lucky sample); the pairs see the truth."""

    def __init__(self, first, true) -> None:
        super().__init__(first)
        self.true = true

    def paired(self, cands, launches, pairs):
        keys = [(c.backend, c.tactic.tile_m, c.tactic.tile_n) for c in cands]
        self.pair_calls.append(tuple(keys))
        return [tuple(self.true[key] for key in keys) for _ in range(pairs)]


def _race(make_dispatcher, challenger_true_us: float, **kw):
    d = make_dispatcher(**kw)
    first = {DEFAULT: 100.0, CHALLENGER: 70.0}  # the first pass: 30% faster (noise)
    timer = NoisyFirstPass(first, {DEFAULT: 100.0, CHALLENGER: challenger_true_us})
    (r,) = d.tune([(M, N, K)], timer=timer, band=0.02, progress=False)
    return d, r, timer


def _key(c):
    return (c.backend, c.tactic.tile_m, c.tactic.tile_n)


def test_a_winner_within_the_band_keeps_the_default(make_dispatcher, tmp_path):
    """1% faster in the paired check, 2% band: the default stays, and the entry says so."""
    d, r, timer = _race(make_dispatcher, 99.0, cache=tmp_path / "kept.json")
    assert timer.pair_calls == [(CHALLENGER, DEFAULT)]
    assert r.kept_default and r.paired_ratio == pytest.approx(0.99) and r.pairs == 5
    assert _key(r.winner) == DEFAULT and _key(r.challenger) == CHALLENGER
    assert "default kept" in r.decision and "default kept" in r.winner.reason
    assert _key(d.select(M, N, K)) == DEFAULT  # what runs is the default
    (entry,) = TuningCache(tmp_path / "kept.json").entries()
    assert entry["kept_default"] is True and entry["paired_ratio"] == pytest.approx(0.99)
    assert entry["challenger"]["backend"] == "fake-b" and entry["measure"] == "eager"
    out = r.to_json()
    assert out["kept_default"] is True and out["paired_ratio"] == pytest.approx(0.99)
    # a fresh process reads the decision back from the cache
    (again,) = make_dispatcher(cache=tmp_path / "kept.json").tune([(M, N, K)], progress=False)
    assert again.source == "cache" and again.kept_default
    assert again.paired_ratio == pytest.approx(0.99)


def test_a_winner_faster_beyond_the_band_is_adopted(make_dispatcher, tmp_path):
    d, r, _ = _race(make_dispatcher, 80.0, cache=tmp_path / "won.json")
    assert not r.kept_default and r.paired_ratio == pytest.approx(0.8)
    assert _key(r.winner) == CHALLENGER and r.challenger is None
    assert r.decision.startswith("adopted") and _key(d.select(M, N, K)) == CHALLENGER
    (entry,) = TuningCache(tmp_path / "won.json").entries()
    assert entry["kept_default"] is False and entry["backend"] == "fake-b"


def test_a_failing_default_cannot_be_kept(make_dispatcher):
    """The default fails to build: the winner is adopted without a pair."""
    d = make_dispatcher(FakeA({(128, 256): "build"}), FakeB())
    timer = NoisyFirstPass({CHALLENGER: 70.0}, {})
    (r,) = d.tune([(M, N, K)], timer=timer, band=0.02, progress=False)
    assert math.isinf(r.heuristic_us) and _key(r.heuristic) == DEFAULT
    assert _key(r.winner) == CHALLENGER and not r.kept_default and r.pairs == 0
    assert timer.pair_calls == [] and "default failed" in r.decision


def test_the_pairs_alternate_a_plain_timer(make_dispatcher):
    """A timer with no ``paired`` method: the check alternates its calls (5 pairs)."""

    class Plain:
        def __init__(self) -> None:
            self.calls: list = []

        def __call__(self, cand, launch, best):
            key = _key(cand)
            self.calls.append(key)
            first = len(self.calls) <= 16  # the first pass over the 16 tactics
            us = {DEFAULT: 100.0, CHALLENGER: 70.0 if first else 99.5}.get(key, 1000.0)
            return Timing((us, us), "fake")

    timer = Plain()
    d = make_dispatcher()
    (r,) = d.tune([(M, N, K)], timer=timer, band=0.02, progress=False)
    assert r.kept_default and r.paired_ratio == pytest.approx(0.995)
    assert sorted(timer.calls[16:]) == sorted([CHALLENGER, DEFAULT] * 5)


def test_a_paired_check_that_fails_keeps_the_default(make_dispatcher, caplog):
    class Broken(NoisyFirstPass):
        def paired(self, cands, launches, pairs):
            raise RuntimeError("the GPU fell off the bus (synthetic)")

    d = make_dispatcher()
    timer = Broken({DEFAULT: 100.0, CHALLENGER: 50.0}, {})
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.autotune.tuning"):
        (r,) = d.tune([(M, N, K)], timer=timer, band=0.02, progress=False)
    assert r.kept_default and _key(r.winner) == DEFAULT and math.isnan(r.paired_ratio)
    assert "fell off the bus" in r.decision and "paired check failed" in caplog.text


def test_the_default_as_winner_needs_no_pair(make_dispatcher):
    timer = NoisyFirstPass({DEFAULT: 10.0}, {})
    (r,) = make_dispatcher().tune([(M, N, K)], timer=timer, progress=False)
    assert _key(r.winner) == DEFAULT and not r.kept_default and timer.pair_calls == []
    assert r.decision == "the default is the measured winner"


def test_pairs_below_the_floor_are_refused(make_dispatcher):
    d = make_dispatcher()
    with pytest.raises(ValueError, match="pairs"):
        Tuner(d, pairs=3)


# ---- the measurement policy -----------------------------------------------------------------


def test_the_policy_is_recorded_and_a_cpu_measures_eagerly(make_dispatcher, tmp_path):
    from fp4_dispatch.autotune.tuning import CudaTimer, default_timer, policy_of

    path = tmp_path / "policy.json"
    d = make_dispatcher(cache=path)
    (r,) = d.tune([(M, N, K)], measure="graph", timer=FakeTimer({}), progress=False)
    assert r.measure == "eager"  # WallClockTimer territory: eager by nature
    assert TuningCache(path).entries()[0]["measure"] == "eager"
    with pytest.raises(ValueError, match="measure"):
        d.tune([(M, N, K)], measure="sometimes")
    with pytest.raises(ValueError, match="measure"), d.autotuning(measure="sometimes"):
        pass
    gpu = d.device.model_copy(update={"kind": "cuda"})
    assert policy_of(gpu, "graph") == "graph" and policy_of(gpu, "eager") == "eager"
    timer = default_timer(gpu, "eager")
    assert isinstance(timer, CudaTimer) and timer.measure == "eager"
    assert default_timer(gpu).measure == "graph"


def test_a_winner_of_another_policy_is_re_measured(make_dispatcher, tmp_path):
    """A cached graph-policy winner is no hit for an eager tuning (and vice versa)."""
    path = _tune_and_edit(make_dispatcher, tmp_path, lambda e: e.update(measure="graph"))
    d = make_dispatcher(cache=path)
    bkey = (N, K, 128, "bfloat16", "w4a4")
    assert d.winners.cached_result(bkey, (M, N, K), "graph") is not None
    assert d.winners.cached_result(bkey, (M, N, K), "eager") is None
    timer = FakeTimer({})
    (r,) = d.tune([(M, N, K)], timer=timer, progress=False)  # a CPU tunes eagerly
    assert r.source == "measured" and len(timer.calls) == 16


def test_entries_without_a_policy_read_it_from_the_method():
    from fp4_dispatch.store.winners import CacheEntry

    base = {"device": "cpu|-|1", "n": 256, "k": 128, "m_bucket": 128, "out_dtype": "bfloat16",
            "backend": "fake-a", "backend_version": "1", "tactic": {"backend": "fake-a"},
            "us": 3}  # fmt: skip
    assert CacheEntry.model_validate({**base, "method": "wall-clock"}).policy == "eager"
    assert CacheEntry.model_validate({**base, "method": "cuda-graph"}).policy == "graph"
    assert CacheEntry.model_validate({**base, "measure": "eager"}).policy == "eager"
    assert CacheEntry.model_validate({**base, "measure": 5}).policy == "graph"  # odd: ignored


# ---- the operation ----------------------------------------------------------------------------


@pytest.fixture
def reference_only(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")  # built-ins only: the reference on CPU
    return Dispatcher(device="cpu", cache=tmp_path / "ops.json")


def test_w4a16_is_tuned_and_cached_apart_from_w4a4(reference_only, tmp_path):
    d = reference_only
    (r16,) = d.tune([(16, 64, 128)], operation="w4a16", progress=False)
    assert r16.problem.operation == "w4a16" and r16.winner.backend == "torch-reference"
    assert r16.bucket == (64, 128, 16, "bfloat16", "w4a16")
    assert d.select(16, 64, 128, operation="w4a16").reason.startswith("tuned")
    assert d.select(16, 64, 128).reason == "heuristic top-1"  # w4a4: not tuned
    (r4,) = d.tune([(16, 64, 128)], progress=False)
    assert r4.problem.operation == "w4a4" and r4.source == "measured"
    entries = TuningCache(tmp_path / "ops.json").entries()
    assert sorted(e["operation"] for e in entries) == ["w4a16", "w4a4"]  # both kept
    with pytest.raises(ValueError, match="operation"):
        d.tune([(16, 64, 128)], operation="w8a8")


def test_an_entry_without_an_operation_is_w4a4(make_dispatcher, tmp_path):
    path = _tune_and_edit(make_dispatcher, tmp_path, lambda e: e.pop("operation"))
    assert "operation" not in json.loads(path.read_text())["entries"][0]
    d = make_dispatcher(cache=path)
    assert d.select(M, N, K).reason.startswith("tuned")
    assert d.winners.bucket((N, K, 128, "bfloat16", "w4a16")) is None


def test_dense_inputs_and_their_check():
    from fp4_dispatch.autotune.tuning import check_output, make_inputs
    from fp4_dispatch.backends.reference import gemm_dense
    from fp4_dispatch.contracts.backend import DenseOperands
    from fp4_dispatch.contracts.device import CPU

    inp = make_inputs(Problem(m=40, n=32, k=64, operation="w4a16"), CPU, copies=2)
    ops = inp.copies[0]
    assert isinstance(ops, DenseOperands) and ops.a.dtype == torch.bfloat16
    assert ops.a.shape == (40, 64) and len(inp.copies) == 2
    inp.out.fill_(math.nan)
    gemm_dense(ops, inp.out, compute_dtype="float32", k_chunk=0)
    assert check_output(inp.out, inp) is None
    inp.out.zero_()
    assert "relative error" in check_output(inp.out, inp)


def test_autotuning_tunes_a_dense_call(reference_only):
    d = reference_only
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    from fp4_dispatch import quantize_nvfp4

    qb = quantize_nvfp4(torch.randn(64, 128))
    with d.autotuning(measure="eager"):
        d.gemm(x, qb)
    assert d.winners.bucket((64, 128, 8, "bfloat16", "w4a16")) is not None
    assert d.winners.results[(64, 128, 8, "bfloat16", "w4a16")].measure == "eager"


def test_cli_tune_op_and_measure_then_explain_and_show(capsys, monkeypatch, tmp_path):
    from fp4_dispatch.cli import main

    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "")
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "cli.json"))
    args = ["tune", "--shapes", "16,64,256", "--device", "cpu", "--no-progress",
            "--op", "w4a16", "--measure", "eager", "--json"]  # fmt: skip
    assert main(args) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["problem"]["operation"] == "w4a16" and r["measure"] == "eager"
    assert "paired_ratio" in r and r["kept_default"] in (True, False)
    assert main(["explain", "16", "64", "256", "--device", "cpu", "--op", "w4a16"]) == 0
    text = capsys.readouterr().out
    assert "tuned: torch-reference" in text and "measure eager" in text and "vs default" in text
    assert main(["explain", "16", "64", "256", "--device", "cpu"]) == 0
    assert "no cache entry for this bucket" in capsys.readouterr().out  # w4a4: untuned
    assert main(["explain", "16", "64", "256", "--device", "cpu", "--op", "w4a16", "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)["tuned"]
    assert tuned["operation"] == "w4a16" and tuned["usable"] is True
    assert main(["cache", "show"]) == 0
    text = capsys.readouterr().out
    assert "w4a16" in text and "vs default" in text and "eager" in text


def test_explain_shows_a_kept_default(make_dispatcher, tmp_path, capsys):
    from fp4_dispatch.cli.explain import render_tuned, tuned_entry

    d, _, _ = _race(make_dispatcher, 99.0, cache=tmp_path / "kept.json")
    row = tuned_entry(d, M, N, K, "bfloat16", "w4a4")
    assert row["kept_default"] is True and row["usable"] is True
    text = render_tuned(row)
    assert "paired ratio 0.990 over 5 pairs, default kept" in text
    assert "challenger that lost: fake-b" in text
    assert tuned_entry(d, M, N, K, "bfloat16", "w4a16") is None


def test_a_rank_precompiles_only_its_share_of_the_race(make_dispatcher):
    """In a tuning group each rank compiles the candidates it measures (`Fleet.share`);
    rank 0 also the default pick (it runs the paired check). Alone: the whole race."""
    from types import SimpleNamespace

    from fp4_dispatch.autotune.distributed import Fleet
    from fp4_dispatch.contracts.tactics import Problem

    d = make_dispatcher()
    p = Problem(m=M, n=N, k=K)
    sl = list(d.ranker.shortlist(p.model_copy(update={"m": m_bucket(M)})).candidates)
    race, default = race_list(d.ranker, p.model_copy(update={"m": m_bucket(M)}), sl)
    assert len(race) >= 3

    def compiled(fleet) -> list:
        return [(b.name, t) for b, t, _ in d._compile_pairs([p], [sl], fleet)]

    assert compiled(None) == [(c.backend, c.tactic) for c in race]
    shares = {}
    for rank in (0, 1):
        fleet = SimpleNamespace(rank=rank, size=2, is_root=rank == 0)
        fleet.share = functools.partial(Fleet.share, fleet)
        shares[rank] = compiled(fleet)
    want1 = [(c.backend, c.tactic) for c in race[1::2]]
    assert shares[1] == want1
    assert set(shares[0]) == {(c.backend, c.tactic) for c in race[0::2]} | {
        (default.backend, default.tactic)
    }
    assert not set(shares[0][: len(race[0::2])]) & set(want1)  # no kernel compiled twice
