"""H200: programmatic dependent launch (PDL) on the two-launch sm90 paths, on and off.

    python3 benchmarks/bench_pdl.py            # OUT=/dir: also $OUT/pdl.json
    python3 benchmarks/bench_pdl.py --smoke    # CPU: the two first kernels, interpreter

Two calls of the dispatcher are two launches, a short kernel that writes the activations
and the GEMM that reads them (`fp4_dispatch.backends.pdl` says what PDL changes):

- W4A4 at M <= 8, ``triton-sm90-mma``: `expand_rows` then the W4A16 mma kernel, whose
  CTAs prefetch their first weight steps to L2 before they wait. Grid: bench_w4a4_decode's
  M <= 8 shapes (M 1 and 4 x the issue's six (N, K), M 2 and 8 x its three held-out).
- W4A16 at M 64-256, ``triton-sm90-rs``: the activations' pass then the GEMM, whose TMA
  warp loads the ring's first weight steps before it waits. Grid: M of ``--ms`` x the
  issue's six (N, K).

Per shape, the untuned ``Dispatcher`` pick (shapes where it is another backend are
skipped and listed) is built twice, PDL on and off (two kernel objects of one tactic).
Both outputs, poisoned with NaN first, are checked against float64 (relative error <=
1e-2, else the shape fails). GPU time: CUDA graphs with the L2 flushed before every call
(`harness.gpu_clock`), the two variants sampled alternately (``--samples`` each, median)
so drift hits both; eager wall per call (`harness.eager_wall_us`) of each; bf16 cuBLAS
and FP8 cuBLASLt from the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import markdown_table, num, ratio, smoke_or_sm90, write_json, write_text
from bench_w4a4_decode import Shape as W4A4Shape
from bench_w4a16_decode import HELD_NK, NK, TOL, eager, rel_err
from bench_w4a16_decode import Shape as W4A16Shape
from bench_w4a16_decode import baselines as w4a16_baselines

from fp4_dispatch import Dispatcher
from fp4_dispatch.harness import dequant, gpu_clock, stress_nvfp4

W4A4_GRID = [(m, n, k) for m in (1, 4) for n, k in NK] + [
    (m, n, k) for m in (2, 8) for n, k in HELD_NK
]
RS_MS = (64, 128, 192, 256)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=int, nargs="+", default=list(RS_MS), help="W4A16 rs M values")
    p.add_argument("--samples", type=int, default=15, help="graph samples of each variant")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting shapes after")
    p.add_argument("--smoke", action="store_true", help="CPU: the first kernels, interpreter")
    return p.parse_args(argv)


def twins(op: str, tactic) -> tuple[object, object]:
    """Two kernel objects of `tactic`, PDL on and off (the plugin's own build is cached,
    so both are made here from the tactic's kernel config)."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    make = mm.build_w4a4 if op == "w4a4" else rs.build
    on, off = make(tactic.kernel_config()), make(tactic.kernel_config())
    off.pdl = False
    return on, off


def paired_us(run_on, run_off, device: torch.device, samples: int) -> tuple[float, float]:
    """Median GPU µs per call of two callables, their graph clocks sampled alternately."""
    clocks = (gpu_clock(run_on, device=device), gpu_clock(run_off, device=device))
    got: tuple[list[float], list[float]] = ([], [])
    for i in range(samples):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            got[j].append(clocks[j]())
    return statistics.median(got[0]), statistics.median(got[1])


def measure(op: str, shape, ops, ref_check, dispatcher: Dispatcher, samples: int) -> dict:
    """One shape: the pick, both variants checked and timed (graph and eager)."""
    m, n, k, device = shape.m, shape.n, shape.k, shape.device
    dtype = str(shape.dtype).split(".")[1]
    pick = dispatcher.select(m, n, k, out_dtype=dtype, operation=op)
    row: dict = {"op": op, "m": m, "n": n, "k": k, "pick": pick.tactic.canonical_json()}
    want = "triton-sm90-mma" if op == "w4a4" else "triton-sm90-rs"
    if pick.backend != want:
        row["skipped"] = f"the pick is {pick.backend}, not {want}"
        return row
    on, off = twins(op, pick.tactic)
    run_on = lambda: on(ops, shape.out)  # noqa: E731
    run_off = lambda: off(ops, shape.out)  # noqa: E731
    row["err_on"], row["err_off"] = ref_check(run_on), ref_check(run_off)
    if max(row["err_on"], row["err_off"]) > TOL:
        row["failed"] = True
        return row
    row["on_us"], row["off_us"] = paired_us(run_on, run_off, device, samples)
    row["eager_on_us"], row["eager_off_us"] = eager(run_on, device), eager(run_off, device)
    return row


def w4a4_row(m: int, n: int, k: int, device, dispatcher: Dispatcher, samples: int) -> dict:
    s = W4A4Shape(m, n, k, device, torch.bfloat16)
    row = measure("w4a4", s, s.ops, s.check, dispatcher, samples)
    return row | s.baselines()


def w4a16_row(m: int, n: int, k: int, device, dispatcher: Dispatcher, samples: int) -> dict:
    s = W4A16Shape(m, n, k, device, torch.bfloat16)

    def check(run) -> float:
        s.out.fill_(math.nan)
        run()
        return rel_err(s.out, s.ref)

    row = measure("w4a16", s, s.ops, check, dispatcher, samples)
    return row | w4a16_baselines(s)


def table(rows: list[dict]) -> str:
    head = ["op", "M", "N x K", "pick", "bf16 µs", "FP8 µs", "PDL on µs", "PDL off µs",
            "on / off", "bf16 / on", "bf16 / off", "FP8 / on", "eager on µs",
            "eager off µs", "eager bf16 µs", "eager FP8 µs"]  # fmt: skip
    body = []
    for r in rows:
        if "on_us" not in r:
            continue
        pick = r["pick"].split('"backend":"')[1].split('"')[0]
        body.append([r["op"], str(r["m"]), f"{r['n']}x{r['k']}", pick, num(r["bf16_us"]),
                     num(r["fp8_us"]), num(r["on_us"]), num(r["off_us"]),
                     ratio(r["on_us"], r["off_us"]), ratio(r["bf16_us"], r["on_us"]),
                     ratio(r["bf16_us"], r["off_us"]), ratio(r["fp8_us"], r["on_us"]),
                     num(r["eager_on_us"]), num(r["eager_off_us"]),
                     num(r.get("bf16_eager_us")), num(r.get("fp8_eager_us"))])  # fmt: skip
    return markdown_table(head, body)


def smoke() -> int:
    """CPU: the two first kernels (PDL compiled out under the interpreter) still match
    their references: `expand_rows` against `harness.dequant` (float64), the pass
    against `dot_order`."""
    from fp4_dispatch.backends import pdl
    from fp4_dispatch.backends.sm90 import expand_rows
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import dot_order

    a = torch.randn(5, 256).to(torch.float16)
    pass_ok = bool(torch.equal(rs.dot_order_into(a, torch.empty_like(a)), dot_order(a)))
    data, scale = stress_nvfp4(3, 256, torch.device("cpu"), torch.Generator().manual_seed(0))
    rows = torch.empty(3, 256, dtype=torch.float16)
    expand_rows.expand(data, scale, rows, (torch.ones(1), torch.ones(1), torch.empty(1)))
    expand_ok = bool(torch.equal(rows.double(), dequant(data, scale, torch.float64)))
    result = {"smoke": True, "pdl_enabled": pdl.ENABLED, "pass_matches": pass_ok,
              "expand_matches": expand_ok}  # fmt: skip
    write_json("pdl.json", result)
    print(result)
    return 0 if pass_ok and expand_ok and not pdl.ENABLED else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := smoke_or_sm90(args.smoke, smoke)) is not None:
        return code
    from fp4_dispatch.backends import pdl

    device, dispatcher = torch.device("cuda"), Dispatcher(cache=False)
    grid = [("w4a4", *s) for s in W4A4_GRID] + [("w4a16", m, n, k) for m in args.ms
                                                 for n, k in NK]  # fmt: skip
    t0, rows = time.time(), []
    for op, m, n, k in grid:
        if time.time() - t0 > args.budget_s:
            rows.append({"op": op, "m": m, "n": n, "k": k, "skipped": "budget spent"})
            continue
        make = w4a4_row if op == "w4a4" else w4a16_row
        rows.append(make(m, n, k, device, dispatcher, args.samples))
        r = rows[-1]
        print(f"{op} {m}x{n}x{k}: " + (r.get("skipped") or "failed" if "on_us" not in r else
              f"on {r['on_us']:.1f} off {r['off_us']:.1f} bf16 {r['bf16_us']:.1f} "
              f"fp8 {r['fp8_us']:.1f} eager {r['eager_on_us']:.1f}/{r['eager_off_us']:.1f}"),
              flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "pdl_enabled": pdl.ENABLED}  # fmt: skip
    write_json("pdl.json", {"meta": meta, "rows": rows})
    text = table(rows)
    write_text("pdl.md", text)
    print("\n" + text)
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
