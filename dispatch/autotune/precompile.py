"""Compile a shortlist's kernels in parallel worker processes, before they are measured.

Why: tuning a shape this process has never compiled was dominated by compiles - Triton
JIT-compiles each tactic on its first launch, one after another (~1 s each on the H200
host: 20-38 s per cold shape). Compiles are CPU work and independent, so spawned worker
processes do them side by side and leave the results in the on-disk kernel caches
(Triton's cache dir, ``FP4_DISPATCH_KERNEL_CACHE`` for the CuTe-DSL artifacts); the
process that measures then only *loads* compiled kernels (milliseconds each). The same
code serves `Dispatcher.tune`, ``fp4-dispatch compile`` and the benchmarks.

The unit of work is a `Job`: one (backend, tactic, problem in the kernel's orientation).
A worker calls `Backend.precompile` (default: `build`; backends that compile lazily on
first launch override it to compile without launching). `precompile` returns a
`PrecompileReport`: every job is ``compiled``, ``failed`` (with the reason: the
exception, or "worker process died" when the compile took its process down) or
``skipped`` (the deadline came first). Nothing here raises for a job: a job that did not
compile is compiled on first use, as before.

Workers. Separate interpreters started with ``python -m fp4_dispatch.autotune.precompile_worker``
through `subprocess` (never forked: a forked CUDA or Triton state is unusable; never
multiprocessing's spawn: it re-imports the user's main module in each worker, running an
unguarded script again, and fails for a parent reading standard input), at most
``min(#jobs, cpu_count - 1, 16)`` unless told otherwise (``workers=`` or
``FP4_DISPATCH_PRECOMPILE_WORKERS``; 0 turns precompiling off). Each has its own socket
pair; the parent hands one job at a time to an idle worker, so the jobs spread evenly and
the job a crashing worker was on is known exactly (it is reported failed and a replacement
worker takes the rest). Workers stay alive between calls (starting one costs an
interpreter, torch and Triton: 2-10 s) and exit after `IDLE_EXIT_S` without work or as
soon as their socket closes, so they never outlive this process. A backend travels to the
worker by pickle (its class is imported there, with the parent's ``sys.path`` of when the
worker started, as ``PYTHONPATH``: a changed path restarts the workers); one that does not
pickle, or whose class lives in the parent's ``__main__`` (which the worker never
imports), is looked up by name in the worker's own registry.

Process memory. `is_ready`/`mark_ready` remember, per process, which
(backend, `Backend.precompile_key`) pairs are compiled - on disk by a worker, or launched
here - so a second tune of the same kernels starts no worker at all.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import multiprocessing.connection as mpc
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fp4_dispatch.contracts.backend import Backend, kernel_problem
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic

log = logging.getLogger(__name__)

#: environment variable: default number of worker processes (0 = do not precompile)
ENV_WORKERS = "FP4_DISPATCH_PRECOMPILE_WORKERS"
#: most worker processes by default (each holds an interpreter, torch and Triton: ~0.5 GB)
MAX_WORKERS = 16
#: an idle worker exits after this many seconds without a job
IDLE_EXIT_S = 120.0
#: how long to wait for a worker to come up before its jobs are given to others
START_TIMEOUT_S = 120.0
#: `Dispatcher.tune` stops waiting for compiles after this long (the rest compile on first
#: use): a hung compiler must not hang tuning
TUNE_DEADLINE_S = 300.0

Status = Literal["compiled", "failed", "skipped"]


@dataclass(frozen=True)
class Job:
    """One kernel to compile: `problem` is in the kernel's orientation (`kernel_problem`)."""

    backend: Backend
    tactic: Tactic
    problem: Problem

    @property
    def key(self) -> tuple[str, Hashable]:
        """(backend name, `Backend.precompile_key`): equal keys share one compiled kernel."""
        return (self.backend.name, self.backend.precompile_key(self.tactic, self.problem))


@dataclass(frozen=True)
class Outcome:
    """What became of one `Job`; ``details`` is the kernel's own compile description
    (e.g. ``source``: "compiled"/"disk", ``cubin_sm``, ``compile_s``) when it has one."""

    job: Job
    status: Status
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.job.backend.name,
            "tactic": self.job.tactic.model_dump(mode="json"),
            "problem": self.job.problem.model_dump(mode="json"),
            "status": self.status,
            "reason": self.reason,
            "seconds": self.seconds,
            **self.details,
        }


