"""Measuring a shortlist on the device, and a winner that independent processes agree on.

Tuning ends at a `TuneResult`; cache entries, adoption and re-validation belong to the
winner store (`fp4_dispatch.winners`).

Lessons from FlashInfer's autotuner (its issue tracker): 5+ minutes of warm-up for one model
(issue 3295), a pick 11-12% slower than the default at M=1 before it measured with CUDA
graphs and a cold L2 (3648), and different winners in different processes from noisy
"fastest" picks (4433). So, per tactic of the shortlist:

1. **Build** through `Dispatcher.kernel_for` (the same cache `gemm` uses). A build that
   raises times as infinity and is reported (tactic, error); tuning goes on.
2. **Warm-up and check**: ``out`` is filled with NaN, one launch and a synchronize
   (triggers JIT; a raising or faulting launch is reported like a failed build), then
   the output is compared with the float64 reference ``alpha * dequant(A) @
   dequant(B).T`` of the same inputs (`check_output`). A wrong result (relative
   Frobenius error over `CHECK_RTOL`, any NaN/inf, an element left unwritten) is a
   failure (method ``wrong``, time infinity, ``error`` says why): a fast kernel that
   writes zeros, ignores ``out``'s strides on a swapped tactic or misses a tail tile
   is never adopted. Each candidate is checked once per bucket it is tuned for.
3. **Timing** by a timer (injectable, see `Timer`):

   - CUDA (`CudaTimer`): a delay kernel (``torch.cuda._sleep``) is queued first so the
     CPU has enqueued the work before the GPU reaches the start event (launch overhead
     never times into the measurement); a single-launch probe between CUDA events picks
     ``repeat`` so one replay lasts about ``target_replay_us``; ``repeat`` launches
     cycling over rotating input copies are captured into a CUDA graph; the graph is
     replayed ``replays`` times, each after a delay kernel, timed with CUDA events; the
     samples are per-launch times (replay time / repeat). If capture fails the same loop
     runs eagerly (method ``cuda-eager``, the reason in ``note``). A kernel longer than
     ``target_replay_us`` has ``repeat = 1``: the probe is its first sample and
     ``replays - 1`` more single launches (each on the next input copy, after a delay
     kernel) complete it (method ``cuda-events``) - a graph of one launch adds nothing.
   - CPU (`WallClockTimer`): ``time.perf_counter`` around ``repeat`` launches, a few
     times.
   - Pruning: a tactic whose probe is over ``prune`` (1.5) x the best time measured so far
     is not measured further (method ``pruned``, its probe is its time). It cannot win:
     the noise band is far below 50%. Candidates are measured in rank order, so the
     likely winners come first. This is what keeps tuning a shape near one second.

   Inputs: random normal data quantized with `quantize_nvfp4` (non-zero, realistic
   exponent spread); ``n_copies = min(ceil(3 * L2 / input_bytes) + 1, max_repeat + 1)``
   copies (bounded by `COPY_MEMORY_CAP`) so consecutive launches read cold data.

**Noise band.** Each measured tactic has several replay samples; its relative spread is
``(max - min) / median``. The band is the median of those spreads over the measured
tactics, clamped to [``NOISE_FLOOR`` = 2%, ``NOISE_CAP`` = 10%] (the floor covers what
one process cannot see: run-to-run clock and placement differences between processes).
**Winner**: among tactics within ``(1 + band) x best``, the first in the ranking's tie
order ``(est_us, backend name, canonical tactic JSON)`` — a content order, so two
processes whose measurements differ by noise pick the same tactic.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from .backend import Kernel
from .device import DeviceInfo
from .guard import launch as run_kernel

# the numerics (random inputs, float64 reference, the check) live in the harness, shared
# with the conformance kit and the benchmarks; re-exported here under their old names
from .harness import (  # noqa: F401 - re-exported
    CHECK_FULL_MACS,
    CHECK_HEAD,
    CHECK_INTERIOR,
    CHECK_RTOL,
    CHECK_TAIL,
    COPY_MEMORY_CAP,
    MAX_REPEAT,
    OUT_DTYPES,
    Inputs,
    check_indices,
    check_output,
    make_inputs,
    n_copies,
    reference_output,
)
from .ranking import Candidate, Ranker, m_bucket
from .tactics import Problem

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger(__name__)

NOISE_FLOOR = 0.02
NOISE_CAP = 0.10
PRUNE_FACTOR = 1.5
#: one graph replay should last about this long (enough launches to average noise)
TARGET_REPLAY_US = 1000.0
REPLAYS = 3
#: delay kernel before each timed region, in GPU clock cycles (~0.5 ms at 2 GHz)
SLEEP_CYCLES = 1_000_000

Launch = Callable[[int], None]
"""``launch(i)`` runs the candidate once on input copy ``i % n_copies``."""

KernelFor = Callable[[Candidate, Problem], Kernel]
"""``kernel_for(candidate, problem) -> kernel``: builds (once) what `gemm` would run."""


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
the kernel and run one warm-up launch. Tests inject fake timers here."""


