"""Hopper benchmark: the sm90 NVFP4 GEMMs against cuBLAS on one H200, one run.

The sm90 family has two backends: ``triton-sm90`` (direct: reads NVFP4 in the GEMM
kernel) and ``triton-sm90-unpack`` (unpack each operand once to bf16, then cuBLAS; only
offered for M >= 256). For each shape it times, side by side, with the project's one GPU
clock (`fp4_dispatch.harness.gpu_time_us`: CUDA-graph replay, L2 flushed before each
call, the tuner's clock too) on random non-zero stress data (`harness.stress_operands`):

- ``best``: every tactic both backends enumerate (both orientations), the fastest;
- ``direct``: the fastest ``triton-sm90`` tactic; ``unpack+cuBLAS``: the fastest
  ``triton-sm90-unpack`` tactic (n/a below M = 256);
- ``untuned``: the dispatcher's heuristic pick (``Dispatcher().select``), whatever backend;
- ``est``: the two backends' own ``estimate_us`` top-1 (how good the models are);
- ``bf16``: cuBLAS ``A @ B.T`` on the dequantized operands in bf16;
- ``fp8``: cuBLASLt ``torch._scaled_mm`` with per-tensor scales (e4m3 operands);
- ``naive``: the torch reference (unpack, scale, bf16 matmul), eager;
- floors: NVFP4 bytes at the measured copy bandwidth, FLOPs at the measured bf16 rate.

Run (on the H200, through the device tool)::

    python benchmarks/bench_hopper.py --out $OUT

``--smoke`` runs the same code on CPU under TRITON_INTERPRET=1 with tiny shapes (script
check only; its times mean nothing). Everything is written to ``--out`` as JSON and a
markdown table; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import (
    failures_by_tactic,
    markdown_table,
    num,
    precompile_kernels,
    ratio,
    write_json,
    write_text,
)

from fp4_dispatch import harness
from fp4_dispatch.backend import GemmOperands
from fp4_dispatch.backend import launch as launch_kernel
from fp4_dispatch.device import DeviceInfo, detect
from fp4_dispatch.plugins.sm90 import (
    Sm90UnpackTactic,
    TritonSm90Backend,
    TritonSm90Tactic,
    TritonSm90UnpackBackend,
    _kernel_for,
    _unpack_kernel_for,
)
from fp4_dispatch.profiles import simulated
from fp4_dispatch.tactics import Problem, tactic_label

BENCH_MS = (1, 16, 128, 1024, 4096, 16384)
BENCH_NK = ((8192, 8192), (28672, 8192), (8192, 28672))
SMOKE_SHAPES = ((1, 96, 256), (16, 64, 128), (40, 48, 192), (260, 40, 96))


# ---- operands, launch, timing: the harness's -------------------------------------------

#: the stress operands (all 16 e2m1 codes, log-uniform scales, NaN in the scale padding)
random_nvfp4 = harness.stress_nvfp4
make_operands = harness.stress_operands
dequant = harness.dequant


def launch(kernel, swap: bool, ops: GemmOperands, out: torch.Tensor) -> None:
    """The contract's swap convention (`fp4_dispatch.backend.launch`), in this script's
    argument order (bench_w4a16 imports it too)."""
    launch_kernel(kernel, ops, out, swap)


def tactic_kernel(t: TritonSm90Tactic | Sm90UnpackTactic):
    if isinstance(t, Sm90UnpackTactic):
        return _unpack_kernel_for(t.block_r, t.block_k)
    return _kernel_for(t.kernel_config())


def parse_tactic(tj: str) -> TritonSm90Tactic | Sm90UnpackTactic:
    """A tactic of either sm90 backend from its canonical JSON (by its backend field)."""
    if json.loads(tj).get("backend") == TritonSm90UnpackBackend.name:
        return Sm90UnpackTactic.model_validate_json(tj)
    return TritonSm90Tactic.model_validate_json(tj)


def time_graph(calls, device: torch.device, flops: float) -> float:
    """Microseconds per call of ``calls[0]``: `harness.time_us` (CUDA graph, L2 flushed
    before each call; wall time on a CPU). The flush makes rotating input copies
    unnecessary: only the first of `calls` is timed (the list form is kept for
    bench_w4a16). Fewer calls per graph for long kernels (> 1 TFLOP)."""
    return harness.time_us(calls[0], device, calls=20 if flops < 1e12 else 4)


def time_eager(call, device: torch.device, iters: int = 5) -> float:
    """Host wall microseconds per eager call, back to back (`harness.eager_wall_us`)."""
    return harness.eager_wall_us(call, calls=iters, warmup=1)


def n_copies(bytes_per_copy: float, l2_bytes: int) -> int:
    """Input copies a timing needs: one, since the harness flushes L2 before each call
    (kept so that callers building copy lists still run)."""
    return 1


# ---- baselines ------------------------------------------------------------------------


def measure_floors(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate at 8192^3, measured now."""
    if device.type != "cuda":
        return {"copy_gbps": 4250.0, "bf16_tflops": 691.0, "measured": False}
    n = 1 << 30
    bufs = [torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255) for _ in range(2)]
    us = harness.gpu_time_us(lambda: bufs[1].copy_(bufs[0]), calls=3, cold_l2=False)
    copy_gbps = 2 * n / us / 1e3
    bufs.clear()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    us = harness.gpu_time_us(lambda: a @ b, calls=3, cold_l2=False)
    return {"copy_gbps": copy_gbps, "bf16_tflops": 2 * 8192**3 / us / 1e6, "measured": True}


