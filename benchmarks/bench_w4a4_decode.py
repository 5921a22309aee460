"""H200: W4A4 decode on Hopper, the two W4A4 kernels side by side, in one device call.

    python3 benchmarks/bench_w4a4_decode.py          # OUT=/dir: also $OUT/w4a4_decode.json
    python3 benchmarks/bench_w4a4_decode.py --smoke  # CPU: tiny shapes, interpreter

Both operands NVFP4 (`harness.stress_operands`: all 16 codes, log-uniform e4m3 scales,
NaN in the scale padding). Grid: `bench_w4a16_decode`'s (M in (1, 4, 16) x its six
(N, K), then M in (2, 8) x its three held-out (N, K), held out of the ``triton-sm90-dense``
fit in `fit_w4a16_model.py --dense`: chosen before the fit). Per shape:

1. bf16 cuBLAS and FP8 cuBLASLt (per-tensor scales) on the dequantized operands;
2. every offered ``triton-sm90-dense`` tactic (the W4A16 kernel, activations expanded
   in-kernel) and the ``triton-sm90`` estimate's best `SM90_TOP` (its untuned
   candidates: the backend offers ~120 tactics a shape, too many to time them all here);
3. each output (poisoned with NaN) against the float64 product of the dequantized
   operands: relative Frobenius error <= 1e-2, else failed and not timed;
4. GPU time (`harness.gpu_time_us`: CUDA graph, L2 flushed before every call); eager
   wall per call (`harness.eager_wall_us`) of ``Dispatcher().gemm`` on the pre-quantized
   operands (its untuned pick, whichever backend), bf16 and FP8.

Everything compiles first in parallel (`fp4_dispatch.precompile`); ``--budget-s`` (default
240, compiling included) skips what is left once spent (counted in the JSON).
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
from bench_hopper import dequant
from bench_w4a16_decode import (
    HELD,
    TOL,
    eager,
    precompile_plans,
    rel_err,
    run_setup,
    shape_grid,
    time_pairs,
    timed,
    top_by_estimate,
)

from fp4_dispatch import Dispatcher, Nvfp4Tensor
from fp4_dispatch.backend import launch
from fp4_dispatch.backends.sm90 import expand_rows
from fp4_dispatch.harness import stress_operands
from fp4_dispatch.plugins.sm90 import TritonSm90Backend
from fp4_dispatch.plugins.sm90.dense import TritonSm90DenseBackend
from fp4_dispatch.plugins.sm90.mma import TritonSm90MmaBackend
from fp4_dispatch.tactics import Problem

#: triton-sm90 tactics timed per shape: its estimate's best (what a tuner would shortlist)
SM90_TOP = 6
DENSE, SM90, MMA = TritonSm90DenseBackend(), TritonSm90Backend(), TritonSm90MmaBackend()
NAMES = (DENSE.name, SM90.name, MMA.name)


def plan(problem: Problem, info) -> list[tuple[object, object]]:
    """(backend, tactic) pairs timed for `problem`: every dense tactic, every mma tactic
    (M <= 8; none under the interpreter), then triton-sm90's `SM90_TOP` by its estimate."""
    dense = [(DENSE, t) for t in DENSE.tactics(problem, info)]
    mma = [(MMA, t) for t in MMA.tactics(problem, info)] if MMA.supports(info).ok else []
    return dense + mma + [(SM90, t) for t in top_by_estimate(SM90, problem, info, SM90_TOP)]


