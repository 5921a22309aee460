"""What every suite shares: the run's context, shape grids, and timing through the harness.

The measuring itself is `fp4_dispatch.autotune.harness` (GPU time of CUDA-graph replays with a cold
L2, eager wall of back-to-back calls, host wall of single calls, one numerics check) and
the tuner's `fp4_dispatch.autotune.tuning.Tuner.measure` for backend tactics (build, NaN-poisoned
launch, float64 check, the tuner's own clock), so a suite's figure compares with a tuned
one. Compiling ahead of the timed loop is the library's parallel precompile. This module
turns those measurements into `results.Row`s; a suite module holds only its routines.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .results import Row, write_rows

log = logging.getLogger("benchmarks")
ROOT = Path(__file__).resolve().parents[1]

Shape = tuple[int, int, int]


def commit() -> str:
    """The source commit (``FP4_COMMIT``, else ``git rev-parse``), else "unknown"."""
    if os.environ.get("FP4_COMMIT"):
        return os.environ["FP4_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT, timeout=10)  # fmt: skip
    except OSError as exc:
        log.info("no git here: %s", exc)
        return "unknown"
    return out.stdout.strip() or "unknown"


@dataclass
class Context:
    """One suite run: its options, device, output file and the rows' common fields."""

    suite: str
    args: argparse.Namespace
    device: torch.device
    out: Path
    meta: dict[str, str] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    @property
    def smoke(self) -> bool:
        return bool(self.args.smoke)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def row(self, case: str, **fields: Any) -> Row:
        """A row of this run (suite, device, date, commit, command filled in)."""
        return Row(suite=self.suite, case=case, **{**self.meta, **fields})

    def emit(self, rows: Iterable[Row]) -> list[Row]:
        """Append `rows` to the run's JSON lines now (nothing is lost if a later case
        dies) and log one line each."""
        rows = list(rows)
        write_rows(self.out, rows)
        self.rows += rows
        for r in rows:
            what = r.failure or f"{r.median_us and round(r.median_us, 1)} µs"
            log.info("%s | %s %s | %s %s,%s,%s | %s", r.case, r.backend, r.tactic, r.clock,
                     r.m, r.n, r.k, what)  # fmt: skip
        return rows

    def grid(self, ms: Sequence[int], nks: Sequence[tuple[int, int]]) -> list[Shape]:
        """The shapes of a routine: ``--shapes`` if given, else (``--m`` or `ms`) x (``--nk``
        or `nks`), N and K outer (one weight, every M)."""
        if self.args.shapes:
            return list(self.args.shapes)
        ms = self.args.m or ms
        return [(m, n, k) for n, k in (self.args.nk or nks) for m in ms]


def context(suite: str, args: argparse.Namespace, argv: Sequence[str]) -> Context:
    """The run's context: the device (a CPU with ``--smoke``), ``<out>/<suite>.jsonl``
    truncated, and the meta fields every row carries."""
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":  # no GPU clock here: every clock would be the eager wall
        args.clocks = [c for c in args.clocks if c != "graph"] or ["eager"]
    folder = Path(args.out or os.environ.get("OUT") or ".")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{suite}.jsonl"
    out.write_text("")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = {"device": name + (" (smoke)" if args.smoke else ""),
            "date": dt.date.today().isoformat(), "commit": commit(),
            "command": " ".join(["python -m benchmarks", suite, *argv])}  # fmt: skip
    return Context(suite, args, device, out, meta)


# ---- timing through the harness ---------------------------------------------------------


def samples(fn: Callable[[], object], clock: str, device: torch.device, calls: int = 20
            ) -> list[float]:  # fmt: skip
    """µs per call of `fn`: ``graph`` = `harness.gpu_time_samples` (CUDA graph, L2 flushed
    before each call), ``eager``/``compile`` = `harness.eager_wall_samples` (back to
    back, one synchronisation). On a CPU every clock is the eager wall (a script check)."""
    from fp4_dispatch.autotune import harness

    if clock == "graph" and device.type == "cuda":
        return harness.gpu_time_samples(fn, calls=calls, device=device)
    if device.type != "cuda":
        return harness.eager_wall_samples(fn, calls=2, warmup=1, replays=3)
    return harness.eager_wall_samples(fn, calls=max(calls, 50), warmup=10)


