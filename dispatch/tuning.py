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
3. **Timing** by a timer (`fp4_dispatch.timers`; injectable, see `Timer`), under a POLICY
   (``measure``, recorded in each result and cache entry): tune the way the call will
   run.

   - ``"graph"`` (the default; how graph-captured serving runs): CUDA-graph replays
     with the L2 flushed before each call, the flushes timed alone and subtracted -
     `fp4_dispatch.harness.gpu_clock`, the very clock of the benchmarks'
     `~fp4_dispatch.harness.gpu_time_us`, so tuned and benchmarked times compare. If
     capture fails the tactic is timed eagerly (method ``cuda-eager``, the reason in
     ``note``).
   - ``"eager"`` (a Python serving loop without graphs): back-to-back launches cycling
     over rotating input copies, synchronised once at the end, host wall time per call
     (`fp4_dispatch.harness.eager_clock`, = `~fp4_dispatch.harness.eager_wall_us`):
     launch overhead counts, as it does for such a caller.
   - CUDA (`CudaTimer`): a single-launch probe between CUDA events (behind a delay
     kernel, so launch overhead never times into it) picks ``calls`` so one sample
     lasts about ``target_replay_us`` (at most `GRAPH_CALLS` per graph: the flushes
     dominate short kernels); then ``replays`` samples of the policy's clock.
   - CPU (`WallClockTimer`): ``time.perf_counter`` around ``calls`` launches: eager by
     nature, so a CPU result always records ``measure="eager"``.
   - Pruning: a tactic whose probe is over ``prune`` (1.5) x the best time measured so far
     is not measured further (method ``pruned``, its probe is its time). It cannot win:
     the noise band is far below 50%. Candidates are measured in rank order, so the
     likely winners come first. This is what keeps tuning a shape near one second.

   Inputs: random normal data quantized with `quantize_nvfp4` (non-zero, realistic
   exponent spread); ``n_copies = min(ceil(3 * L2 / input_bytes) + 1, max_repeat + 1)``
   copies (bounded by `COPY_MEMORY_CAP`) so consecutive eager launches read cold data.
   W4A16 problems (``Problem.operation``) get dense activations in the output dtype and
   an NVFP4 weight; their reference is ``alpha * x @ dequant(W).T`` in float64.

**Noise band.** Each measured tactic has several replay samples; its relative spread is
``(max - min) / median``. The band is the median of those spreads over the measured
tactics, clamped to [``NOISE_FLOOR`` = 2%, ``NOISE_CAP`` = 10%] (the floor covers what
one process cannot see: run-to-run clock and placement differences between processes).
**Winner**: among tactics within ``(1 + band) x best``, the first in the ranking's tie
order ``(est_us, backend name, canonical tactic JSON)`` — a content order, so two
processes whose measurements differ by noise pick the same tactic.

**A tuned pick never loses to the default** (FlashInfer issue 3537: tuned tactics 2x
slower than the default, frozen into CUDA graphs). The default is the heuristic pick (what
an untuned call runs); it always races. A winner other than the default replaces it only
when a PAIRED measurement says so: ``pairs`` (>= 5) alternating samples of the winner and
the default on the same inputs under the same policy (the order flips every pair, so a
drift of clocks or temperature hits both), and the median of the per-pair ratios
``winner / default`` is below ``1 - band``. Otherwise the default is kept
(``TuneResult.kept_default``; the ratio is recorded either way). A default that failed
(build, run or check) cannot be kept: the winner is adopted without a pair.

**Distributed** (``group=``, `fp4_dispatch.distributed`): each rank measures its share of
the same shortlist, the measurements are all-gathered, every rank picks by the rule above
on the same data, the paired check runs on the group's rank 0 and its decision is
broadcast; the ranks then check they agree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from .backend import Kernel
from .buckets import BucketKey, bucket_key
from .device import DeviceInfo
from .distributed import Fleet, merge_shares
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
    check_rtol,
    make_dense_inputs,
    make_inputs,
    n_copies,
    reference_output,
)
from .ranking import Candidate, Ranker, m_bucket
from .tactics import Problem

# the clocks and timers live in `fp4_dispatch.timers`; re-exported under their old names
from .timers import (  # noqa: F401 - re-exported
    GRAPH_CALLS,
    MEASURES,
    PRUNE_FACTOR,
    REPLAYS,
    SLEEP_CYCLES,
    TARGET_REPLAY_US,
    Clock,
    CudaTimer,
    Launch,
    Measure,
    Pair,
    Timer,
    Timing,
    WallClockTimer,
    _check_measure,
    _repeat_for,
    alternate,
    default_timer,
    paired_samples,
    policy_of,
)

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger(__name__)