@dataclass(frozen=True)
class Measurement:
    """One candidate's result: ``us`` is infinity when it failed (``error`` says why)."""

    candidate: Candidate
    us: float
    method: str
    samples_us: tuple[float, ...] = ()
    error: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return math.isfinite(self.us)

    @property
    def spread(self) -> float | None:
        """Relative spread ``(max - min) / median`` of the samples (None if < 2)."""
        s = self.samples_us
        if len(s) < 2 or self.method == "pruned":
            return None
        med = statistics.median(s)
        return (max(s) - min(s)) / med if med > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.candidate.backend,
            "tactic": self.candidate.tactic.model_dump(mode="json"),
            "est_us": self.candidate.est_us,
            "us": self.us if self.ok else None,
            "method": self.method,
            "samples_us": list(self.samples_us),
            "error": self.error,
            "note": self.note,
        }


def tie_key(c: Candidate) -> tuple[float, str, str]:
    """The ranking's content order: (est_us, backend name, canonical tactic JSON)."""
    return (c.est_us, c.backend, c.tactic.canonical_json())


def noise_band(
    measurements: Iterable[Measurement], floor: float = NOISE_FLOOR, cap: float = NOISE_CAP
) -> float:
    """Median relative spread of the measured tactics, clamped to [floor, cap]."""
    spreads = [s for m in measurements if m.ok and (s := m.spread) is not None]
    band = statistics.median(spreads) if spreads else floor
    return min(cap, max(floor, band))


def pick_winner(
    measurements: Sequence[Measurement], band: float
) -> tuple[Measurement | None, Measurement | None]:
    """(winner, runner-up): the winner is the tie-order first within (1 + band) x best;
    the runner-up is the fastest of the others. (None, None) when nothing ran."""
    ok = [m for m in measurements if m.ok]
    if not ok:
        return None, None
    best = min(m.us for m in ok)
    within = [m for m in ok if m.us <= best * (1.0 + band)]
    winner = min(within, key=lambda m: tie_key(m.candidate))
    others = [m for m in ok if m is not winner]
    runner = min(others, key=lambda m: (m.us, tie_key(m.candidate))) if others else None
    return winner, runner


@dataclass
class TuneResult:
    """The outcome of tuning one bucket (``problem`` is its representative, M = bucket)."""

    problem: Problem
    source: Literal["measured", "cache"]
    winner: Candidate | None
    winner_us: float
    heuristic: Candidate
    heuristic_us: float
    runner_up: Candidate | None = None
    runner_up_us: float = math.nan
    noise_band: float = NOISE_FLOOR
    measurements: list[Measurement] = field(default_factory=list)
    wall_s: float = 0.0
    requested: tuple[int, int, int] | None = None

    @property
    def failures(self) -> list[Measurement]:
        return [m for m in self.measurements if not m.ok]

    @property
    def regret(self) -> float:
        """How much slower the heuristic pick is than the winner (0.05 = 5%)."""
        if not (self.winner_us > 0 and math.isfinite(self.winner_us)):
            return math.nan
        return self.heuristic_us / self.winner_us - 1.0

    def to_json(self) -> dict[str, Any]:
        def cand(c: Candidate | None) -> dict[str, Any] | None:
            return None if c is None else c.to_json()

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "problem": self.problem.model_dump(mode="json"),
            "requested": list(self.requested) if self.requested else None,
            "source": self.source,
            "winner": cand(self.winner),
            "winner_us": num(self.winner_us),
            "runner_up": cand(self.runner_up),
            "runner_up_us": num(self.runner_up_us),
            "heuristic": cand(self.heuristic),
            "heuristic_us": num(self.heuristic_us),
            "regret": num(self.regret),
            "noise_band": self.noise_band,
            "wall_s": self.wall_s,
            "measured": len(self.measurements),
            "failures": [
                {"backend": m.candidate.backend, "tactic": m.candidate.tactic.model_dump(
                    mode="json"), "error": m.error}
                for m in self.failures
            ],
        }  # fmt: skip