@dataclass
class ShapeResult:
    m: int
    n: int
    k: int
    tactics: dict[str, float]
    failures: dict[str, str]
    best: str | None
    best_us: float
    direct_best: str | None
    direct_us: float
    unpack_best: str | None
    unpack_us: float
    untuned: str
    untuned_us: float
    est_pick: str
    est_pick_us: float
    bf16_us: float
    fp8_us: float
    naive_us: float
    mem_floor_us: float
    compute_floor_us: float


def bench_shape(
    m: int,
    n: int,
    k: int,
    backends: list[TritonSm90Backend | TritonSm90UnpackBackend],
    info: DeviceInfo,
    device: torch.device,
    floors: dict[str, float],
    dispatcher,
    max_tactics: int | None,
    skip_baselines: bool,
) -> ShapeResult:
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 * m + n + k)
    problem = Problem(m=m, n=n, k=k)
    nv_bytes = (m + n) * k * (0.5 + 1 / 16)
    copies = n_copies(nv_bytes, info.l2_bytes)
    ops_list = [make_operands(m, n, k, device, gen) for _ in range(copies)]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    flops = 2.0 * m * n * k

    tactics = []
    ranked = []  # (estimate, json, tactic) over both backends: one microsecond scale
    for backend in backends:
        own = sorted(
            ((backend.estimate_us(problem, info, t), t.canonical_json(), t)
             for t in backend.tactics(problem, info)),
            key=lambda e: e[:2],
        )  # fmt: skip
        ranked += own
        tactics += [e[2] for e in own[:max_tactics]]  # [:None] keeps all
    est_pick = min(ranked, key=lambda e: e[:2])[2]
    times: dict[str, float] = {}
    failures: dict[str, str] = {}
    for t in tactics:
        tj = t.canonical_json()
        kern = tactic_kernel(t)
        try:
            times[tj] = time_graph(
                [lambda o=o, kern=kern, t=t: launch(kern, t.swap_ab, o, out) for o in ops_list],
                device,
                flops,
            )
        except Exception as exc:  # a failing tactic times as infinity and is reported
            failures[tj] = f"{type(exc).__name__}: {str(exc)[:300]}"
            times[tj] = math.inf
    best = min(times, key=lambda j: (times[j], j)) if times else None
    best_us = times[best] if best else math.inf
    per_backend = {}
    for name in (TritonSm90Backend.name, TritonSm90UnpackBackend.name):
        own = [j for j in times if json.loads(j)["backend"] == name]
        top = min(own, key=lambda j: (times[j], j)) if own else None
        per_backend[name] = (top, times[top] if top else math.nan)
    est_json = est_pick.canonical_json()
    if est_json not in times:
        kern = tactic_kernel(est_pick)
        times[est_json] = time_graph(
            [lambda o=o: launch(kern, est_pick.swap_ab, o, out) for o in ops_list], device, flops
        )

    untuned, untuned_us = "n/a", math.nan
    if dispatcher is not None:
        cand = dispatcher.select(m, n, k)
        kern = dispatcher.kernel_for(cand, problem)
        untuned = json.dumps(
            {"backend": cand.backend, **cand.tactic.model_dump(mode="json")}, sort_keys=True
        )
        cj = cand.tactic.canonical_json()
        if cand.backend in {b.name for b in backends} and cj in times:
            untuned_us = times[cj]
        else:
            calls = [lambda o=o: launch(kern, cand.tactic.swap_ab, o, out) for o in ops_list]
            try:
                untuned_us = time_graph(calls, device, flops)
            except Exception as exc:  # e.g. a torch backend that is not graph-capturable
                print(f"untuned {cand.backend}: graph capture failed ({exc}); eager", flush=True)
                untuned_us = time_eager(calls[0], device, 3)

    bf16_us = fp8_us = naive_us = math.nan
    if not skip_baselines:
        c16 = n_copies((m + n) * k * 2.0, info.l2_bytes)
        src = [ops_list[i % len(ops_list)] for i in range(c16)]
        a16 = [dequant(o.a_data, o.a_scale, torch.bfloat16) for o in src]
        b16 = [dequant(o.b_data, o.b_scale, torch.bfloat16) for o in src]
        bf16_us = time_graph(
            [lambda a=a, b=b: torch.mm(a, b.t(), out=out) for a, b in zip(a16, b16, strict=True)],
            device,
            flops,
        )
        if device.type == "cuda":
            c8 = n_copies((m + n) * k * 1.0, info.l2_bytes)
            a8 = [(a16[i % len(a16)] * 0.125).to(torch.float8_e4m3fn) for i in range(c8)]
            b8 = [(b16[i % len(b16)] * 0.125).to(torch.float8_e4m3fn) for i in range(c8)]
            one = torch.ones((), dtype=torch.float32, device=device)
            try:
                fp8_us = time_graph(
                    [
                        lambda a=a, b=b: torch._scaled_mm(
                            a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                        )
                        for a, b in zip(a8, b8, strict=True)
                    ],
                    device,
                    flops,
                )
            except Exception as exc:  # reported in the table as n/a with the reason logged
                print(f"fp8 _scaled_mm failed at {m}x{n}x{k}: {exc}", file=sys.stderr)
            del a8, b8
        del a16, b16
        from fp4_dispatch.backends import reference

        naive_us = time_eager(
            lambda: reference.gemm(ops_list[0], out, compute_dtype="bfloat16", k_chunk=0), device, 3
        )

    return ShapeResult(
        m, n, k, times, failures, best, best_us,
        *per_backend[TritonSm90Backend.name], *per_backend[TritonSm90UnpackBackend.name],
        untuned, untuned_us, est_json,
        times[est_json], bf16_us, fp8_us, naive_us,
        problem.min_bytes / (floors["copy_gbps"] * 1e3),
        flops / (floors["bf16_tflops"] * 1e6),
    )  # fmt: skip


