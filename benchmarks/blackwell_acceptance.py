"""Acceptance run for the Blackwell/Rubin families on real hardware (B200, B300, SM107 part).

NOT RUN BY THIS PROJECT: no Blackwell or Rubin GPU was available; the kernels were only
compiled for their targets (``fp4-dispatch compile ... --device sm100|sm103|sm107``).
This is what a user with the hardware runs to check every shortlisted CuTe-DSL tactic
against the float64 reference and to time it against cuBLASLt (``torch._scaled_mm`` with
NVFP4 operands), e.g.::

    pip install '.[cute]'
    python benchmarks/blackwell_acceptance.py                    # default shapes
    python benchmarks/blackwell_acceptance.py --shapes 1x8192x8192 32768x4096x8192

For each shape it prints one row per shortlisted tactic of a CuTe-DSL family (sm100,
sm103, sm107, and FlashInfer's fi-* with ``pip install '.[flashinfer]'``):
PASS/FAIL against the reference (relative Frobenius error <= --tol), the median time over
CUDA-graph replays with a cold L2, TFLOP/s, and the ratio to cuBLASLt. Exit status 1 if
any tactic fails to build, run or match. Add the table to benchmarks/RESULTS.md with the
date, the device and the command.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import markdown_table, parse_shape, write_json

from fp4_dispatch import Dispatcher, harness, quantize_nvfp4
from fp4_dispatch.backend import GemmOperands
from fp4_dispatch.guard import launch
from fp4_dispatch.nvfp4 import reference_gemm
from fp4_dispatch.tactics import Problem

DEFAULT_SHAPES = ["1x8192x8192", "128x8192x8192", "4096x8192x8192", "32768x4096x8192"]
HEADERS = ("M", "N", "K", "backend", "tactic", "check", "rel err", "us", "TFLOP/s", "vs cuBLASLt")


def time_us(fn, repeat: int) -> float:
    """GPU microseconds per call: `harness.gpu_time_us` (CUDA graph, L2 flushed before
    each call), the clock the tuner and every other benchmark use."""
    return harness.gpu_time_us(fn, calls=repeat)


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


def _shape_rows(d: Dispatcher, m: int, n: int, k: int, args, out_dtype) -> tuple[list, int]:
    """(table rows, failures) for one shape: cuBLASLt, then every shortlisted tactic of a
    family that compiles ahead of time (the CuTe-DSL families: cute-sm10x, fi-*)."""
    dev = d.device
    g = torch.Generator(device="cpu").manual_seed(m * 31 + n * 7 + k)
    qa = quantize_nvfp4(torch.randn(m, k, generator=g)).to(dev.torch_device)
    qb = quantize_nvfp4(torch.randn(n, k, generator=g)).to(dev.torch_device)
    qa, qb = qa.with_layout("swizzled"), qb.with_layout("swizzled")
    ref = reference_gemm(qa, qb)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
    flops = 2.0 * m * n * k
    rows, failed = [], 0
    try:
        base_us = time_us(cublaslt(qa, qb, out_dtype), args.repeat)
    except Exception as exc:  # e.g. cuBLASLt rejecting small M: shown, not fatal
        rows.append((m, n, k, "cuBLASLt", "-", f"n/a: {type(exc).__name__}: {exc}", "", "", "", ""))
        base_us = float("nan")
    else:
        rows.append((m, n, k, "cuBLASLt", "_scaled_mm", "-", "-", f"{base_us:.1f}",
                     f"{flops / base_us / 1e6:.0f}", "1.00"))  # fmt: skip
    problem = Problem(m=m, n=n, k=k, out_dtype=args.out_dtype)
    for cand in d.candidates(m, n, k, args.out_dtype).candidates:
        if not getattr(d.registry.backends[cand.backend], "compiles_ahead_of_time", False):
            continue
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev.torch_device)
        tactic = f"`{cand.tactic.canonical_json()}`"
        swap = cand.tactic.swap_ab
        try:
            kernel = d.kernel_for(cand, problem)
            launch(kernel, ops, out, swap)
            torch.cuda.synchronize()
            err, why = harness.compare(out, ref, args.tol)
            us = time_us(lambda kk=kernel, o=out, s=swap: launch(kk, ops, o, s), args.repeat)
        except Exception as exc:  # a tactic that fails is reported, the rest continue
            failed += 1
            rows.append((m, n, k, cand.backend, tactic, f"ERROR {type(exc).__name__}: {exc}",
                         "", "", "", ""))  # fmt: skip
            continue
        failed += bool(why)
        rows.append((m, n, k, cand.backend, tactic, "FAIL" if why else "PASS", f"{err:.2e}",
                     f"{us:.1f}", f"{flops / us / 1e6:.0f}", f"{base_us / us:.2f}"))  # fmt: skip
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="MxNxK ...")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--repeat", type=int, default=20, help="calls per timed CUDA graph")
    p.add_argument("--tol", type=float, default=1e-2, help="relative Frobenius error bound")
    p.add_argument("--out-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = p.parse_args(argv)

    d = Dispatcher(budget=args.budget)
    dev = d.device
    if dev.kind != "cuda" or (dev.cc or 0) < 100:
        print(f"needs a Blackwell/Rubin GPU (sm_100a+); found {dev.name} ({dev.note})")
        return 2
    out_dtype = harness.OUT_DTYPES[args.out_dtype]
    print(f"# {time.strftime('%Y-%m-%d')} {dev.name}, cc {dev.cc}, {dev.sm_count} SMs, "
          f"torch {torch.__version__}")  # fmt: skip
    rows, failed = [], 0
    for m, n, k in map(parse_shape, args.shapes):
        shape_rows, shape_failed = _shape_rows(d, m, n, k, args, out_dtype)
        rows += shape_rows
        failed += shape_failed
    write_json("blackwell_acceptance.json", {"device": dev.name, "rows": rows})
    print(markdown_table(HEADERS, rows, "rrrlllrrrr"))
    print(f"\n{failed} tactic(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
