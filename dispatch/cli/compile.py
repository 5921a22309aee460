"""``fp4-dispatch compile M N K``: compile the shortlist's Blackwell/Rubin kernels ahead of time.

Works without a GPU: ``--device sm100|sm103|sm107`` compiles for that arch and SM count
(CuTe-DSL compiles on a CPU). Each shortlisted tactic of a backend that declares
``compiles_ahead_of_time = True`` (the CuTe-DSL families, FlashInfer's fi-*) is built in
a worker process (`fp4_dispatch.precompile`, spawned, ``--jobs`` of them), so compiles
run in parallel and one crashing compile cannot take the others down. Compiled kernels
land in the on-disk kernel cache (``FP4_DISPATCH_KERNEL_CACHE``), so a later run on
that device loads them (FlashInfer's fi-* kernels are compiled and checked, not stored on disk).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import Counter
from typing import Any

from .common import (
    CliError,
    add_budget_arg,
    add_command,
    add_device_args,
    add_json_arg,
    add_shape_args,
    emit_json,
    format_table,
    make_dispatcher,
    positive_int,
    problem_groups,
)

log = logging.getLogger(__name__)


def compiles_ahead_of_time(backend: Any) -> bool:
    """A backend declares ``compiles_ahead_of_time = True`` when `build` compiles for a
    (possibly simulated) device without running anything (CuTe-DSL families)."""
    return bool(getattr(backend, "compiles_ahead_of_time", False))


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "compile",
        help="compile the shortlist's Blackwell/Rubin kernels (no GPU needed)",
        description="Compile each shortlisted sm100/sm103/sm107 tactic of one shape ahead "
        "of time, in parallel worker processes, into the on-disk kernel cache "
        "(FP4_DISPATCH_KERNEL_CACHE), so a later run on that device loads them. Works "
        "without a GPU; the kernels are compiled, not run.",
        examples="""fp4-dispatch compile 128 4096 4096 --device sm100
