"""H200: the register-sourced wgmma W4A16 kernel (`gemm_w4a16_rs`) against ws, bf16 and FP8.

    python3 benchmarks/bench_w4a16_rs.py --ms 64 128 192 256  # OUT=/dir: $OUT/w4a16_rs.json
    python3 benchmarks/bench_w4a16_rs.py --smoke              # CPU: the activation pass only

Grid: M of ``--ms`` x `bench_w4a16_decode.NK` (the issue's (N, K)). Per shape, in one run:

1. bf16 cuBLAS and FP8 cuBLASLt on the dequantized weight (`bench_w4a16_decode.baselines`);
2. every `RS_CONFIGS` variant of the kernel for that M: its output (poisoned with NaN
   first) against float64 (relative error <= 1e-2, else failed and not timed), then the
   GPU time of a whole call (the activation pass and the GEMM), of the GEMM alone on
   activations already in the dot's order, and the eager wall time per call;
3. the activation pass alone, and the `WS_CONFIGS` of ``triton-sm90-ws`` (the kernel this
   one competes with at these M), timed the same way;
4. ``Dispatcher().gemm(x, w)`` untuned (its pick among every W4A16 backend: rs, ws,
   direct, unpack): the pick, GPU time and eager wall per call.

GPU time: CUDA graph, L2 flushed before every call (`harness.gpu_time_us`); eager: back to
back calls, one synchronisation (`harness.eager_wall_us`). The ``triton-sm90-rs`` backend
offers the specialized variants at 64 (4 stages; one or two CTAs an SM), 128 and 256
tokens (3 stages). M = 192 is held out of the ``fit_w4a16_model.py --rs`` fit, as M = 128.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from _common import smoke_or_sm90, write_json
from bench_w4a16_decode import NK, TOL, Shape, baselines, eager, rel_err, timed
from bench_w4a16_ws import dispatcher_row

from fp4_dispatch import Dispatcher

#: (block_m, split_k, stages, specialized, ctas_per_sm) timed per M: every offered tactic
#: of ``triton-sm90-rs``, what the two-CTA budget would give below one wave, and splits
#: over one wave. Run 9 also timed the single-partition variant and other stage counts
#: (sm90_w4a16_rs_run9_final.json)
RS_CONFIGS = {
    64: [(64, s, 4, True, c) for s in (1, 2, 3, 4) for c in (1, 2)],
    128: [(128, s, 3, True, 1) for s in (1, 2, 3, 4)]
    + [(64, s, 4, True, c) for s in (1, 2, 3, 4) for c in (1, 2)],
    192: [(t, s, 3, True, 1) for t in (128, 256) for s in (1, 2, 3, 4)],
    256: [(t, s, 3, True, 1) for t in (128, 256) for s in (1, 2, 3, 4)],
}  # fmt: skip
#: (block_m, split_k) of the ws kernel per M (run 6's best tactics at these M)
WS_CONFIGS = {64: [(64, 1), (64, 2), (64, 3)], 128: [(128, 1), (128, 2)],
              192: [(64, 1), (64, 2), (128, 1), (128, 2)], 256: [(128, 1)]}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ms = sorted(RS_CONFIGS)
    p.add_argument("--ms", type=int, nargs="+", default=ms, choices=ms)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting shapes after")
    p.add_argument("--smoke", action="store_true", help="CPU: check the activation pass only")
    return p.parse_args(argv)


def config_name(cfg: tuple[int, int, int, bool, int]) -> str:
    bm, split, stages, spec, ctas = cfg
    name = f"{bm} tokens, split {split}, {stages} stages" + (", specialized" if spec else "")
    return name + (f", {ctas} CTAs an SM" if ctas > 1 else "")


def measure_rs(s: Shape, cfg: tuple[int, int, int, bool, int]) -> dict:
    """Check, then time one variant on `s` (an exception is recorded, never fatal)."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    bm, split, stages, spec, ctas = cfg
    entry: dict = {}
    try:
        kern = rs.build(rs.RsConfig(block_m=bm, split_k=split, stages=stages, specialized=spec,
                                    ctas_per_sm=ctas))  # fmt: skip
        s.out.fill_(math.nan)
        kern(s.ops, s.out)
        entry["rel_err"] = rel_err(s.out, s.ref)
        if entry["rel_err"] <= TOL:
            run = lambda: kern(s.ops, s.out)  # noqa: E731
            xp = kern.permute_activations(s.x).clone()
            entry["us"] = timed(run, s.device)
            entry["gemm_us"] = timed(lambda: kern.launch(xp, s.ops, s.out), s.device)
            entry["eager_us"] = eager(run, s.device)
    except Exception as exc:  # recorded: the table says failed
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return entry