class Shape:
    """Operands, float64 reference and bf16/FP8 baselines of one (M, N, K)."""

    def __init__(self, m: int, n: int, k: int, device: torch.device, dtype: torch.dtype):
        gen = torch.Generator(device=device)
        gen.manual_seed(2000 * m + n + k)
        self.m, self.n, self.k, self.device, self.dtype = m, n, k, device, dtype
        self.ops = stress_operands(m, n, k, device, gen)
        o = self.ops
        a64, b64 = (
            dequant(o.a_data, o.a_scale, torch.float64),
            dequant(o.b_data, o.b_scale, torch.float64),
        )
        self.ref = (a64 @ b64.T) * float(o.alpha)
        self.a16, self.b16 = (a64 * float(o.alpha)).to(dtype), b64.to(dtype)
        del a64, b64
        self.out = torch.empty((m, n), dtype=dtype, device=device)

    def check(self, fn) -> float:
        self.out.fill_(float("nan"))
        fn()
        return rel_err(self.out, self.ref)

    def baselines(self) -> dict:
        bf16 = lambda: torch.mm(self.a16, self.b16.t(), out=self.out)  # noqa: E731
        row = {"bf16_us": timed(bf16, self.device), "bf16_eager_us": eager(bf16, self.device)}
        if self.device.type != "cuda":
            return row | {"fp8_us": math.nan}
        one = torch.ones((), dtype=torch.float32, device=self.device)
        sa, sb = float(self.a16.abs().max()) / 400, float(self.b16.abs().max()) / 400
        a8 = (self.a16 / sa).to(torch.float8_e4m3fn)
        b8 = (self.b16 / sb).to(torch.float8_e4m3fn)
        fp8 = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,  # noqa: E731
                                       out_dtype=self.dtype)  # fmt: skip
        return row | {"fp8_us": timed(fp8, self.device), "fp8_eager_us": eager(fp8, self.device)}

    def dispatcher_eager(self, dispatcher: Dispatcher) -> dict:
        """``Dispatcher.gemm`` on the pre-quantized operands, eagerly: its pick and wall µs."""
        o = self.ops
        one = torch.ones((), device=self.device)
        a = Nvfp4Tensor(o.a_data, o.a_scale, one, "swizzled", (self.m, self.k))
        b = Nvfp4Tensor(o.b_data, o.b_scale, o.alpha.reshape(()), "swizzled", (self.n, self.k))
        call = lambda: dispatcher.gemm(a, b, out_dtype=self.dtype, out=self.out)  # noqa: E731
        call()
        pick = dispatcher.select(self.m, self.n, self.k, out_dtype=str(self.dtype).split(".")[1])
        return {"dispatcher_pick": pick.tactic.canonical_json(),
                "dispatcher_us": timed(call, self.device),
                "dispatcher_eager_us": eager(call, self.device),
                "dispatcher_err": self.check(call)}  # fmt: skip

    def expand_us(self) -> float:
        """GPU µs of the activations' expansion alone (what the mma path adds to the W4A16
        kernel: `plugins.sm90.mma.EXPAND_US`); NaN without CUDA."""
        if self.device.type != "cuda":
            return math.nan
        o = self.ops
        rows = torch.empty((self.m, self.k), dtype=self.dtype, device=self.device)
        alphas = (o.alpha, torch.ones(1, device=self.device), torch.empty(1, device=self.device))
        return timed(lambda: expand_rows.expand(o.a_data, o.a_scale, rows, alphas), self.device)


def measure(s: Shape, pairs, info, deadline: float) -> dict:
    """Check and time every (backend, tactic) of `pairs` on `s`."""
    problem = Problem(m=s.m, n=s.n, k=s.k, out_dtype=str(s.dtype).split(".")[1])
    row: dict = {"m": s.m, "n": s.n, "k": s.k, "held_out": (s.m, s.n, s.k) in HELD,
                 **s.baselines(), "tactics": {}, "skipped": []}  # fmt: skip

    def calls(kernel, t) -> tuple:
        run = lambda: launch(kernel, s.ops, s.out, t.swap_ab)  # noqa: E731
        return (lambda: s.check(run)), run

    time_pairs(row, pairs, problem, info, deadline, NAMES, calls, s.device)
    row["expand_us"] = s.expand_us()
    return row