@dataclass
class PrecompileReport:
    """Every job's outcome (in job order), the wall time and the worker count used."""

    outcomes: list[Outcome]
    seconds: float = 0.0
    workers: int = 0

    def _with(self, status: Status) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def compiled(self) -> list[Outcome]:
        return self._with("compiled")

    @property
    def failed(self) -> list[Outcome]:
        return self._with("failed")

    @property
    def skipped(self) -> list[Outcome]:
        return self._with("skipped")

    def summary(self) -> str:
        return (f"{len(self.compiled)} compiled, {len(self.failed)} failed, "
                f"{len(self.skipped)} skipped in {self.seconds:.1f} s "
                f"({self.workers} worker processes)")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "workers": self.workers,
            "compiled": len(self.compiled),
            "failed": len(self.failed),
            "skipped": len(self.skipped),
            "outcomes": [o.to_json() for o in self.outcomes],
        }


# ---- what this process has compiled -----------------------------------------------------

_READY: set[tuple[str, Hashable]] = set()


def is_ready(job: Job) -> bool:
    """Was this job's kernel compiled (on disk by a worker, or launched) in this process?"""
    return job.key in _READY


def mark_ready(jobs: Iterable[Job]) -> None:
    """Remember `jobs` as compiled (after a worker compiled them or this process ran them)."""
    _READY.update(j.key for j in jobs)


def forget_ready() -> None:
    """Forget what was compiled (tests; after pointing the kernel caches elsewhere)."""
    _READY.clear()


def jobs_for(
    pairs: Iterable[tuple[Backend, Tactic, Problem]], *, skip_ready: bool = True
) -> list[Job]:
    """One job per distinct compiled kernel of (backend, tactic, problem) triples.

    ``problem`` is the caller's (unswapped, any M); each job gets the problem the kernel
    is built for (`kernel_problem`: M rounded to its bucket, swapped when the tactic
    swaps). Duplicates by `Job.key` are dropped, and with ``skip_ready`` so is what this
    process already compiled.
    """
    seen: set[tuple[str, Hashable]] = set()
    jobs: list[Job] = []
    for backend, tactic, problem in pairs:
        job = Job(backend, tactic, kernel_problem(problem, tactic))
        key = job.key
        if key in seen or (skip_ready and key in _READY):
            continue
        seen.add(key)
        jobs.append(job)
    return jobs


def default_workers(n_jobs: int) -> int:
    """``min(n_jobs, cpu_count - 1, 16)``, or ``FP4_DISPATCH_PRECOMPILE_WORKERS`` if set."""
    raw = os.environ.get(ENV_WORKERS, "").strip()
    if raw:
        try:
            return max(0, min(n_jobs, int(raw)))
        except ValueError:
            log.warning("%s=%r is not an integer; using the default", ENV_WORKERS, raw)
    return max(1, min(n_jobs, (os.cpu_count() or 2) - 1, MAX_WORKERS))


# ---- the parent side --------------------------------------------------------------------