def measure_shape(m: int, n: int, k: int, device: torch.device, dispatcher: Dispatcher) -> dict:
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    s = Shape(m, n, k, device, torch.bfloat16)
    row: dict = {"m": m, "n": n, "k": k, **baselines(s), "rs": {}, "ws": {}}
    for cfg in RS_CONFIGS[m]:
        row["rs"][config_name(cfg)] = measure_rs(s, cfg)
    kern = rs.build(rs.RsConfig(block_m=64))
    row["pass_us"] = timed(lambda: kern.permute_activations(s.x), device)
    for bm, split in WS_CONFIGS[m]:
        row["ws"][f"{bm} tokens, split {split}"] = measure_ws(s, bm, split)
    row.update(dispatcher_row(s, dispatcher))
    return row


def measure_ws(s: Shape, block_m: int, split: int) -> dict:
    """One ws tactic on `s`: its error, GPU time and eager wall per call."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_ws as ws

    kern = ws.build(ws.WsConfig(block_m=block_m, split_k=split))
    s.out.fill_(math.nan)
    kern(s.ops, s.out)
    run = lambda: kern(s.ops, s.out)  # noqa: E731
    return {"rel_err": rel_err(s.out, s.ref), "us": timed(run, s.device),
            "eager_us": eager(run, s.device)}  # fmt: skip


def best(entries: dict, key: str = "us") -> tuple[str, dict] | None:
    timed_ = [(name, e) for name, e in entries.items() if key in e]
    return min(timed_, key=lambda ne: ne[1][key]) if timed_ else None


def summary(row: dict) -> str:
    b, w = best(row["rs"]), best(row["ws"])
    g = best(row["rs"], "gemm_us")
    text = f"{row['m']}x{row['n']}x{row['k']}: bf16 {row['bf16_us']:.1f} fp8 {row['fp8_us']:.1f}"
    if w:
        text += f" | ws {w[1]['us']:.1f}"
    if b:
        text += f" | rs {b[1]['us']:.1f} ({b[0]}) gemm alone {g[1]['gemm_us']:.1f} ({g[0]})"
    failed = [n for n, e in row["rs"].items() if "us" not in e]
    text += f" | pass {row['pass_us']:.1f} | gemm() {row['dispatcher_us']:.1f} "
    text += f"(eager {row['dispatcher_eager_us']:.1f}) {row['dispatcher_pick']}"
    return text + (f" | failed: {failed}" if failed else "")


def smoke() -> int:
    """CPU: the activation pass under the interpreter against the host permutation."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import dot_order

    a = torch.randn(5, 256).to(torch.float16)
    out = rs.dot_order_into(a, torch.empty_like(a))
    ok = bool(torch.equal(out, dot_order(a)))
    write_json("w4a16_rs.json", {"smoke": True, "pass_matches": ok})
    print(f"activation pass matches the host permutation: {ok}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := smoke_or_sm90(args.smoke, smoke)) is not None:
        return code
    device = torch.device("cuda")
    dispatcher = Dispatcher(cache=False)  # untuned: its heuristic pick
    t0, rows = time.time(), []
    for m in args.ms:
        for n, k in NK:
            if time.time() - t0 > args.budget_s:
                print(f"budget spent: {m}x{n}x{k} and later shapes not run", flush=True)
                continue
            rows.append(measure_shape(m, n, k, device, dispatcher))
            print(summary(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__}  # fmt: skip
    write_json("w4a16_rs.json", {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
