"""Fit ``time_scale`` of ``triton-sm90-mma`` (cost_model.json, "mma") so the untuned pick
across backends takes it where it is faster, and check it on held-out shapes.

Why a separate factor: ``fit_w4a16_model.py --mma`` fits the mma constants by the pick
among mma tactics, which a common factor never changes; how the dispatcher chooses
between backends depends on the factor alone. The mma estimate runs 5-8% high on
average (log) and the dense W4A4 estimate 15-20% low at large N, so at W4A4 the untuned
pick took the dense kernel on 8 of 18 decode shapes where the mma path was 1.17-1.46x
faster (RESULTS.md "Hopper W4A16" run 8).

Data: run 8's two H200 sweeps of device call 2, measured with the factor at 1 -
``bench_w4a16_mma.py`` (W4A16: mma beside the direct kernel's best 6) and
``bench_w4a4_decode.py`` (W4A4: mma, dense, triton-sm90's best 6); call 3 measured both
again with the fitted factor (the ``_final``/``run8`` files), and the same fit on them
chooses the same factor.
Objective, on the in-sample rows of both (M 1, 4 and 16 x six (N, K)): the mean over
shapes of the measured time of the tactic with the lowest estimate among every timed
offered tactic of every backend, over the best measured one; ties go to the factor
nearest 1. The held-out rows (M 2 and 8 x three (N, K), fixed in run 4) are only scored.

    python benchmarks/fit_mma_scale.py            # fit, print in-sample and held-out
    python benchmarks/fit_mma_scale.py --check    # score the file's factor
    python benchmarks/fit_mma_scale.py --write    # fit and store it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fit_w4a16_model import MODEL, ROOT, constants, pick_over_best

from fp4_dispatch.plugins.sm90 import TritonSm90Backend
from fp4_dispatch.plugins.sm90.dense import TritonSm90DenseBackend
from fp4_dispatch.plugins.sm90.mma import TritonSm90MmaBackend
from fp4_dispatch.plugins.sm90.w4a16 import TritonSm90W4A16Backend
from fp4_dispatch.profiles import rated, simulated
from fp4_dispatch.tactics import Problem

DATA = {
    "w4a16": ROOT / "benchmarks" / "data" / "sm90_w4a16_mma_run8_call2.json",
    "w4a4": ROOT / "benchmarks" / "data" / "sm90_w4a4_decode_run8_call2.json",
}
#: factors searched (0.70 .. 1.00)
GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(31))
BACKENDS = {b.name: b for b in (TritonSm90MmaBackend(), TritonSm90W4A16Backend(),
                                TritonSm90DenseBackend(), TritonSm90Backend())}  # fmt: skip


def load(path: Path, operation: str, device) -> list[tuple[Problem, bool, list]]:
    """(problem, held out, [(backend, tactic, measured µs)]) per shape: timed tactics that
    their backend offers for the shape."""
    rows = []
    for r in json.loads(path.read_text())["shapes"]:
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16", operation=operation)
        timed = []
        for tj, e in r["tactics"].items():
            b = BACKENDS[e["backend"]]
            t = b.tactic_type.model_validate_json(tj)
            if "us" in e and b.validate(t, p, device) is None:
                timed.append((b, t, e["us"]))
        rows.append((p, bool(r["held_out"]), timed))
    return rows


def score(rows, device, scale: float) -> float:
    """Mean of (the lowest estimate's measured time / the best measured time)."""
    with constants({"time_scale": scale}, "mma"):
        ratios = [pick_over_best(p, device, timed) for p, _, timed in rows]
    return sum(ratios) / len(ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="score the file's factor only")
    ap.add_argument("--write", action="store_true", help="store the fitted factor")
    args = ap.parse_args(argv)
    device = rated(simulated("sm90"))
    rows = {op: load(path, op, device) for op, path in DATA.items()}
    train = [r for rs in rows.values() for r in rs if not r[1]]
    current = json.loads(MODEL.read_text())["mma"]["time_scale"]
    scale = current if args.check else min(GRID, key=lambda s: (score(train, device, s), -s))
    print(f"time_scale {scale}")
    for op, rs in rows.items():
        for name, held in (("in-sample", False), ("held-out", True)):
            part = [r for r in rs if r[1] == held]
            print(f"{op} {name}: pick/best mean {score(part, device, scale):.3f} "
                  f"({len(part)} shapes; factor 1: {score(part, device, 1.0):.3f})")  # fmt: skip
    if args.write and not args.check:
        data = json.loads(MODEL.read_text())
        data["mma"]["time_scale"] = scale
        MODEL.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
