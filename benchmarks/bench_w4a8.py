"""H200 benchmark of W4A8 (issue 34): FP8 tensor cores for NVFP4 weights, against the exact
W4A16 pick, bf16 cuBLAS and FP8 cuBLASLt with FP8 weights.

    python3 benchmarks/bench_w4a8.py              # OUT=dir: $OUT/w4a8.jsonl, .json, .md
    python3 benchmarks/bench_w4a8.py --ms 64 256  # only these M
    python3 benchmarks/bench_w4a8.py --smoke      # CPU: tiny sizes, Triton interpreter

Shapes (N x K: output x input features, as bench_w4a16.py writes them): 5120 x 5120 and
13824 x 5120 (a 5120-wide model's attention and MLP up projections), 3584 x 18944 (a
3584-wide model's MLP down projection), each at M in 1, 16, 64, 256, 1024, 4096. Per
shape, bf16 activations ``x`` (random normal) and an NVFP4 weight (``0.02 * randn``,
quantized), every path on the same operands:

- ``bf16``: ``torch.mm`` of ``x`` and the dequantized weight in bf16 (cuBLAS);
- ``w4a16``: the exact dispatcher's pick (``Dispatcher().gemm``, untuned: the estimate);
- ``w4a8_fused``: the fused W4A8 kernel, best of the ``--top`` fused tactics the fp8
  estimate ranks first (offered for M <= 1024);
- ``w4a8_unpack``: the weight to E4M3 per call, then ``torch._scaled_mm`` (M >= 128; in
  ``--smoke`` at every M, on torch's CPU ``_scaled_mm``);
- ``fp8_pick``: ``Dispatcher(precision="fp8").gemm`` (its pick's operation recorded);
- ``scaled_mm``: ``torch._scaled_mm`` alone on E4M3 weights kept in memory and activations
  already in E4M3 (row-wise scales): the FP8 GEMM the issue compares with;
- ``scaled_mm_q``: the same plus our per-token activation pass (what a serving stack with
  FP8 weights runs per call).

Each path: GPU time (`fp4_dispatch.harness.gpu_time_us`: a CUDA graph of 20 calls, L2
flushed before each, median of 5 replays) and eager wall time per call
(`eager_wall_us`: back to back, host launch path included); the relative Frobenius error
of one output against float64 ``x @ dequant(W).T``. Every kernel compiles before the
timed loop (`_common.precompile_kernels`). JSON lines (one per shape) and a markdown table
with each path's speed relative to bf16. Budget: under 4 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import (
    markdown_table,
    num,
    out_dir,
    precompile_kernels,
    ratio,
    smoke_or_sm90,
    write_json,
    write_text,
)

from fp4_dispatch import Dispatcher
from fp4_dispatch.backend import DenseOperands
from fp4_dispatch.device import DeviceInfo
from fp4_dispatch.harness import eager_wall_us, gpu_time_us
from fp4_dispatch.nvfp4 import dequantize, quantize_nvfp4
from fp4_dispatch.tactics import Problem, tactic_label

SHAPES = ((5120, 5120), (13824, 5120), (3584, 18944))  # (N, K)
MS = (1, 16, 64, 256, 1024, 4096)
SMOKE_SHAPES = ((96, 128),)
SMOKE_MS = (1, 16)
PATHS = ("bf16", "w4a16", "w4a8_fused", "w4a8_unpack", "fp8_pick", "scaled_mm", "scaled_mm_q")


def operands(m: int, n: int, k: int, device: torch.device, seed: int):
    """(bf16 x [M, K], the NVFP4 weight, its dequantized float64 [N, K])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    qw = quantize_nvfp4(torch.randn(n, k, generator=gen, device=device) * 0.02)
    return x, qw, dequantize(qw).double()


def w4a8_candidates(d8: Dispatcher, m: int, n: int, k: int, top: int) -> dict[str, list]:
    """The fp8 shortlist's W4A8 candidates by path, best estimate first (`top` fused)."""
    sl = d8.candidates(m, n, k, operation="w4a16")
    by_path: dict[str, list] = {"fused": [], "unpack": []}
    for c in sl.candidates:
        if c.operation == "w4a8" and c.backend == "triton-sm90-w4a8":
            by_path[c.tactic.path].append(c)
    return {"fused": by_path["fused"][:top], "unpack": by_path["unpack"][:1]}


