"""The ``blackwell`` suite: the acceptance run of the CuTe-DSL families on real hardware.

NOT RUN BY THIS PROJECT: no Blackwell or Rubin GPU was available; these kernels were only
compiled for their targets ("compiled, not run on hardware": ``fp4-dispatch compile ...
--device sm100|sm103|sm107``). A user with a B200, B300 or an SM107 part runs::

    pip install '.[cute]'            # and '.[flashinfer]' for FlashInfer's fi-* families
    python -m benchmarks blackwell --shapes 1,8192,8192 32768,4096,8192

For each shape: cuBLASLt NVFP4 (``torch._scaled_mm`` on e2m1 operands, alpha applied
after, as in our kernels) and every shortlisted tactic of a family that compiles ahead of
time (cute-sm10x, fi-*), built, checked against the float64 reference (NaN-poisoned
output) and timed by the tuner's `Tuner.measure` (CUDA graph, cold L2); ratios to
cuBLASLt. Fails the run if any tactic fails to build, run or match. ``--smoke`` lists
the shortlist of a simulated sm100 (nothing is built or run).
"""

from __future__ import annotations

import torch

from .common import Context, path_rows, tactic_rows

SHAPES = [(1, 8192, 8192), (128, 8192, 8192), (4096, 8192, 8192), (32768, 4096, 8192)]


def acceptance(ctx: Context) -> None:
    from fp4_dispatch import Dispatcher, quantize_nvfp4
    from fp4_dispatch.contracts.tactics import Problem, tactic_label

    d = Dispatcher("sm100" if ctx.smoke else None, cache=False)
    if not ctx.smoke and (d.device.kind != "cuda" or (d.device.cc or 0) < 100):
        ctx.emit([ctx.row("acceptance", clock="host", failure=f"needs a Blackwell/Rubin GPU "
                          f"(sm_100a+); found {d.device.name}")])  # fmt: skip
        return
    failed = 0
    for m, n, k in ctx.args.shapes or SHAPES:
        backends = d.registry.backends
        aot = [c for c in d.candidates(m, n, k).candidates
               if getattr(backends[c.backend], "compiles_ahead_of_time", False)]  # fmt: skip
        if ctx.smoke:
            if not aot:
                ctx.emit([ctx.row("acceptance", m=m, n=n, k=k, clock="host", failure=(
                    "no ahead-of-time family installed (pip install '.[cute]')"))])  # fmt: skip
            ctx.emit(ctx.row("acceptance", backend=c.backend, tactic=tactic_label(c.tactic),
                             m=m, n=n, k=k, clock="host", extra={"est_us": c.est_us})
                     for c in aot)  # fmt: skip
            continue
        g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
        qa, qb = (quantize_nvfp4(torch.randn(r, k, generator=g)).to(d.device.torch_device)
                  .with_layout("swizzled") for r in (m, n))  # fmt: skip
        ref = qa.dequantize().double() @ qb.dequantize().double().T
        out = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
        rows = path_rows(ctx, "acceptance", cublaslt(qa, qb), out, ref, ["graph"],
                         backend="cuBLASLt _scaled_mm nvfp4", m=m, n=n, k=k)  # fmt: skip
        rows += tactic_rows(ctx, "acceptance", d, Problem(m=m, n=n, k=k), aot, "graph")
        base = rows[0].median_us
        for r in rows:
            if base and r.median_us:
                r.ratios["cuBLASLt"] = base / r.median_us
        failed += sum(r.failure is not None for r in rows[1:])
        ctx.emit(rows)
    assert failed == 0, f"{failed} tactic(s) failed to build, run or match"


def cublaslt(qa, qb):
    """cuBLASLt NVFP4 through ``torch._scaled_mm``; alpha applied after, as in our kernels."""
    fp4 = torch.float4_e2m1fn_x2
    a, b, alpha = qa.data.view(fp4), qb.data.view(fp4), qa.global_scale * qb.global_scale

    def run(o: torch.Tensor) -> None:
        torch._scaled_mm(a, b.t(), qa.scale.reshape(-1), qb.scale.reshape(-1),
                         out_dtype=torch.bfloat16, out=o)  # fmt: skip
        o.mul_(alpha)

    return run


ROUTINES = {"acceptance": acceptance}
SMOKE = ("acceptance",)
