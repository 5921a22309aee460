"""Fleet tuning benchmark: the never-loses check under both policies, and distributed tuning.

One device call. Single process (``python benchmarks/bench_tuning_fleet.py``): for each of
4 shapes, tune with ``measure="graph"`` (CUDA-graph replay, cold L2) and
``measure="eager"`` (back-to-back launches), each from scratch (``force``), and report
the winner, the default (heuristic) pick, the paired ratio winner / default of the
never-loses check, whether the default was kept, and the tuning wall time (the first
policy's includes compiling the shortlist). Then an independent check, outside the
tuner: the adopted pick and the default timed again on fresh inputs with the harness
(`gpu_time_us` for graph, `eager_wall_us` for eager); "check" is their ratio (<= 1 +
band: the tuned pick does not lose).

Under torchrun (``torchrun --nproc-per-node N benchmarks/bench_tuning_fleet.py``; NCCL
on GPUs, one GPU per rank, gloo on CPU): every rank first tunes all shapes alone once
(a warm-up: every kernel is compiled on every rank, so the timed runs compare
measurement, not compilation); then rank 0 tunes them alone, timed, while the others
wait; then the whole group tunes them together (``group=WORLD``), timed. Reports each
rank's picks, whether all ranks agree (and with rank 0 alone), and wall time of the
group vs one rank alone.

Nothing is written to the user's tuning cache (memory only). Writes
``$OUT/tuning_fleet.json`` (or ``--out``) and prints a table last. ``--quick``: a tiny
CPU version with the reference backend (script check; times mean nothing).

Run on the H200 (one GPU)::

    python benchmarks/bench_tuning_fleet.py

and on two GPUs of one host (the ``nvidia-h200-x2`` kind)::

    torchrun --nproc-per-node 2 benchmarks/bench_tuning_fleet.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fp4_dispatch import Dispatcher, harness
from fp4_dispatch.guard import launch as run_kernel
from fp4_dispatch.tactics import tactic_label
from fp4_dispatch.tuning import default_timer, make_inputs

#: decode, small batch, prefill chunk, prefill: (M, N, K) of a 70B-class layer
SHAPES = ((1, 8192, 8192), (16, 28672, 8192), (256, 8192, 28672), (4096, 8192, 8192))
QUICK_SHAPES = ((1, 256, 256), (16, 256, 512), (64, 512, 256), (200, 256, 256))
POLICIES = ("graph", "eager")

log = logging.getLogger("bench_tuning_fleet")


def _key(c) -> str | None:
    return None if c is None else f"{c.backend} {c.tactic.canonical_json()}"


def _label(c) -> str:
    """``backend 128x64 knob=value``: the backend and `fp4_dispatch.tactics.tactic_label`."""
    return "-" if c is None else f"{c.backend} {tactic_label(c.tactic)}"


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _row(r, policy: str) -> dict:
    p = r.problem
    return {
        "shape": list(r.requested or (p.m, p.n, p.k)),
        "bucket_m": p.m,
        "policy_asked": policy,
        "measure": r.measure,
        "winner": _key(r.winner),
        "winner_label": _label(r.winner),
        "winner_us": _num(r.winner_us),
        "default": _key(r.heuristic),
        "default_us": _num(r.heuristic_us),
        "paired_ratio": _num(r.paired_ratio),
        "pairs": r.pairs,
        "kept_default": r.kept_default,
        "challenger": _key(r.challenger),
        "decision": r.decision,
        "noise_band": r.noise_band,
        "measured": len(r.measurements),
        "failures": len(r.failures),
        "wall_s": r.wall_s,
    }


def check_ratio(d: Dispatcher, r, quick: bool) -> float | None:
    """Adopted pick / default, timed again outside the tuner (fresh inputs, seed 1)."""
    if r.winner is None:
        return None
    if _key(r.winner) == _key(r.heuristic):
        return 1.0
    p = r.problem
    inputs = make_inputs(p, d.device, seed=1, copies=1)

    def call(c):
        kernel = d.kernel_for(c, p)
        return lambda: run_kernel(kernel, inputs.copies[0], inputs.out, c.tactic.swap_ab)

    fns = [call(r.winner), call(r.heuristic)]
    if r.measure == "graph":
        times = [harness.gpu_time_us(f) for f in fns]
    else:
        calls = 5 if quick else 200
        times = [harness.eager_wall_us(f, calls=calls, warmup=2) for f in fns]
    return times[0] / times[1] if times[1] > 0 else None


def policies(d: Dispatcher, shapes, quick: bool) -> list[dict]:
    """Each shape tuned from scratch under each policy (memory only), then checked."""
    rows = []
    for policy in POLICIES:
        for r in d.tune(shapes, measure=policy, force=True, save=False):
            row = _row(r, policy)
            row["check_ratio"] = check_ratio(d, r, quick)
            row["check_ok"] = (row["check_ratio"] is None
                               or row["check_ratio"] <= 1 + r.noise_band)  # fmt: skip
            rows.append(row)
    return rows


class Counting:
    """The device's default timer, counting the tactics this rank measured itself."""

    def __init__(self, d: Dispatcher) -> None:
        self.inner = default_timer(d.device)
        self.calls = 0

    def __call__(self, cand, launch, best_us):
        self.calls += 1
        return self.inner(cand, launch, best_us)

    def paired(self, cands, launches, pairs):
        return self.inner.paired(cands, launches, pairs)