def spread(values: Sequence[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if values else None


def timed_rows(ctx: Context, case: str, fn: Callable[[], object], clocks: Sequence[str],
               **fields: Any) -> list[Row]:  # fmt: skip
    """One row per clock for `fn` (already warm); a failure becomes the row's ``failure``."""
    rows = []
    for clock in clocks:
        try:
            got = samples(fn, clock, ctx.device)
        except Exception as exc:  # a path that cannot run here is a recorded gap
            rows.append(ctx.row(case, clock=clock, failure=_why(exc), **fields))
            continue
        rows.append(ctx.row(case, clock=clock, median_us=statistics.median(got),
                            spread_us=spread(got), **fields))  # fmt: skip
    return rows


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def path_rows(ctx: Context, case: str, fn: Callable[[torch.Tensor], object],
              out: torch.Tensor, ref: torch.Tensor | None, clocks: Sequence[str],
              **fields: Any) -> list[Row]:  # fmt: skip
    """Rows of one path writing `out` (or returning its result, as a layer does): a warm,
    NaN-poisoned first run checked against the float64 `ref` (the error of every row),
    then each clock."""
    from fp4_dispatch.autotune import harness

    try:
        out.fill_(float("nan"))
        got = fn(out)
        got = got if isinstance(got, torch.Tensor) else out
        err = harness.compare(got, ref, math.inf)[0] if ref is not None else None
    except Exception as exc:  # e.g. cuBLASLt refusing a shape: a gap, not the end
        return [ctx.row(case, clock=c, failure=_why(exc), **fields) for c in clocks]
    rows = timed_rows(ctx, case, lambda: fn(out), clocks, **fields)
    for r in rows:
        r.error = err
        if err is not None and not math.isfinite(err):
            r.failure = r.failure or "output not written (NaN) or non-finite"
    return rows


def add_ratios(rows: list[Row], bases: dict[str, str]) -> None:
    """``ratios[name]`` = the base path's time / this row's, same clock (> 1: faster)."""
    for name, path in bases.items():
        base = {r.clock: r.median_us for r in rows if r.backend == path and r.median_us}
        for r in rows:
            if r.median_us and r.clock in base:
                r.ratios[name] = base[r.clock] / r.median_us


def tactic_rows(ctx: Context, case: str, dispatcher: Any, problem: Any, candidates: Sequence,
                clock: str, deadline: float | None = None) -> list[Row]:  # fmt: skip
    """Each candidate built, checked (float64 reference, NaN-poisoned output) and timed by
    the tuner's own `Tuner.measure` under the `clock` policy: one row each, the method
    (``cuda-graph``, ``pruned`` after one probe launch...) in ``extra``."""
    from fp4_dispatch.autotune.tuning import Tuner
    from fp4_dispatch.contracts.tactics import tactic_label

    tuner = Tuner(dispatcher, measure="eager" if clock == "eager" else "graph")
    rows = []
    for m in tuner.measure(problem, candidates, deadline=deadline):
        c = m.candidate
        rows.append(ctx.row(
            case, backend=c.backend, tactic=tactic_label(c.tactic), operation=c.operation,
            m=problem.m, n=problem.n, k=problem.k, clock=clock,
            median_us=m.us if m.ok else None, spread_us=spread(m.samples_us),
            failure=m.error or None,
            extra={"method": m.method, "est_us": round(c.est_us, 2),
                   "tactic_json": c.tactic.canonical_json()},
        ))  # fmt: skip
    return rows


def precompile(planned: Iterable[tuple[Any, Any, Any]], info: Any, workers: int) -> Any:
    """Compile every distinct kernel of the planned (backend, tactic, problem) triples in
    `workers` processes (`fp4_dispatch.autotune.precompile`: Triton ``warmup``, no launch) so the
    timed code loads kernels from the disk caches; off (every job skipped) unless `info`
    is a CUDA device. The report has one outcome per distinct kernel."""
    from fp4_dispatch.autotune import precompile as pc

    jobs = pc.jobs_for(planned, skip_ready=False)
    report = pc.precompile(jobs, info, workers=workers if info.kind == "cuda" else 0)
    log.info("precompiled %d kernels (%d failed) in %.0f s", len(report.outcomes),
             len(report.failed), report.seconds)  # fmt: skip
    return report


def compiled_alone(modules: dict[str, Any]) -> dict[str, Any]:
    """Each module under ``torch.compile`` in default mode (no CUDA graphs), compiled for
    the shapes of its first call alone (``dynamic=False``), Dynamo's caches reset first and
    Inductor's FX-graph and AOTAutograd caches off. Why: a module compiled once and called
    at a second shape is recompiled with symbolic sizes (Dynamo's automatic dynamic
    shapes), and a W4A16 call of symbolic M keeps its custom op (docs/launch.md); a
    serving engine compiles per batch size. The caches' keys hold neither this project's
    code nor ``FP4_DISPATCH_INDUCTOR``, so a cached graph of another run could be timed
    (benchmarks/RESULTS.md, "Eager launch" run 10)."""
    torch._dynamo.reset()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    return {name: torch.compile(m, dynamic=False) for name, m in modules.items()}


def on_cuda_or_smoke(ctx: Context, what: str) -> bool:
    """Whether a GPU routine can run: on CUDA, or as its ``--smoke`` CPU check; else a
    row saying why it was skipped."""
    if ctx.cuda or ctx.smoke:
        return True
    ctx.emit([ctx.row(what, clock="host", failure="needs a CUDA GPU (or --smoke on a CPU)")])
    return False


def python(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run `code` in a fresh interpreter (cold imports and memos); its stdout, or
    RuntimeError with its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout
