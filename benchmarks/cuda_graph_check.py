"""CUDA-graph and torch.compile check of the fp4_dispatch ops on a real GPU (H200).

What it checks (PASS/FAIL lines, then a summary; exit status 1 on any FAIL):

1. **tune / warm-up**: a `Dispatcher` on the GPU tunes the decode shapes (if
   ``Dispatcher.tune`` exists; ``--no-tune`` skips) and `torch_ops.warmup` runs each
   exact shape once eagerly (build, JIT compile, workspace allocation).
2. **op capture**: ``torch.ops.fp4_dispatch.gemm`` on static inputs is captured in a
   ``torch.cuda.CUDAGraph``; for several fresh inputs (quantized eagerly, copied into
   the static tensors) the replay must match the float64 reference (relative error <
   1e-2), equal the eager result, and change when the inputs change.
3. **module capture**: the same for `Nvfp4Linear.forward` (quantize + GEMM + bias in
   the graph), against ``F.linear`` on the dequantized operands.
4. **not warmed**: capturing a shape that never ran eagerly raises
   `CaptureNotWarmError` (nothing launched), the aborted capture leaves the device
   usable, and the next eager call works.
5. **compile**: ``torch.compile(mode="reduce-overhead", fullgraph=True)`` of a two-layer
   Nvfp4Linear model (CUDA graphs through cudagraph trees) matches eager.
6. **conformance** (``--no-conformance`` skips): `fp4_dispatch.testing.check_plugin`
   of the built-in ``sm90`` plugin on the GPU (sampled tactics against the reference).
7. **info**: whether the portable reference backend can be captured (not a failure).

It also prints the op's eager wall time per call and its GPU time in a CUDA graph
(`fp4_dispatch.harness.eager_wall_us` / `gpu_time_us`); ``$OUT/cuda_graph_check.json``
gets every PASS/FAIL line when ``OUT`` is set.
On a machine without CUDA it runs a CPU smoke test of the op and module and says that
the graph part was skipped.

    python benchmarks/cuda_graph_check.py [--shapes 1,4096,4096 8,4096,4096] [--no-tune]
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from _common import markdown_table, parse_shapes, write_json
from torch import nn

import fp4_dispatch
from fp4_dispatch import Dispatcher, dequantize, harness, quantize_nvfp4, reference_gemm, torch_ops
from fp4_dispatch.nn import Nvfp4Linear
from fp4_dispatch.torch_ops import CaptureNotWarmError

TOL = 1e-2
DEFAULT_SHAPES = ("1,4096,4096", "8,4096,4096", "32,14336,4096", "128,4096,14336")
RESULTS: list[tuple[str, str, str]] = []


def record(status: str, name: str, detail: str = "") -> bool:
    RESULTS.append((status, name, detail))
    print(f"{status:4} {name}" + (f": {detail}" if detail else ""), flush=True)
    return status == "PASS"


#: ``||out - ref|| / ||ref||`` in float64, inf when out is not finite (the harness's rule)
rel = harness.relative_error


def guarded(name: str):
    """Run a check; an unexpected exception is a FAIL with its traceback, not a crash."""

    def wrap(fn):
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # reported as FAIL with the traceback
                traceback.print_exc()
                record("FAIL", name, f"{type(exc).__name__}: {exc}")
                return None

        return inner

    return wrap


def new_operand(rows: int, k: int, device: torch.device, gen: torch.Generator, scale: float = 1.0):
    return quantize_nvfp4((torch.randn(rows, k, generator=gen) * scale).to(device))


def make_dispatcher(device: str) -> Dispatcher:
    kwargs = {}
    if "cache" in inspect.signature(Dispatcher).parameters:
        kwargs["cache"] = False  # keep this check out of the user's tuning cache
    return Dispatcher(device=device, **kwargs)


# ---- CPU smoke --------------------------------------------------------------------------------


def cpu_smoke() -> None:
    d = make_dispatcher("cpu")
    gen = torch.Generator().manual_seed(0)
    qa, qb = new_operand(8, 256, torch.device("cpu"), gen), new_operand(64, 256, "cpu", gen)
    did = torch_ops.dispatcher_id(d)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    y = torch.ops.fp4_dispatch.gemm(
        qa.data, qa.scale, qb.data, qb.scale, alpha, torch.bfloat16, did
    )
    err = rel(y, reference_gemm(qa, qb))
    record("PASS" if err < TOL else "FAIL", "cpu op vs reference", f"rel err {err:.2e}")
    lin = nn.Linear(256, 64).to(torch.bfloat16).requires_grad_(False)
    mod = Nvfp4Linear.from_linear(lin, dispatcher=d)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    xq = dequantize(quantize_nvfp4(x))
    ref = F.linear(xq, mod.dequantized_weight(), lin.bias.float())
    err = rel(mod(x), ref)
    record(
        "PASS" if err < TOL else "FAIL",
        "cpu Nvfp4Linear vs F.linear(dq(x), dq(W))",
        f"rel err {err:.2e}",
    )


# ---- CUDA --------------------------------------------------------------------------------------


#: warm `fn` on a side stream (as PyTorch recommends), then capture it; (graph, output)
capture = harness.capture


@guarded("op capture")
def check_op_capture(d: Dispatcher, m: int, n: int, k: int, timings: list) -> None:
    dev = torch.device(d.device.torch_device)
    gen = torch.Generator().manual_seed(m * 7 + n)
    qb = new_operand(n, k, dev, gen, 0.02)
    qa = new_operand(m, k, dev, gen, 3.0)
    a, sa = qa.data.clone(), qa.scale.clone()
    alpha = (qa.global_scale * qb.global_scale).reshape(1).clone()
    did = torch_ops.dispatcher_id(d)

    def call():
        return torch.ops.fp4_dispatch.gemm(a, sa, qb.data, qb.scale, alpha, torch.bfloat16, did)

    graph, y = capture(call)
    plan = d.cached_plan(m, n, k, "bfloat16")
    backend = plan.candidate.backend if plan else "?"
    who = f"{backend} ({plan.candidate.reason})" if plan else "?"
    prev = None
    errs = []
    for trial in range(3):
        fresh = new_operand(m, k, dev, gen, 1.0 + trial)
        a.copy_(fresh.data)
        sa.copy_(fresh.scale)
        alpha.copy_((fresh.global_scale * qb.global_scale).reshape(1))
        graph.replay()
        torch.cuda.synchronize()
        got = y.clone()
        err = rel(got, reference_gemm(fresh, qb))
        eager = torch_ops.gemm(d, fresh, qb)
        same = torch.equal(got, eager)
        changed = prev is None or not torch.equal(got, prev)
        errs.append(err)
        if not (err < TOL and same and changed):
            record(
                "FAIL",
                f"op capture M={m} N={n} K={k}",
                f"trial {trial}: rel err {err:.2e}, equal to eager {same}, changed {changed}",
            )
            return
        prev = got
    record(
        "PASS",
        f"op capture M={m} N={n} K={k}",
        f"{who}; 3 replays, max rel err {max(errs):.2e}, equal to eager, change with inputs",
    )
    eager_us = harness.eager_wall_us(call, calls=200)
    graph_us = harness.gpu_time_us(call, calls=20, cold_l2=False)
    timings.append((m, n, k, backend, eager_us, graph_us))


@guarded("module capture")
def check_module_capture(d: Dispatcher, m: int, n: int, k: int) -> None:
    for activations in ("nvfp4", "bf16"):  # W4A4 and W4A16 (weight-only)
        _module_capture(d, m, n, k, activations)


def _module_capture(d: Dispatcher, m: int, n: int, k: int, activations: str) -> None:
    dev = torch.device(d.device.torch_device)
    torch.manual_seed(m + 1)
    lin = nn.Linear(k, n).to(device=dev, dtype=torch.bfloat16).requires_grad_(False)
    mod = Nvfp4Linear.from_linear(lin, dispatcher=d, activations=activations)
    name = f"Nvfp4Linear({activations}) capture M={m} N={n} K={k}"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        graph, y = capture(lambda: mod(x))
        prev = None
        for trial in range(3):
            fresh = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * (1 + trial)
            x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            got = y.clone()
            # W4A4 rounds the activation to NVFP4; W4A16 multiplies it as it is
            xq = dequantize(quantize_nvfp4(fresh)) if activations == "nvfp4" else fresh
            ref = F.linear(xq.double(), mod.dequantized_weight().double(), lin.bias.double())
            err = rel(got, ref)
            eager = mod(fresh)
            same = torch.equal(got, eager)
            changed = prev is None or not torch.equal(got, prev)
            if not (err < TOL and same and changed):
                record(
                    "FAIL",
                    name,
                    f"trial {trial}: rel err {err:.2e}, equal to eager {same}, changed {changed}",
                )
                return
            prev = got
    record("PASS", name, "3 replays match F.linear(dq(q(x)) or x, dq(W)) and eager")


@guarded("capture of a shape never run")
def check_not_warm(d: Dispatcher, n: int, k: int) -> None:
    dev = torch.device(d.device.torch_device)
    gen = torch.Generator().manual_seed(99)
    m = 3  # never warmed (warm-up used other M)
    qa, qb = new_operand(m, k, dev, gen), new_operand(n, k, dev, gen)
    if torch_ops.is_warm(d, m, n, k, torch.bfloat16):
        record("FAIL", "capture of a shape never run", f"M={m} is unexpectedly warm")
        return
    graph = torch.cuda.CUDAGraph()
    raised = None
    try:
        with torch.cuda.graph(graph):
            torch_ops.gemm(d, qa, qb)
    except CaptureNotWarmError as exc:
        raised = exc
    capturing = torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    out = torch_ops.gemm(d, qa, qb)  # eager afterwards: plans, builds, runs
    err = rel(out, reference_gemm(qa, qb))
    ok = raised is not None and not capturing and err < TOL
    detail = (
        f"raised {type(raised).__name__}; device usable after (eager rel err {err:.2e}); "
        f"message: {str(raised)[:160]}..."
        if raised
        else "did not raise"
    )
    record("PASS" if ok else "FAIL", "capture of a shape never run", detail)


@guarded("torch.compile reduce-overhead")
def check_compile(d: Dispatcher, n: int, k: int) -> None:
    dev = torch.device(d.device.torch_device)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, k)).to(dev, torch.bfloat16)
    for i in (0, 2):
        model[i] = Nvfp4Linear.from_linear(model[i], dispatcher=d)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    t0 = time.perf_counter()
    worst = 0.0
    with torch.no_grad():
        for _ in range(4):  # cudagraph trees: warm-up run(s), record, then replays
            x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
            got = compiled(x).clone()
            eager = model(x)
            worst = max(worst, rel(got, eager))
    secs = time.perf_counter() - t0
    ok = worst < 1e-3
    record(
        "PASS" if ok else "FAIL",
        "torch.compile(mode='reduce-overhead', fullgraph=True)",
        f"2-layer Nvfp4Linear MLP, M=8: max rel diff to eager {worst:.2e} "
        f"over 4 calls ({secs:.1f} s incl. compile)",
    )


@guarded("conformance sm90")
def check_conformance(device: str) -> None:
    from fp4_dispatch.testing import check_plugin

    t0 = time.perf_counter()
    report = check_plugin("sm90", device=device, samples=2)
    secs = time.perf_counter() - t0
    print(report.summary())
    record(
        "PASS" if report.ok else "FAIL",
        "conformance kit: check_plugin('sm90', 'cuda')",
        f"{len(report.passed)} passed, {len(report.failures)} failed ({secs:.1f} s)",
    )


def info_reference_capture(n: int, k: int) -> None:
    """Can the portable reference backend be captured? Informational, never a FAIL."""
    os.environ["FP4_DISPATCH_DISABLE"] = "sm90,sm100,sm103,sm107,example"
    try:
        d = make_dispatcher("cuda")
    finally:
        del os.environ["FP4_DISPATCH_DISABLE"]
    dev = torch.device(d.device.torch_device)
    gen = torch.Generator().manual_seed(5)
    qa, qb = new_operand(8, k, dev, gen), new_operand(n, k, dev, gen)
    torch_ops.warmup(d, [(8, n, k)], show_progress=False)
    try:
        graph, y = capture(lambda: torch_ops.gemm(d, qa, qb))
        graph.replay()
        torch.cuda.synchronize()
        err = rel(y, reference_gemm(qa, qb))
        record("INFO", "reference backend capture", f"captured; rel err {err:.2e}")
    except Exception as exc:  # informational: reported, not a failure of this check
        record(
            "INFO",
            "reference backend capture",
            f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
        )


def run_cuda(shapes: list[tuple[int, int, int]], tune: bool, conformance: bool) -> None:
    d = make_dispatcher("cuda")
    print(f"device: {d.device.name} (cc {d.device.compute_capability}, {d.device.sm_count} SMs)")
    print("available backends:", ", ".join(b.name for b in d.available))
    if tune and hasattr(d, "tune"):
        t0 = time.perf_counter()
        kw = {"save": False} if "save" in inspect.signature(d.tune).parameters else {}
        results = d.tune(shapes, **kw)
        record("PASS", "tune", f"{len(results)} buckets in {time.perf_counter() - t0:.1f} s")
    elif tune:
        record("INFO", "tune", "Dispatcher.tune does not exist in this build: heuristic picks")
    t0 = time.perf_counter()
    picked = torch_ops.warmup(d, shapes, show_progress=False)
    warm = all(torch_ops.is_warm(d, *s, torch.bfloat16) for s in shapes)
    record(
        "PASS" if warm else "FAIL",
        "warm-up",
        f"{len(picked)} shapes in {time.perf_counter() - t0:.1f} s: "
        + "; ".join(f"M={m}:{c.backend}/{c.reason}" for (m, _, _, _), c in picked.items()),
    )
    timings: list = []
    for m, n, k in shapes:
        check_op_capture(d, m, n, k, timings)
    for m, n, k in shapes[:2]:
        check_module_capture(d, m, n, k)
    check_not_warm(d, shapes[0][1], shapes[0][2])
    check_compile(d, 1024, 2048)
    if conformance:
        check_conformance(d.device.torch_device)
    info_reference_capture(512, 1024)
    if timings:
        print("\nper call (fp4_dispatch.harness): eager wall, 200 back-to-back calls, vs GPU "
              "time in a CUDA graph (warm L2)")  # fmt: skip
        rows = [(m, n, k, b, f"{e:.1f}", f"{g:.1f}") for m, n, k, b, e, g in timings]
        print(markdown_table(("M", "N", "K", "backend", "eager us", "graph us"), rows, "rrrlrr"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="M,N,K ...")
    p.add_argument("--no-tune", action="store_true", help="heuristic picks only")
    p.add_argument("--no-conformance", action="store_true", help="skip check_plugin('sm90')")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    os.environ.setdefault("FP4_DISPATCH_PROGRESS", "0")
    shapes = parse_shapes(args.shapes)
    print(f"fp4-dispatch {fp4_dispatch.__version__} from {os.path.dirname(fp4_dispatch.__file__)}")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    cpu_smoke()
    if torch.cuda.is_available():
        run_cuda(shapes, tune=not args.no_tune, conformance=not args.no_conformance)
    else:
        record("SKIP", "CUDA graph checks", "no CUDA device: only the CPU smoke test ran")
    counts = {s: sum(1 for r in RESULTS if r[0] == s) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    print(
        f"\nsummary: {counts['PASS']} passed, {counts['FAIL']} failed, "
        f"{counts['SKIP']} skipped, {counts['INFO']} info"
    )
    write_json("cuda_graph_check.json", {"counts": counts, "results": RESULTS})
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
