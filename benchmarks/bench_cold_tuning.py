"""Cold tuning: wall time of `Dispatcher.tune` when nothing is compiled yet (issue 14).

Targets (H200): 10 new shapes tuned cold in one ``tune`` call <= 30 s in total; one new M
bucket of an (N, K) already compiled in the process <= 3 s.

Each scenario runs in a FRESH subprocess (Triton's in-memory kernels and the library's
"compiled in this process" memory are per process) with an EMPTY Triton cache dir
(``TRITON_CACHE_DIR``), an empty CuTe kernel cache and an empty tuning cache:

- ``precompile``: one ``tune`` call for the 10 shapes (a 70B-like set: (N, K) in
  {(8192, 8192), (28672, 8192), (8192, 28672), (10240, 8192)} x a few M) - the kernels
  are compiled first in parallel worker processes (`fp4_dispatch.precompile`), then
  measured; then one new M bucket of (8192, 8192) in the same process.
- ``serial`` (comparison, ``--no-compare`` skips it): the old way, ``precompile=False``
  (each kernel JIT-compiled on its first launch, one after another) - only the first
  shape and the new bucket, as 10 shapes would take minutes.

Run on the H200 (one device call, about 2-3 minutes; writes ``cold_tuning.json`` to
``$OUT`` when set)::

    python benchmarks/bench_cold_tuning.py

Check the script on a CPU (the reference backend, small shapes, precompile forced on;
times mean nothing)::

    python benchmarks/bench_cold_tuning.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: (N, K) of a 70B-like model (attention out / MLP up / MLP down / fused QKV) x M
SHAPES = [(1, 8192, 8192), (64, 8192, 8192), (4096, 8192, 8192),
          (1, 28672, 8192), (64, 28672, 8192), (4096, 28672, 8192),
          (1, 8192, 28672), (64, 8192, 28672),
          (1, 10240, 8192), (64, 10240, 8192)]  # fmt: skip
#: a new M bucket (16) of an (N, K) compiled by the 10-shape call
NEW_BUCKET = (16, 8192, 8192)
QUICK_SHAPES = [(1, 256, 512), (64, 256, 512), (1, 512, 1024)]
QUICK_NEW_BUCKET = (16, 256, 512)
COLD_TARGET_S, BUCKET_TARGET_S = 30.0, 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU check of the script")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --quick)")
    p.add_argument("--no-compare", action="store_true", help="skip the serial comparison")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for cold_tuning.json")
    p.add_argument("--scenario", default=None, help=argparse.SUPPRESS)  # the child's job
    return p.parse_args(argv)


# ---- one scenario (child process) --------------------------------------------------------


def _tune_timed(d, shapes, precompile: bool) -> dict[str, Any]:
    """Wall time of one ``tune`` call, with the precompile report(s) it produced."""
    from fp4_dispatch import precompile as pc

    reports: list = []
    real = pc.precompile

    def recording(*args, **kwargs):
        rep = real(*args, **kwargs)
        reports.append(rep)
        return rep

    pc.precompile = recording
    try:
        t0 = time.perf_counter()
        results = d.tune(shapes, precompile=precompile, progress=False)
        wall = time.perf_counter() - t0
    finally:
        pc.precompile = real
    return {
        "shapes": [list(s) for s in shapes],
        "wall_s": wall,
        "precompile": [
            {"seconds": r.seconds, "workers": r.workers, "compiled": len(r.compiled),
             "failed": len(r.failed), "skipped": len(r.skipped),
             "failures": [f"{o.job.backend.name} {o.job.tactic.canonical_json()}: {o.reason}"
                          for o in r.failed][:10]}
            for r in reports
        ],
        "measured": sum(len(r.measurements) for r in results),
        "failed_tactics": sum(len(r.failures) for r in results),
        "winners": [None if r.winner is None else r.winner.backend for r in results],
    }  # fmt: skip


def scenario(name: str, device: str, quick: bool) -> dict[str, Any]:
    from fp4_dispatch.dispatcher import Dispatcher

    shapes = QUICK_SHAPES if quick else SHAPES
    bucket = QUICK_NEW_BUCKET if quick else NEW_BUCKET
    precompile = name == "precompile"
    if name == "serial":
        shapes = shapes[:1]
    t0 = time.perf_counter()
    d = Dispatcher(device=device, cache=Path(os.environ["FP4_DISPATCH_CACHE"]))
    setup_s = time.perf_counter() - t0
    cold = _tune_timed(d, shapes, precompile)
    new_bucket = _tune_timed(d, [bucket], precompile)
    return {"scenario": name, "device": d.device.name, "setup_s": setup_s,
            "cold": cold, "new_bucket": new_bucket}  # fmt: skip


# ---- the driver (parent process) ---------------------------------------------------------


def run_child(name: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """One scenario in a fresh process with empty kernel and tuning caches."""
    tmp = Path(tempfile.mkdtemp(prefix=f"fp4-cold-{name}-"))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp / "triton"),
               FP4_DISPATCH_KERNEL_CACHE=str(tmp / "kernels"),
               FP4_DISPATCH_CACHE=str(tmp / "tuning.json"), FP4_DISPATCH_PROGRESS="0")  # fmt: skip
    cmd = [sys.executable, __file__, "--scenario", name, "--device", device]
    if args.quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    if proc.returncode != 0:
        return {"scenario": name, "error": proc.stderr[-3000:]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | shapes | tune wall s | precompile s (kernels, workers) | measured "
        "| new bucket s | bucket precompile s |"
    )
    lines = [head, "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | error: {r['error'][-200:]!r} | | | | | |")
            continue
        c, b = r["cold"], r["new_bucket"]

        def pcs(part: dict) -> str:
            p = part["precompile"]
            if not p:
                return "none"
            x = p[0]
            return (f"{x['seconds']:.1f} ({x['compiled']} compiled, {x['failed']} failed, "
                    f"{x['skipped']} skipped; {x['workers']})")  # fmt: skip

        lines.append(f"| {r['scenario']} | {len(c['shapes'])} | {c['wall_s']:.1f} | {pcs(c)} "
                     f"| {c['measured']} | {b['wall_s']:.2f} | {pcs(b)} |")  # fmt: skip
    pre = next((r for r in rows if r.get("scenario") == "precompile" and "error" not in r), None)
    if pre is not None:
        cw, bw = pre["cold"]["wall_s"], pre["new_bucket"]["wall_s"]
        n = len(pre["cold"]["shapes"])
        met_cold = "met" if cw <= COLD_TARGET_S else "NOT met"
        met_bucket = "met" if bw <= BUCKET_TARGET_S else "NOT met"
        lines += ["",
                  f"- {n} new shapes cold in one tune call: {cw:.1f} s "
                  f"(target <= {COLD_TARGET_S:.0f} s: {met_cold})",
                  f"- one new M bucket of a compiled (N, K): {bw:.2f} s "
                  f"(target <= {BUCKET_TARGET_S:.0f} s: {met_bucket})"]  # fmt: skip
        for part in ("cold", "new_bucket"):
            for p in pre[part]["precompile"]:
                for f in p["failures"]:
                    lines.append(f"- precompile failure ({part}): {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device or ("cpu" if args.quick else "cuda")
    if args.scenario:
        if args.quick:  # the reference backend only: precompile exercised on CPU too
            os.environ.setdefault("FP4_DISPATCH_PLUGINS", "")
            os.environ.setdefault("FP4_DISPATCH_PRECOMPILE_WORKERS", "2")
        row = scenario(args.scenario, device, args.quick)
        sys.stdout.write(json.dumps(row) + "\n")
        return 0
    names = ["precompile"] + ([] if args.no_compare else ["serial"])
    rows = []
    for name in names:
        print(f"scenario {name} ...", flush=True)
        rows.append(run_child(name, args, device))
    meta = {"device": device, "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(sys.argv)}  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cold_tuning.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
