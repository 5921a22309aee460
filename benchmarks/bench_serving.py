"""Serving benchmark: what swapping nn.Linear for Nvfp4Linear costs or gains, per call.

One device call (H200), the way users run, in one process, beside bf16 cuBLAS and FP8
cuBLASLt from the same run. For (N, K) in {4096x4096, 8192x8192, 13824x5120} and
M in {1, 16, 256, 4096}:

- quantize: `quantize_nvfp4(x)` of a bf16 [M, K] activation - GPU time per call in a
  CUDA graph with a cold L2, and eager wall per call (`fp4_dispatch.harness`);
- GEMM call overhead: `Dispatcher.gemm` eager wall vs `torch._scaled_mm` (FP8, per-tensor
  scales) eager wall, and both GPU times (cold L2) beside bf16 `x @ w.T`;
- the layer: `Nvfp4Linear` vs bf16 `nn.Linear` - eager wall and CUDA-graph replay
  (GPU time, cold L2), with the relative error of Nvfp4Linear against float64.

The dispatcher runs its heuristic pick unless ``--tune`` (then each bucket is tuned
first, for both operations; the tuning wall time is reported); ``--ms 1 16`` limits M.
Writes ``$OUT/serving.json`` (or ``--out``) and prints a table last. ``--smoke`` runs a
tiny CPU version (script check; times mean nothing).

Run on the H200::

    python benchmarks/bench_serving.py [--tune]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from fp4_dispatch import Dispatcher, dequantize, quantize_nvfp4, reference_gemm
from fp4_dispatch.harness import eager_wall_samples, gpu_time_us, relative_error
from fp4_dispatch.nn import Nvfp4Linear
from fp4_dispatch.tactics import tactic_label

NK = ((4096, 4096), (8192, 8192), (13824, 5120))
MS = (1, 16, 256, 4096)
SMOKE_NK, SMOKE_MS = ((256, 256),), (1, 16)

log = logging.getLogger("bench_serving")


def _wall(fn) -> float:
    """Eager wall µs per call: the median of 5 samples of 200 back-to-back calls, each
    synchronised once at the end. One sample is fragile on the shared H200 host: one
    device call read 37.3 µs here and 23.0 µs in bench_launch_overhead.py for the same
    one-row quantize; a stray pause lands in one sample, not in the median."""
    return statistics.median(eager_wall_samples(fn, calls=200, warmup=50, replays=5))


def _timed(what: str, fn) -> float | None:
    """`fn()` or None when it cannot run (recorded in the log, never hidden)."""
    try:
        return fn()
    except Exception as exc:  # a baseline that does not run here is a row with a gap
        log.warning("%s: %s: %s", what, type(exc).__name__, exc)
        return None


def fp8_operands(x: torch.Tensor, w: torch.Tensor):
    """Per-tensor e4m3 operands and scales for `torch._scaled_mm` (cuBLASLt FP8)."""
    f8 = torch.float8_e4m3fn
    sx = (x.abs().amax().float() / 448).clamp(min=1e-12)
    sw = (w.abs().amax().float() / 448).clamp(min=1e-12)
    return (x / sx).to(f8), (w / sw).to(f8), sx, sw


def gpu_us(fn, device: torch.device, smoke: bool) -> float | None:
    if smoke:
        return None
    return gpu_time_us(fn, device=device)


def one_shape(d: Dispatcher, m: int, n: int, k: int, device, smoke: bool, tune: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    row: dict = {"m": m, "n": n, "k": k}
    tune_s = None
    if tune and not smoke:
        t0 = time.perf_counter()
        d.tune([(m, n, k)])  # the GEMM call's W4A4 and the layer's W4A16 (its op on Hopper)
        d.tune([(m, n, k)], operation="w4a16")
        tune_s = time.perf_counter() - t0
    row["tune_s"] = tune_s

    # quantize
    row["quant_wall_us"] = _wall(lambda: quantize_nvfp4(x))
    row["quant_gpu_us"] = _timed(
        "quantize graph", lambda: gpu_us(lambda: quantize_nvfp4(x), device, smoke)
    )

    # GEMM call: dispatcher vs cuBLASLt FP8 vs cuBLAS bf16
    qa, qb = quantize_nvfp4(x), quantize_nvfp4(w)
    out = d.gemm(qa, qb)
    row["pick"] = d.select(m, n, k).backend
    row["gemm_rel_err"] = relative_error(out, reference_gemm(qa, qb))
    row["gemm_wall_us"] = _wall(lambda: d.gemm(qa, qb))
    row["gemm_gpu_us"] = _timed("gemm graph", lambda: gpu_us(lambda: d.gemm(qa, qb), device, smoke))
    row["bf16_gpu_us"] = _timed("bf16 graph", lambda: gpu_us(lambda: x @ w.T, device, smoke))
    if device.type == "cuda":
        x8, w8, sx, sw = fp8_operands(x, w)

        def fp8():
            return torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16)

        row["fp8_wall_us"] = _timed("fp8 eager", lambda: _wall(fp8))
        row["fp8_gpu_us"] = _timed("fp8 graph", lambda: gpu_us(fp8, device, smoke))

    # the layer
    lin = nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    q = Nvfp4Linear.from_linear(lin, dispatcher=d)
    with torch.inference_mode():
        y = q(x)
        row["linear_op"] = q.operation(x.device)  # "auto": W4A16 on Hopper, W4A4 on sm100+
        lp = d.select(m, n, k, "bfloat16", row["linear_op"])
        row["linear_pick"] = f"{lp.backend} {tactic_label(lp.tactic)}"
        # whether the layer keeps (and hands its kernel) the sm90-prepared weight copy
        row["linear_prepared"] = q.__dict__.get("_prepared_cache") is not None
        xa = dequantize(quantize_nvfp4(x)) if row["linear_op"] == "w4a4" else x
        ref = xa.double() @ q.dequantized_weight().double().T + lin.bias.double()
        row["linear_rel_err"] = relative_error(y, ref)
        row["linear_wall_us"] = _wall(lambda: q(x))
        row["bf16_linear_wall_us"] = _wall(lambda: lin(x))
        row["linear_gpu_us"] = _timed("linear graph", lambda: gpu_us(lambda: q(x), device, smoke))
        row["bf16_linear_gpu_us"] = _timed(
            "bf16 linear graph", lambda: gpu_us(lambda: lin(x), device, smoke)
        )
    return row


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = (
        "| M | N x K | pick (W4A4) | Linear op | quant GPU µs | quant wall µs | gemm wall µs "
        "| fp8 wall µs | gemm GPU µs | bf16 GPU | fp8 GPU | Linear graph µs | bf16 Linear graph "
        "| graph ratio | Linear wall µs | bf16 Linear wall | wall ratio | rel err | Linear pick |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['m']} | {r['n']}x{r['k']} | {r['pick']} | {r['linear_op']} "
            f"| {num(r['quant_gpu_us'], 2)} "
            f"| {num(r['quant_wall_us'])} | {num(r['gemm_wall_us'])} | {num(r.get('fp8_wall_us'))} "
            f"| {num(r['gemm_gpu_us'])} | {num(r['bf16_gpu_us'])} | {num(r.get('fp8_gpu_us'))} "
            f"| {num(r['linear_gpu_us'])} | {num(r['bf16_linear_gpu_us'])} "
            f"| {ratio(r['linear_gpu_us'], r['bf16_linear_gpu_us'])} "
            f"| {num(r['linear_wall_us'])} | {num(r['bf16_linear_wall_us'])} "
            f"| {ratio(r['linear_wall_us'], r['bf16_linear_wall_us'])} "
            f"| {r['linear_rel_err']:.2e} | {r['linear_pick']}"
            f"{' (prepared)' if r['linear_prepared'] else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help="tune each bucket before timing")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for serving.json")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help=f"M values (default {MS})")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    d = Dispatcher(device=str(device), cache=False)
    nk, ms = (SMOKE_NK, SMOKE_MS) if smoke else (NK, tuple(args.ms or MS))
    rows = []
    for n, k in nk:
        for m in ms:
            rows.append(one_shape(d, m, n, k, device, smoke, args.tune))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    meta = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "tuned": args.tune,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "serving.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print(table(rows))
    bad = [r for r in rows if not (r["linear_rel_err"] < 2e-2 and r["gemm_rel_err"] < 1e-2)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