def short(tj: str | None) -> str:
    """A table cell for a tactic's JSON: `fp4_dispatch.tactics.tactic_label`, prefixed
    ``unpack`` for the unpack + cuBLAS backend (the direct kernel's is bare)."""
    if not tj:
        return "-"
    t = parse_tactic(tj)
    prefix = "unpack " if t.backend == TritonSm90UnpackBackend.name else ""
    return prefix + tactic_label(t)


def table(results: list[ShapeResult]) -> str:
    """The markdown table printed last: milliseconds, ratios to the best tactic."""
    headers = ("M", "N", "K", "best ms", "best tactic", "direct ms", "unpack+cuBLAS ms",
               "untuned ms", "est-pick ms", "bf16 ms", "fp8 ms", "naive ms", "mem floor ms",
               "compute floor ms", "bf16/best", "fp8/best", "best/floor")  # fmt: skip

    def ms(us: float) -> str:
        return num(us / 1e3, ".4f" if us < 1e5 else ".1f")

    rows = []
    for x in results:
        floor = max(x.mem_floor_us, x.compute_floor_us)
        rows.append((x.m, x.n, x.k, ms(x.best_us), short(x.best), ms(x.direct_us),
                     ms(x.unpack_us), ms(x.untuned_us), ms(x.est_pick_us), ms(x.bf16_us),
                     ms(x.fp8_us), ms(x.naive_us), ms(x.mem_floor_us), ms(x.compute_floor_us),
                     ratio(x.bf16_us, x.best_us), ratio(x.fp8_us, x.best_us),
                     ratio(x.best_us, floor)))  # fmt: skip
    return markdown_table(headers, rows, "rrrrlrrrrrrrrrrrr") + "\n"


