"""The timers a tuner measures candidates with, under the graph or eager policy.

They are the CUDA and wall-clock timers and the alternating pairs of the never-loses check.

The policies (``measure``): ``"graph"`` times CUDA-graph replays with the L2 flushed
before every call (`fp4_dispatch.autotune.harness.gpu_clock`: how graph-captured serving runs),
``"eager"`` back-to-back launches synchronised at the end (`harness.eager_clock`: a
Python serving loop, launch overhead included). CPUs time eagerly whatever is asked. A
timer probes one launch first, so a tactic far slower than the best so far is cut after
one launch (``pruned``); the rest get ``replays`` samples. How the tuner uses them is in
`fp4_dispatch.autotune.tuning`.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from fp4_dispatch.autotune import harness
from fp4_dispatch.autotune.harness import MAX_REPEAT
from fp4_dispatch.contracts.candidates import Candidate
from fp4_dispatch.contracts.device import DeviceInfo

log = logging.getLogger(__name__)

#: the measurement policies (module doc): CUDA-graph replay (cold L2) or eager launches
MEASURES = ("graph", "eager")
Measure = Literal["graph", "eager"]
PRUNE_FACTOR = 1.5
#: one graph replay should last about this long (enough launches to average noise)
TARGET_REPLAY_US = 1000.0
#: calls per CUDA graph under the graph policy (`CudaTimer.graph_calls`)
GRAPH_CALLS = 20
REPLAYS = 3
#: delay kernel before each timed region, in GPU clock cycles (~0.5 ms at 2 GHz)
SLEEP_CYCLES = 1_000_000

Launch = Callable[[int], None]
"""``launch(i)`` runs the candidate once on input copy ``i % n_copies``."""


@dataclass(frozen=True)
class Timing:
    """What a timer measured: per-launch samples in microseconds, and how."""

    samples_us: tuple[float, ...]
    method: str
    note: str = ""

    @property
    def us(self) -> float:
        return statistics.median(self.samples_us) if self.samples_us else math.inf


Timer = Callable[[Candidate, Launch, float], Timing]
"""``timer(candidate, launch, best_us_so_far) -> Timing``; the tuner has already built
the kernel and run one warm-up launch. Tests inject fake timers here. A timer may also
have ``paired(candidates, launches, pairs) -> [(a_us, b_us), ...]`` for the never-loses
check (`paired_samples`; without it the check alternates calls of the timer)."""


# ---- timers ---------------------------------------------------------------------------


Clock = Callable[[], float]
"""One sample per call: microseconds per launch (`fp4_dispatch.autotune.harness` clocks)."""

Pair = tuple[float, float]


def _repeat_for(probe_us: float, target_us: float, max_repeat: int) -> int:
    return max(1, min(max_repeat, int(target_us / max(probe_us, 1e-3))))


def alternate(clock_a: Clock, clock_b: Clock, pairs: int) -> list[Pair]:
    """``pairs`` (a, b) samples taken alternately; the order flips every pair, so a slow
    drift (clocks, temperature, a neighbour's load) lands on both sides alike."""
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            a = clock_a()
            b = clock_b()
        else:
            b = clock_b()
            a = clock_a()
        out.append((a, b))
    return out


def _check_measure(measure: str) -> str:
    if measure not in MEASURES:
        raise ValueError(f"measure: expected one of {list(MEASURES)}, got {measure!r}")
    return measure


@dataclass
class CudaTimer:
    """Times CUDA launches under a measurement policy (module doc): ``measure="graph"``
    through `fp4_dispatch.autotune.harness.gpu_clock` (graph replay, cold L2), ``"eager"``
    through `fp4_dispatch.autotune.harness.eager_clock` (back-to-back launches, host wall time)."""

    measure: Measure = "graph"
    replays: int = REPLAYS
    target_replay_us: float = TARGET_REPLAY_US
    max_repeat: int = MAX_REPEAT
    prune: float = PRUNE_FACTOR
    sleep_cycles: int = SLEEP_CYCLES
    #: at most this many calls per graph (the benchmarks' `gpu_time_us` default): with
    #: an L2 flush before each call the flush dominates short kernels, so more calls
    #: cost time and add nothing to the average
    graph_calls: int = GRAPH_CALLS

    def __post_init__(self) -> None:
        _check_measure(self.measure)

    def _probe(self, launch: Launch) -> float:
        """Microseconds of one launch's GPU work, queued behind a delay kernel (so the
        CPU has enqueued it before the GPU reaches the start event)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(self.sleep_cycles)
        start.record()
        launch(1)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def clock(self, candidate: Candidate | None, launch: Launch, calls: int):
        """(clock, method, note) of `launch` under this policy, ``calls`` launches a sample."""
        if self.measure == "graph":
            try:
                calls = min(calls, self.graph_calls)
                return harness.gpu_clock(lambda: launch(0), calls=calls), "cuda-graph", ""
            except Exception as exc:  # not capturable: time eagerly and say so
                torch.cuda.synchronize()
                note = f"graph capture failed: {type(exc).__name__}: {exc}"
                name = "-" if candidate is None else candidate.backend
                log.info("%s: %s; timed eagerly", name, note)
                return self._eager(launch, calls), "cuda-eager", note
        return self._eager(launch, calls), "cuda-eager", ""

    @staticmethod
    def _eager(launch: Launch, calls: int) -> Clock:
        copy = itertools.count()  # consecutive launches read other (cold) input copies
        return harness.eager_clock(lambda: launch(next(copy)), calls=calls, warmup=1)

    def __call__(self, candidate: Candidate, launch: Launch, best_us: float) -> Timing:
        probe = self._probe(launch)
        if math.isfinite(best_us) and probe > self.prune * best_us:
            return Timing((probe,), "pruned", f"probe {probe:.1f} us > {self.prune}x best")
        calls = _repeat_for(probe, self.target_replay_us, self.max_repeat)
        clock, method, note = self.clock(candidate, launch, calls)
        return Timing(tuple(clock() for _ in range(self.replays)), method, note)

    def paired(
        self, candidates: tuple[Candidate, Candidate], launches: tuple[Launch, Launch], pairs: int
    ) -> list[Pair]:
        """Alternating samples of two launches, same policy and ``calls`` (module doc)."""
        calls = _repeat_for(min(self._probe(f) for f in launches), self.target_replay_us,
                            self.max_repeat)  # fmt: skip
        made = [self.clock(c, f, calls) for c, f in zip(candidates, launches, strict=True)]
        if made[0][1] != made[1][1]:  # one could not be captured: compare both eagerly
            made = [(self._eager(f, calls), "cuda-eager", "") for f in launches]
        return alternate(made[0][0], made[1][0], pairs)


@dataclass
class WallClockTimer:
    """``time.perf_counter`` around ``calls`` launches (CPU backends): eager by nature."""

    replays: int = REPLAYS
    target_replay_us: float = 2000.0
    max_repeat: int = MAX_REPEAT
    prune: float = PRUNE_FACTOR
    measure: Measure = "eager"

    @staticmethod
    def _probe(launch: Launch) -> float:
        t0 = time.perf_counter()
        launch(1)
        return (time.perf_counter() - t0) * 1e6

    @staticmethod
    def clock(launch: Launch, calls: int) -> Clock:
        copy = itertools.count()

        def sample() -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                launch(next(copy))
            return (time.perf_counter() - t0) * 1e6 / calls

        return sample

    def __call__(self, candidate: Candidate, launch: Launch, best_us: float) -> Timing:
        probe = self._probe(launch)
        if math.isfinite(best_us) and probe > self.prune * best_us:
            return Timing((probe,), "pruned", f"probe {probe:.1f} us > {self.prune}x best")
        clock = self.clock(launch, _repeat_for(probe, self.target_replay_us, self.max_repeat))
        return Timing(tuple(clock() for _ in range(self.replays)), "wall-clock")

    def paired(
        self, candidates: tuple[Candidate, Candidate], launches: tuple[Launch, Launch], pairs: int
    ) -> list[Pair]:
        """Alternating samples of two launches with the same ``calls``."""
        probe = min(self._probe(f) for f in launches)
        calls = _repeat_for(probe, self.target_replay_us, self.max_repeat)
        return alternate(self.clock(launches[0], calls), self.clock(launches[1], calls), pairs)


def default_timer(device: DeviceInfo, measure: str = "graph") -> Timer:
    """`CudaTimer` under `measure` on CUDA devices; `WallClockTimer` (eager) elsewhere."""
    _check_measure(measure)
    return CudaTimer(measure=measure) if device.kind == "cuda" else WallClockTimer()  # type: ignore[arg-type]


def policy_of(device: DeviceInfo, measure: str) -> str:
    """The policy a result under `measure` really has on `device`: CPUs time eagerly."""
    _check_measure(measure)
    return measure if device.kind == "cuda" else "eager"


def paired_samples(
    timer: Timer,
    candidates: tuple[Candidate, Candidate],
    launches: tuple[Launch, Launch],
    pairs: int,
) -> list[Pair]:
    """``pairs`` alternating (a, b) samples: the timer's own
    ``paired(candidates, launches, pairs)`` when it has one (one setup, then alternate
    samples), else alternate calls of the timer itself (each one a full measurement; its
    median is the sample)."""
    own = getattr(timer, "paired", None)
    if callable(own):
        return list(own(candidates, launches, pairs))

    def clock(i: int) -> Clock:
        return lambda: timer(candidates[i], launches[i], math.inf).us

    return alternate(clock(0), clock(1), pairs)
