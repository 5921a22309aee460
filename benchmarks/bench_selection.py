"""Selection quality: tuned pick and heuristic pick against the exhaustive best.

For each shape of the Hopper grid (M = 1, 16, 128, 1024, 4096, 16384 for (N, K) =
(8192, 8192), (28672, 8192), (8192, 28672)) it:

1. tunes the shape with a fresh `Dispatcher` and an empty tuning cache, default budget
   (``tune first``: wall time of `Dispatcher.tune`, kernels already compiled on disk by
   the parallel precompile step, loaded into this process on first use);
2. times **every** valid tactic of the backend with the same measurement code
   (`fp4_dispatch.tuning.Tuner.measure`: CUDA graphs, cold L2, delay kernel; tactics
   more than 1.5x slower than the best so far are cut after one probe launch and keep
   the probe as their time - they cannot be the best). Shapes with more than
   ``--max-tactics`` tactics are sampled deterministically (best estimates first, then
   evenly spaced), and the table says so;
3. tunes again with another fresh `Dispatcher` (``tune warm``: everything compiled and
   loaded) and checks that both tunings picked the same tactic;
4. compares, on the exhaustive measurement: tuned pick / best (target <= 1.03), heuristic
   pick (`Dispatcher.select`, untuned) / best (target <= 1.15), and the tuning time
   (target <= 2 s).

Run on the H200 (one device call; writes ``selection.json`` and ``selection.md`` under
``$OUT``, default ./out)::

    python benchmarks/bench_selection.py

Check the script on a CPU with the reference backend (times mean nothing)::

    python benchmarks/bench_selection.py --device cpu --quick

The backend under test is ``--backend`` (default triton-sm90 on CUDA, torch-reference on
CPU); every other plugin is disabled through ``FP4_DISPATCH_DISABLE`` so the dispatcher
chooses among that backend's tactics only (``--all-backends`` keeps them). The tuning
caches are fresh files in a temporary folder, never the user's cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GRID_M = (1, 16, 128, 1024, 4096, 16384)
GRID_NK = ((8192, 8192), (28672, 8192), (8192, 28672))
QUICK_M = (1, 16, 128)
QUICK_NK = ((256, 4096), (512, 2048))
TUNED_TARGET, HEURISTIC_TARGET, TUNE_TIME_TARGET_S = 1.03, 1.15, 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cuda[:N] or cpu")
    p.add_argument("--quick", action="store_true", help="small shapes (script check)")
    p.add_argument("--backend", default=None, help="backend under test")
    p.add_argument("--all-backends", action="store_true", help="keep the other plugins")
    p.add_argument("--budget", type=int, default=None, help="tuning budget (default: library)")
    p.add_argument("--max-tactics", type=int, default=200, help="exhaustive cap per shape")
    p.add_argument("--time-limit", type=float, default=270.0, help="seconds for everything")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="precompile processes (0: none; default: on CUDA, min(cpus - 1, 16))",
    )
    p.add_argument("--shapes", nargs="*", default=None, metavar="M,N,K", help="override grid")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    p.add_argument(
        "--model-check",
        default=None,
        metavar="SELECTION_JSON",
        help="no measuring: the held-out check of the installed cost model on a "
        "selection file (benchmarks/fit_cost_model.py check), to $OUT/model_check.json",
    )
    return p.parse_args(argv)


def model_check(path: str, out: Path) -> int:
    """The installed cost model's heuristic pick on a selection file's shapes (CPU only):
    how many are within HEURISTIC_TARGET of the exhaustive best, and whether the file's
    grid was held out from the model's fit."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fit_cost_model import check

    res = check(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_check.json").write_text(json.dumps(res, indent=1))
    print(f"grid N,K {res['grid_nk']} x M {res['grid_m']}: "
          f"{'held out from' if res['held_out'] else 'OVERLAPS'} the model's fit "
          f"({res['model'].get('nk')}); {res['summary']}")  # fmt: skip
    return 0


def grid_record(shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Which grid this run measures, against the grid the installed sm90 model was fitted
    on: when they are disjoint, the heuristic column is a held-out check."""
    try:
        from fp4_dispatch.plugins.sm90 import cost_model
    except ImportError as exc:  # no sm90 plugin: nothing to compare with
        return {"nk": sorted({(n, k) for _, n, k in shapes}), "model": f"unavailable: {exc}"}
    fitted = cost_model.constants().get("fitted_on", {})
    nk = sorted({(n, k) for _, n, k in shapes})
    overlap = sorted(set(nk) & {tuple(x) for x in fitted.get("nk", [])})
    return {"nk": nk, "m": sorted({m for m, _, _ in shapes}), "model_fitted_on": fitted,
            "held_out_from_model": not overlap, "overlap": overlap}  # fmt: skip


# ---- setup ------------------------------------------------------------------------------


def restrict_plugins(backend: str, device: str) -> str:
    """Disable every plugin but the one that provides `backend`; returns its plugin name."""
    from fp4_dispatch.dispatcher import Dispatcher

    probe = Dispatcher(device=device, cache=False)
    if backend not in probe.registry.backends:
        sys.exit(f"backend {backend!r} is not installed; have {sorted(probe.registry.backends)}")
    if backend not in {b.name for b in probe.available}:
        row = next(r for r in probe.backends() if r.name == backend)
        sys.exit(f"backend {backend!r} is not available here: {row.reason}")
    mine = probe.registry.plugin_of[backend].name
    others = sorted({r.name for r in probe.registry.plugins} - {mine})
    os.environ["FP4_DISPATCH_DISABLE"] = ",".join(others)
    return mine


def sample(cands: list, cap: int) -> tuple[list, bool]:
    """At most `cap` candidates: the best half by estimate, then evenly spaced others."""
    if len(cands) <= cap:
        return cands, False
    head = cands[: cap // 2]
    rest = cands[cap // 2 :]
    step = len(rest) / (cap - len(head))
    return head + [rest[int(i * step)] for i in range(cap - len(head))], True


# ---- precompile (CUDA) --------------------------------------------------------------------


def precompile(d, plan: dict, workers: int, deadline_s: float) -> dict[str, Any]:
    """Compile every planned (shape, tactic) in `workers` processes with the library's
    shared implementation (`fp4_dispatch.precompile`: Triton ``warmup``, no launch), so
    the timed code only loads kernels from Triton's disk cache."""
    from fp4_dispatch import precompile as pc
    from fp4_dispatch.tactics import Problem

    pairs = []
    for (m, n, k), tactic_jsons in plan.items():
        for tj in tactic_jsons:
            raw = json.loads(tj)
            backend = d.registry.backends[raw["backend"]]
            pairs.append((backend, backend.tactic_type.model_validate(raw), Problem(m=m, n=n, k=k)))
    jobs = pc.jobs_for(pairs)
    report = pc.precompile(jobs, d.device, workers=workers, deadline_s=deadline_s)
    return {"seconds": report.seconds, "ran": len(report.compiled),
            "skipped_deadline": len(report.skipped), "distinct_kernels": len(jobs),
            "failures": [(o.job.backend.name, o.job.tactic.canonical_json(), o.reason)
                         for o in report.failed]}  # fmt: skip


# ---- one shape --------------------------------------------------------------------------


def _same(a, b) -> bool:
    return a is not None and b is not None and (a.backend, a.tactic) == (b.backend, b.tactic)


def tactic_label(c) -> str:
    """A candidate's tactic as a table cell (`fp4_dispatch.tactics.tactic_label`)."""
    from fp4_dispatch.tactics import tactic_label as label

    return label(c.tactic)


def fresh_dispatcher(device: str, budget: int | None, cache: Path):
    from fp4_dispatch.dispatcher import Dispatcher

    cache.unlink(missing_ok=True)
    kwargs = {} if budget is None else {"budget": budget}
    return Dispatcher(device=device, cache=cache, **kwargs)


def bench_shape(shape, args, caches: Path, index: int) -> dict[str, Any]:
    from fp4_dispatch.ranking import shortlist
    from fp4_dispatch.tactics import Problem
    from fp4_dispatch.tuning import Tuner

    m, n, k = shape
    problem = Problem(m=m, n=n, k=k)
    # 1. tune (first in this process for this shape)
    d1 = fresh_dispatcher(args.device, args.budget, caches / f"cache-{index}a.json")
    heuristic = d1.select(m, n, k)  # untuned: the heuristic pick
    t0 = time.perf_counter()
    (first,) = d1.tune([shape], progress=False)
    tune_first_s = time.perf_counter() - t0
    # 2. exhaustive
    everything = shortlist(problem, d1.device, d1.available, budget=10**9).candidates
    todo, sampled = sample(everything, args.max_tactics)
    tuner = Tuner(d1)
    t0 = time.perf_counter()
    measured = tuner.measure(problem, todo, deadline=args.deadline)
    exhaustive_s = time.perf_counter() - t0
    by_tactic = {(x.candidate.backend, x.candidate.tactic): x for x in measured}
    ok = [x for x in measured if x.ok]
    best = min(ok, key=lambda x: x.us) if ok else None
    # 3. tune again, everything compiled
    d2 = fresh_dispatcher(args.device, args.budget, caches / f"cache-{index}b.json")
    t0 = time.perf_counter()
    (warm,) = d2.tune([shape], progress=False)
    tune_warm_s = time.perf_counter() - t0

    def exh_us(c) -> float:
        if c is None:
            return math.nan
        x = by_tactic.get((c.backend, c.tactic))
        return x.us if x is not None else math.nan

    best_us = best.us if best else math.nan
    row = {
        "shape": [m, n, k],
        "tactics_valid": len(everything),
        "tactics_timed": len(todo),
        "sampled": sampled,
        "failed": sum(1 for x in measured if not x.ok and x.method != "skipped"),
        "not_timed_deadline": sum(1 for x in measured if x.method == "skipped"),
        "pruned": sum(1 for x in measured if x.method == "pruned"),
        "best": None if best is None else tactic_label(best.candidate),
        "best_us": best_us,
        "tuned": None if warm.winner is None else tactic_label(warm.winner),
        "tuned_us": exh_us(warm.winner),
        "tuned_own_us": warm.winner_us,
        "tuned_first": None if first.winner is None else tactic_label(first.winner),
        "tuned_first_us": exh_us(first.winner),
        "picks_agree": _same(first.winner, warm.winner),
        "heuristic": tactic_label(heuristic),
        "heuristic_us": exh_us(heuristic),
        "heuristic_est_us": heuristic.est_us,
        "noise_band": warm.noise_band,
        "tune_first_s": tune_first_s,
        "tune_warm_s": tune_warm_s,
        "tune_measured": len(warm.measurements),
        "exhaustive_s": exhaustive_s,
        "failures": [
            (tactic_label(x.candidate), x.error)
            for x in measured
            if not x.ok and x.method != "skipped"
        ][:20],
        "all": [
            {"tactic": x.candidate.tactic.model_dump(mode="json"), "est_us": x.candidate.est_us,
             "us": x.us if x.ok else None, "method": x.method}
            for x in measured
        ],
    }  # fmt: skip
    row["tuned_ratio"] = row["tuned_us"] / best_us if best else math.nan
    row["heuristic_ratio"] = row["heuristic_us"] / best_us if best else math.nan
    return row


# ---- report -----------------------------------------------------------------------------


def _f(x: float, nd: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{nd}f}"


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| M | N | K | tactics | best µs | tuned µs | tuned/best | heuristic µs | heur/best "
        "| tune first s | tune warm s | picks agree | best tactic | tuned | heuristic |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---|---|---|"
    )
    lines = [head]
    for r in rows:
        m, n, k = r["shape"]
        if "skipped" in r:
            lines.append(f"| {m} | {n} | {k} | {r['skipped']} |" + " |" * 11)
            continue
        tact = f"{r['tactics_timed']}" + (f" of {r['tactics_valid']} (sampled)" if r["sampled"]
                                          else "")  # fmt: skip
        if r["not_timed_deadline"]:
            tact += f" ({r['not_timed_deadline']} not timed: time limit)"
        cells = [m, n, k, tact, _f(r["best_us"]), _f(r["tuned_us"]), _f(r["tuned_ratio"], 3),
                 _f(r["heuristic_us"]), _f(r["heuristic_ratio"], 3), _f(r["tune_first_s"], 2),
                 _f(r["tune_warm_s"], 2), "yes" if r["picks_agree"] else "NO", r["best"],
                 r["tuned"], r["heuristic"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    done = [r for r in rows if "skipped" not in r]
    if done:
        tr = [r["tuned_ratio"] for r in done if math.isfinite(r["tuned_ratio"])]
        hr = [r["heuristic_ratio"] for r in done if math.isfinite(r["heuristic_ratio"])]
        tw = [r["tune_warm_s"] for r in done]
        tf = [r["tune_first_s"] for r in done]
        lines += [
            "",
            f"- tuned pick within {TUNED_TARGET - 1:.0%} of the best: "
            f"{sum(x <= TUNED_TARGET for x in tr)}/{len(tr)} shapes "
            f"(geomean {statistics.geometric_mean(tr):.3f}, worst {max(tr):.3f})"
            if tr
            else "",
            f"- heuristic pick within {HEURISTIC_TARGET - 1:.0%}: "
            f"{sum(x <= HEURISTIC_TARGET for x in hr)}/{len(hr)} shapes "
            f"(geomean {statistics.geometric_mean(hr):.3f}, worst {max(hr):.3f})"
            if hr
            else "",
            f"- tuning one shape <= {TUNE_TIME_TARGET_S:.0f} s: warm {sum(x <= 2 for x in tw)}"
            f"/{len(tw)} (max {max(tw):.2f} s), first {sum(x <= 2 for x in tf)}/{len(tf)} "
            f"(max {max(tf):.2f} s)",
            f"- both tunings picked the same tactic: {sum(r['picks_agree'] for r in done)}"
            f"/{len(done)}",
        ]
    lines += ["", f"device: {meta['device']}; backend {meta['backend']}; "
              f"budget {meta['budget']}; total {meta['total_s']:.0f} s"]  # fmt: skip
    return "\n".join(lines)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    (out / "selection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "selection.md").write_text(markdown(rows, meta) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_check:
        return model_check(args.model_check, Path(args.out))
    start = time.time()
    # no new tactic is timed after this: the rest of the shape is reported as not timed
    args.deadline = time.monotonic() + args.time_limit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["FP4_DISPATCH_PROGRESS"] = "0"
    caches = Path(tempfile.mkdtemp(prefix="fp4-bench-caches-"))
    os.environ["FP4_DISPATCH_CACHE"] = str(caches / "unused.json")

    from fp4_dispatch.profiles import resolve

    info = resolve(args.device)
    args.device = info.torch_device if info.kind == "cuda" else "cpu"
    backend = args.backend or ("triton-sm90" if info.kind == "cuda" else "torch-reference")
    if not args.all_backends:
        restrict_plugins(backend, args.device)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    else:
        ms, nks = (QUICK_M, QUICK_NK) if args.quick else (GRID_M, GRID_NK)
        shapes = [(m, n, k) for n, k in nks for m in ms]

    from fp4_dispatch.dispatcher import Dispatcher
    from fp4_dispatch.ranking import DEFAULT_BUDGET, shortlist
    from fp4_dispatch.tactics import Problem

    d = Dispatcher(device=args.device, cache=False)
    plan = {}
    for m, n, k in shapes:
        cands = shortlist(Problem(m=m, n=n, k=k), d.device, d.available, budget=10**9).candidates
        plan[(m, n, k)] = [c.tactic.canonical_json() for c in sample(cands, args.max_tactics)[0]]
    meta: dict[str, Any] = {
        "device": f"{info.name} ({info.kind}, {info.sm_count} SMs)",
        "backend": backend if not args.all_backends else "all",
        "budget": args.budget or DEFAULT_BUDGET,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "total_s": 0.0,
        "grid": grid_record(shapes),
    }
    workers = args.workers
    if workers is None:
        from fp4_dispatch.precompile import default_workers

        workers = 0 if info.kind != "cuda" else default_workers(10**6)
    if workers > 0:
        print(f"precompiling {sum(map(len, plan.values()))} (shape, tactic) pairs in "
              f"{workers} processes ...", flush=True)  # fmt: skip
        budget_s = start + 0.45 * args.time_limit - time.time()
        meta["precompile"] = precompile(d, plan, workers, budget_s)
        pc = meta["precompile"]
        print(
            f"  {pc['ran']} ran, {len(pc['failures'])} failed, "
            f"{pc['skipped_deadline']} left to JIT, {pc['seconds']:.0f} s",
            flush=True,
        )
        for f in pc["failures"][:10]:
            print("  failed:", *f, flush=True)

    rows: list[dict] = []
    for i, shape in enumerate(shapes):
        if time.time() - start > args.time_limit:
            rows.append({"shape": list(shape), "skipped": "time limit"})
            continue
        t0 = time.time()
        try:
            row = bench_shape(shape, args, caches, i)
        except Exception as exc:  # one shape failing must not lose the others: recorded
            row = {"shape": list(shape), "skipped": f"error: {type(exc).__name__}: {exc}"}
        rows.append(row)
        meta["total_s"] = time.time() - start
        write(out, rows, meta)
        if "skipped" in row:
            print(f"{shape}: {row['skipped']}", flush=True)
            continue
        print(f"{shape}: best {_f(row['best_us'])} us, tuned x{_f(row['tuned_ratio'], 3)}, "
              f"heuristic x{_f(row['heuristic_ratio'], 3)}, tune {row['tune_first_s']:.2f}/"
              f"{row['tune_warm_s']:.2f} s, {row['tactics_timed']} timed ({row['pruned']} pruned) "
              f"in {time.time() - t0:.1f} s", flush=True)  # fmt: skip
    meta["total_s"] = time.time() - start
    write(out, rows, meta)
    print()
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
