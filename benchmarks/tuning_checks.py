"""GPU check of the tuner's result check and the cache's environment record, one run.

What only a GPU can show: that every real kernel of the shortlist (Triton sm90 direct
and unpack+cuBLAS, split-K and swapped tactics included) passes the float64 reference
check at `fp4_dispatch.harness.CHECK_RTOL` (a false "wrong" would drop a good kernel),
what the check costs per bucket, that a cached winner is verified on its first use in
a fresh process, and that the CUDA driver version is recorded.

Run (on the H200, through the device tool)::

    python benchmarks/tuning_checks.py            # writes $OUT/tuning_checks.json if set

Per shape it tunes the bucket into a temporary cache (wall-clock, every candidate
checked), then builds a second `Dispatcher` on that cache and times its first
``select`` (re-validation + one verified run). The table printed last lists, per
shape: candidates measured, how many the check failed (expected 0; each failure is
printed with its error above the table), the seconds spent in the check, the tuning
wall time, whether the second process used the cached pick, and its first-use time.
Exit status 1 when any real kernel failed the check.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import markdown_table, parse_shapes, write_json

from fp4_dispatch import Dispatcher, harness
from fp4_dispatch import tuning as tuning_mod
from fp4_dispatch.cache import TuningCache
from fp4_dispatch.winners import environment

log = logging.getLogger("tuning_checks")

SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (128, 4096, 14336), (1024, 8192, 8192),
          (4096, 8192, 8192), (8192, 8192, 28672), (100, 3000, 4096)]  # fmt: skip


#: seconds spent in `check_output` since the last reset (see `_time_the_check`)
_SPENT = [0.0]


def _time_the_check() -> None:
    """Wrap `fp4_dispatch.tuning.check_output` once to add its wall time to `_SPENT`."""
    real = tuning_mod.check_output

    def timed(out, inputs, seed=0):
        t0 = time.perf_counter()
        try:
            return real(out, inputs, seed)
        finally:
            _SPENT[0] += time.perf_counter() - t0

    tuning_mod.check_output = timed


def run_shape(shape: tuple[int, int, int], folder: Path) -> dict:
    path = folder / f"c-{'x'.join(map(str, shape))}.json"
    _SPENT[0] = 0.0
    d = Dispatcher(cache=path)
    got: dict = {}
    tune_s = harness.call_wall_us(lambda: got.update(r=d.tune([shape], progress=False)), 1) / 1e6
    (r,) = got["r"]
    wrong = [m for m in r.measurements if m.method == "wrong"]
    d2 = Dispatcher(cache=path)
    first_use_s = harness.call_wall_us(lambda: got.update(pick=d2.select(*shape)), 1) / 1e6
    pick = got["pick"]
    return {
        "shape": shape,
        "measured": len(r.measurements),
        "wrong": len(wrong),
        "wrong_errors": [f"{m.candidate.backend} {m.candidate.tactic}: {m.error}" for m in wrong],
        "check_s": _SPENT[0],
        "tune_s": tune_s,
        "cached_pick_used": pick.reason.startswith("tuned"),
        "first_use_s": first_use_s,
        "winner": None if r.winner is None else f"{r.winner.backend} {r.winner.tactic}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=None, help="M,N,K ... (default: a set)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU")
        return 2
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    _time_the_check()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            rows.append(run_shape(shape, Path(tmp)))
        env = environment(Dispatcher(cache=False).device)
        entries = TuningCache(Path(tmp) / f"c-{'x'.join(map(str, shapes[0]))}.json").entries()
    result = {"environment": env, "entry_env": entries[0].get("env") if entries else None,
              "rtol": harness.CHECK_RTOL, "rows": rows}  # fmt: skip
    write_json("tuning_checks.json", result)
    for row in rows:
        for err in row["wrong_errors"]:
            sys.stdout.write(f"WRONG {row['shape']}: {err}\n")
    sys.stdout.write(f"environment: {json.dumps(env)}\n\n")
    headers = ("shape", "measured", "wrong", "check s", "tune s", "cached pick", "first use s")
    table = [(r["shape"], r["measured"], r["wrong"], f"{r['check_s']:.2f}", f"{r['tune_s']:.2f}",
              r["cached_pick_used"], f"{r['first_use_s']:.2f}") for r in rows]  # fmt: skip
    sys.stdout.write(markdown_table(headers, table, "lrrrrlr") + "\n")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