fp4-dispatch compile 32768 4096 8192 --device sm107 --budget 8 --jobs 2
fp4-dispatch compile 1 8192 8192 --device sm103 --json
fp4-dispatch compile 64 1536 2048 --device sm100 --op grouped_w4a4 --groups 128""",
    )
    add_shape_args(p)
    add_device_args(p)
    add_budget_arg(p, "shortlist size")
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=min(4, os.cpu_count() or 1),
        help="parallel compile processes",
    )
    p.add_argument("--out-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument(
        "--op",
        default="w4a4",
        choices=("w4a4", "w4a16", "grouped_w4a16", "grouped_w4a4"),
        help="the problem's operation (default w4a4); a grouped one needs --groups",
    )
    p.add_argument(
        "--groups", type=int, default=None, metavar="E", help="expert count of a grouped --op"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (or FP4_DISPATCH_PROGRESS=0)"
    )
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    groups = problem_groups(args)
    d = make_dispatcher(args, budget=args.budget)
    shortlist = d.candidates(args.m, args.n, args.k, args.out_dtype, args.op, groups)
    aot = {n for n, b in d.registry.backends.items() if compiles_ahead_of_time(b)}
    todo = [c for c in shortlist.candidates if c.backend in aot]
    dev = d.device
    if not todo:
        why = [f"{r.name}: {r.status} ({r.reason})" for r in d.backends()
               if r.name in aot or r.name.startswith("<")]  # fmt: skip
        raise CliError(
            f"nothing to compile on {dev.name}: no ahead-of-time tactic in the shortlist"
            + (f" ({'; '.join(why)})" if why else "")
        )
    from ..tactics import Problem  # noqa: PLC0415 - lazy: start-up time

    problem = Problem(
        m=args.m,
        n=args.n,
        k=args.k,
        out_dtype=args.out_dtype,
        operation=shortlist.problem.operation,
        groups=groups,
    ).model_dump_json()
    jobs = max(1, min(args.jobs, len(todo)))  # at most; cached kernels need no worker
    if not args.json:
        per = Counter(c.family for c in todo)
        print(f"device: {dev.name}, {dev.sm_count} SMs, target {dev.arch}")
        print(f"compiling {len(todo)} shortlisted tactics "
              f"({', '.join(f'{f}: {n}' for f, n in sorted(per.items()))}) "
              f"with {jobs} process(es)")  # fmt: skip
    results = _from_cache(d, todo, problem)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        jobs = max(1, min(args.jobs, len(missing)))
        built = _compile_all(d, [todo[i] for i in missing], problem, jobs, not args.no_progress)
        for i, res in zip(missing, built, strict=True):
            results[i] = res
    return _report(todo, results, args.json, time.perf_counter())


def _from_cache(d, todo: list, problem_json: str) -> list[dict | None]:
    """Load what the kernel cache already has, in this process (no worker to start).

    Starting a compile worker costs a fresh interpreter, torch and the CuTe DSL (5-10 s on
    a small CPU); loading a cached kernel here costs ~0.05 s. Backends without a
    ``build_cached`` method, and kernels not in the cache, get None: the workers build them.
    """
    from ..backend import kernel_problem  # noqa: PLC0415 - lazy: start-up time
    from ..tactics import Problem  # noqa: PLC0415 - lazy: start-up time

    problem = Problem.model_validate_json(problem_json)
    out: list[dict | None] = []
    for c in todo:
        loader = getattr(d.registry.backends[c.backend], "build_cached", None)
        kernel = None
        t0 = time.perf_counter()
        if loader is not None:
            try:
                mine = kernel_problem(problem.as_operation(c.operation), c.tactic)
                kernel = loader(c.tactic, mine, d.device)
            except Exception as exc:  # a broken cache entry: the worker compiles it afresh
                log.info("%s: loading from the kernel cache failed (%r); compiling", c.backend,
                         exc)  # fmt: skip
        if kernel is None:
            out.append(None)
            continue
        compiled = getattr(kernel, "compiled", None)
        out.append({"backend": c.backend, "tactic": c.tactic.model_dump_json(), "ok": True,
                    "source": getattr(compiled, "source", "?"),
                    "cubin_sm": getattr(compiled, "cubin_sm", None),
                    "compile_s": getattr(compiled, "seconds", None),
                    "seconds": time.perf_counter() - t0})  # fmt: skip
    return out


def _compile_all(d, todo: list, problem_json: str, jobs: int, bar_ok: bool) -> list[dict]:
    """Compile `todo` in `jobs` worker processes (`fp4_dispatch.precompile`), one bar."""
    from .. import precompile as pc  # noqa: PLC0415 - lazy: start-up time
    from ..backend import kernel_problem  # noqa: PLC0415 - lazy: start-up time
    from ..progress import progress  # noqa: PLC0415 - lazy: start-up time
    from ..tactics import Problem  # noqa: PLC0415 - lazy: start-up time

    problem = Problem.model_validate_json(problem_json)
    work = [pc.Job(d.registry.backends[c.backend], c.tactic,
                   kernel_problem(problem.as_operation(c.operation), c.tactic))
            for c in todo]  # fmt: skip
    bar = progress(iter(()), total=len(work), desc="compile", unit="kernel",
                   enable=None if bar_ok else False)  # fmt: skip
    with bar:
        report = pc.precompile(work, d.device, workers=jobs, on_outcome=lambda _: bar.update(1))
    out = []
    for cand, o in zip(todo, report.outcomes, strict=True):
        res: dict[str, Any] = {
            "backend": cand.backend,
            "tactic": cand.tactic.model_dump_json(),
            "ok": o.status == "compiled",
            "seconds": o.seconds,
            **o.details,
        }
        if o.status != "compiled":
            res["error"] = o.reason if o.status == "failed" else f"not compiled: {o.reason}"
        out.append(res)
    return out


def _report(todo: list, results: list[dict], as_json: bool, _t: float) -> int:
    families: dict[str, dict[str, Any]] = {}
    failures = []
    for cand, res in zip(todo, results, strict=True):
        row = families.setdefault(
            cand.family, {"shortlisted": 0, "compiled": 0, "failed": 0, "cached": 0, "seconds": 0.0}
        )
        row["shortlisted"] += 1
        row["seconds"] += res.get("compile_s") or 0.0
        if res["ok"]:
            row["compiled"] += 1
            row["cached"] += res.get("source") in ("disk", "memory")
        else:
            row["failed"] += 1
            failures.append((cand, res["error"]))
    if as_json:
        emit_json({
            "families": families,
            "results": [{**r, "family": c.family, "tactic": c.tactic.model_dump(mode="json")}
                        for c, r in zip(todo, results, strict=True)],
        })  # fmt: skip
    else:
        table = [(f, r["shortlisted"], r["compiled"], r["failed"], r["cached"], r["seconds"])
                 for f, r in sorted(families.items())]  # fmt: skip
        print(format_table(table, ("family", "shortlisted", "compiled", "failed", "from cache",
                                   "compile s (sum)")))  # fmt: skip
        if failures:
            print(f"\n{len(failures)} failed:")
            for cand, err in failures:
                print(f"  {cand.backend} {cand.tactic.canonical_json()}\n    {err}")
        print("\nnote: compiled for the target only; Blackwell/Rubin kernels are not run here")
    return 1 if failures else 0