# ---- checking results (the numerics are `fp4_dispatch.harness`'s) --------------------


def verify_candidate(
    cand: Candidate,
    kernel_for: KernelFor,
    problem: Problem,
    device: DeviceInfo,
    seed: int = 0,
) -> str | None:
    """Build `cand` for `problem`, run it once on random inputs and check the result.

    Returns why it is wrong (build or run errors included), None when it is right. This
    is the check a cached winner gets on its first use in a process.
    """
    try:
        kernel = kernel_for(cand, problem)
        inputs = make_inputs(problem, device, seed, copies=1)
        inputs.out.fill_(math.nan)
        run_kernel(kernel, inputs.copies[0], inputs.out, cand.tactic.swap_ab)
        _sync(device)
    except Exception as exc:  # a plugin's build or kernel failing: the answer is "wrong"
        return f"{type(exc).__name__}: {exc}"
    return check_output(inputs.out, inputs, seed)


# ---- timers ---------------------------------------------------------------------------


def _repeat_for(probe_us: float, target_us: float, max_repeat: int) -> int:
    return max(1, min(max_repeat, int(target_us / max(probe_us, 1e-3))))


@dataclass
class CudaTimer:
    """CUDA events around CUDA-graph replays, each after a delay kernel (module doc)."""

    replays: int = REPLAYS
    target_replay_us: float = TARGET_REPLAY_US
    max_repeat: int = MAX_REPEAT
    prune: float = PRUNE_FACTOR
    sleep_cycles: int = SLEEP_CYCLES

    def _timed(self, body: Callable[[], None]) -> float:
        """Microseconds of `body`'s GPU work, queued behind a delay kernel."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(self.sleep_cycles)
        start.record()
        body()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def _capture(self, graph: torch.cuda.CUDAGraph, loop: Callable[[], None]) -> None:
        """Capture `loop` on a side stream. Not `torch.cuda.graph(...)`: on entry that
        context synchronizes and empties the allocator cache (older torch versions also
        ran ``gc.collect()``), a cost paid again per tactic."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=current.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                loop()
            except Exception:
                try:
                    graph.capture_end()
                except RuntimeError as end_exc:  # the capture was invalidated: expected
                    log.debug("capture_end after a failed capture: %r", end_exc)
                raise
            graph.capture_end()
        current.wait_stream(side)

    def __call__(self, candidate: Candidate, launch: Launch, best_us: float) -> Timing:
        probe = self._timed(lambda: launch(1))
        if math.isfinite(best_us) and probe > self.prune * best_us:
            return Timing((probe,), "pruned", f"probe {probe:.1f} us > {self.prune}x best")
        repeat = _repeat_for(probe, self.target_replay_us, self.max_repeat)
        if repeat == 1:  # a long kernel: nothing to replay; the delay hides the launch
            more = [self._timed(lambda i=i: launch(2 + i)) for i in range(self.replays - 1)]
            return Timing((probe, *more), "cuda-events")

        def loop() -> None:
            for i in range(repeat):
                launch(i)

        method, note, body = "cuda-graph", "", loop
        graph = torch.cuda.CUDAGraph()
        try:
            self._capture(graph, loop)
            body = graph.replay
        except Exception as exc:  # not capturable: time eagerly and say so
            torch.cuda.synchronize()
            method, note = "cuda-eager", f"graph capture failed: {type(exc).__name__}: {exc}"
            log.info("%s %s: %s", candidate.backend, candidate.tactic.canonical_json(), note)
        samples = tuple(self._timed(body) / repeat for _ in range(self.replays))
        del graph
        return Timing(samples, method, note)


