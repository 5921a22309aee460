"""H200: the warp-specialized W4A16 kernel against the direct kernel, bf16 and FP8 (M = 32-256).

    python3 benchmarks/bench_w4a16_ws.py          # OUT=/dir: also $OUT/w4a16_ws.json
    python3 benchmarks/bench_w4a16_ws.py --smoke  # CPU: tiny shapes, interpreter

Grid: `bench_w4a16_decode.shape_grid`'s ``--mid`` grid (M 64 and 256 x its six (N, K),
in-sample; M 32 and 128 x its three held-out (N, K), held out of the ``triton-sm90-ws``
fit in ``fit_w4a16_model.py --ws``: fixed before it). Per shape:

1. bf16 cuBLAS and FP8 cuBLASLt (per-tensor scales) on the dequantized weight (GPU time and
   eager wall), `bench_w4a16_decode.baselines`;
2. every offered ``triton-sm90-ws`` tactic, and the ``triton-sm90-w4a16`` estimate's best
   `W4A16_TOP` (its untuned candidates: the direct, unpack and gemv paths);
3. each output (poisoned with NaN) against the float64 ``alpha * x @ dequant(W).T``:
   relative Frobenius error <= 1e-2, else failed and not timed;
4. GPU time (`harness.gpu_time_us`: CUDA graph, L2 flushed before every call);
5. ``Dispatcher().gemm(x, w)`` (the W4A16 call, untuned: its pick among both backends):
   its pick, GPU time and eager wall per call (`harness.eager_wall_us`).

Under ``--smoke`` (CPU, interpreter) the ws backend offers nothing (Gluon has no
interpreter): the run checks the script. Everything compiles first in parallel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import markdown_table, write_json
from bench_w4a16_decode import (
    HELD,
    NK,
    TOL,
    Shape,
    baselines,
    eager,
    precompile_plans,
    run_setup,
    shape_grid,
    time_pairs,
    timed,
    top_by_estimate,
)

from fp4_dispatch import Dispatcher, Nvfp4Tensor
from fp4_dispatch.plugins.sm90.w4a16 import TritonSm90W4A16Backend
from fp4_dispatch.plugins.sm90.ws import TritonSm90WsBackend
from fp4_dispatch.tactics import Problem

#: triton-sm90-w4a16 tactics timed per shape: its estimate's best (a tuner's shortlist)
W4A16_TOP = 6
#: token counts of a ``--space`` sweep (bench_w4a16_mma.py): the grid's in-sample M and 8
SPACE_MS = (1, 4, 8, 16)
WS, W4A16 = TritonSm90WsBackend(), TritonSm90W4A16Backend()


def plan(problem: Problem, info, new=WS, space=None) -> list[tuple[object, object]]:
    """(backend, tactic) pairs timed for `problem`: every tactic of the `new` backend
    (ws here, `bench_w4a16_mma`'s) - with `space`, ``space(problem)``, offered or not -
    then the W4A16 backend's `W4A16_TOP` by its estimate."""
    if not new.supports(info).ok:
        mine = []
    else:
        mine = [(new, t) for t in (space(problem) if space else new.tactics(problem, info))]
    return mine + [(W4A16, t) for t in top_by_estimate(W4A16, problem, info, W4A16_TOP)]


def measure(s: Shape, pairs, info, deadline: float, new=WS) -> dict:
    """Check and time every (backend, tactic) of `pairs` on `s`; the best per backend."""
    problem = Problem(m=s.m, n=s.n, k=s.k, out_dtype=str(s.dtype).split(".")[1],
                      operation="w4a16")  # fmt: skip
    row: dict = {"m": s.m, "n": s.n, "k": s.k, "held_out": (s.m, s.n, s.k) in HELD,
                 **baselines(s), "tactics": {}, "skipped": []}  # fmt: skip
    time_pairs(row, pairs, problem, info, deadline, (new.name, W4A16.name),
               lambda kernel, t: (lambda: s.check(kernel, s.ops), lambda: kernel(s.ops, s.out)),
               s.device, fields=lambda t: {"path": t.path})  # fmt: skip
    return row


def dispatcher_row(s: Shape, dispatcher: Dispatcher) -> dict:
    """``Dispatcher.gemm(x, w)`` (untuned): its pick, GPU time, eager wall and error."""
    w = Nvfp4Tensor(s.wd, s.ws, s.alpha.reshape(()), "swizzled", (s.n, s.k))
    call = lambda: dispatcher.gemm(s.x, w, out=s.out)  # noqa: E731
    call()
    s.out.fill_(float("nan"))
    call()
    err = float((s.out.double() - s.ref).norm() / s.ref.norm())
    pick = dispatcher.select(s.m, s.n, s.k, out_dtype=str(s.dtype).split(".")[1],
                             operation="w4a16")  # fmt: skip
    return {"dispatcher_pick": pick.tactic.canonical_json(), "dispatcher_err": err,
            "dispatcher_us": timed(call, s.device),
            "dispatcher_eager_us": eager(call, s.device)}  # fmt: skip


def table(rows: list[dict], new=WS) -> str:
    def f(x) -> str:
        return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f}"

    def r(a, b) -> str:
        return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "n/a"

    def short(tj) -> str:
        if not tj:
            return "-"
        d = json.loads(tj)
        if "path" not in d:  # another backend's pick (the reference on a CPU)
            return d["backend"]
        extra = (f", {d['num_warps']} warps, prefetch {d['prefetch']}, unroll {d['unroll']}"
                 if "unroll" in d else "")  # fmt: skip
        return f"{d['path']} {d['tile_m']}x{d['tile_n']} split {d['split_k']}{extra}"

    short_name = new.name.removeprefix("triton-sm90-")
    head = ["M", "N x K", "set", "bf16 µs", "FP8 µs", f"{short_name} best µs (tactic)",
            f"w4a16 best of top {W4A16_TOP} µs (tactic)", f"bf16 / {short_name}",
            f"FP8 / {short_name}", f"{short_name} / w4a16", "gemm pick", "gemm µs",
            "bf16 / gemm", "eager: gemm µs", "eager: bf16 µs", "eager: FP8 µs",
            "failed"]  # fmt: skip
    body = []
    for x in rows:
        w, d = x[f"best_{new.name}_us"], x[f"best_{W4A16.name}_us"]
        where = "held-out" if x["held_out"] else "in-sample"
        body.append([str(x["m"]), f"{x['n']}x{x['k']}", where,
                     f(x["bf16_us"]), f(x["fp8_us"]), f"{f(w)} ({short(x[f'best_{new.name}'])})",
                     f"{f(d)} ({short(x[f'best_{W4A16.name}'])})", r(x["bf16_us"], w),
                     r(x["fp8_us"], w), r(w, d), short(x.get("dispatcher_pick")),
                     f(x.get("dispatcher_us", math.nan)),
                     r(x["bf16_us"], x.get("dispatcher_us", math.nan)),
                     f(x.get("dispatcher_eager_us", math.nan)), f(x.get("bf16_eager_us")),
                     f(x.get("fp8_eager_us", math.nan)), str(len(x["failed"]))])  # fmt: skip
    return markdown_table(head, body)