def _timed(fn, device: torch.device, smoke: bool) -> tuple[float, float]:
    """(GPU µs in a graph with a cold L2, eager wall µs per call); on a CPU: wall twice."""
    fn()  # warm: compiled, workspaces made, plans warm
    if device.type != "cuda":
        wall = eager_wall_us(fn, calls=2, warmup=0)
        return wall, wall
    return gpu_time_us(fn, device=device), eager_wall_us(fn, calls=100, warmup=10)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def bench_shape(m: int, n: int, k: int, ctx: dict) -> dict:
    """Every path of one shape: times, errors, which tactic ran."""
    device, smoke, top = ctx["device"], ctx["smoke"], ctx["top"]
    # imported here, after --smoke set TRITON_INTERPRET (the module reads it on import)
    from fp4_dispatch.backends.sm90 import gemm_w4a8 as g

    x, qw, w64 = operands(m, n, k, device, seed=m + n + k)
    ref = x.double() @ w64.T
    alpha = qw.global_scale.reshape(1)
    ops = DenseOperands(x, qw.data, qw.scale, alpha)
    row: dict = {"m": m, "n": n, "k": k, "device": ctx["name"]}
    runs: dict = {}
    w_bf16 = w64.to(torch.bfloat16)
    runs["bf16"] = (lambda o: torch.mm(x, w_bf16.t(), out=o), "torch.mm bf16")
    d16, d8 = ctx["exact"], ctx["fp8"]
    runs["w4a16"] = (lambda o: d16.gemm(x, qw, out=o), None)
    runs["fp8_pick"] = (lambda o: d8.gemm(x, qw, out=o), None)
    cands = w4a8_candidates(d8, m, n, k, top) if not smoke else {"fused": [], "unpack": []}
    fused = [(c.tactic, g.build(c.tactic.kernel_config())) for c in cands["fused"]]
    if smoke:  # the interpreter: one small fused config, no estimate needed
        fused = [("smoke 64x16x64", g.build(g.W4A8Config(block_n=64, block_m=16, block_k=64)))]
    if smoke:  # the interpreter's passes, torch's CPU _scaled_mm
        cands["unpack"] = [None]
    if device.type == "cuda" or smoke:
        wq, sw = g.weight_to_fp8(qw.data, qw.scale, alpha)
        xq, sa = g.quantize_activations(x)
        mm = torch._scaled_mm
        runs["scaled_mm"] = (lambda o: mm(xq, wq.t(), sa[:, None], sw[None, :],
                                          out_dtype=torch.bfloat16, out=o), "rowwise")  # fmt: skip

        def with_quant(o):
            q, s = g.quantize_activations(x)
            mm(q, wq.t(), s[:, None], sw[None, :], out_dtype=torch.bfloat16, out=o)

        runs["scaled_mm_q"] = (with_quant, "rowwise + activation pass")
        for c in cands["unpack"]:
            br, bk = (16, 128) if c is None else (c.tactic.block_r, c.tactic.tile_k)
            kern = g.build_unpack(br, bk)
            label = f"block_r={br} tile_k={bk}" if c is None else tactic_label(c.tactic)
            runs["w4a8_unpack"] = (lambda o, kern=kern: kern(ops, o), label)
    timed: dict[str, tuple[float, float]] = {}
    for label, kern in fused:  # the best of the top fused tactics (by GPU time)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        gpu, wall = _timed(lambda kern=kern, out=out: kern(ops, out), device, smoke)
        if "w4a8_fused" not in timed or gpu < timed["w4a8_fused"][0]:
            timed["w4a8_fused"] = (gpu, wall)
            runs["w4a8_fused"] = (lambda o, kern=kern: kern(ops, o), label)
    for name in PATHS:
        if name not in runs:
            row[name] = None
            continue
        fn, what = runs[name]
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        if name in timed:
            gpu, wall = timed[name]
        else:
            gpu, wall = _timed(lambda fn=fn, out=out: fn(out), device, smoke)
        fn(out)
        entry = {"gpu_us": gpu, "eager_us": wall, "rel_err": _error(out, ref)}
        d = {"w4a16": d16, "fp8_pick": d8}.get(name)
        if d is not None:
            plan = d.cached_plan(m, n, k, "bfloat16", "w4a16")
            what = f"{plan.candidate.backend} {tactic_label(plan.candidate.tactic)}"
            entry["operation"] = plan.candidate.operation
        entry["what"] = what if isinstance(what, str) else tactic_label(what)
        row[name] = entry
    return row


