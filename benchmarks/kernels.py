"""The ``kernels`` suite: dense GEMMs per operation, the quantize kernel and the grouped MoE
GEMM, on one GPU.

    python -m benchmarks kernels                       # every routine, default grids
    python -m benchmarks kernels --cases w4a16-decode --top 0   # the whole shortlist
    python -m benchmarks kernels --cases w4a8 --m 1 16 --nk 5120,5120

Per shape of a GEMM routine (operands: activations ``3 * randn``, weights ``0.02 *
randn`` quantized to NVFP4, drawn on the CPU from a seed; the float64 product of the
dequantized operands - W4A16 and W4A8: of the bf16 activation itself - is the reference):

- baselines on the dequantized operands: ``torch.mm bf16`` (cuBLAS) and ``_scaled_mm fp8``
  (cuBLASLt, e4m3 with per-tensor scales);
- ``dispatcher``: ``Dispatcher().gemm``, its untuned pick (the tactic it ran is named);
- each backend's first ``--top`` tactics of the shortlist (0: every valid tactic, the
  sweeps ``fit_w4a16_model.py`` fits on), built, checked and timed by the tuner's own
  `Tuner.measure` (``--budget-s`` then skips the rest);
- ``w4a8`` adds the fp8 dispatcher (``precision="fp8"``), ``_scaled_mm`` on FP8 weights
  kept in memory with row-wise scales, alone and with the per-token activation pass.

Every path: GPU time (``graph``: CUDA-graph replays, L2 flushed before each call) and
eager wall per call (``eager``), the relative error of one NaN-poisoned output, and
``ratios`` to bf16 and FP8 (their time over this one: > 1 is faster). Every kernel is
compiled first in parallel. ``quantize``: `quantize_nvfp4` of a bf16 activation, checked
bit for bit against the CPU reference, GB/s of bytes read and written. ``grouped``: the
grouped W4A16 GEMM of MoE layers against bf16 ``torch._grouped_mm`` and a loop of dense
GEMMs (`benchmarks.grouped`, with the suite's own ``--tune`` and ``--configs``).
``moe-layer``: one whole MoE layer, `Nvfp4MoE` against transformers' bf16 block with
``grouped_mm`` experts on the same weights (`benchmarks.grouped.layer_routine`; GPU only).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from . import grouped
from .common import (
    Context,
    add_ratios,
    on_cuda_or_smoke,
    path_rows,
    precompile,
    tactic_rows,
    timed_rows,
)

#: the decode sweeps' (N, K): the issue's four and two more, then the held-out ones (fixed
#: before the W4A16 fits: `fit_w4a16_model.HELD_OUT` only scores them)
DECODE_NK = ((8192, 8192), (5120, 5120), (13824, 5120), (10240, 8192), (4608, 3584),
             (18944, 3584))  # fmt: skip
HELD_NK = ((6144, 4096), (28672, 8192), (4096, 14336))
#: blocks of (M values, (N, K) pairs) of each GEMM routine: the Hopper grid, the issue-13
#: grid, the decode and mid-M sweeps the sm90 W4A16 constants are fitted on (in-sample,
#: then held out), the shapes of W4A8 (issue 34)
GRIDS: dict[str, tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]] = {
    "w4a4": (((1, 16, 128, 1024, 4096, 16384), ((8192, 8192), (28672, 8192), (8192, 28672))),),
    "w4a4-decode": (((1, 4, 16), DECODE_NK), ((2, 8), HELD_NK)),
    "w4a16": (((1, 16, 64, 256, 4096), DECODE_NK[:4]),),
    "w4a16-decode": (((1, 4, 16), DECODE_NK), ((2, 8), HELD_NK)),
    "w4a16-mid": (((64, 256), DECODE_NK), ((32, 128), HELD_NK)),
    "w4a8": (((1, 16, 64, 256, 1024, 4096), ((5120, 5120), (13824, 5120), (3584, 18944))),),
}  # fmt: skip
SMOKE_GRID = (((1,), ((96, 128),)),)
QUANTIZE_GRID = ((1, 16, 256, 4096), (4096, 5120, 8192))


def operands(m: int, n: int, k: int, dense: bool, device: torch.device, seed: int):
    """(activation: bf16 tensor or NVFP4, NVFP4 weight, float64 reference on `device`)."""
    from fp4_dispatch import quantize_nvfp4

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen) * 3.0
    qb = quantize_nvfp4((torch.randn(n, k, generator=gen) * 0.02).to(device))
    act = a.to(device, torch.bfloat16) if dense else quantize_nvfp4(a.to(device))
    a64 = act.double() if dense else act.dequantize().double()
    return act, qb, a64 @ qb.dequantize().double().T


def baselines(act, qb, dense: bool) -> dict[str, Callable[[torch.Tensor], object]]:
    """bf16 cuBLAS and FP8 cuBLASLt (per-tensor e4m3) on the dequantized operands."""
    x = act if dense else act.dequantize().to(torch.bfloat16)
    w = qb.dequantize().to(torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    sx = (x.abs().amax().float() / 448).clamp(min=1e-12)
    sw = (w.abs().amax().float() / 448).clamp(min=1e-12)
    x8, w8 = (x.float() / sx).to(e4m3), (w.float() / sw).to(e4m3)
    return {
        "torch.mm bf16": lambda o: torch.mm(x, w.t(), out=o),
        "_scaled_mm fp8": lambda o: torch._scaled_mm(x8, w8.t(), sx, sw,
                                                     out_dtype=torch.bfloat16, out=o),
    }  # fmt: skip


def shortlisted(d, m: int, n: int, k: int, operation: str, top: int, only: str = "") -> list:
    """The shortlist's first `top` candidates of each backend (all with 0), rank order;
    only those computing `only` when given (the fp8 dispatcher's W4A8 ones, say)."""
    seen: dict[str, int] = {}
    chosen = []
    for c in d.candidates(m, n, k, operation=operation).candidates:
        if only and c.operation != only:
            continue
        seen[c.backend] = seen.get(c.backend, 0) + 1
        if top == 0 or seen[c.backend] <= top:
            chosen.append(c)
    return chosen


def dispatcher_path(ctx: Context, case: str, d, act, qb, ref, m: int, n: int, k: int,
                    name: str = "dispatcher") -> list:  # fmt: skip
    """`Dispatcher.gemm` as a user calls it; the tactic of its plan named in the rows."""
    from fp4_dispatch.contracts.tactics import tactic_label

    out = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
    rows = path_rows(ctx, case, lambda o: d.gemm(act, qb, out=o), out, ref, ctx.args.clocks,
                     backend=name, m=m, n=n, k=k)  # fmt: skip
    op = "w4a16" if isinstance(act, torch.Tensor) else "w4a4"
    plan = d.cached_plan(m, n, k, "bfloat16", op)
    for r in rows:
        if plan is not None:
            c = plan.candidate
            r.tactic, r.operation = f"{c.backend} {tactic_label(c.tactic)}", c.operation
    return rows


def gemm_routine(operation: str, grid: str) -> Callable[[Context], None]:
    def routine(ctx: Context) -> None:
        if on_cuda_or_smoke(ctx, grid):
            run_gemm(ctx, grid, operation)

    return routine


def run_gemm(ctx: Context, case: str, operation: str) -> None:
    """Baselines, the dispatcher and each backend's tactics for every shape of `case`."""
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.contracts.tactics import Problem

    dense8 = operation == "w4a8"
    budget = 10**6 if ctx.args.top == 0 else max(32, ctx.args.top * 8)  # 0: every tactic
    where = str(ctx.device)
    d = Dispatcher(where, cache=False, budget=budget)  # the tactics' shortlist
    fp8 = Dispatcher(where, cache=False, budget=budget, precision="fp8") if dense8 else None
    # what a user gets: the untuned pick of a default dispatcher
    users = [("dispatcher", Dispatcher(where, cache=False))] + (
        [("dispatcher fp8", Dispatcher(where, cache=False, precision="fp8"))] if dense8 else []
    )
    dense = operation != "w4a4"
    blocks = SMOKE_GRID if ctx.smoke else GRIDS[case]
    if ctx.args.shapes or ctx.args.m or ctx.args.nk:  # the options replace the blocks
        blocks = blocks[:1]
    grid = [s for ms, nks in blocks for s in ctx.grid(ms, nks)]
    ask = "w4a4" if operation == "w4a4" else "w4a16"
    lists = {s: shortlisted(fp8 or d, *s, ask, ctx.args.top, "w4a8" if fp8 else "")
             for s in grid}  # fmt: skip
    planned = [(d.registry.backends[c.backend], c.tactic,
                Problem(m=m, n=n, k=k, operation=c.operation))
               for (m, n, k), cs in lists.items() for c in cs]  # fmt: skip
    if ctx.cuda:
        precompile(planned, d.device, ctx.args.workers)
    deadline = time.monotonic() + ctx.args.budget_s
    for m, n, k in grid:
        act, qb, ref = operands(m, n, k, dense, ctx.device, seed=m + n + k)
        rows = []
        for name, fn in baselines(act, qb, dense).items():
            out = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
            op = "bf16" if "bf16" in name else "fp8"
            rows += path_rows(ctx, case, fn, out, ref, ctx.args.clocks, backend=name,
                              operation=op, m=m, n=n, k=k)  # fmt: skip
        for name, user in users:
            rows += dispatcher_path(ctx, case, user, act, qb, ref, m, n, k, name)
        if fp8 is not None:
            rows += w4a8_paths(ctx, case, act, qb, ref)
        problem = Problem(m=m, n=n, k=k, operation="w4a8" if fp8 else operation)
        for clock in ctx.args.clocks:
            rows += tactic_rows(ctx, case, fp8 or d, problem, lists[(m, n, k)], clock, deadline)
        add_ratios(rows, {"bf16": "torch.mm bf16", "fp8": "_scaled_mm fp8"})
        ctx.emit(rows)


def w4a8_paths(ctx: Context, case: str, x: torch.Tensor, qb, ref) -> list:
    """``_scaled_mm`` on E4M3 weights kept in memory (row-wise scales), alone and with
    our per-token activation pass (what a stack with FP8 weights runs per call); in
    ``--smoke`` also one fused W4A8 kernel under the interpreter (no shortlist on a CPU)."""
    from fp4_dispatch.backends.sm90 import gemm_w4a8 as g
    from fp4_dispatch.contracts.backend import DenseOperands

    m, n, k = x.shape[0], qb.rows, qb.k
    alpha = qb.global_scale.reshape(1)
    wq, sw = g.weight_to_fp8(qb.data, qb.scale, alpha)
    xq, sa = g.quantize_activations(x)
    mm = torch._scaled_mm

    def with_quant(o: torch.Tensor) -> None:
        q, s = g.quantize_activations(x)
        mm(q, wq.t(), s[:, None], sw[None, :], out_dtype=torch.bfloat16, out=o)

    paths = {
        "_scaled_mm fp8 rowwise": lambda o: mm(xq, wq.t(), sa[:, None], sw[None, :],
                                               out_dtype=torch.bfloat16, out=o),
        "_scaled_mm fp8 rowwise + quantize": with_quant,
    }  # fmt: skip
    if ctx.smoke:
        kern = g.build(g.W4A8Config(block_n=64, block_m=16, block_k=64))
        ops = DenseOperands(x, qb.data, qb.scale, alpha)
        paths["triton-sm90-w4a8 fused 64x16x64"] = lambda o: kern(ops, o)
    rows = []
    for name, fn in paths.items():
        out = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
        rows += path_rows(ctx, case, fn, out, ref, ctx.args.clocks, backend=name,
                          operation="w4a8", m=m, n=n, k=k)  # fmt: skip
    return rows


def quantize(ctx: Context) -> None:
    """`quantize_nvfp4` of bf16 [M, K]: bit-equal to the CPU reference (else the row
    fails), GPU time and eager wall, GB/s = (bf16 read + data and scales written) / time."""
    if not on_cuda_or_smoke(ctx, "quantize"):
        return
    from fp4_dispatch import quantize_nvfp4

    ms, ks = ((1, 16), (128,)) if ctx.smoke else QUANTIZE_GRID
    for k in [nk[1] for nk in ctx.args.nk] if ctx.args.nk else ks:
        for m in ctx.args.m or ms:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
            x = x.to(ctx.device, torch.bfloat16)
            got, want = quantize_nvfp4(x), quantize_nvfp4(x.cpu())
            same = all(torch.equal(getattr(got, f).cpu(), getattr(want, f))
                       for f in ("data", "scale", "global_scale"))  # fmt: skip
            rows = timed_rows(ctx, "quantize", lambda x=x: quantize_nvfp4(x), ctx.args.clocks,
                              backend="quantize_nvfp4", operation="quantize", m=m, k=k)  # fmt: skip
            moved = x.numel() * 2 + got.data.numel() + got.scale.numel()
            for r in rows:
                r.failure = r.failure or (None if same else "not bit-equal to the CPU reference")
                if r.median_us:
                    r.extra["gb_per_s"] = round(moved / r.median_us / 1e3, 1)
            ctx.emit(rows)


ROUTINES: dict[str, Callable[[Context], None]] = {
    "w4a4": gemm_routine("w4a4", "w4a4"),
    "w4a4-decode": gemm_routine("w4a4", "w4a4-decode"),
    "w4a16": gemm_routine("w4a16", "w4a16"),
    "w4a16-decode": gemm_routine("w4a16", "w4a16-decode"),
    "w4a16-mid": gemm_routine("w4a16", "w4a16-mid"),
    "w4a8": gemm_routine("w4a8", "w4a8"),
    "quantize": quantize,
    "grouped": grouped.routine,
    "moe-layer": grouped.layer_routine,
}
SMOKE = ("w4a4", "w4a16", "w4a8", "quantize", "grouped", "moe-layer")


def options(args: argparse.Namespace, argv: list[str]) -> None:
    """The suite's own options (after the runner's common ones): the grouped routine's."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernels")
    ap.add_argument(
        "--tune",
        action="store_true",
        help="grouped: tune each bucket first (--top tactics, 0: the shortlist); moe-layer: "
        "tune the layer's buckets first (the default dispatcher's budget)",
    )
    ap.add_argument(
        "--fused-routing",
        action="store_true",
        help="moe-layer: time Nvfp4MoE under both routings (torch and fused kernels)",
    )
    ap.add_argument("--configs", nargs="+", default=None, choices=list(grouped.CONFIGS),
                    help="grouped: MoE layers (default: all)")  # fmt: skip
    ap.parse_args(argv, namespace=args)
