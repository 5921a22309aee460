"""The public object: load backends, rank their tactics, run the winner.

``Dispatcher().gemm(qa, qb)`` checks its arguments, looks up the plan for the problem
(the tuned winner of its bucket, else the memoized heuristic pick), builds the kernel
once, and runs it. Nothing is written to ``out`` unless every check has passed.

Tuning (`Dispatcher.tune`, or ``with d.autotuning():``) measures a bucket's shortlist
(`fp4_dispatch.tuning`) and stores the winner in the tuning cache
(`fp4_dispatch.cache`), which this dispatcher reads lazily: each cached winner of its
device is re-validated before first use, and a stale one is ignored with a warning.
Tuning never happens on the hot path outside those two.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from . import checks, registry, torch_ops
from . import tuning as _tuning
from .backend import Backend, GemmOperands, Kernel
from .cache import TuningCache, device_fingerprint
from .device import DeviceInfo, resolve
from .nvfp4 import Nvfp4Tensor
from .ranking import Candidate, Ranker, Shortlist, m_bucket
from .tactics import Problem
from .winners import BucketKey, TunedWinners

log = logging.getLogger(__name__)

Status = Literal["available", "unsupported", "failed", "disabled"]


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``list-backends``: a backend, or a plugin that failed to give one."""

    name: str
    family: str
    origin: str
    version: str
    status: Status
    reason: str
    plugin: str
    error: registry.LoadError | None = None

    def to_json(self) -> dict:
        row = asdict(self)
        row["error"] = None if self.error is None else asdict(self.error)
        return row


def launch(
    candidate: Candidate, kernel: Kernel, operands: GemmOperands, out: torch.Tensor
) -> torch.Tensor:
    """Call `kernel`, realising ``swap_ab`` by exchanging operands and writing ``out.T``."""
    if candidate.tactic.swap_ab:
        kernel(operands.swapped(), out.t())
    else:
        kernel(operands, out)
    return out