def precompile(ctx: dict, grid: list[tuple[int, int, int]]) -> dict:
    """Compile every kernel the run launches (the dispatchers' picks, the W4A8 tactics)."""
    planned = []
    for m, n, k in grid:
        for d in (ctx["exact"], ctx["fp8"]):
            c = d.select(m, n, k, operation="w4a16")
            p = Problem(m=m, n=n, k=k, operation=c.operation)
            planned.append((d.registry.backends[c.backend], c.tactic, p))
        for cs in w4a8_candidates(ctx["fp8"], m, n, k, ctx["top"]).values():
            for c in cs:
                p = Problem(m=m, n=n, k=k, operation="w4a8")
                planned.append((ctx["fp8"].registry.backends[c.backend], c.tactic, p))
    report = precompile_kernels(planned, ctx["exact"].device, workers=ctx["workers"])
    return {"jobs": len(report.outcomes), "failed": len(report.failed),
            "seconds": round(report.seconds, 1)}  # fmt: skip


def table(rows: list[dict]) -> str:
    """Speed relative to bf16 (bf16 µs / path µs: > 1 is faster) and relative errors."""
    headers = ["M", "N x K", "bf16 µs", *[f"{p} x" for p in PATHS[1:]], "fp8 pick op",
               "err w4a16", "err w4a8 fused", "err w4a8 unpack", "err scaled_mm"]  # fmt: skip
    body = []
    for r in rows:
        base = r["bf16"]["gpu_us"] if r["bf16"] else float("nan")
        speed = [ratio(base, r[p]["gpu_us"]) if r[p] else "n/a" for p in PATHS[1:]]
        errs = [num(r[p]["rel_err"], ".2e") if r[p] else "n/a"
                for p in ("w4a16", "w4a8_fused", "w4a8_unpack", "scaled_mm")]  # fmt: skip
        pick = (r["fp8_pick"] or {}).get("operation", "n/a")
        body.append([r["m"], f"{r['n']}x{r['k']}", num(base), *speed, pick, *errs])
    return markdown_table(headers, body, "rrr" + "r" * (len(PATHS) - 1) + "lrrrr")


def eager_table(rows: list[dict]) -> str:
    """Eager wall µs per call of every path (host launch path included)."""
    headers = ["M", "N x K", *[f"{p} µs" for p in PATHS]]
    body = [[r["m"], f"{r['n']}x{r['k']}",
             *[num(r[p]["eager_us"]) if r[p] else "n/a" for p in PATHS]] for r in rows]  # fmt: skip
    return markdown_table(headers, body, "rr" + "r" * len(PATHS))


def run(ms: tuple[int, ...], shapes: tuple, ctx: dict) -> int:
    grid = [(m, n, k) for n, k in shapes for m in ms]
    t0 = time.perf_counter()
    compiled = precompile(ctx, grid) if not ctx["smoke"] else {"jobs": 0, "failed": 0}
    rows = []
    where = out_dir()
    lines_path = where / "w4a8.jsonl" if where else None
    if lines_path is not None:
        lines_path.write_text("")
    for m, n, k in grid:
        row = bench_shape(m, n, k, ctx)
        rows.append(row)
        if lines_path is not None:
            with lines_path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)
    md = "\n\n".join([f"device: {ctx['name']}; {time.strftime('%Y-%m-%d')}; precompile "
                      f"{compiled}; {time.perf_counter() - t0:.0f} s",
                      "GPU time (CUDA graph, cold L2), speed relative to bf16 cuBLAS:",
                      table(rows), "eager wall per call:", eager_table(rows)])  # fmt: skip
    write_text("w4a8.md", md + "\n")
    write_json("w4a8.json", {"device": ctx["name"], "precompile": compiled, "rows": rows})
    print(md)
    return 0


def context(device: torch.device, smoke: bool, top: int, workers: int) -> dict:
    where = "cpu" if smoke else str(device)
    exact = Dispatcher(where, cache=False)
    fp8 = Dispatcher(where, precision="fp8", cache=False)
    info: DeviceInfo = exact.device
    return {"device": device, "smoke": smoke, "top": top, "workers": workers,
            "exact": exact, "fp8": fp8, "name": info.name}  # fmt: skip


def smoke() -> int:
    """The CPU run: the fused kernel under the interpreter, the dispatcher paths on the
    portable backends; writes the same files."""
    return run(SMOKE_MS, SMOKE_SHAPES, context(torch.device("cpu"), True, 1, 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=int, nargs="*", default=list(MS), help="M values")
    p.add_argument("--top", type=int, default=2, help="fused W4A8 tactics timed per shape")
    p.add_argument("--workers", type=int, default=8, help="precompile processes")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny sizes, interpreter")
    args = p.parse_args(argv)
    if (code := smoke_or_sm90(args.smoke, smoke)) is not None:
        return code
    ctx = context(torch.device("cuda"), False, args.top, args.workers)
    return run(tuple(args.ms), SHAPES, ctx)


if __name__ == "__main__":
    sys.exit(main())
