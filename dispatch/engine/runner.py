"""The engine of one device: backends loaded, ranked, tuned on request, planned and run.

`Runner` is what a `fp4_dispatch.Dispatcher` is below its public calls. A call comes
down to `Runner.run_checked` / `Runner.run_dense` with checked operands and goes only
downwards from there: the plan of its exact problem (`fp4_dispatch.engine.plans`), made
on a miss from the tuned winner of its bucket (`fp4_dispatch.store.winners`) or else the
memoized heuristic pick (`fp4_dispatch.policy.ranking`); under ``autotuning()`` the
engine first asks the tuner (`fp4_dispatch.autotune.tuning`) for a measured winner and
hands it to the winner store, which owns the cache file (`fp4_dispatch.store.cache`).
Each cached winner of the device is re-validated before first use; a stale one is
ignored with a warning. Tuning never happens on the hot path outside those two.

Not the engine, so elsewhere: the ``list-backends`` rows (`fp4_dispatch.loading.status`),
``launch`` (`fp4_dispatch.loading.guard`), the ``cache`` argument rule
(`fp4_dispatch.store.cache.from_argument`) and the ``shapes`` check
(`fp4_dispatch.format.checks.tune_shape`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

from fp4_dispatch.autotune import distributed as _distributed
from fp4_dispatch.autotune import precompile as _precompile
from fp4_dispatch.autotune import tuning as _tuning
from fp4_dispatch.contracts.backend import Backend, GemmOperands, Kernel, kernel_problem
from fp4_dispatch.contracts.buckets import BucketKey, bucket_key, describe, m_bucket
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic, check_precision, problem_operation
from fp4_dispatch.engine import blame as _blame
from fp4_dispatch.engine import firstuse as _firstuse
from fp4_dispatch.engine.capture import not_warm, stream_capturing
from fp4_dispatch.engine.plans import Plan, PlanKey, plan_for, replays_default
from fp4_dispatch.format import checks
from fp4_dispatch.format.checks import tune_shape as _shape
from fp4_dispatch.format.grouped import check_groups
from fp4_dispatch.loading import registry
from fp4_dispatch.loading.guard import Fault, Guard, PluginFault
from fp4_dispatch.loading.guard import launch_candidate as launch
from fp4_dispatch.loading.profiles import resolve
from fp4_dispatch.loading.status import BackendStatus, Status, backend_rows
from fp4_dispatch.policy.ranking import Candidate, Ranker, Shortlist
from fp4_dispatch.store.cache import TuningCache, device_fingerprint
from fp4_dispatch.store.cache import from_argument as _tuning_cache
from fp4_dispatch.store.winners import StoreContext, TunedWinners
from fp4_dispatch.support.progress import progress as bar_of

log = logging.getLogger(__name__)


class Runner:
    """The engine of one device: loads backends, ranks, tunes on request, plans, runs.

    Everything `Dispatcher` does except its public calls (`Dispatcher.gemm`, ``mm_fp4``),
    which sit above the custom ops (`fp4_dispatch.engine.torch_ops`): the ops call this
    class, never the other way round. Constructor arguments: see `Dispatcher`.
    """

    def __init__(
        self,
        device: str | DeviceInfo | None = None,
        *,
        strict: bool | None = None,
        budget: int = 32,
        sm_count: int | None = None,
        cache: str | os.PathLike[str] | TuningCache | bool | None = None,
        verify_cache: bool | None = None,
        replay: bool | None = None,
        precision: str = "exact",
        verify_plugins: bool | None = None,
    ) -> None:
        if type(budget) is not int or budget < 1:  # bool is an int subclass: not a budget
            raise ValueError(f"budget: expected a positive int, got {budget!r}")
        #: the precision policy (`fp4_dispatch.contracts.tactics.PRECISIONS`)
        self.precision = check_precision(precision)
        #: the operation a dense call is planned, ranked, tuned and cached as
        self.dense_operation = problem_operation("w4a16", self.precision)
        self.strict = registry.strict_default() if strict is None else strict
        if replay is not None and not isinstance(replay, bool):
            raise TypeError(f"replay: expected a bool or None, got {type(replay).__name__}")
        self.replay = replays_default() if replay is None else replay
        self.budget = budget
        self.registry = registry.load(strict=self.strict)
        #: every call into plugin code after loading goes through it
        self.guard = Guard(
            strict=self.strict,
            plugin_of={name: rep.name for name, rep in self.registry.plugin_of.items()},
            faults=self.registry.faults,
        )
        self.device = resolve(device, sm_count, self.registry.backends.values())
        self._status = {name: self._check_support(b) for name, b in self.registry.backends.items()}
        self.available: list[Backend] = [
            b for name, b in self.registry.backends.items() if self._status[name][0] == "available"
        ]
        self.ranker = Ranker(self.available, self.device, budget, guard=self.guard)
        #: this engine's id for the ``fp4_dispatch::gemm`` op: a plain int, so that
        #: torch.compile can read it from a module attribute without tracing the registry
        self.op_id = dispatcher_id(self)
        self._kernels: dict[tuple, Kernel] = {}
        self._plans: dict[PlanKey, Plan] = {}
        #: shapes that ran eagerly at least once (to say "plan changed" in a capture)
        self._ran: set[PlanKey] = set()
        self._announced: set[PlanKey] = set()
        self._torch_device = (
            None if self.device.is_simulated else torch.device(self.device.torch_device)
        )
        if verify_plugins is not None and not isinstance(verify_plugins, bool):
            raise TypeError(
                f"verify_plugins: expected a bool or None, got {type(verify_plugins).__name__}"
            )
        #: the first run of each third-party (backend, tactic, bucket) is checked, and of
        #: each built-in one whose kernels have not run on hardware (`_unproven`)
        self.first_use = _firstuse.FirstUse(
            _firstuse.default() if verify_plugins is None else verify_plugins, self._unproven
        )
        context = StoreContext(
            device=self.device,
            backends=self.registry.backends,
            available=self.available,
            ranker=self.ranker,
            guard=self.guard,
            kernel_for=self.kernel_for,
            mark_checked=self.first_use.mark,
        )
        self.winners = TunedWinners(context, _tuning_cache(cache), verify_cache)
        self._untuned_logged: set[BucketKey] = set()
        self._autotune_depth = 0
        #: bumped whenever a plan is dropped (tuned, fallen back): callers that keep a
        #: plan's replay (`replay_of`) compare it instead of looking the plan up again
        self.plan_epoch = 0
        #: (measure, group) of each active `autotuning` block, innermost last
        self._autotune_opts: list[tuple[str, object]] = []
        #: (bucket, policy) pairs `autotuning` has settled (tuned, or a hit of that policy)
        self._autotuned: set[tuple[BucketKey, str]] = set()
        self._capture_warned: set[BucketKey] = set()

    def _unproven(self, name: str) -> bool:
        """Whether backend `name`'s kernels are unproven here: a plugin that is not built
        in (this project's CI never ran it), or a built-in backend whose kernels were
        compiled but never run on hardware (`Backend.compile_only_note`)."""
        if not getattr(self.registry.plugin_of.get(name), "builtin", True):
            return True
        return bool(getattr(self.registry.backends.get(name), "compile_only_note", ""))

    def __repr__(self) -> str:
        """``Dispatcher(device=..., backends=[...], budget=N, cache=path)``: what it serves."""
        cache = self.cache
        where = "memory only" if cache is None else str(cache.path)
        names = ", ".join(b.name for b in self.available) or "none available"
        return (f"Dispatcher(device={self.device.name!r} ({self.device.kind}), "
                f"backends=[{names}], budget={self.budget}, precision={self.precision!r}, "
                f"cache={where!r})")  # fmt: skip

    @property
    def cache(self) -> TuningCache | None:
        """The tuning cache this dispatcher reads and writes (None: memory only)."""
        return self.winners.cache

    # ---- backends -------------------------------------------------------------------

    @property
    def faults(self) -> list[Fault]:
        """Every contained fault of plugin code in this dispatcher (shown by list-backends)."""
        return self.registry.faults

    def _check_support(self, backend: Backend) -> tuple[Status, str]:
        """Through the guard: raising or returning a non-`Support` marks the backend failed."""
        support = self.guard.supports(backend, self.device)
        if isinstance(support, PluginFault):  # recorded (strict mode raised already)
            return "failed", support.fault.what
        return ("available" if support.ok else "unsupported"), support.reason

    def backends(self) -> list[BackendStatus]:
        """Every backend and every plugin that failed or was disabled, for ``list-backends``."""
        return backend_rows(self.registry, self._status, self.guard.hook_summary)

    # ---- ranking --------------------------------------------------------------------

    def operation_of(self, operation: str) -> str:
        """The problem operation a call of `operation` is under this dispatcher's precision
        (`fp4_dispatch.contracts.tactics.problem_operation`: "w4a16" becomes "w4a8" under "fp8";
        "w4a8" itself is refused under "exact")."""
        return problem_operation(operation, self.precision)

    def candidates(
        self,
        m: int,
        n: int,
        k: int,
        out_dtype: str = "bfloat16",
        operation: str = "w4a4",
        groups: int | None = None,
    ) -> Shortlist:
        """The capped, explained shortlist for one problem (``operation`` w4a4 or w4a16,
        ranked as `operation_of` says, or a grouped one with ``groups`` = E; each
        candidate names the operation it computes)."""
        checks.problem_dims(m, n, k)
        operation = self.operation_of(operation)
        return self.ranker.shortlist(
            Problem(m=m, n=n, k=k, out_dtype=out_dtype, operation=operation, groups=groups)
        )

    def select(
        self,
        m: int,
        n: int,
        k: int,
        out_dtype: str = "bfloat16",
        operation: str = "w4a4",
        groups: int | None = None,
    ) -> Candidate:
        """The candidate a call of this shape would run: the bucket's tuned winner if there
        is a valid one, else the heuristic pick (logged once per bucket). A (backend,
        tactic) that failed to build or run in this process is never selected.
        ``groups``: E of a grouped operation (docs/grouped.md)."""
        checks.problem_dims(m, n, k)
        operation = self.operation_of(operation)
        tuned = self.winners.pick(m, n, k, out_dtype, operation, groups)
        if tuned is not None and (tuned.backend, tuned.tactic) not in self.guard.broken:
            return tuned
        pick = self.ranker.pick(m, n, k, out_dtype, operation, groups)
        bkey = bucket_key(m, n, k, out_dtype, operation, groups)
        if bkey not in self._untuned_logged:
            self._untuned_logged.add(bkey)
            log.info(
                "bucket %s is not tuned: heuristic pick %s %s",
                describe(bkey), pick.backend, pick.tactic.canonical_json(),
            )  # fmt: skip
        return pick

    # ---- tuning ---------------------------------------------------------------------

    @property
    def device_fingerprint(self) -> str:
        """Identity of this device in the tuning cache (name, capability, SM count)."""
        d = self.device
        return device_fingerprint(d.name, d.compute_capability, d.sm_count)

    def tune(
        self,
        shapes: Iterable[tuple[int, int, int]],
        *,
        out_dtype: str = "bfloat16",
        operation: str = "w4a4",
        measure: str = "graph",
        group: object = None,
        force: bool = False,
        save: bool = True,
        progress: bool | None = None,
        timer: _tuning.Timer | None = None,
        band: float | None = None,
        precompile: bool | None = None,
        groups: int | None = None,
    ) -> list[_tuning.TuneResult]:
        """Measure the shortlist of each shape's bucket and adopt the winners.

        ``shapes``: (M, N, K) tuples; shapes of one bucket are tuned once. ``operation``:
        "w4a4" (both operands NVFP4) or "w4a16" (dense activations). ``measure``: the
        policy, "graph" (CUDA-graph replay, cold L2: graph-captured serving) or "eager"
        (back-to-back launches); a CPU measures eagerly whatever is asked. A bucket with
        a valid cached winner of the same policy is not measured again unless ``force``
        (its result has ``source == "cache"``). The heuristic pick always races and is
        replaced only by a winner faster in a paired check (`fp4_dispatch.autotune.tuning`).
        Winners are used by `gemm`/`select` from now on and, when ``save``, merged into
        the tuning cache. A tactic that fails to build or run is timed as infinity and
        listed in the result's ``failures``, never raised. ``group``: a
        ``torch.distributed`` process group whose ranks tune together, each measuring
        its share; every rank adopts the same winners and only the group's rank 0 writes
        the cache (`fp4_dispatch.autotune.distributed`; every rank must call with the same
        shapes). ``progress``: a progress bar (None: ``FP4_DISPATCH_PROGRESS``, else only
        on a terminal). ``timer``/``band``: see `fp4_dispatch.autotune.tuning.Tuner`. ``precompile``
        (default: on for CUDA devices): first compile the shortlists' kernels in parallel
        worker processes (`fp4_dispatch.autotune.precompile`; skipped for kernels this process
        already compiled); the one progress bar counts compiles and measurements.
        ``groups``: the expert count E, for (and only for) a grouped ``operation``
        ("grouped_w4a16", "grouped_w4a4"); M is then the total rows (docs/grouped.md).
        """
        groups = check_groups(operation, groups)
        if out_dtype not in _tuning.OUT_DTYPES:
            raise ValueError(
                f"out_dtype: expected one of {sorted(_tuning.OUT_DTYPES)}, got {out_dtype!r}"
            )
        operation = self.operation_of(operation)  # raises for an unknown or refused one
        if shapes is None or isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
            raise TypeError(f"shapes: expected an iterable of (M, N, K) tuples, got "
                            f"{type(shapes).__name__}")  # fmt: skip
        fleet = _distributed.fleet_of(group)
        tuner = _tuning.Tuner(self.device, self.kernel_for, self.ranker, timer=timer, band=band,
                              measure=measure)  # fmt: skip
        order, results, todo = self._tune_todo(shapes, out_dtype, operation, force, tuner.policy,
                                               groups)  # fmt: skip
        if fleet is not None:
            todo = self._fleet_todo(fleet, todo, results, order)
        shortlists = [
            self.ranker.shortlist(p.model_copy(update={"m": m_bucket(p.m)})).candidates
            for p in todo
        ]
        if precompile is None:
            precompile = self.device.kind == "cuda"
        new_jobs = _precompile.jobs_for(self._compile_pairs(todo, shortlists, fleet))
        jobs = new_jobs if precompile else []
        total = sum(len(sl) for sl in shortlists) + len(jobs)
        with bar_of(range(total), total=total, desc="tuning", unit="kernel",
                    enable=progress) as bar:  # fmt: skip
            if jobs:
                bar.set_description_str(f"compiling {len(jobs)} kernels")
                _precompile.precompile(jobs, self.device, deadline_s=_precompile.TUNE_DEADLINE_S,
                                       on_outcome=lambda _: bar.update(1))  # fmt: skip
            for p, sl in zip(todo, shortlists, strict=True):
                bar.set_description_str(f"tuning M={p.m} N={p.n} K={p.k}")
                result = tuner.tune(p, bar, sl, fleet=fleet)
                results[result.bucket] = result
                self._adopt(result, save and (fleet is None or fleet.is_root))
        if fleet is not None:
            fleet.agree("the tuned picks", [_pick_of(results[b]) for b in order])
        _precompile.mark_ready(new_jobs)  # each one was built and launched
        return [results[b] for b in order]

    def _compile_pairs(
        self,
        todo: list[Problem],
        shortlists: list[list[Candidate]],
        fleet: _distributed.Fleet | None,
    ) -> list[tuple[Backend, Tactic, Problem]]:
        """(backend, tactic, problem) of every kernel this rank will launch while tuning:
        what each bucket races (`tuning.race_list`), in a group only this rank's share
        (`Fleet.share`, as the tuner splits it) plus, on rank 0, the default pick for
        the paired check. A winner another rank compiled is in Triton's on-disk cache on
        a shared host; elsewhere it compiles once at the paired check."""
        pairs = []
        for p, sl in zip(todo, shortlists, strict=True):
            bucket = p.model_copy(update={"m": m_bucket(p.m)})
            race, default = _tuning.race_list(self.ranker, bucket, sl)
            if fleet is not None:
                mine = [race[i] for i in fleet.share(len(race))]
                ours = {(c.backend, c.tactic) for c in mine}
                extra = fleet.is_root and (default.backend, default.tactic) not in ours
                race = mine + [default] * extra
            pairs += [(self.registry.backends[c.backend], c.tactic, p.as_operation(c.operation))
                      for c in race]  # fmt: skip
        return pairs

    def _tune_todo(
        self,
        shapes: Iterable[tuple[int, int, int]],
        out_dtype: str,
        operation: str,
        force: bool,
        policy: str,
        groups: int | None = None,
    ) -> tuple[list[BucketKey], dict[BucketKey, _tuning.TuneResult], list[Problem]]:
        """(buckets in the order asked, cached results of this policy, problems to measure):
        one problem per bucket, the first shape asked of it."""
        todo: list[Problem] = []
        results: dict[BucketKey, _tuning.TuneResult] = {}
        order: list[BucketKey] = []
        for shape in shapes:
            m, n, k = _shape(shape)
            bkey = bucket_key(m, n, k, out_dtype, operation, groups)
            if bkey in order:
                continue
            order.append(bkey)
            hit = None if force else self.winners.cached_result(bkey, (m, n, k), policy)
            if hit is not None:
                results[bkey] = hit
            else:
                todo.append(Problem(m=m, n=n, k=k, out_dtype=out_dtype, operation=operation,
                                    groups=groups))  # fmt: skip
        return order, results, todo

    def _fleet_todo(
        self,
        fleet: _distributed.Fleet,
        todo: list[Problem],
        results: dict[BucketKey, _tuning.TuneResult],
        order: list[BucketKey],
    ) -> list[Problem]:
        """The buckets the whole group measures: those any rank lacks (in `order`), so
        every rank runs the same collectives; a local cache hit of one is re-measured."""
        fleet.agree("the shapes to tune", order)
        problems = {bucket_key(p.m, p.n, p.k, p.out_dtype, p.operation, p.groups): p
                    for p in todo}  # fmt: skip
        need = set().union(*fleet.gather(sorted(problems)))
        out = []
        for bkey in order:
            if bkey not in need:
                continue
            hit = results.pop(bkey, None)
            if bkey in problems:
                out.append(problems[bkey])
            else:  # a local hit another rank lacks: measure it with the group
                assert hit is not None
                m, n, k = hit.requested or (hit.problem.m, hit.problem.n, hit.problem.k)
                out.append(Problem(m=m, n=n, k=k, out_dtype=bkey[3], operation=bkey[4],
                                   groups=bkey[5] if len(bkey) > 5 else None))  # fmt: skip
        return out

    def _adopt(self, result: _tuning.TuneResult, save: bool) -> None:
        """Use a measured winner from now on (new plans for its bucket); maybe save it."""
        bkey = result.bucket
        self._autotuned.add((bkey, result.measure))
        if result.winner is None:
            return
        self.winners.adopt(result, save)
        self.plan_epoch += 1
        self._plans = {
            key: plan for key, plan in self._plans.items()
            if bucket_key(*key) != bkey
        }  # fmt: skip

    @contextlib.contextmanager
    def autotuning(self, *, measure: str = "graph", group: object = None) -> Iterator[Runner]:
        """While active, `gemm`/`mm_fp4` on a bucket with no tuned winner tunes it first.

        The winner is used at once and saved to the cache. ``measure``: the policy of
        `tune` ("graph" or "eager"). ``group``: a ``torch.distributed`` process group
        tuning together (see `tune`): every rank must make the same calls in the same
        order (as the ranks of a tensor-parallel model do), since each first call of a
        bucket is a collective. Inside CUDA-graph capture
        (``torch.cuda.is_current_stream_capturing()``) nothing is tuned and nothing
        synchronizes: the cached or heuristic pick runs, with a warning once per bucket;
        the bucket is tuned on its next call outside capture. Nests (the innermost
        block's options apply); not thread-safe.
        """
        _tuning.policy_of(self.device, measure)  # raises for an unknown policy
        if group is not None:
            _distributed.Fleet(group)  # raises now for a bad group, not on a later call
        self._autotune_depth += 1
        self._autotune_opts.append((measure, group))
        try:
            yield self
        finally:
            self._autotune_opts.pop()
            self._autotune_depth -= 1

    def _capturing(self) -> bool:
        """Is the current CUDA stream being captured into a graph (never tune then)?"""
        return self.device.kind == "cuda" and torch.cuda.is_current_stream_capturing()

    def _autotune(
        self,
        m: int,
        n: int,
        k: int,
        dtype: str,
        operation: str = "w4a4",
        groups: int | None = None,
    ) -> None:
        bkey = bucket_key(m, n, k, dtype, operation, groups)
        measure, group = self._autotune_opts[-1] if self._autotune_opts else ("graph", None)
        policy = _tuning.policy_of(self.device, measure)
        done = (bkey, policy)  # settled for this policy (a winner of the other is no hit)
        if done in self._autotuned:
            return
        # in a group every rank must reach `tune` (a collective), whatever its own cache
        # holds: `tune` measures only buckets that some rank lacks
        if group is None and self.winners.cached_result(bkey, (m, n, k), policy) is not None:
            self._autotuned.add(done)
            return
        if self._capturing():
            if bkey not in self._capture_warned:
                self._capture_warned.add(bkey)
                log.warning("autotuning: %s called inside CUDA-graph capture; not tuning "
                            "now (heuristic or cached pick used)", describe(bkey))  # fmt: skip
            return
        self._autotuned.add(done)
        self.tune([(m, n, k)], out_dtype=dtype, operation=operation, measure=measure,
                  group=group, groups=groups)  # fmt: skip

    # ---- running --------------------------------------------------------------------

    def kernel_for(self, candidate: Candidate, problem: Problem) -> Kernel:
        """Build (once) the kernel of `candidate` for problems of this bucket."""
        bucketed = kernel_problem(problem.as_operation(candidate.operation), candidate.tactic)
        key = (candidate.backend, candidate.tactic, bucketed)
        kernel = self._kernels.get(key)
        if kernel is None:
            backend = self.registry.backends[candidate.backend]
            log.info("building %s %s for %s", candidate.backend, candidate.tactic, bucketed)
            # raises PluginFault (recorded, pair marked broken) when build fails or
            # returns something that is not callable
            kernel = self.guard.build(backend, candidate.tactic, bucketed, self.device)
            self._kernels[key] = kernel
        return kernel

    def cached_plan(
        self,
        m: int,
        n: int,
        k: int,
        dtype: str,
        operation: str = "w4a4",
        groups: int | None = None,
    ) -> Plan | None:
        """The plan of this exact problem if one was made, else None (never ranks or builds).

        Tuning replaces a bucket's plans with new objects, so a changed plan is not warm.
        A dense call's plan is found by "w4a16" under either precision (`dense_operation`).
        ``groups``: E of a grouped operation.
        """
        if operation == "w4a16":
            operation = self.dense_operation
        if groups is not None:
            return self._plans.get((m, n, k, dtype, operation, groups))
        return self._plans.get((m, n, k, dtype, operation))

    def _new_plan(self, key: PlanKey) -> Plan:
        """The selected candidate's plan; on a failed build, the next candidate's.

        Each failed (backend, tactic) is remembered for the process (`Guard.broken`), so
        the next `select` ranks without it: the loop ends when a build works or ranking
        finds no candidate left (its RuntimeError then lists why). Strict: raises.
        """
        m, n, k, dtype, op = key[:5]
        groups = key[5] if len(key) > 5 else None
        problem = Problem(m=m, n=n, k=k, out_dtype=dtype, operation=op, groups=groups)
        while True:
            candidate = self.select(m, n, k, dtype, op, groups)
            try:
                kernel = self.kernel_for(candidate, problem)
            except Exception as exc:  # recorded by the guard; fall back unless strict
                err = exc if isinstance(exc, PluginFault) else getattr(exc, "plugin_fault", None)
                if not isinstance(err, PluginFault):
                    err = self.guard.fault(candidate.backend, "build()", exc, candidate.tactic)
                self._fall_back(candidate, err)
                continue
            plan = self._plans[key] = plan_for(key, candidate, kernel, self.replay)
            return plan

    def _fall_back(self, candidate: Candidate, err: PluginFault) -> None:
        """Forget every plan and memo that used `candidate`; warn once; strict: raise."""
        if self.strict:
            raise err
        self.guard.broken.add((candidate.backend, candidate.tactic))
        log.warning(
            "backend %s tactic %s failed (%s); falling back to the next candidate",
            candidate.backend, candidate.tactic.canonical_json(), err.fault.message,
        )  # fmt: skip
        self.ranker.clear()
        gone = (candidate.backend, candidate.tactic)
        self.plan_epoch += 1
        self._plans = {
            key: plan for key, plan in self._plans.items()
            if (plan.candidate.backend, plan.candidate.tactic) != gone
        }  # fmt: skip

    def check_device(self, name: str, t: torch.Tensor) -> torch.device:
        """The torch device this dispatcher runs on; raises unless `t` is there and it is real
        (`checks.on_device`: a CUDA tensor is compared by index, without ``t.device``)."""
        want = self._torch_device
        if want is not None and checks.on_device(t, want):
            return want
        if want is None:
            raise RuntimeError(
                f"{self.device.name} is simulated: it ranks and compiles but runs nothing; "
                "use Dispatcher() on the real device to run a GEMM"
            )
        raise ValueError(
            f"{name}: expected a tensor on the dispatcher's device {want}, got {t.device}"
        )

    def run_checked(
        self,
        a: torch.Tensor,
        sa: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        dtype: str,
        alpha_b: torch.Tensor | None = None,
    ) -> None:
        """The W4A4 hot path: checked operands (`GemmOperands` order) through their plan;
        ``alpha_b`` an optional second factor of ``alpha`` (`GemmOperands.alpha_b`)."""
        if a.shape[0] and b.shape[0]:  # an empty product (an empty batch): nothing to do
            self._run(self.w4a4_plan_key(a, b, dtype), (a, sa, b, sb, alpha, out, alpha_b))

    def w4a4_plan_key(self, a: torch.Tensor, b: torch.Tensor, dtype: str) -> PlanKey:
        """The plan key of a `run_checked` call (``a``, ``b``: the packed data)."""
        return (a.shape[0], b.shape[0], a.shape[1] * 2, dtype, "w4a4")

    def dense_plan_key(self, a: torch.Tensor, b: torch.Tensor, dtype: str) -> PlanKey:
        """The plan key of a `run_dense` call (``a`` dense, ``b`` the packed weight)."""
        return (a.shape[0], b.shape[0], a.shape[1], dtype, self.dense_operation)

    def run_dense(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        dtype: str,
        bias: torch.Tensor | None = None,
        b_prepared: torch.Tensor | None = None,
    ) -> None:
        """The dense hot path: ``a`` [M, K] times the NVFP4 ``b`` through their plan (W4A16;
        under ``precision="fp8"`` the plan's candidate may be W4A8);
        ``bias`` ([N], optional) is added to every row (`DenseOperands.bias`);
        ``b_prepared``: ``b`` in the sm90-prepared byte order, or None
        (`DenseOperands.b_prepared`)."""
        if a.shape[0] and b.shape[0]:
            self._run(self.dense_plan_key(a, b, dtype), (a, b, sb, alpha, out, bias, b_prepared))

    def run_grouped(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
        dtype: str,
    ) -> None:
        """The grouped hot path (`GroupedOperands`): ``a`` dense ``[T, K]`` (``a_scale``
        None: grouped W4A16) or NVFP4 data ``[T, K/2]`` with its swizzled scales (grouped
        W4A4), the expert stack ``b`` ``[E, N, K/2]``/``sb``, ``alpha`` ``[E]``, device
        ``offsets`` ``[E]``. The plan key holds E; nothing reads the offsets here."""
        if not (a.shape[0] and b.shape[1]):
            return
        e = b.shape[0]
        if a_scale is None:
            self._run((a.shape[0], b.shape[1], a.shape[1], dtype, "grouped_w4a16", e),
                      (a, b, sb, alpha, offsets, out))  # fmt: skip
        else:
            self._run((a.shape[0], b.shape[1], a.shape[1] * 2, dtype, "grouped_w4a4", e),
                      (a, a_scale, b, sb, alpha, offsets, out))  # fmt: skip

    def _run(self, key: PlanKey, args: tuple) -> None:
        """Run `args` through the plan of `key`.

        Outside a CUDA-graph capture this may make the plan (select, build, and under
        `autotuning` tune). Inside one only a warm plan of the exact problem launches;
        else `fp4_dispatch.engine.capture.CaptureNotWarmError` before anything launches.
        """
        plan = self._plans.get(key)
        if stream_capturing():
            self._launch_captured(key, plan, args)
            return
        if self._autotune_depth:
            self._autotune(*key)
            plan = self._plans.get(key)
        while True:
            if plan is None:
                plan = self._new_plan(key)
            # inline (zero-cost try) rather than guard.contain: this is the hot path
            # a warm plan runs its replay where it has one (`fp4_dispatch.engine.plans`)
            try:
                plan.run(args)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # plugin kernel: recorded; the next one rewrites out
                # the caller's fault (it runs on fresh copies of the arguments)? then raise,
                # recording nothing: no caller can disable a backend for later callers
                blame = _blame.callers_fault(plan, args, exc)
                if blame is not None:
                    raise blame from exc
                cand = plan.candidate
                err = self.guard.fault(cand.backend, "kernel()", exc, cand.tactic, quiet=True)
            else:
                if plan.warm or not self.first_use.needed(plan):
                    break
                wrong = self.first_use.check(plan, args)  # a plugin's kernel, first run
                if wrong is None:
                    break
                cand = plan.candidate
                err = self.guard.fault(cand.backend, "kernel() result", wrong, cand.tactic,
                                       quiet=True)  # fmt: skip
            self._fall_back(plan.candidate, err)
            plan = None
        plan.warm = True
        self._ran.add(key)

    def replay_of(self, key: PlanKey, args: tuple) -> object | None:
        """The recorded replay that `args` (checked operands, as `_run` takes them) hit in
        the warm plan of `key`, or None. Valid while `plan_epoch` is unchanged and no
        `autotuning` block is active (`Nvfp4Linear` keeps it per layer)."""
        plan = self._plans.get(key)
        if plan is None or not plan.warm or self._autotune_depth:
            return None
        replay = plan.replays.get(plan.replay_key(args))
        return replay if callable(replay) else None

    def _launch_captured(self, key: PlanKey, plan: Plan | None, args: tuple) -> None:
        if plan is None or not plan.warm:
            why = (
                "after its plan changed since it last ran (re-tuned?)"
                if key in self._ran
                else "without ever having run eagerly"
            )
            raise not_warm(self.device.name, key, why)
        if key not in self._announced:
            self._announced.add(key)
            log.info("capturing %s for M=%d N=%d K=%d (%s)", plan.candidate.backend,
                     *key[:3], plan.candidate.reason)  # fmt: skip
        plan(*args)

    def run(self, operands: GemmOperands, out: torch.Tensor, dtype: str) -> torch.Tensor:
        """Run checked operands through the plan for their shape (no further checks)."""
        o = operands
        self.run_checked(o.a_data, o.a_scale, o.b_data, o.b_scale, o.alpha, out, dtype)
        return out

    def run_candidate(
        self, candidate: Candidate, operands: GemmOperands, out: torch.Tensor
    ) -> torch.Tensor:
        """Run one specific candidate (doctor, tuning), building its kernel if needed."""
        dtype = checks.out_dtype_name(out.dtype)
        problem = Problem(m=operands.m, n=operands.n, k=operands.k, out_dtype=dtype)
        return launch(candidate, self.kernel_for(candidate, problem), operands, out)


def _pick_of(result: _tuning.TuneResult) -> tuple:
    """What ranks of a tuning group must agree on for one bucket (picklable, comparable)."""
    w = result.winner
    return (result.bucket, None if w is None else (w.backend, w.tactic.canonical_json()),
            result.kept_default)  # fmt: skip


#: live engines by their op id (`dispatcher_id`): a compiled graph holds the id, a plain int
_ids_lock = threading.Lock()
_next_id = itertools.count(1)
_by_id: weakref.WeakValueDictionary[int, Runner] = weakref.WeakValueDictionary()
_id_of: weakref.WeakKeyDictionary[Runner, int] = weakref.WeakKeyDictionary()


@torch.compiler.assume_constant_result
def dispatcher_id(dispatcher: Runner) -> int:
    """The op-level id of `dispatcher` (registered on first use, held weakly).

    Under torch.compile this runs at trace time and the id becomes a constant of the
    graph (dynamo guards on the dispatcher object, so another one recompiles).
    """
    with _ids_lock:
        did = _id_of.get(dispatcher)
        if did is None:
            did = next(_next_id)
            _id_of[dispatcher] = did
            _by_id[did] = dispatcher
        return did


def runner_of(did: int) -> Runner | None:
    """The live engine of op id `did`, or None once it was garbage-collected."""
    return _by_id.get(did)