class Dispatcher:
    """Picks and runs NVFP4 GEMM kernels for one device.

    ``device``: None/"auto" (detect), "cpu", "cuda[:N]", a `DeviceInfo`, or a simulated
    family ("sm90", "sm100", "sm103", "sm107") for inspecting dispatch without the
    hardware (simulated devices rank and compile but run nothing). ``strict`` (default
    ``FP4_DISPATCH_STRICT``) turns any plugin or backend failure into an exception.
    ``budget`` is how many tactics a shortlist keeps. ``cache``: the tuning cache file
    (None = `fp4_dispatch.cache.default_path()`, i.e. ``FP4_DISPATCH_CACHE`` or the user
    cache dir; a path; a `TuningCache`; False = keep tuned winners in memory only).
    """

    def __init__(
        self,
        device: str | DeviceInfo | None = None,
        *,
        strict: bool | None = None,
        budget: int = 32,
        sm_count: int | None = None,
        cache: str | os.PathLike[str] | TuningCache | bool | None = None,
    ) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget: expected a positive int, got {budget!r}")
        self.device = resolve(device, sm_count)
        self.strict = registry.strict_default() if strict is None else strict
        self.budget = budget
        self.registry = registry.load(strict=self.strict)
        self._status = {name: self._check_support(b) for name, b in self.registry.backends.items()}
        self.available: list[Backend] = [
            b for name, b in self.registry.backends.items() if self._status[name][0] == "available"
        ]
        self.ranker = Ranker(self.available, self.device, budget)
        #: this dispatcher's id for the ``fp4_dispatch::gemm`` op: a plain int, so that
        #: torch.compile can read it from a module attribute without tracing the registry
        self.op_id = torch_ops.dispatcher_id(self)
        self._kernels: dict[tuple, Kernel] = {}
        self._plans: dict[tuple[int, int, int, str], tuple[Candidate, Kernel]] = {}
        self.winners = TunedWinners(self, _tuning_cache(cache))
        self._untuned_logged: set[BucketKey] = set()
        self._autotune_depth = 0
        self._autotuned: set[BucketKey] = set()
        self._capture_warned: set[BucketKey] = set()

    def __repr__(self) -> str:
        """``Dispatcher(device=..., backends=[...], budget=N, cache=path)``: what it serves."""
        cache = self.cache
        where = "memory only" if cache is None else str(cache.path)
        names = ", ".join(b.name for b in self.available) or "none available"
        return (f"Dispatcher(device={self.device.name!r} ({self.device.kind}), "
                f"backends=[{names}], budget={self.budget}, cache={where!r})")  # fmt: skip

    @property
    def cache(self) -> TuningCache | None:
        """The tuning cache this dispatcher reads and writes (None: memory only)."""
        return self.winners.cache

    # ---- backends -------------------------------------------------------------------

    def _check_support(self, backend: Backend) -> tuple[Status, str]:
        try:
            support = backend.supports(self.device)
        except Exception as exc:  # a backend's own check failed: a failure, shown to users
            log.warning("backend %s: supports() raised %r", backend.name, exc)
            if self.strict:
                raise
            return "failed", f"supports() raised {type(exc).__name__}: {exc}"
        return ("available" if support.ok else "unsupported"), support.reason

    def backends(self) -> list[BackendStatus]:
        """Every backend and every plugin that failed or was disabled, for ``list-backends``."""
        rows = []
        for report in self.registry.plugins:
            for name in report.backends:
                b = self.registry.backends[name]
                status, reason = self._status[name]
                rows.append(
                    BackendStatus(
                        name, b.family, report.origin, b.version, status, reason, report.name
                    )
                )
            for err in report.errors:
                rows.append(
                    BackendStatus(
                        name=f"<{report.name}>",
                        family="?",
                        origin=report.origin,
                        version=report.version,
                        status="failed",
                        reason=f"{err.stage}: {err.error_type}: {err.message}",
                        plugin=report.name,
                        error=err,
                    )
                )
            if report.status == "disabled":
                rows.append(
                    BackendStatus(
                        f"<{report.name}>", "?", report.origin, report.version,
                        "disabled", report.reason, report.name,
                    )
                )  # fmt: skip
        return rows

    # ---- ranking --------------------------------------------------------------------

    def candidates(self, m: int, n: int, k: int, out_dtype: str = "bfloat16") -> Shortlist:
        """The capped, explained shortlist for one problem."""
        return self.ranker.shortlist(Problem(m=m, n=n, k=k, out_dtype=out_dtype))

    def select(self, m: int, n: int, k: int, out_dtype: str = "bfloat16") -> Candidate:
        """The candidate a call of this shape would run: the bucket's tuned winner if there
        is a valid one, else the heuristic pick (logged once per bucket)."""
        tuned = self.winners.pick(m, n, k, out_dtype)
        if tuned is not None:
            return tuned
        pick = self.ranker.pick(m, n, k, out_dtype)
        bkey = (n, k, m_bucket(m), out_dtype)
        if bkey not in self._untuned_logged:
            self._untuned_logged.add(bkey)
            log.info(
                "bucket N=%d K=%d M<=%d %s is not tuned: heuristic pick %s %s",
                *bkey, pick.backend, pick.tactic.canonical_json(),
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
        force: bool = False,
        save: bool = True,
        progress: bool | None = None,
        timer: _tuning.Timer | None = None,
        band: float | None = None,
    ) -> list[_tuning.TuneResult]:
        """Measure the shortlist of each shape's bucket and adopt the winners.

        ``shapes``: (M, N, K) tuples; shapes of one bucket are tuned once. A bucket with
        a valid cached winner is not measured again unless ``force`` (its result has
        ``source == "cache"``). Winners are used by `gemm`/`select` from now on and, when
        ``save``, merged into the tuning cache. A tactic that fails to build or run is
        timed as infinity and listed in the result's ``failures``, never raised.
        ``progress``: a progress bar (None: ``FP4_DISPATCH_PROGRESS``, else only on a
        terminal). ``timer``/``band``: see `fp4_dispatch.tuning.Tuner`.
        """
        from .progress import progress as bar_of

        if out_dtype not in _tuning.OUT_DTYPES:
            raise ValueError(
                f"out_dtype: expected one of {sorted(_tuning.OUT_DTYPES)}, got {out_dtype!r}"
            )
        tuner = _tuning.Tuner(self, timer=timer, band=band)
        todo: list[Problem] = []
        results: dict[BucketKey, _tuning.TuneResult] = {}
        order: list[BucketKey] = []
        for shape in shapes:
            m, n, k = _shape(shape)
            bkey = (n, k, m_bucket(m), out_dtype)
            if bkey in order:
                continue
            order.append(bkey)
            cached = None if force else self.winners.bucket(bkey)
            entry = self.winners.entries().get(bkey)
            if cached is not None and bkey in self.winners.results:
                results[bkey] = self.winners.results[bkey]
            elif cached is not None and entry is not None:
                results[bkey] = _tuning.result_from_entry(entry, cached, self)
                results[bkey].requested = (m, n, k)
            else:
                todo.append(Problem(m=m, n=n, k=k, out_dtype=out_dtype))
        shortlists = [
            self.ranker.shortlist(p.model_copy(update={"m": m_bucket(p.m)})).candidates
            for p in todo
        ]
        total = sum(len(sl) for sl in shortlists)
        with bar_of(range(total), total=total, desc="tuning", unit="tactic",
                    enable=progress) as bar:  # fmt: skip
            for p, sl in zip(todo, shortlists, strict=True):
                bar.set_description_str(f"tuning M={p.m} N={p.n} K={p.k}")
                result = tuner.tune(p, bar, sl)
                results[(p.n, p.k, result.problem.m, p.out_dtype)] = result
                self._adopt(result, save)
        return [results[b] for b in order]

    def _adopt(self, result: _tuning.TuneResult, save: bool) -> None:
        """Use a measured winner from now on (new plans for its bucket); maybe save it."""
        p = result.problem
        bkey = (p.n, p.k, p.m, p.out_dtype)
        self._autotuned.add(bkey)
        if result.winner is None:
            return
        self.winners.adopt(result, save)
        self._plans = {
            key: plan for key, plan in self._plans.items()
            if (key[1], key[2], m_bucket(key[0]), key[3]) != bkey
        }  # fmt: skip

    @contextlib.contextmanager
    def autotuning(self) -> Iterator[Dispatcher]:
        """While active, `gemm`/`mm_fp4` on a bucket with no tuned winner tunes it first.

        The winner is used at once and saved to the cache. Inside CUDA-graph capture
        (``torch.cuda.is_current_stream_capturing()``) nothing is tuned and nothing
        synchronizes: the cached or heuristic pick runs, with a warning once per bucket;
        the bucket is tuned on its next call outside capture. Nests; not thread-safe.
        """
        self._autotune_depth += 1
        try:
            yield self
        finally:
            self._autotune_depth -= 1

    def _capturing(self) -> bool:
        """Is the current CUDA stream being captured into a graph (never tune then)?"""
        return self.device.kind == "cuda" and torch.cuda.is_current_stream_capturing()

    def _autotune(self, m: int, n: int, k: int, dtype: str) -> None:
        bkey = (n, k, m_bucket(m), dtype)
        if bkey in self._autotuned:
            return
        if self.winners.bucket(bkey) is not None:
            self._autotuned.add(bkey)
            return
        if self._capturing():
            if bkey not in self._capture_warned:
                self._capture_warned.add(bkey)
                log.warning("autotuning: N=%d K=%d M<=%d %s called inside CUDA-graph capture; "
                            "not tuning now (heuristic or cached pick used)", *bkey)  # fmt: skip
            return
        self._autotuned.add(bkey)
        self.tune([(m, n, k)], out_dtype=dtype)

    # ---- running --------------------------------------------------------------------

    def kernel_for(self, candidate: Candidate, problem: Problem) -> Kernel:
        """Build (once) the kernel of `candidate` for problems of this bucket."""
        bucketed = problem.model_copy(update={"m": m_bucket(problem.m)})
        if candidate.tactic.swap_ab:
            bucketed = bucketed.swapped()
        key = (candidate.backend, candidate.tactic, bucketed)
        kernel = self._kernels.get(key)
        if kernel is None:
            backend = self.registry.backends[candidate.backend]
            log.info("building %s %s for %s", candidate.backend, candidate.tactic, bucketed)
            kernel = backend.build(candidate.tactic, bucketed, self.device)
            self._kernels[key] = kernel
        return kernel

    def cached_plan(self, m: int, n: int, k: int, dtype: str) -> tuple[Candidate, Kernel] | None:
        """The plan `run` would launch for this exact shape if it has already run, else None.

        Never ranks or builds: this is what a CUDA-graph capture may use. Tuning replaces
        a bucket's plans with new objects, so a changed plan is detectable by identity.
        """
        return self._plans.get((m, n, k, dtype))

    def _plan(self, m: int, n: int, k: int, dtype: str) -> tuple[Candidate, Kernel]:
        key = (m, n, k, dtype)
        plan = self._plans.get(key)
        if plan is None:
            candidate = self.select(m, n, k, dtype)
            plan = candidate, self.kernel_for(candidate, Problem(m=m, n=n, k=k, out_dtype=dtype))
            self._plans[key] = plan
        return plan

    def check_device(self, name: str, t: torch.Tensor) -> torch.device:
        """The torch device this dispatcher runs on; raises unless `t` is there and it is real."""
        if self.device.is_simulated:
            raise RuntimeError(
                f"{self.device.name} is simulated: it ranks and compiles but runs nothing; "
                "use Dispatcher() on the real device to run a GEMM"
            )
        want = torch.device(self.device.torch_device)
        if t.device != want:
            raise ValueError(
                f"{name}: expected a tensor on the dispatcher's device {want}, got {t.device}"
            )
        return want

    def run(self, operands: GemmOperands, out: torch.Tensor, dtype: str) -> torch.Tensor:
        """Run checked operands through the plan for their shape (no further checks)."""
        if self._autotune_depth:
            self._autotune(operands.m, operands.n, operands.k, dtype)
        candidate, kernel = self._plan(operands.m, operands.n, operands.k, dtype)
        return launch(candidate, kernel, operands, out)

    def run_candidate(
        self, candidate: Candidate, operands: GemmOperands, out: torch.Tensor
    ) -> torch.Tensor:
        """Run one specific candidate (doctor, tuning), building its kernel if needed."""
        dtype = checks.out_dtype_name(out.dtype)
        problem = Problem(m=operands.m, n=operands.n, k=operands.k, out_dtype=dtype)
        return launch(candidate, self.kernel_for(candidate, problem), operands, out)

    def gemm(
        self,
        qa: Nvfp4Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[M, N] = dequant(qa) @ dequant(qb).T`` (B held as [N, K], like a Linear weight).

        Through `fp4_dispatch.torch_ops`: under torch.compile the GEMM is the custom op
        ``fp4_dispatch::gemm`` (no graph break, plan made at run time); eagerly the same
        code runs directly; inside a CUDA-graph capture only an already-run plan launches.
        """
        return torch_ops.gemm(self, qa, qb, out_dtype, out)

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
        device = self.check_device("a", a)
        checks.same_device(device, b=b, a_descale=a_descale, b_descale=b_descale)
        a_scale = checks.swizzled_scale("a_descale", a_descale, m, k)
        b_scale = checks.swizzled_scale("b_descale", b_descale, n, k)
        alpha = checks.alpha_tensor(alpha, device)
        out = checks.out_tensor(out, m, n, out_dtype, device)
        return torch_ops.run(self, a, a_scale, b.t(), b_scale, alpha, out_dtype, out)


def _tuning_cache(cache: str | os.PathLike[str] | TuningCache | bool | None) -> TuningCache | None:
    """The `Dispatcher` ``cache`` argument as a cache (None = FP4_DISPATCH_CACHE / default)."""
    if cache is False:
        return None
    if cache is None or cache is True:
        return TuningCache()
    return cache if isinstance(cache, TuningCache) else TuningCache(cache)


def _shape(shape: object) -> tuple[int, int, int]:
    """Check one (M, N, K) of `Dispatcher.tune`."""
    try:
        m, n, k = shape  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"shapes: expected (M, N, K) tuples, got {shape!r}") from None
    for name, v in (("M", m), ("N", n), ("K", k)):
        if type(v) is not int or v < 1:
            raise ValueError(f"shapes: {name} must be a positive int, got {v!r} in {shape!r}")
    return m, n, k