def table(rows: list[dict]) -> str:
    def f(x) -> str:
        return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f}"

    def r(a, b) -> str:
        return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "n/a"

    def short(tj) -> str:
        if not tj:
            return "-"

        d = json.loads(tj)
        return f"{d['tile_m']}x{d['tile_n']} split {d['split_k']}" + (
            " swap" if d.get("swap_ab") else ""
        )

    head = ["M", "N x K", "set", "bf16 µs", "FP8 µs", "dense best µs (tactic)",
            f"triton-sm90 best of top {SM90_TOP} µs (tactic)", "mma best µs (tactic)",
            "expand µs", "bf16 / dense", "bf16 / mma", "FP8 / best", "gemm µs (pick)",
            "bf16 / gemm", "eager: gemm µs", "eager: FP8 µs", "failed"]  # fmt: skip
    body = []
    for x in rows:
        d, s, m = (x[f"best_{name}_us"] for name in NAMES)
        best = min((v for v in (d, s, m) if math.isfinite(v)), default=math.nan)
        pick = x.get("dispatcher_pick")
        pick_s = "-" if not pick else pick.split('"backend":"')[1].split('"')[0]
        gemm = x.get("dispatcher_us", math.nan)
        body.append([str(x["m"]), f"{x['n']}x{x['k']}", "held-out" if x["held_out"] else "issue",
                     f(x["bf16_us"]), f(x["fp8_us"]), f"{f(d)} ({short(x[f'best_{DENSE.name}'])})",
                     f"{f(s)} ({short(x[f'best_{SM90.name}'])})",
                     f"{f(m)} ({short(x[f'best_{MMA.name}'])})", f(x.get("expand_us")),
                     r(x["bf16_us"], d), r(x["bf16_us"], m), r(x["fp8_us"], best),
                     f"{f(gemm)} ({pick_s})", r(x["bf16_us"], gemm),
                     f(x.get("dispatcher_eager_us", math.nan)),
                     f(x.get("fp8_eager_us", math.nan)), str(len(x["failed"]))])  # fmt: skip
    return markdown_table(head, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny shapes, interpreter")
    ap.add_argument("--budget-s", type=float, default=240.0, help="seconds, then skip")
    ap.add_argument("--workers", type=int, default=0, help="compile processes (0: auto)")
    args = ap.parse_args(argv)
    t0 = time.time()
    setup = run_setup(args.smoke)
    if setup is None:
        return 2
    cuda, device, info, dtype = setup
    grid = shape_grid(cuda)
    plans = {}
    for m, n, k in grid:
        p = Problem(m=m, n=n, k=k, out_dtype=str(dtype).split(".")[1])
        pairs = plan(p, info)
        plans[(m, n, k)] = (p, pairs[:3] + pairs[-1:] if args.smoke else pairs)
    fails = precompile_plans(plans, info, args.workers)
    result = {"device": info.name, "torch": torch.__version__, "smoke": args.smoke,
              "compile_failures": fails, "shapes": []}  # fmt: skip
    dispatcher = Dispatcher(cache=False)  # untuned: its heuristic pick (CPU: the reference)
    for key, (_, pairs) in plans.items():
        s = Shape(*key, device, dtype)
        row = measure(s, pairs, info, t0 + args.budget_s)
        row |= s.dispatcher_eager(dispatcher)
        result["shapes"].append(row)
        print(f"{'x'.join(map(str, key))}: bf16 {row['bf16_us']:.1f}, dense "
              f"{row[f'best_{DENSE.name}_us']:.1f}, sm90 {row[f'best_{SM90.name}_us']:.1f}, "
              f"mma {row[f'best_{MMA.name}_us']:.1f}; "
              f"{len(row['failed'])} failed", flush=True)  # fmt: skip
        write_json("w4a4_decode.json", result)
    print("\n" + table(result["shapes"]))
    bad = sum(len(r["failed"]) for r in result["shapes"])
    print(f"\n{bad} tactic(s) over rel err {TOL} or failing; total {time.time() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