def precompile(
    jobs: Sequence[Job],
    device: DeviceInfo,
    *,
    workers: int | None = None,
    deadline_s: float | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> PrecompileReport:
    """Compile `jobs` in worker processes; never raises for a job (see the module doc).

    ``workers``: processes to use (None: `default_workers`; 0: compile nothing, every
    job ``skipped``). ``deadline_s``: seconds from now after which no job starts; a job
    still compiling then is reported ``skipped`` and left to finish in its worker.
    ``on_outcome`` is called in the parent for each outcome as it arrives (progress).
    Compiled jobs are marked ready (`mark_ready`).
    """
    t0 = time.perf_counter()
    n = len(jobs)
    count = default_workers(n) if workers is None else max(0, min(workers, n))
    if n == 0 or count == 0:
        outcomes = [Outcome(j, "skipped", "precompiling is off (0 workers)") for j in jobs]
        for o in outcomes:
            _notify(on_outcome, o)
        return PrecompileReport(outcomes, time.perf_counter() - t0, 0)
    deadline = math.inf if deadline_s is None else time.time() + deadline_s
    payloads = [_payload(j, device) for j in jobs]
    outcomes = _pool().run(jobs, payloads, count, deadline, on_outcome)
    mark_ready(o.job for o in outcomes if o.status == "compiled")
    report = PrecompileReport(outcomes, time.perf_counter() - t0, count)
    log.info("precompile: %s", report.summary())
    return report


def _notify(on_outcome: Callable[[Outcome], None] | None, outcome: Outcome) -> None:
    if on_outcome is not None:
        on_outcome(outcome)


def _payload(job: Job, device: DeviceInfo) -> bytes:
    """The pickled job; a backend that does not pickle travels by name (worker registry)."""
    if type(job.backend).__module__ == "__main__":  # the worker never imports __main__
        return pickle.dumps(("name", job.backend.name, job.tactic, job.problem, device))
    try:
        return pickle.dumps(("object", job.backend, job.tactic, job.problem, device))
    except Exception as exc:  # e.g. a backend holding a lock: the worker loads it by name
        log.debug("backend %s does not pickle (%r): sent by name", job.backend.name, exc)
        return pickle.dumps(("name", job.backend.name, job.tactic, job.problem, device))


class _Process:
    """A worker interpreter (`subprocess.Popen`) with the few `multiprocessing.Process`
    methods the pool uses."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: the caller acts
            self._popen.wait(timeout)


def _worker_env() -> dict[str, str]:
    """This environment with ``PYTHONPATH`` = this process's ``sys.path`` (then the old one)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if isinstance(p, str) and p]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


def start_worker() -> tuple[_Process, mpc.Connection]:
    """Start ``python -m fp4_dispatch.autotune.precompile_worker`` on one end of a socket pair."""
    mine, theirs = socket.socketpair()
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "fp4_dispatch.autotune.precompile_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=_worker_env(),
            close_fds=True,
        )  # fmt: skip
    finally:
        theirs.close()
    return _Process(popen), mpc.Connection(mine.detach())


@dataclass
class _Worker:
    process: _Process
    conn: mpc.Connection
    started: float
    #: (batch, job index) it is compiling, or None when idle
    busy: tuple[int, int] | None = None
    ready: bool = False


class _Pool:
    """Persistent worker interpreters, one socket each (see the module doc)."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._batches = itertools.count()
        self._sys_path = tuple(sys.path)

    def _start(self) -> None:
        process, conn = start_worker()
        self._workers.append(_Worker(process, conn, time.monotonic()))

    def _reap(self) -> list[_Worker]:
        """Drop dead workers; return those that died while busy."""
        dead = [w for w in self._workers if not w.process.is_alive()]
        for w in dead:
            self._workers.remove(w)
            w.conn.close()
        return [w for w in dead if w.busy is not None]

    def shutdown(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError, BrokenPipeError):  # already gone: nothing to do
                w.conn.send_bytes(b"")
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.terminate()
        self._workers.clear()

    def run(
        self,
        jobs: Sequence[Job],
        payloads: list[bytes],
        count: int,
        deadline: float,
        on_outcome: Callable[[Outcome], None] | None,
    ) -> list[Outcome]:
        batch = next(self._batches)
        results: dict[int, Outcome] = {}
        queue = list(range(len(jobs)))[::-1]  # pop() from the end: job order
        restarts = 0

        def finish(i: int, outcome: Outcome) -> None:
            if i not in results:
                results[i] = outcome
                _notify(on_outcome, outcome)

        if tuple(sys.path) != self._sys_path:  # workers import with the path they started with
            self.shutdown()
            self._sys_path = tuple(sys.path)
        self._reap()
        while len(self._workers) < count:
            self._start()
        while len(results) < len(jobs):
            now = time.time()
            for w in self._workers:  # hand out work to idle workers
                if w.busy is None and queue and now < deadline:
                    i = queue.pop()
                    w.busy = (batch, i)
                    try:
                        w.conn.send_bytes(payloads[i])
                    except OSError as exc:  # its process is gone: reaped below
                        w.busy = None
                        queue.append(i)
                        log.debug("precompile worker pipe closed: %r", exc)
            if now >= deadline:
                for i in queue:
                    finish(i, Outcome(jobs[i], "skipped", "deadline: not started"))
                queue.clear()
                self._stop_busy(batch, jobs, finish)
                break
            wait_for = [w.conn for w in self._workers]  # a dead worker's socket reads EOF
            timeout = None if deadline == math.inf else max(0.0, deadline - now)
            ready = mpc.wait(wait_for, timeout=min(timeout, 1.0) if timeout is not None else 1.0)
            for w in list(self._workers):
                if w.conn in ready:
                    self._receive(w, batch, jobs, finish)
            for w in self._reap():
                b, i = w.busy  # type: ignore[misc]
                code = w.process.exitcode
                if b == batch:
                    why = f"worker process died (exit code {code}) compiling it"
                    finish(i, Outcome(jobs[i], "failed", why))
                    job = jobs[i]
                    log.warning("precompile: %s: %s %s", why, job.backend.name, job.tactic)
                if queue and restarts < count:
                    restarts += 1
                    self._start()
            if not self._workers and queue:
                for i in queue:
                    finish(i, Outcome(jobs[i], "failed", "no precompile worker left"))
                queue.clear()
            self._drop_stuck_starts(queue, count)
        return [results[i] for i in range(len(jobs))]

    def _stop_busy(self, batch: int, jobs: Sequence[Job], finish) -> None:
        """At the deadline: what is still compiling is skipped (compiled on first use) and
        its worker stopped, so that a hung compile cannot hold a worker forever (Triton
        writes its cache entries atomically: a stopped compile leaves nothing half made)."""
        for w in list(self._workers):
            if w.busy is None:
                continue
            if w.busy[0] == batch:
                finish(w.busy[1], Outcome(jobs[w.busy[1]], "skipped", "deadline: still compiling"))
            w.process.terminate()
            w.process.join(timeout=2)
            self._workers.remove(w)
            w.conn.close()

    def _receive(self, w: _Worker, batch: int, jobs: Sequence[Job], finish) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker is gone: let it exit, then it is reaped
            w.process.join(timeout=5)
            w.process.terminate()  # closed its socket but still running: of no more use
            w.process.join(timeout=2)
            return
        if msg == "up":
            w.ready = True
            return
        status, reason, seconds, details = msg
        b, i = w.busy if w.busy is not None else (-1, -1)
        w.busy = None
        if b == batch:
            finish(i, Outcome(jobs[i], status, reason, seconds, details))

    def _drop_stuck_starts(self, queue: list[int], count: int) -> None:
        """A worker that never came up (START_TIMEOUT_S) is stopped; its job is retried."""
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.started > START_TIMEOUT_S:
                log.warning("precompile: a worker did not start in %.0f s; stopping it",
                            START_TIMEOUT_S)  # fmt: skip
                w.process.terminate()
                w.process.join(timeout=2)
                if w.busy is not None:
                    queue.append(w.busy[1])
                    w.busy = None
                self._workers.remove(w)


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.shutdown)
    return _POOL


def shutdown() -> None:
    """Stop this process's precompile workers now (they also exit when idle or with it)."""
    if _POOL is not None:
        _POOL.shutdown()


