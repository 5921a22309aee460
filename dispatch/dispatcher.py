"""The engine: one `Dispatcher` per device loads backends, ranks their tactics, runs the winner.

``Dispatcher().gemm(qa, qb)`` checks its arguments, looks up the plan for the problem
(the tuned winner of its bucket, else the memoized heuristic pick), builds the kernel
once, and runs it. Nothing is written to ``out`` unless every check has passed.

Tuning (`Dispatcher.tune`, or ``with d.autotuning():``) measures a bucket's shortlist
(`fp4_dispatch.tuning`) and hands the winner to the winner store
(`fp4_dispatch.winners`, over the cache file `fp4_dispatch.cache`), which this
dispatcher reads lazily: each cached winner of its device is re-validated before first
use, and a stale one is ignored with a warning. Tuning never happens on the hot path
outside those two.

Not the engine, so elsewhere (importable from here as before): the ``list-backends``
rows (`fp4_dispatch.status`: `BackendStatus`), ``launch`` (`fp4_dispatch.guard`), the
``cache`` argument rule (`fp4_dispatch.cache.from_argument`) and the ``shapes`` check
(`fp4_dispatch.checks.tune_shape`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from . import blame as _blame
from . import checks, registry, torch_ops
from . import distributed as _distributed
from . import firstuse as _firstuse
from . import precompile as _precompile
from . import tuning as _tuning
from .backend import Backend, GemmOperands, Kernel, kernel_problem
from .buckets import BucketKey, bucket_key, describe, m_bucket
from .cache import TuningCache, device_fingerprint
from .cache import from_argument as _tuning_cache
from .checks import tune_shape as _shape
from .device import DeviceInfo
from .grouped import Nvfp4Experts, check_groups, check_offsets
from .guard import Fault, Guard, PluginFault
from .guard import launch_candidate as launch
from .nvfp4 import Nvfp4Tensor
from .plans import Plan, PlanKey, plan_for, replays_default
from .profiles import resolve
from .progress import progress as bar_of
from .ranking import Candidate, Ranker, Shortlist
from .status import BackendStatus, Status, backend_rows
from .tactics import Problem, Tactic, check_precision, problem_operation
from .winners import TunedWinners

log = logging.getLogger(__name__)


class Dispatcher:
    """Picks and runs NVFP4 GEMM kernels for one device.

    ``device``: None/"auto" (detect), "cpu", "cuda[:N]", a `DeviceInfo`, or a simulated
    family ("sm90", "sm100", "sm103", "sm107") for inspecting dispatch without the
    hardware (simulated devices rank and compile but run nothing). ``strict`` (default
    ``FP4_DISPATCH_STRICT``) turns any plugin or backend failure into an exception.
    ``budget`` is how many tactics a shortlist keeps. ``cache``: the tuning cache file
    (None = `fp4_dispatch.cache.default_path()`, i.e. ``FP4_DISPATCH_CACHE`` or the user
    cache dir; a path; a `TuningCache`; False = keep tuned winners in memory only).
    ``verify_cache`` (default ``FP4_DISPATCH_VERIFY_CACHE``, on): run each cached winner
    once on its first use in this process and ignore it (one warning) if its output is
    not the reference's (`fp4_dispatch.winners`). ``replay`` (default
    ``FP4_DISPATCH_REPLAY``, on): a warm plan relaunches its recorded kernels through the
    CUDA driver with a kept argument buffer (`fp4_dispatch.plans`), the eager fast path.
    ``precision``: ``"exact"`` (default) never runs a lossy candidate; ``"fp8"`` lets
    dense (W4A16) calls also run as W4A8, activations and weights rounded to FP8 E4M3
    for the FP8 tensor cores, whenever that ranks (or tunes) faster: the problem is then
    ``operation="w4a8"`` everywhere (plans, ranking, tuning, cache), its candidates
    ``w4a16`` or ``w4a8`` (docs/PRECISION.md).

    ``verify_plugins`` (default ``FP4_DISPATCH_VERIFY_PLUGINS``, on): the first run of each
    (backend, tactic, shape bucket) of a plugin that is not built in is compared with the
    float64 reference on a sample of its output, once per process; a wrong kernel is
    marked broken and the call falls back (`fp4_dispatch.firstuse`).
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
        #: the precision policy (`fp4_dispatch.tactics.PRECISIONS`)
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
        #: this dispatcher's id for the ``fp4_dispatch::gemm`` op: a plain int, so that
        #: torch.compile can read it from a module attribute without tracing the registry
        self.op_id = torch_ops.dispatcher_id(self)
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
        #: the first run of each third-party (backend, tactic, bucket) is checked
        self.first_use = _firstuse.FirstUse(
            _firstuse.default() if verify_plugins is None else verify_plugins,
            lambda name: not getattr(self.registry.plugin_of.get(name), "builtin", True),
        )
        self.winners = TunedWinners(self, _tuning_cache(cache), verify_cache)
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
        (`fp4_dispatch.tactics.problem_operation`: "w4a16" becomes "w4a8" under "fp8";
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
        replaced only by a winner faster in a paired check (`fp4_dispatch.tuning`).
        Winners are used by `gemm`/`select` from now on and, when ``save``, merged into
        the tuning cache. A tactic that fails to build or run is timed as infinity and
        listed in the result's ``failures``, never raised. ``group``: a
        ``torch.distributed`` process group whose ranks tune together, each measuring
        its share; every rank adopts the same winners and only the group's rank 0 writes
        the cache (`fp4_dispatch.distributed`; every rank must call with the same
        shapes). ``progress``: a progress bar (None: ``FP4_DISPATCH_PROGRESS``, else only
        on a terminal). ``timer``/``band``: see `fp4_dispatch.tuning.Tuner`. ``precompile``
        (default: on for CUDA devices): first compile the shortlists' kernels in parallel
        worker processes (`fp4_dispatch.precompile`; skipped for kernels this process
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
    def autotuning(self, *, measure: str = "graph", group: object = None) -> Iterator[Dispatcher]:
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
            self._run((a.shape[0], b.shape[0], a.shape[1] * 2, dtype, "w4a4"),
                      (a, sa, b, sb, alpha, out, alpha_b))  # fmt: skip

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
            self._run((a.shape[0], b.shape[0], a.shape[1], dtype, self.dense_operation),
                      (a, b, sb, alpha, out, bias, b_prepared))  # fmt: skip

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
        else `fp4_dispatch.torch_ops.CaptureNotWarmError` before anything launches.
        """
        plan = self._plans.get(key)
        if torch_ops.stream_capturing():
            self._launch_captured(key, plan, args)
            return
        if self._autotune_depth:
            self._autotune(*key)
            plan = self._plans.get(key)
        while True:
            if plan is None:
                plan = self._new_plan(key)
            # inline (zero-cost try) rather than guard.contain: this is the hot path
            try:
                plan.run(args)  # a warm plan's replay where it has one (`fp4_dispatch.plans`)
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
            raise torch_ops.not_warm(self.device.name, key, why)
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

    def gemm(
        self,
        qa: Nvfp4Tensor | torch.Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[M, N] = A @ dequant(qb).T`` (B held as [N, K], like a Linear weight).

        ``qa`` an `Nvfp4Tensor`: W4A4 (both operands NVFP4; ``out_dtype`` default bfloat16).
        ``qa`` a dense bfloat16/float16 ``[M, K]`` tensor: W4A16, weight-only (activations
        stay as they are; ``out_dtype`` default ``qa.dtype``). Arguments are checked here,
        once; under torch.compile the GEMM is a custom op (no graph break, plan made at
        run time); eagerly the plan runs directly; inside a CUDA-graph capture only an
        already-run plan launches.
        """
        qb = checks.nvfp4_operand("qb", qb)
        if isinstance(qa, torch.Tensor):
            return self._gemm_dense(qa, qb, out_dtype, out)
        qa = checks.nvfp4_operand("qa", qa)
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        dtype = checks.out_dtype_name(out_dtype)
        checks.k_dims(qa.k, qb.k)
        device = self.check_device("qa", qa.data)
        checks.same_device(device, qb=qb.data)
        # backends read natural data order (an "sm90-prepared" weight is restored here)
        qa, qb = qa.with_layout("swizzled").natural(), qb.with_layout("swizzled").natural()
        if out is not None:
            out = checks.out_tensor(out, qa.rows, qb.rows, out_dtype, device)
        if torch.compiler.is_compiling():
            alpha = (qa.global_scale * qb.global_scale).reshape(1)
            return torch_ops.run(self, qa.data, qa.scale, qb.data, qb.scale, alpha, out_dtype, out)
        if out is None:  # eagerly: straight to the plan (checked here, once)
            out = torch.empty((qa.rows, qb.rows), dtype=out_dtype, device=device)
        # the global scales as alpha's two factors: the kernel multiplies them (or the plan)
        self.run_checked(qa.data, qa.scale, qb.data, qb.scale, qa.global_scale, out, dtype,
                         qb.global_scale)  # fmt: skip
        return out

    def _gemm_dense(
        self,
        a: torch.Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        a = checks.dense_activation("qa", a)
        out_dtype = a.dtype if out_dtype is None else out_dtype
        dtype = checks.out_dtype_name(out_dtype)
        checks.k_dims(a.shape[1], qb.k)
        device = self.check_device("qa", a)
        checks.same_device(device, qb=qb.data)
        qb = qb.with_layout("swizzled").natural()  # backends read natural data order
        if out is not None:
            out = checks.out_tensor(out, a.shape[0], qb.rows, out_dtype, device)
        alpha = qb.global_scale.reshape(1)  # a view: no kernel launch
        if torch.compiler.is_compiling():
            return torch_ops.run_w4a16(self, a, qb.data, qb.scale, alpha, out_dtype, out)
        if out is None:
            out = torch.empty((a.shape[0], qb.rows), dtype=out_dtype, device=device)
        self.run_dense(a, qb.data, qb.scale, alpha, out, dtype)
        return out

    def grouped_gemm(
        self,
        a: torch.Tensor | Nvfp4Tensor,
        b: Nvfp4Experts,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The grouped (mixture-of-experts) GEMM, torch's ``_grouped_mm`` convention:
        ``out[r] = A[r] @ dequant(b[e]).T`` for the rows ``r`` of each expert ``e``
        (docs/grouped.md).

        ``a``: ``[T, K]`` rows sorted by expert: dense bfloat16/float16 (grouped W4A16;
        ``out_dtype`` default ``a.dtype``) or an `Nvfp4Tensor` (grouped W4A4; default
        bfloat16). ``b``: the stacked expert weights, an `Nvfp4Experts` ``[E, N, K]``.
        ``offsets``: int32 ``[E]`` on the same device, cumulative row ends (empty experts
        allowed; the last must be T). Its values are never read here (no host sync), so
        the call is capturable in a CUDA graph once its plan is warm. ``out``: optional
        ``[T, N]`` output."""
        if not isinstance(b, Nvfp4Experts):
            raise TypeError(f"b: expected an Nvfp4Experts [E, N, K] (quantize_experts), "
                            f"got {type(b).__name__}")  # fmt: skip
        e, n, k = b.shape
        if isinstance(a, Nvfp4Tensor):
            qa = a.with_layout("swizzled").natural()
            checks.k_dims(qa.k, k, ("a", "b"))
            out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
            device = self.check_device("a", qa.data)
            x, a_scale, t = qa.data, qa.scale, qa.rows
        else:
            x = checks.dense_activation("a", a)
            checks.k_dims(x.shape[1], k, ("a", "b"))
            out_dtype = x.dtype if out_dtype is None else out_dtype
            device = self.check_device("a", x)
            a_scale, t = None, x.shape[0]
        dtype = checks.out_dtype_name(out_dtype)
        checks.same_device(device, b=b.data, offsets=offsets)
        check_offsets(offsets, e)
        out = checks.out_tensor(out, t, n, out_dtype, device)
        # per-expert alpha: the weights' scales (a view), times A's for W4A4 (one launch)
        alpha = b.global_scale if a_scale is None else b.global_scale * qa.global_scale
        if torch.compiler.is_compiling():
            return torch_ops.run_grouped(self, x, a_scale, b.data, b.scale, alpha, offsets,
                                         out_dtype, out)  # fmt: skip
        if out is None:
            out = torch.empty((t, n), dtype=out_dtype, device=device)
        self.run_grouped(x, a_scale, b.data, b.scale, alpha, offsets, out, dtype)
        return out

    def mm_fp4(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        a_descale: torch.Tensor,
        b_descale: torch.Tensor,
        alpha: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FlashInfer-style call: ``a`` [M, K/2] fp4, ``b`` the [K/2, N] transposed view of an
        [N, K/2] tensor, swizzled e4m3 descales, ``alpha`` one float32 element (the
        product of the global scales)."""
        a = checks.fp4_data("a", a)
        b = checks.fp4_data("b", b)
        checks.out_dtype_name(out_dtype)
        if not a.is_contiguous():
            raise ValueError(f"a: expected a contiguous [M, K/2] tensor, got strides {a.stride()}")
        if not b.t().is_contiguous():
            raise ValueError(
                "b: expected the [K/2, N] transposed view of a contiguous [N, K/2] tensor "
                f"(strides (1, K/2)), got strides {b.stride()}"
            )
        m, n = a.shape[0], b.shape[1]
        k = checks.k_dims(a.shape[1] * 2, b.shape[0] * 2, ("a", "b"))
        a_scale = checks.swizzled_scale("a_descale", a_descale, m, k)  # types before devices
        b_scale = checks.swizzled_scale("b_descale", b_descale, n, k)
        device = self.check_device("a", a)
        checks.same_device(device, b=b, a_descale=a_descale, b_descale=b_descale)
        alpha = checks.alpha_tensor(alpha, device)
        out = checks.out_tensor(out, m, n, out_dtype, device)
        return torch_ops.run(self, a, a_scale, b.t(), b_scale, alpha, out_dtype, out)


torch_ops.set_default_factory(
    lambda device, precision: Dispatcher(device=device, precision=precision)
)


def _pick_of(result: _tuning.TuneResult) -> tuple:
    """What ranks of a tuning group must agree on for one bucket (picklable, comparable)."""
    w = result.winner
    return (result.bucket, None if w is None else (w.backend, w.tactic.canonical_json()),
            result.kept_default)  # fmt: skip
