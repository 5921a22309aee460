"""On-device correctness grid for the sm90 backends: every enumerated tactic.

Both sm90 backends: ``triton-sm90`` (every tactic of the grid below) and
``triton-sm90-unpack`` (unpack to bf16 + cuBLAS; every tactic for M in 256, 1000 and 4096
with the same (N, K)). The unpack path rounds a bf16 output twice (bf16 product, then
alpha) - still inside the bf16 tolerance - and keeps the product in fp32 for fp16 output.

For each shape of the grid (M in 1, 3, 16, 100, 128, 1000, 4096 x several (N, K),
including an N that is no multiple of 16 and a K that is no multiple of any K tile),
every tactic the plugin enumerates (both orientations) runs on fresh random non-zero
NVFP4 inputs (all 16 e2m1 codes, block scales log-uniform over 2**-9..2**6 including
e4m3 subnormals, NaN in the scale padding) into an output poisoned with NaN, and is
compared with the float64 product of the dequantized operands:
``||out - ref|| / ||ref||`` must be below 4e-3 for bf16 output and 1e-3 for fp16
(the outputs' rounding; the products are exact and accumulate in fp32), and every
element must be finite. Out dtype alternates bf16/fp16 between tactics.

Every distinct kernel is first compiled in worker processes (`fp4_dispatch.precompile`,
``--workers`` of them, CUDA only); the checks then run in this process.

    python benchmarks/hopper_correctness.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, precompile_kernels, write_json
from bench_hopper import parse_tactic, tactic_kernel

from fp4_dispatch import harness
from fp4_dispatch.backend import launch
from fp4_dispatch.device import detect
from fp4_dispatch.plugins.sm90 import (
    Sm90UnpackTactic,
    TritonSm90Backend,
    TritonSm90Tactic,
    TritonSm90UnpackBackend,
)
from fp4_dispatch.profiles import simulated
from fp4_dispatch.tactics import Problem

GRID_MS = (1, 3, 16, 100, 128, 1000, 4096)
GRID_NK = ((8192, 8192), (1000, 4160), (2048, 1056))
#: M values of the grid for the unpack + cuBLAS backend (it offers nothing below 256)
UNPACK_GRID_MS = (256, 1000, 4096)
SMOKE_SHAPES = ((1, 40, 96), (3, 72, 160), (17, 24, 64))
UNPACK_SMOKE_SHAPES = ((260, 40, 96), (300, 17, 160))
TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
if "--smoke" in sys.argv:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    TOL[torch.bfloat16] = 8e-3


def check_one(
    t: TritonSm90Tactic | Sm90UnpackTactic, m: int, n: int, k: int, device, gen, dtype
) -> tuple[float, str]:
    """(relative error, why it fails or "") of one tactic on fresh stress operands."""
    ops = harness.stress_operands(m, n, k, device, gen)
    ref = harness.reference_output(ops)  # float64 on the operands' device
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    launch(tactic_kernel(t), ops, out, t.swap_ab)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return harness.compare(out, ref, TOL[dtype])


def check_all(jobs: list[tuple[str, int, int, int]], device, seed: int) -> list[dict]:
    """Run every (tactic JSON, M, N, K) job in this process; out dtype alternates
    bf16/fp16 between jobs (`out_dtype`). One row per job; a crash is a failed row."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rows = []
    for i, (tj, m, n, k) in enumerate(jobs):
        t = parse_tactic(tj)
        dtype = out_dtype(i)
        try:
            err, why = check_one(t, m, n, k, device, gen, dtype)
        except Exception as exc:  # a crash is a failure of this tactic, recorded
            err, why = float("nan"), f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(
            {
                "backend": t.backend,
                "tactic": tj,
                "m": m,
                "n": n,
                "k": k,
                "dtype": str(dtype),
                "err": err,
                "fail": why,
            }
        )
    return rows


def out_dtype(i: int) -> torch.dtype:
    """The output dtype of the `i`-th job: bf16 and fp16 in turn."""
    return torch.bfloat16 if i % 2 == 0 else torch.float16


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET, tiny shapes")
    ap.add_argument(
        "--backends",
        default="triton-sm90,triton-sm90-unpack",
        help="comma list of the sm90 backends to check",
    )
    args = ap.parse_args()
    wanted = set(args.backends.split(","))
    if args.smoke:
        device, info, shapes = "cpu", simulated("sm90"), list(SMOKE_SHAPES)
        unpack_shapes = list(UNPACK_SMOKE_SHAPES)
    else:
        device, info = "cuda", detect()
        shapes = [(m, n, k) for n, k in GRID_NK for m in GRID_MS]
        unpack_shapes = [(m, n, k) for n, k in GRID_NK for m in UNPACK_GRID_MS]
    jobs: list[tuple[str, int, int, int]] = []
    planned = []  # (backend, tactic, problem) of each job, for the precompile
    per_shape = {}
    for backend, grid in (
        (TritonSm90Backend(), shapes),
        (TritonSm90UnpackBackend(), unpack_shapes),
    ):
        if backend.name not in wanted:
            continue
        for m, n, k in grid:
            ts = list(backend.tactics(Problem(m=m, n=n, k=k), info))
            per_shape[f"{backend.name} {m}x{n}x{k}"] = len(ts)
            for t in ts:
                dtype = str(out_dtype(len(jobs))).removeprefix("torch.")
                planned.append((backend, t, Problem(m=m, n=n, k=k, out_dtype=dtype)))
                jobs.append((t.canonical_json(), m, n, k))
    t0 = time.time()
    report = precompile_kernels(planned, info, args.workers)
    print(f"{len(jobs)} runs: {len(report.outcomes)} kernel variants over {len(per_shape)} "
          f"shapes; tactics per shape {per_shape}", flush=True)  # fmt: skip
    print(f"precompile: {report.summary()}", flush=True)
    rows = check_all(jobs, device, 17)
    fails = [r for r in rows if r["fail"]]
    errs = [r["err"] for r in rows if not r["fail"]]
    write_json("hopper_correctness.json",
               {"device": info.name, "per_shape": per_shape, "rows": rows}, args.out)  # fmt: skip
    print(
        f"{len(rows)} runs in {time.time() - t0:.0f}s: {len(rows) - len(fails)} PASS, "
        f"{len(fails)} FAIL; max rel err of passes {max(errs, default=float('nan')):.3g}"
    )
    for r in fails[:30]:
        print(f"  FAIL {r['m']}x{r['n']}x{r['k']} {r['dtype']} {r['tactic']}: {r['fail']}")
    by_shape: dict[str, list[int]] = {}
    for r in rows:
        c = by_shape.setdefault(f"{r['backend']} {r['m']}x{r['n']}x{r['k']}", [0, 0])
        c[0 if not r["fail"] else 1] += 1
    table = [(s, ok + bad, ok, bad) for s, (ok, bad) in by_shape.items()]
    print(markdown_table(("shape", "tactics", "pass", "fail"), table, "lrrr"))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