# ---- the worker side ----------------------------------------------------------------------


def worker_loop(conn: mpc.Connection, idle_exit_s: float) -> None:
    """A worker's loop (`fp4_dispatch.autotune.precompile_worker`): receive a pickled job, compile
    it, answer; exit when idle, told to (an empty message) or the parent has gone."""
    conn.send("up")
    while conn.poll(idle_exit_s):
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent has gone
            return
        if not data:  # shutdown
            return
        conn.send(compile_payload(data))


def compile_payload(data: bytes) -> tuple[Status, str, float, dict[str, Any]]:
    """Unpickle one job and compile it: (status, reason, seconds, details); never raises."""
    t0 = time.perf_counter()
    try:
        how, backend, tactic, problem, device = pickle.loads(data)
        if how == "name":
            backend = _registry_backends()[backend]
        result = backend.precompile(tactic, problem, device)
    except Exception as exc:  # reported per (backend, tactic) by the parent, never fatal
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return ("failed", tb[:500], time.perf_counter() - t0, {})
    return ("compiled", "", time.perf_counter() - t0, describe(result))


_BACKENDS: dict[str, Backend] | None = None


def _registry_backends() -> dict[str, Backend]:
    global _BACKENDS
    if _BACKENDS is None:
        from fp4_dispatch.loading.registry import load  # noqa: PLC0415 - only for backends that do not pickle

        _BACKENDS = load(strict=False).backends
    return _BACKENDS


def describe(kernel: object) -> dict[str, Any]:
    """The JSON-able part of a built kernel's ``compiled`` description, if it has one
    (ahead-of-time families record where the binary came from and what it targets)."""
    compiled = getattr(kernel, "compiled", None)
    if compiled is None:
        return {}
    out: dict[str, Any] = {}
    for name in ("source", "cubin_sm", "seconds"):
        value = getattr(compiled, name, None)
        if isinstance(value, (str, int, float)) or value is None:
            out["compile_s" if name == "seconds" else name] = value
    return out