#: alternating (winner, default) samples of the never-loses check; 5 is the floor: the
#: median of 5 ratios ignores up to two disturbed pairs
PAIRS = 5
MIN_PAIRS = 5

NOISE_FLOOR = 0.02
NOISE_CAP = 0.10

KernelFor = Callable[[Candidate, Problem], Kernel]
"""``kernel_for(candidate, problem) -> kernel``: builds (once) what `gemm` would run."""


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


def check_band(band: object) -> float:
    """A fixed noise band: a finite number >= 0 (a fraction: 0.05 = 5 %); TypeError or
    ValueError naming ``band`` otherwise (a negative or NaN band selects no winner)."""
    if isinstance(band, bool) or not isinstance(band, (int, float)):
        raise TypeError(f"band: expected a number >= 0 or None, got {type(band).__name__}")
    if not (math.isfinite(band) and band >= 0):
        raise ValueError(f"band: expected a finite number >= 0 (e.g. 0.05), got {band!r}")
    return float(band)


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
    #: the measurement policy the times were taken under ("graph" or "eager")
    measure: str = "graph"
    #: median of the per-pair ratios winner / default of the paired check (nan: none ran)
    paired_ratio: float = math.nan
    pairs: int = 0
    #: the measured winner was not faster than the default beyond the band: default kept
    kept_default: bool = False
    #: the tactic that won the first pass but lost the paired check (when kept_default)
    challenger: Candidate | None = None
    #: why the adopted tactic is the one it is (the paired check's verdict), one line
    decision: str = ""

    @property
    def bucket(self) -> BucketKey:
        p = self.problem
        return bucket_key(p.m, p.n, p.k, p.out_dtype, p.operation, p.groups)

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
            "measure": self.measure,
            "paired_ratio": num(self.paired_ratio),
            "pairs": self.pairs,
            "kept_default": self.kept_default,
            "challenger": cand(self.challenger),
            "decision": self.decision,
            "wall_s": self.wall_s,
            "measured": len(self.measurements),
            "failures": [
                {"backend": m.candidate.backend, "tactic": m.candidate.tactic.model_dump(
                    mode="json"), "error": m.error}
                for m in self.failures
            ],
        }  # fmt: skip


# ---- checking one candidate -----------------------------------------------------


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
    return check_output(inputs.out, inputs, seed, check_rtol(cand.operation))


def _sync(device: DeviceInfo) -> None:
    if device.kind == "cuda":
        torch.cuda.synchronize(torch.device(device.torch_device))


# ---- the tuner ------------------------------------------------------------------------


def race_list(
    ranker: Ranker, bucket: Problem, shortlist: Sequence[Candidate]
) -> tuple[list[Candidate], Candidate]:
    """(what tuning a bucket measures, the default pick): the shortlist, plus the default
    (heuristic) pick when the cut left it out - the default always races."""
    b = bucket
    heuristic = ranker.pick(b.m, b.n, b.k, b.out_dtype, b.operation, b.groups)
    todo = list(shortlist)
    if not any(_same(c, heuristic) for c in todo):
        todo.append(heuristic)
    return todo, heuristic