def host_overhead(backend, info, device, tj: str, m: int, n: int, k: int) -> dict[str, float]:
    """Eager per-call wall time of one kernel (host launch path), `harness.eager_wall_us`."""
    t = parse_tactic(tj)
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    ops = make_operands(m, n, k, device, gen)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    kern = tactic_kernel(t)
    calls = 200 if device.type == "cuda" else 3
    us = harness.eager_wall_us(lambda: launch(kern, t.swap_ab, ops, out), calls=calls, warmup=10)
    return {"eager_us_per_call": us}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET, tiny shapes")
    ap.add_argument("--ms", default=",".join(map(str, BENCH_MS)))
    ap.add_argument("--nk", default=";".join(f"{n},{k}" for n, k in BENCH_NK))
    ap.add_argument("--max-tactics", type=int, default=None)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--no-dispatcher", action="store_true")
    args = ap.parse_args()

    if args.smoke:
        device, info = torch.device("cpu"), simulated("sm90")
        shapes = list(SMOKE_SHAPES)
        args.max_tactics = args.max_tactics or 2
    else:
        device, info = torch.device("cuda"), detect()
        nks = [tuple(map(int, s.split(","))) for s in args.nk.split(";")]
        shapes = [(m, n, k) for n, k in nks for m in map(int, args.ms.split(","))]
    backend = TritonSm90Backend()
    backends = [backend, TritonSm90UnpackBackend()]
    print(f"device: {info.name} cc={info.compute_capability} sms={info.sm_count} "
          f"torch {torch.__version__} support: {backend.supports(info)}", flush=True)  # fmt: skip

    dispatcher = None
    if not args.no_dispatcher and not args.smoke:
        try:
            from fp4_dispatch import Dispatcher

            dispatcher = Dispatcher(device="cuda")
        except Exception as exc:  # the table then says n/a for "untuned"
            print(f"dispatcher unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)

    planned = []  # (backend, tactic, problem): each shape's tactics, best estimate first
    for m, n, k in shapes:
        problem = Problem(m=m, n=n, k=k)
        for b in backends:
            ts = sorted(
                b.tactics(problem, info),
                key=lambda t, b=b: (b.estimate_us(problem, info, t), t.canonical_json()),
            )
            ts = ts[: args.max_tactics] if args.max_tactics else ts
            planned += [(b, t, problem) for t in ts]
    report = precompile_kernels(planned, info, args.workers)
    compile_failures = failures_by_tactic(report)
    print(f"precompiled {len(report.outcomes)} variants in {report.seconds:.0f}s; "
          f"{len(compile_failures)} failed", flush=True)  # fmt: skip
    for tj, why in sorted(compile_failures.items())[:20]:
        print(f"  FAIL {short(tj)}: {why}", flush=True)

    floors = measure_floors(device)
    print(f"floors: {floors}", flush=True)
    results = []
    for m, n, k in shapes:
        t1 = time.time()
        res = bench_shape(
            m, n, k, backends, info, device, floors, dispatcher, args.max_tactics, False
        )
        results.append(res)
        print(f"{m}x{n}x{k}: best {res.best_us:.1f}us ({short(res.best)}) direct "
              f"{res.direct_us:.1f}us unpack {res.unpack_us:.1f}us untuned "
              f"{res.untuned_us:.1f}us bf16 {res.bf16_us:.1f}us fp8 {res.fp8_us:.1f}us "
              f"[{len(res.tactics)} tactics, {time.time() - t1:.0f}s]", flush=True)  # fmt: skip
        write_json("bench_hopper.json", {"device": info.model_dump(mode="json"),
                   "floors": floors, "compile_failures": compile_failures,
                   "results": [r.__dict__ for r in results]}, args.out)  # fmt: skip
    decode = next((r for r in results if r.best), None)
    if decode is not None:
        ho = host_overhead(backend, info, device, decode.best, decode.m, decode.n, decode.k)
        print(f"host path {decode.m}x{decode.n}x{decode.k}: {ho} (graph {decode.best_us:.1f} us)")
    md = table(results)
    write_text("bench_table.md", md, args.out)
    print(md)


if __name__ == "__main__":
    main()
