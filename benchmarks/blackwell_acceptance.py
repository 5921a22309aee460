"""Acceptance run for the Blackwell/Rubin families on real hardware (B200, B300, SM107 part).

NOT RUN BY THIS PROJECT: no Blackwell or Rubin GPU was available; the kernels were only
compiled for their targets (``fp4-dispatch compile ... --device sm100|sm103|sm107``).
This is what a user with the hardware runs to check every shortlisted CuTe-DSL tactic
against the float64 reference and to time it against cuBLASLt (``torch._scaled_mm`` with
NVFP4 operands), e.g.::

    pip install 'fp4-dispatch[cute]'
    python benchmarks/blackwell_acceptance.py                    # default shapes
    python benchmarks/blackwell_acceptance.py --shapes 1x8192x8192 32768x4096x8192

For each shape it prints one row per shortlisted tactic of a CuTe-DSL family (sm100,
sm103, sm107, and FlashInfer's fi-* with ``pip install 'fp4-dispatch[flashinfer]'``):
PASS/FAIL against the reference (relative Frobenius error <= --tol), the median time over
CUDA-graph replays with a cold L2, TFLOP/s, and the ratio to cuBLASLt. Exit status 1 if
any tactic fails to build, run or match. Add the table to benchmarks/RESULTS.md with the
date, the device and the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fp4_dispatch import Dispatcher, quantize_nvfp4
from fp4_dispatch.backend import GemmOperands
from fp4_dispatch.dispatcher import launch
from fp4_dispatch.nvfp4 import reference_gemm

DEFAULT_SHAPES = ["1x8192x8192", "128x8192x8192", "4096x8192x8192", "32768x4096x8192"]


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in text.lower().split("x"))
    return m, n, k


def time_us(fn, flush: torch.Tensor, repeat: int) -> float:
    """Median of `repeat` CUDA-graph replays of `fn`, each after an L2-evicting write."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up (and lazy init) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(repeat):
        flush.add_(1)  # evict L2: the buffer is larger than the cache
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cublaslt(qa, qb, out_dtype: torch.dtype):
    """cuBLASLt NVFP4 through torch._scaled_mm; alpha applied after, as in our kernels."""
    fp4 = torch.float4_e2m1fn_x2
    a, b = qa.data.view(fp4), qb.data.view(fp4)
    alpha = qa.global_scale * qb.global_scale

    def run() -> torch.Tensor:
        y = torch._scaled_mm(a, b.t(), qa.scale.reshape(-1), qb.scale.reshape(-1),
                             out_dtype=out_dtype)  # fmt: skip
        return y.mul_(alpha)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="MxNxK ...")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tol", type=float, default=1e-2, help="relative Frobenius error bound")
    p.add_argument("--out-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = p.parse_args(argv)

    d = Dispatcher(budget=args.budget)
    dev = d.device
    if dev.kind != "cuda" or (dev.cc or 0) < 100:
        print(f"needs a Blackwell/Rubin GPU (sm_100a+); found {dev.name} ({dev.note})")
        return 2
    out_dtype = getattr(torch, args.out_dtype)
    flush = torch.empty(2 * dev.l2_bytes // 4, dtype=torch.float32, device=dev.torch_device)
    print(f"# {time.strftime('%Y-%m-%d')} {dev.name}, cc {dev.cc}, {dev.sm_count} SMs, "
          f"torch {torch.__version__}")  # fmt: skip
    print("| M | N | K | backend | tactic | check | rel err | us | TFLOP/s | vs cuBLASLt |")
    print("|---:|---:|---:|---|---|---|---:|---:|---:|---:|")
    failed = 0
    for m, n, k in map(parse_shape, args.shapes):
        g = torch.Generator(device="cpu").manual_seed(m * 31 + n * 7 + k)
        qa = quantize_nvfp4(torch.randn(m, k, generator=g)).to(dev.torch_device)
        qb = quantize_nvfp4(torch.randn(n, k, generator=g)).to(dev.torch_device)
        qa, qb = qa.with_layout("swizzled"), qb.with_layout("swizzled")
        ref = reference_gemm(qa, qb).to(dev.torch_device)
        alpha = (qa.global_scale * qb.global_scale).reshape(1)
        ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
        flops = 2.0 * m * n * k
        try:
            base_us = time_us(cublaslt(qa, qb, out_dtype), flush, args.repeat)
        except Exception as exc:  # e.g. cuBLASLt rejecting small M: shown, not fatal
            print(f"| {m} | {n} | {k} | cuBLASLt | - | n/a: {type(exc).__name__}: {exc} "
                  "| | | | |")  # fmt: skip
            base_us = float("nan")
        else:
            print(f"| {m} | {n} | {k} | cuBLASLt | _scaled_mm | - | - | {base_us:.1f} "
                  f"| {flops / base_us / 1e6:.0f} | 1.00 |")  # fmt: skip
        shortlist = d.candidates(m, n, k, args.out_dtype)
        for cand in shortlist.candidates:
            if not getattr(d.registry.backends[cand.backend], "compiles_ahead_of_time", False):
                continue  # the CuTe-DSL families: cute-sm10x and FlashInfer's fi-*
            out = torch.empty(m, n, dtype=out_dtype, device=dev.torch_device)
            tactic = cand.tactic.canonical_json()
            try:
                problem_kernel = d.kernel_for(cand, _problem(m, n, k, args.out_dtype))
                launch(cand, problem_kernel, ops, out)
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                ok = err <= args.tol
                us = time_us(lambda c=cand, kk=problem_kernel, o=out, x=ops: launch(c, kk, x, o),
                             flush, args.repeat)  # fmt: skip
            except Exception as exc:  # a tactic that fails is reported, the rest continue
                failed += 1
                print(f"| {m} | {n} | {k} | {cand.backend} | `{tactic}` | ERROR "
                      f"{type(exc).__name__}: {exc} | | | | |")  # fmt: skip
                continue
            failed += not ok
            print(f"| {m} | {n} | {k} | {cand.backend} | `{tactic}` | "
                  f"{'PASS' if ok else 'FAIL'} | {err:.2e} | {us:.1f} | "
                  f"{flops / us / 1e6:.0f} | {base_us / us:.2f} |")  # fmt: skip
    print(f"\n{failed} tactic(s) failed")
    return 1 if failed else 0


def _problem(m: int, n: int, k: int, out_dtype: str):
    from fp4_dispatch.tactics import Problem

    return Problem(m=m, n=n, k=k, out_dtype=out_dtype)


if __name__ == "__main__":
    sys.exit(main())