@dataclass
class WallClockTimer:
    """``time.perf_counter`` around `repeat` launches (CPU backends)."""

    replays: int = REPLAYS
    target_replay_us: float = 2000.0
    max_repeat: int = MAX_REPEAT
    prune: float = PRUNE_FACTOR

    def __call__(self, candidate: Candidate, launch: Launch, best_us: float) -> Timing:
        t0 = time.perf_counter()
        launch(1)
        probe = (time.perf_counter() - t0) * 1e6
        if math.isfinite(best_us) and probe > self.prune * best_us:
            return Timing((probe,), "pruned", f"probe {probe:.1f} us > {self.prune}x best")
        repeat = _repeat_for(probe, self.target_replay_us, self.max_repeat)
        samples = []
        for _ in range(self.replays):
            t0 = time.perf_counter()
            for i in range(repeat):
                launch(i)
            samples.append((time.perf_counter() - t0) * 1e6 / repeat)
        return Timing(tuple(samples), "wall-clock")


def default_timer(device: DeviceInfo) -> Timer:
    return CudaTimer() if device.kind == "cuda" else WallClockTimer()


def _sync(device: DeviceInfo) -> None:
    if device.kind == "cuda":
        torch.cuda.synchronize(torch.device(device.torch_device))


# ---- the tuner ------------------------------------------------------------------------


