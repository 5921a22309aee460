"""The grouped NVFP4 GEMM (mixture-of-experts, docs/grouped.md) against bf16
``torch._grouped_mm`` on the same routing and against a loop of dense ``Dispatcher.gemm``
calls, one per expert: the issue 35 targets.

    python3 benchmarks/bench_grouped.py            # GPU; OUT=/dir: $OUT/grouped.jsonl, .md
    python3 benchmarks/bench_grouped.py --tune     # tune each grouped bucket first (graph;
                                                   # --budget 8 tactics a bucket by default)
    python3 benchmarks/bench_grouped.py --smoke    # CPU: a tiny config, interpreter

Configs (per layer, both projections of an expert MLP):

- ``qwen3-30b-a3b``: E = 128 experts, top-8, hidden 2048, expert intermediate 768:
  gate_up N=1536 K=2048, down N=2048 K=768;
- ``deepseek-v3``: E = 256, top-8, hidden 7168, intermediate 2048: gate_up N=4096
  K=7168, down N=7168 K=2048.

Tokens 1, 16, 64 (decode: tokens x 8 rows) and 4096 (prefill). Routing: each token picks
8 distinct experts uniformly at random (seeded), rows sorted by expert, int32 offsets on
the device (empty experts included, as real decode routing has). Per case:

1. ``grouped-w4a16``: `Dispatcher.grouped_gemm` with bf16 rows (the dispatcher's pick:
   the heuristic, or the tuned winner with ``--tune``); its output, poisoned with NaN
   first, against the float64 per-expert reference on sampled rows and columns
   (`grouped.reference_output`): relative error <= 1e-2 (the dense W4A16 tolerance),
   else the row records the error and no time;
2. ``bf16-grouped-mm``: ``torch._grouped_mm(a, W.transpose(-2, -1), offs=offsets)``
   with the dequantized weights in bf16 ``[E, N, K]`` (same offsets);
3. ``dense-loop``: ``Dispatcher.gemm`` (W4A16) once per expert with rows, on that
   expert's row slice (slices fixed outside the timing: a real loop would also read the
   offsets, one synchronisation, not counted).

Clocks: GPU time in CUDA graphs with the L2 flushed before every call
(`harness.gpu_time_us`) and eager host wall per call (`harness.eager_wall_us`). Ratios:
``vs_bf16`` = bf16 time / grouped time (> 1: NVFP4 faster), ``vs_loop`` likewise.
Targets (issue 35, H200): vs_bf16 >= 2.0 at decode (<= 64 tokens), >= 1.0 at 4096;
vs_loop >= 5 at decode.

Weights are random NVFP4 bytes with exact power-of-two scales
(`harness.random_experts`: quantizing 256 x 4096 x 7168 normals would take longer than
the measurement); the weight values do not change a GEMM's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import markdown_table, num, ratio, write_text

from fp4_dispatch import Dispatcher
from fp4_dispatch.backend import GroupedOperands
from fp4_dispatch.backends.reference import dequantize_operand
from fp4_dispatch.grouped import Nvfp4Experts, reference_output
from fp4_dispatch.harness import check_indices, eager_wall_us, random_experts, time_us
from fp4_dispatch.tactics import tactic_label

#: name -> (E, top-k, hidden, expert intermediate)
CONFIGS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}
TOKENS = (1, 16, 64, 4096)
SMOKE_CONFIGS = {"tiny": (8, 2, 64, 32)}
SMOKE_TOKENS = (1, 4)
RTOL = 1e-2


def projections(hidden: int, inter: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of an expert MLP's two grouped GEMMs (gate and up fused)."""
    return [("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def routing(tokens: int, experts: int, top_k: int, device: torch.device, seed: int):
    """int32 offsets ``[E]`` of `tokens` x `top_k` rows, each token on `top_k` distinct
    experts drawn uniformly (seeded): rows sorted by expert."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(picks.flatten(), minlength=experts)
    return counts.cumsum(0).to(torch.int32).to(device)


def make_experts(e: int, n: int, k: int, device: torch.device, seed: int) -> Nvfp4Experts:
    gen = torch.Generator(device=device).manual_seed(seed)
    data, scale, g = random_experts(e, n, k, device, gen)
    return Nvfp4Experts(data, scale, g, (e, n, k))


def bf16_weights(b: Nvfp4Experts) -> torch.Tensor:
    """``[E, N, K]`` bf16 of the dequantized experts (exact), one expert at a time."""
    out = torch.empty(b.shape, dtype=torch.bfloat16, device=b.device)
    for e in range(b.experts):
        w = dequantize_operand(b.data[e], b.scale[e], torch.float32) * b.global_scale[e]
        out[e] = w.to(torch.bfloat16)
    return out


def check(d: Dispatcher, a, b: Nvfp4Experts, off, out) -> str | None:
    """Why the grouped output is wrong on sampled rows/columns (None when right)."""
    out.fill_(math.nan)
    d.grouped_gemm(a, b, off, out=out)
    ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
    rows, cols = check_indices(a.shape[0], b.n, b.k, torch.device("cpu"))
    ref = reference_output(ops, rows, cols)
    got = out.index_select(0, rows.to(out.device)).index_select(1, cols.to(out.device))
    got = got.double().cpu()
    if not bool(torch.isfinite(got).all()):
        return "NaN/inf (unwritten) in the checked output"
    err = float((got - ref).norm() / ref.norm())
    return None if err <= RTOL else f"relative error {err:.3g} > {RTOL}"


def measure(fn, device: torch.device, smoke: bool) -> tuple[float, float]:
    """(GPU µs in a graph with a cold L2, eager wall µs per call); on a CPU wall twice."""
    fn()  # warm: plans, compiles
    if smoke:
        t = time_us(fn, device, calls=4)
        return t, t
    return time_us(fn, device), eager_wall_us(fn, calls=50, warmup=5)


def run_case(d, cfg_name, cfg, proj, tokens, device, smoke, tune) -> list[dict]:
    e, top_k = cfg[0], cfg[1]
    name, n, k = proj
    seed = zlib.crc32(f"{cfg_name} {name} {tokens}".encode())  # stable across processes
    b = make_experts(e, n, k, device, seed)
    off = routing(tokens, e, top_k, device, seed)
    t = tokens * top_k
    a = torch.randn(t, k, device=device).to(torch.bfloat16)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
    touched = int((torch.diff(off.cpu(), prepend=torch.zeros(1, dtype=torch.int32)) > 0).sum())
    base = {"config": cfg_name, "proj": name, "tokens": tokens, "rows": t, "E": e, "N": n,
            "K": k, "touched": touched}  # fmt: skip
    rows = []
    if tune:
        d.tune([(t, n, k)], operation="grouped_w4a16", groups=e, measure="graph",
               progress=False)  # fmt: skip
    why = check(d, a, b, off, out)
    pick = d.select(t, n, k, "bfloat16", "grouped_w4a16", e)
    row = {**base, "variant": "grouped-w4a16", "backend": pick.backend,
           "tactic": tactic_label(pick.tactic), "error": why}  # fmt: skip
    if why is None:
        row["gpu_us"], row["eager_us"] = measure(
            lambda: d.grouped_gemm(a, b, off, out=out), device, smoke
        )
    rows.append(row)

    wt = bf16_weights(b).transpose(-2, -1)  # [E, K, N] view of [E, N, K]: torch's layout

    def bf16() -> torch.Tensor:
        return torch._grouped_mm(a, wt, offs=off)

    try:
        gpu, eager = measure(bf16, device, smoke)
        rows.append({**base, "variant": "bf16-grouped-mm", "gpu_us": gpu, "eager_us": eager,
                     "error": None})  # fmt: skip
    except Exception as exc:  # an unsupported dtype/arch is a finding, not a crash
        rows.append({**base, "variant": "bf16-grouped-mm", "error": f"{type(exc).__name__}: "
                     f"{exc}"[:300]})  # fmt: skip

    ends = off.cpu().tolist()
    slices = [(s, en, b.expert(i)) for i, (s, en) in enumerate(zip([0, *ends], ends, strict=False))
              if en > s]  # fmt: skip

    def loop() -> None:
        for s, en, w in slices:
            d.gemm(a[s:en], w, out=out[s:en])

    gpu, eager = measure(loop, device, smoke)
    rows.append({**base, "variant": "dense-loop", "gpu_us": gpu, "eager_us": eager,
                 "gemms": len(slices), "error": None})  # fmt: skip
    grouped = rows[0].get("gpu_us", math.nan)
    for r in rows[1:]:
        r_us = r.get("gpu_us", math.nan)
        key = "vs_bf16" if r["variant"] == "bf16-grouped-mm" else "vs_loop"
        rows[0][key] = r_us / grouped if grouped and math.isfinite(grouped) else None
    return rows


def table(rows: list[dict]) -> str:
    heads = ["config", "proj", "tokens", "E touched", "grouped GPU µs", "bf16 GPU µs",
             "loop GPU µs", "vs bf16", "vs loop", "grouped eager µs", "pick"]  # fmt: skip
    lines = []
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["config"], r["proj"], r["tokens"]), {})[r["variant"]] = r
    for (cfg, proj, tokens), v in by_case.items():
        g, bf = v.get("grouped-w4a16", {}), v.get("bf16-grouped-mm", {})
        lp = v.get("dense-loop", {})
        nan = math.nan
        lines.append([cfg, proj, tokens, f"{g.get('touched')}/{g.get('E')}",
                      num(g.get("gpu_us", nan)), num(bf.get("gpu_us", nan)),
                      num(lp.get("gpu_us", nan)),
                      ratio(bf.get("gpu_us", nan), g.get("gpu_us", nan)),
                      ratio(lp.get("gpu_us", nan), g.get("gpu_us", nan)),
                      num(g.get("eager_us", nan)),
                      g.get("error") or f"{g.get('backend')} {g.get('tactic')}"])  # fmt: skip
    return markdown_table(heads, lines, "lllrrrrrrrl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny config, interpreter")
    p.add_argument("--tune", action="store_true", help="tune each grouped bucket first")
    p.add_argument("--budget", type=int, default=8,
                   help="tactics a bucket's tuning measures (the dispatcher's budget)")  # fmt: skip
    p.add_argument("--configs", nargs="*", default=None, help=f"subset of {list(CONFIGS)}")
    p.add_argument("--tokens", nargs="*", type=int, default=None)
    args = p.parse_args()
    if args.smoke:
        device, configs, tokens = torch.device("cpu"), SMOKE_CONFIGS, SMOKE_TOKENS
        d = Dispatcher("cpu", cache=False)
        label = "cpu (smoke)"
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU: run with --smoke on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        configs = {k: CONFIGS[k] for k in (args.configs or CONFIGS)}
        tokens = tuple(args.tokens or TOKENS)
        d = Dispatcher(budget=args.budget)
        label = torch.cuda.get_device_name()
    stamp = {"device": label, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "command": " ".join(["python3", *sys.argv])}  # fmt: skip
    rows: list[dict] = []
    for cfg_name, cfg in configs.items():
        for proj in projections(cfg[2], cfg[3]):
            for t in tokens:
                for r in run_case(d, cfg_name, cfg, proj, t, device, args.smoke, args.tune):
                    rows.append({**r, **stamp})
                    print(json.dumps(rows[-1], default=str), flush=True)
    write_text("grouped.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
    md = table(rows)
    write_text("grouped.md", md + "\n")
    print(md)
    return 0 if all(r.get("error") is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