def distributed(d: Dispatcher, shapes) -> dict:
    """Warm-up alone, rank 0 alone (timed), the group together (timed); picks and walls."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d.tune(shapes, force=True, save=False)  # warm-up: every rank compiles every kernel
    dist.barrier()
    alone_s, alone = None, None
    if rank == 0:
        t0 = time.perf_counter()
        alone = [_key(r.winner) for r in d.tune(shapes, force=True, save=False)]
        alone_s = time.perf_counter() - t0
    dist.barrier()
    timer = Counting(d)
    t0 = time.perf_counter()
    results = d.tune(shapes, force=True, save=False, group=dist.group.WORLD, timer=timer)
    group_s = time.perf_counter() - t0
    mine = {
        "rank": rank,
        "picks": [_key(r.winner) for r in results],
        "labels": [_label(r.winner) for r in results],
        "kept_default": [r.kept_default for r in results],
        "paired_ratio": [_num(r.paired_ratio) for r in results],
        "measured_here": timer.calls,
        "shortlist_total": sum(len(r.measurements) for r in results),
        "group_s": group_s,
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    agree = all(e["picks"] == every[0]["picks"] for e in every)
    return {
        "world": world,
        "backend": dist.get_backend(),
        "ranks": every,
        "agree": agree,
        "same_as_alone": alone == every[0]["picks"] if rank == 0 else None,
        "alone_s": alone_s,
        "group_s": max(e["group_s"] for e in every),
        "speedup": (alone_s / max(e["group_s"] for e in every)) if alone_s else None,
    }


def _table(rows: list[dict]) -> str:
    head = (f"{'shape':>18} {'asked':>6} {'policy':>6} {'winner':>44} {'µs':>9} "
            f"{'default µs':>10} {'paired':>7} {'kept':>5} {'check':>6} {'wall s':>7}")  # fmt: skip
    lines = [head]
    for r in rows:
        ratio = "-" if r["paired_ratio"] is None else f"{r['paired_ratio']:.3f}"
        us = "-" if r["winner_us"] is None else f"{r['winner_us']:.2f}"
        dus = "-" if r["default_us"] is None else f"{r['default_us']:.2f}"
        shape = "x".join(str(v) for v in r["shape"])
        winner = r["winner_label"][:44]
        kept = "yes" if r["kept_default"] else "no"
        check = "-" if r["check_ratio"] is None else f"{r['check_ratio']:.3f}"
        check += "" if r["check_ok"] else "!"
        lines.append(
            f"{shape:>18} {r['policy_asked']:>6} {r['measure']:>6} {winner:>44} {us:>9} "
            f"{dus:>10} {ratio:>7} {kept:>5} {check:>6} {r['wall_s']:>7.2f}"
        )
    return "\n".join(lines)


def _dist_table(res: dict) -> str:
    lines = [f"distributed: {res['world']} ranks ({res['backend']}); ranks agree: "
             f"{res['agree']}; same picks as rank 0 alone: {res['same_as_alone']}"]  # fmt: skip
    for e in res["ranks"]:
        lines.append(f"  rank {e['rank']}: measured {e['measured_here']} of "
                     f"{e['shortlist_total']} tactics; "
                     f"wall {e['group_s']:.2f} s; picks {e['labels']}")  # fmt: skip
    if res["alone_s"] is not None:
        lines.append(f"  wall: group {res['group_s']:.2f} s vs one rank alone "
                     f"{res['alone_s']:.2f} s (x{res['speedup']:.2f})")  # fmt: skip
    return "\n".join(lines)


def _init_group(quick: bool) -> bool:
    """Join the torchrun job if there is one (NCCL on CUDA, else gloo); False if none."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = torch.cuda.is_available() and not quick
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(minutes=10))
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU run (script check)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:
        os.environ.setdefault("FP4_DISPATCH_PLUGINS", "")  # the built-in reference on CPU
    os.environ.setdefault("FP4_DISPATCH_PROGRESS", "0")
    grouped = _init_group(args.quick)
    device = "cpu" if args.quick else None
    if not args.quick and not torch.cuda.is_available():
        print("no CUDA device: run with --quick for the CPU check", file=sys.stderr)
        return 2
    if grouped and not args.quick:
        device = f"cuda:{torch.cuda.current_device()}"
    d = Dispatcher(device=device, cache=False)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    report: dict = {"device": d.device.name, "kind": d.device.kind, "quick": args.quick,
                    "date": now}  # fmt: skip
    try:
        if grouped:
            report["distributed"] = distributed(d, shapes)
        else:
            report["policies"] = policies(d, shapes, args.quick)
    finally:
        if grouped:
            dist.destroy_process_group()
    if grouped and report["distributed"]["alone_s"] is None:
        return 0  # rank 0 writes and prints
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning_fleet.json").write_text(json.dumps(report, indent=1))
    print(f"\n{d.device.name} ({d.device.kind})" + ("; --quick: times mean nothing"
                                                   if args.quick else ""))  # fmt: skip
    if grouped:
        print(_dist_table(report["distributed"]))
        return 0 if report["distributed"]["agree"] else 1
    print(_table(report["policies"]))
    lost = [r for r in report["policies"] if not r["check_ok"]]
    print(f"tuned pick slower than the default beyond the band (check '!'): {len(lost)} of "
          f"{len(report['policies'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
