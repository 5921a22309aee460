"""``fp4-dispatch doctor``: a small GEMM on every available backend against the reference.

Modelled on tinygrad's device self-check: PASS/FAIL per backend, with the error.
"""

from __future__ import annotations

import argparse
import logging

import torch

from ..backend import GemmOperands
from ..nvfp4 import quantize_nvfp4, reference_gemm
from ..ranking import Candidate
from .common import add_device_args, add_json_arg, emit_json, format_table, make_dispatcher

log = logging.getLogger(__name__)
TOLERANCE = 1e-2  # relative Frobenius error; bf16 output rounding is ~4e-3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="run a small GEMM on every available backend")
    add_device_args(p)
    add_json_arg(p)
    p.add_argument("--shape", default="96,256,512", help="M,N,K of the test GEMM")
    p.set_defaults(func=run)


def check_backend(dispatcher, name: str, m: int, n: int, k: int) -> dict:
    """Quantize random data, run the backend's best tactic, compare with float64."""
    device = torch.device(dispatcher.device.torch_device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device)
    b = torch.randn(n, k, generator=gen).to(device)
    qa, qb = quantize_nvfp4(a), quantize_nvfp4(b)
    ref = reference_gemm(qa, qb)
    shortlist = dispatcher.candidates(m, n, k)
    mine = [c for c in shortlist.candidates if c.backend == name]
    if not mine:
        return {"backend": name, "result": "FAIL", "error": "no valid tactic for the test shape"}
    cand: Candidate = mine[0]
    try:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        alpha = (qa.global_scale * qb.global_scale).reshape(1)
        ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
        dispatcher.run_candidate(cand, ops, out)
        err = float((out.double().cpu() - ref).norm() / ref.norm())
    except Exception as exc:  # reported as FAIL with the error, never hidden
        log.debug("doctor: %s raised", name, exc_info=True)
        return {"backend": name, "result": "FAIL", "error": f"{type(exc).__name__}: {exc}"}
    ok = err == err and err < TOLERANCE  # NaN never passes
    return {
        "backend": name,
        "tactic": cand.tactic.model_dump(mode="json"),
        "rel_error": err,
        "result": "PASS" if ok else "FAIL",
        "error": "" if ok else f"relative error {err:.3g} >= {TOLERANCE}",
    }


def run(args: argparse.Namespace) -> int:
    m, n, k = (int(x) for x in args.shape.split(","))
    d = make_dispatcher(args)
    results = [check_backend(d, b.name, m, n, k) for b in d.available]
    skipped = [s for s in d.backends() if s.status != "available"]
    if args.json:
        emit_json({"device": d.device.name, "shape": [m, n, k], "results": results,
                   "not_run": [s.to_json() for s in skipped]})  # fmt: skip
    else:
        print(f"device: {d.device.name} ({d.device.kind}); GEMM M={m} N={n} K={k}\n")
        rows = [(r["backend"], r["result"], f"{r.get('rel_error', float('nan')):.2e}", r["error"])
                for r in results]  # fmt: skip
        print(format_table(rows, ("backend", "result", "rel. error", "detail")))
        if skipped:
            print("\nnot run here:")
            for s in skipped:
                print(f"  {s.name} [{s.status}] {s.reason}")
    if not results:
        print("no backend is available on this device")
        return 1
    return 0 if all(r["result"] == "PASS" for r in results) else 1