def grid(cuda: bool, mid: bool, space: bool) -> list[tuple[int, int, int]]:
    """(M, N, K) of a run: `shape_grid`'s; with `space` (a tactic-space sweep, which
    chooses what is offered) its in-sample (N, K) at `SPACE_MS` and no held-out shape."""
    if space and cuda:
        return [(m, n, k) for m in SPACE_MS for n, k in NK]
    return shape_grid(cuda, mid=mid)


def main(argv: list[str] | None = None, new=WS, mid: bool = True, doc: str = __doc__,
         space=None) -> int:  # fmt: skip
    """The sweep of `new` (ws here) beside the W4A16 backend on the decode grid (``mid``
    False: `bench_w4a16_mma`) or the M = 32-256 grid; writes ``<new>.json`` under $OUT.
    `space` (problem -> tactics of `new`, offered or not) enables ``--space``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny shapes, interpreter")
    if space is not None:
        ap.add_argument("--space", action="store_true",
                        help="every tactic the kernel runs, in-sample shapes only")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds, then skip")
    ap.add_argument("--workers", type=int, default=0, help="compile processes (0: auto)")
    args = ap.parse_args(argv)
    t0 = time.time()
    setup = run_setup(args.smoke)
    if setup is None:
        return 2
    cuda, device, info, dtype = setup
    sweep = space if getattr(args, "space", False) else None
    plans = {}
    for m, n, k in grid(cuda, mid, sweep is not None):
        p = Problem(m=m, n=n, k=k, out_dtype=str(dtype).split(".")[1], operation="w4a16")
        pairs = plan(p, info, new, sweep)
        plans[(m, n, k)] = (p, pairs[:3] if args.smoke else pairs)
    fails = precompile_plans(plans, info, args.workers)
    result = {"device": info.name, "torch": torch.__version__, "smoke": args.smoke,
              "compile_failures": fails, "shapes": []}  # fmt: skip
    dispatcher = Dispatcher(cache=False)  # untuned: its heuristic pick (CPU: the reference)
    for key, (_, pairs) in plans.items():
        s = Shape(*key, device, dtype)
        row = measure(s, pairs, info, t0 + args.budget_s, new)
        if sweep is None:
            row |= dispatcher_row(s, dispatcher)
        result["shapes"].append(row)
        print(f"{'x'.join(map(str, key))}: bf16 {row['bf16_us']:.1f}, {new.name} "
              f"{row[f'best_{new.name}_us']:.1f}, w4a16 {row[f'best_{W4A16.name}_us']:.1f}, "
              f"gemm {row.get('dispatcher_us', math.nan):.1f}; {len(row['failed'])} failed",
              flush=True)  # fmt: skip
        stem = f"w4a16_{new.name.removeprefix('triton-sm90-')}" + ("_space" if sweep else "")
        write_json(f"{stem}.json", result)
    print("\n" + table(result["shapes"], new))
    bad = sum(len(r["failed"]) for r in result["shapes"])
    bad += sum(not r.get("dispatcher_err", 0.0) <= TOL for r in result["shapes"])
    print(f"\n{bad} tactic(s) over rel err {TOL} or failing; total {time.time() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