class Tuner:
    """Measures candidates and picks winners (module docstring); it owns no cache entry.

    It takes only what it needs: the `device`, a ``kernel_for`` build function (the
    dispatcher's, so tuned kernels are the ones `gemm` reuses) and the `Ranker` that
    gives a bucket's shortlist and heuristic pick. ``Tuner(dispatcher)`` takes those
    three from a dispatcher and keeps no reference to it. Adopting and caching the
    winner is the winner store's job (`fp4_dispatch.winners`).

    ``measure``: the measurement policy, "graph" (default) or "eager" (module doc); a
    CPU device always measures eagerly. ``timer``: defaults to `CudaTimer` under
    ``measure`` on CUDA devices and `WallClockTimer` elsewhere (an injected timer is
    trusted to follow the policy it is told). ``band``: a fixed noise band instead of the
    measured one. ``pairs``: samples of the paired never-loses check (>= `MIN_PAIRS`).
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
        measure: str = "graph",
        pairs: int = PAIRS,
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
        if type(pairs) is not int:
            raise TypeError(f"pairs: expected an int, got {type(pairs).__name__}")
        if pairs < MIN_PAIRS:
            raise ValueError(f"pairs: expected an int >= {MIN_PAIRS}, got {pairs!r}")
        self.device = device
        self.kernel_for = kernel_for
        self.ranker = ranker
        #: the policy results record: what the timer measures on this device
        self.policy = policy_of(device, measure)
        self.timer = timer if timer is not None else default_timer(self.device, measure)
        self.pairs = pairs
        self.band = None if band is None else check_band(band)
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
        with self._on_device():
            return self._measure(problem, candidates, bar, inputs, deadline)

    def _on_device(self) -> Any:
        """Events, graphs and streams of the right GPU (nothing to do on a CPU)."""
        if self.device.kind == "cuda":
            return torch.cuda.device(torch.device(self.device.torch_device))
        return contextlib.nullcontext()

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
            launch = self._launcher(problem, cand, inputs)
        except Exception as exc:  # a tactic that fails to build is timed as inf, reported
            return self._failed(cand, "build", exc, name)
        out = inputs.out
        try:
            out.fill_(math.nan)  # an element the kernel does not write stays NaN
            launch(0)
            _sync(self.device)
        except Exception as exc:  # a tactic that fails to run is timed as inf, reported
            return self._failed(cand, "run", exc, name)
        why = check_output(out, inputs, self.seed, check_rtol(cand.operation))
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

    def _launcher(self, problem: Problem, cand: Candidate, inputs: Inputs) -> Launch:
        """``launch(i)``: `cand` built for `problem`, run on input copy ``i % copies``."""
        kernel = self.kernel_for(cand, problem)
        copies, out, swap = inputs.copies, inputs.out, cand.tactic.swap_ab
        n = len(copies)

        def launch(i: int) -> None:
            run_kernel(kernel, copies[i % n], out, swap)

        return launch

    @staticmethod
    def _failed(cand: Candidate, stage: str, exc: Exception, name: str) -> Measurement:
        error = f"{stage}: {type(exc).__name__}: {exc}"
        log.warning("tuning: %s failed (timed as infinity): %s", name, error)
        return Measurement(cand, math.inf, "failed", error=error)

    def tune(
        self,
        problem: Problem,
        bar: Any = None,
        shortlist: Sequence[Candidate] | None = None,
        fleet: Fleet | None = None,
    ) -> TuneResult:
        """Measure the shortlist of `problem`'s bucket (or the one given), pick a winner
        and check it against the default in pairs (module doc). ``fleet``: the ranks that
        tune this bucket together (`fp4_dispatch.distributed`); every rank returns the
        same decision."""
        t0 = time.perf_counter()
        bucket = problem.model_copy(update={"m": m_bucket(problem.m)})
        if shortlist is None:
            shortlist = self.ranker.shortlist(bucket).candidates
        todo, heuristic = race_list(self.ranker, bucket, shortlist)
        inputs = self._inputs(bucket)
        measurements = self._race(bucket, todo, bar, inputs, fleet)
        band = self.band if self.band is not None else noise_band(measurements, self.noise_floor)
        first, runner = pick_winner(measurements, band)
        heur = next(m for m in measurements if _same(m.candidate, heuristic))
        verdict = self._verdict(bucket, first, heur, band, inputs, fleet)
        winner = heur if verdict.kept_default else first
        if verdict.kept_default:
            runner = first
        result = TuneResult(
            problem=bucket,
            source="measured",
            winner=None if winner is None else _tuned_candidate(winner, verdict),
            winner_us=math.inf if winner is None else winner.us,
            heuristic=heuristic,
            heuristic_us=heur.us,
            runner_up=None if runner is None else runner.candidate,
            runner_up_us=math.nan if runner is None else runner.us,
            noise_band=band,
            measurements=measurements,
            wall_s=time.perf_counter() - t0,
            requested=(problem.m, problem.n, problem.k),
            measure=self.policy,
            paired_ratio=verdict.ratio,
            pairs=verdict.pairs,
            kept_default=verdict.kept_default,
            challenger=first.candidate if verdict.kept_default and first else None,
            decision=verdict.decision,
        )
        if winner is None:
            log.warning("tuning %s: every tactic failed; the heuristic pick stays", bucket)
        else:
            log.info("tuning %s: %s", bucket, verdict.decision)
        return result

    def _inputs(self, problem: Problem) -> Inputs:
        """Graph timing flushes the L2 itself: two copies do (the probe reads the second);
        eager timing rotates over `n_copies` so consecutive launches read cold data."""
        copies = 2 if self.device.kind == "cuda" and self.policy == "graph" else None
        with self._on_device():
            return make_inputs(problem, self.device, self.seed, copies=copies)

    def _race(
        self,
        problem: Problem,
        todo: list[Candidate],
        bar: Any,
        inputs: Inputs,
        fleet: Fleet | None,
    ) -> list[Measurement]:
        """Every candidate's measurement, in `todo` order: all measured here, or (with a
        fleet) this rank's share measured here and the others' gathered."""
        if fleet is None:
            return self.measure(problem, todo, bar, inputs)
        # ranks with other backends or versions would split different lists: say so
        fleet.agree(f"the shortlist of {problem}", [f"{c.backend} {c.tactic.canonical_json()}"
                                                    for c in todo])  # fmt: skip
        mine = fleet.share(len(todo))
        local = self.measure(problem, [todo[i] for i in mine], bar, inputs)
        if bar is not None:
            bar.update(len(todo) - len(mine))  # the other ranks measured the rest
        wire = [(i, (m.us, m.method, m.samples_us, m.error, m.note))
                for i, m in zip(mine, local, strict=True)]  # fmt: skip
        merged = merge_shares(fleet.gather(wire), len(todo))
        return [
            Measurement(c, us, method, tuple(samples), error, note)
            for c, (us, method, samples, error, note) in zip(todo, merged, strict=True)
        ]

    def _verdict(
        self,
        problem: Problem,
        first: Measurement | None,
        default: Measurement,
        band: float,
        inputs: Inputs,
        fleet: Fleet | None,
    ) -> Verdict:
        """Does the first-pass winner replace the default? (module doc). With a fleet the
        group's rank 0 decides and every rank gets its verdict."""
        if first is None:
            return Verdict(False, math.nan, 0, "every tactic failed: the default stays untuned")
        if _same(first.candidate, default.candidate):
            return Verdict(False, math.nan, 0, "the default is the measured winner")
        if not default.ok:
            return Verdict(
                False, math.nan, 0, f"the default failed ({default.error}): winner adopted unpaired"
            )
        if fleet is not None:
            mine = self._paired(problem, first, default, band, inputs) if fleet.is_root else None
            return fleet.broadcast(mine)
        return self._paired(problem, first, default, band, inputs)

    def _paired(
        self,
        problem: Problem,
        first: Measurement,
        default: Measurement,
        band: float,
        inputs: Inputs,
    ) -> Verdict:
        """`pairs` alternating samples of winner and default; adopt if the median ratio
        is below ``1 - band``. A check that cannot run keeps the default (and says why)."""
        cands = (first.candidate, default.candidate)
        try:
            with self._on_device():
                launches = (
                    self._launcher(problem, cands[0], inputs),
                    self._launcher(problem, cands[1], inputs),
                )
                pairs = paired_samples(self.timer, cands, launches, self.pairs)
                _sync(self.device)
        except Exception as exc:  # a kernel or timer failing here: keep the default, say why
            log.warning(
                "tuning %s: paired check failed (%s: %s); default kept",
                problem,
                type(exc).__name__,
                exc,
            )
            return Verdict(
                True,
                math.nan,
                0,
                f"paired check failed ({type(exc).__name__}: {exc}): default kept",
            )
        ratios = [a / b for a, b in pairs if a > 0 and b > 0 and math.isfinite(a / b)]
        if not ratios:
            return Verdict(True, math.nan, 0, "paired check gave no valid sample: default kept")
        ratio = statistics.median(ratios)
        if ratio < 1.0 - band:
            return Verdict(
                False,
                ratio,
                len(ratios),
                f"adopted: paired ratio {ratio:.3f} < 1 - band {band:.3f}",
            )
        return Verdict(
            True,
            ratio,
            len(ratios),
            f"default kept: paired ratio {ratio:.3f} "
            f">= 1 - band {band:.3f} (not faster beyond the noise)",
        )


@dataclass(frozen=True)
class Verdict:
    """The never-loses check's outcome (picklable: broadcast to every rank of a fleet)."""

    kept_default: bool
    ratio: float
    pairs: int
    decision: str


def _same(a: Candidate, b: Candidate) -> bool:
    return a.backend == b.backend and a.tactic == b.tactic


def _tuned_candidate(m: Measurement, verdict: Verdict | None = None) -> Candidate:
    c = m.candidate
    why = f"tuned ({m.us:.4g} us measured"
    if verdict is not None and verdict.kept_default:
        why += f"; default kept, paired ratio {verdict.ratio:.3f}"
    elif verdict is not None and math.isfinite(verdict.ratio):
        why += f"; paired ratio {verdict.ratio:.3f} vs default"
    return Candidate(c.backend, c.family, c.tactic, c.est_us, why + ")", c.operation)