class Tuner:
    """Measures candidates and picks winners (module docstring); it owns no cache entry.

    It takes only what it needs: the `device`, a ``kernel_for`` build function (the
    dispatcher's, so tuned kernels are the ones `gemm` reuses) and the `Ranker` that
    gives a bucket's shortlist and heuristic pick. ``Tuner(dispatcher)`` takes those
    three from a dispatcher and keeps no reference to it. Adopting and caching the
    winner is the winner store's job (`fp4_dispatch.winners`).

    ``timer``: defaults to `CudaTimer` on CUDA devices and `WallClockTimer` elsewhere.
    ``band``: a fixed noise band instead of the measured one.
    """

    def __init__(
        self,
        device: DeviceInfo | Dispatcher,
        kernel_for: KernelFor | None = None,
        ranker: Ranker | None = None,
        *,
        timer: Timer | None = None,
        band: float | None = None,
        noise_floor: float = NOISE_FLOOR,
        seed: int = 0,
    ) -> None:
        if not isinstance(device, DeviceInfo):  # a Dispatcher: take its three parts
            device, kernel_for, ranker = device.device, device.kernel_for, device.ranker
        if kernel_for is None or ranker is None:
            raise TypeError("kernel_for and ranker: required with a DeviceInfo, got None")
        if device.is_simulated:
            raise RuntimeError(
                f"{device.name} is simulated: tuning measures kernels, so it needs "
                "the real device (use Dispatcher() on it)"
            )
        self.device = device
        self.kernel_for = kernel_for
        self.ranker = ranker
        self.timer = timer if timer is not None else default_timer(self.device)
        self.band = band
        self.noise_floor = noise_floor
        self.seed = seed

    def measure(
        self,
        problem: Problem,
        candidates: Sequence[Candidate],
        bar: Any = None,
        inputs: Inputs | None = None,
        deadline: float | None = None,
    ) -> list[Measurement]:
        """Measure each candidate on `problem` (in the given order); failures are inf.

        ``deadline`` (a `time.monotonic` value): candidates not started by then are not
        measured (method ``skipped``, time infinity, reported in ``error``).
        """
        if self.device.kind == "cuda":  # events, graphs and streams of the right GPU
            with torch.cuda.device(torch.device(self.device.torch_device)):
                return self._measure(problem, candidates, bar, inputs, deadline)
        return self._measure(problem, candidates, bar, inputs, deadline)

    def _measure(
        self,
        problem: Problem,
        candidates: Sequence[Candidate],
        bar: Any,
        inputs: Inputs | None,
        deadline: float | None,
    ) -> list[Measurement]:
        if inputs is None:
            inputs = make_inputs(problem, self.device, self.seed)
        results: list[Measurement] = []
        best = math.inf
        for cand in candidates:
            if deadline is not None and time.monotonic() > deadline:
                m = Measurement(cand, math.inf, "skipped", error="not measured: deadline passed")
            else:
                m = self._measure_one(problem, cand, inputs, best)
            if m.ok and m.method != "pruned":
                best = min(best, m.us)
            results.append(m)
            if bar is not None:
                bar.update(1)
                if math.isfinite(best):
                    bar.set_postfix_str(f"best {best:.1f} us")
        return results

    def _measure_one(
        self, problem: Problem, cand: Candidate, inputs: Inputs, best: float
    ) -> Measurement:
        name = f"{cand.backend} {cand.tactic.canonical_json()}"
        try:
            kernel = self.kernel_for(cand, problem)
        except Exception as exc:  # a tactic that fails to build is timed as inf, reported
            return self._failed(cand, "build", exc, name)
        copies, out = inputs.copies, inputs.out
        n = len(copies)

        swap = cand.tactic.swap_ab

        def launch(i: int) -> None:
            run_kernel(kernel, copies[i % n], out, swap)

        try:
            out.fill_(math.nan)  # an element the kernel does not write stays NaN
            launch(0)
            _sync(self.device)
        except Exception as exc:  # a tactic that fails to run is timed as inf, reported
            return self._failed(cand, "run", exc, name)
        why = check_output(out, inputs, self.seed)
        if why is not None:
            log.warning("tuning: %s gives a wrong result, never adopted: %s", name, why)
            return Measurement(cand, math.inf, "wrong", error=f"wrong result: {why}")
        try:
            timing = self.timer(cand, launch, best)
            _sync(self.device)
        except Exception as exc:  # a tactic that fails to run is timed as inf, reported
            return self._failed(cand, "run", exc, name)
        us = timing.us
        if not (us > 0 and math.isfinite(us)):
            return Measurement(cand, math.inf, timing.method, timing.samples_us,
                               error=f"run: timer returned {us!r}", note=timing.note)  # fmt: skip
        return Measurement(cand, us, timing.method, timing.samples_us, note=timing.note)

    @staticmethod
    def _failed(cand: Candidate, stage: str, exc: Exception, name: str) -> Measurement:
        error = f"{stage}: {type(exc).__name__}: {exc}"
        log.warning("tuning: %s failed (timed as infinity): %s", name, error)
        return Measurement(cand, math.inf, "failed", error=error)

    def tune(
        self, problem: Problem, bar: Any = None, shortlist: Sequence[Candidate] | None = None
    ) -> TuneResult:
        """Measure the shortlist of `problem`'s bucket (or the one given) and pick a winner."""
        t0 = time.perf_counter()
        bucket = problem.model_copy(update={"m": m_bucket(problem.m)})
        if shortlist is None:
            shortlist = self.ranker.shortlist(bucket).candidates
        heuristic = self.ranker.pick(bucket.m, bucket.n, bucket.k, bucket.out_dtype)
        todo = list(shortlist)
        if not any(_same(c, heuristic) for c in todo):  # always measure the heuristic pick
            todo.append(heuristic)
        measurements = self.measure(bucket, todo, bar)
        band = self.band if self.band is not None else noise_band(measurements, self.noise_floor)
        winner, runner = pick_winner(measurements, band)
        heur = next(m for m in measurements if _same(m.candidate, heuristic))
        result = TuneResult(
            problem=bucket,
            source="measured",
            winner=None if winner is None else _tuned_candidate(winner),
            winner_us=math.inf if winner is None else winner.us,
            heuristic=heuristic,
            heuristic_us=heur.us,
            runner_up=None if runner is None else runner.candidate,
            runner_up_us=math.nan if runner is None else runner.us,
            noise_band=band,
            measurements=measurements,
            wall_s=time.perf_counter() - t0,
            requested=(problem.m, problem.n, problem.k),
        )
        if winner is None:
            log.warning("tuning %s: every tactic failed; the heuristic pick stays", bucket)
        return result


def _same(a: Candidate, b: Candidate) -> bool:
    return a.backend == b.backend and a.tactic == b.tactic


def _tuned_candidate(m: Measurement) -> Candidate:
    c = m.candidate
    return Candidate(c.backend, c.family, c.tactic, c.est_us, f"tuned ({m.us:.4g} us measured)")
