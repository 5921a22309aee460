"""H200: what bounds the W4A16 targets still missed: L2, fixed costs, bytes in flight.

    python3 benchmarks/bench_limits.py            # OUT=/dir: also $OUT/limits.json
    python3 benchmarks/bench_limits.py --smoke    # CPU: tiny sizes, interpreter

Four measurements, one device call:

1. **L2 read ceiling.** Every program of `_l2_read_kernel` reads the same 4 MiB buffer
   (``ld.global.cg``: L2 to the SM, no L1; checked against the XOR of its blocks), as
   every CTA of a W4A16 GEMM reads the activations of its token tile. Bytes delivered
   per second, warm L2, for 1-16 programs an SM; the best is the ceiling.
2. **The rs GEMM's L2 traffic** (``triton-sm90-rs``, the GEMM alone on activations already
   in the dot's order). Its TMA boxes are known from the tactic (`rs_l2_bytes`: every CTA
   loads every K step's weight bytes, scales and activation tile once), so the bytes it
   moves from L2 over its measured time is a rate to hold against the ceiling, beside
   the time the MMA alone would take at the tensor peak (`TENSOR_PEAK_FLOPS`).
3. **Fixed cost by a K sweep.** For the untuned pick of each missed shape (M, N, K), the
   same kernel object at the K of `K_SWEEP` and the shape's own: a least-squares line
   ``t = fixed + slope * K`` (`fit_line`), the same for bf16 cuBLAS and FP8 cuBLASLt, so
   a kernel's fixed cost (launch, first loads, epilogue, split-K sum) and its streaming
   rate (weight bytes per µs of the slope) are read apart; with the eager wall time per
   call of the pick, bf16 and FP8 at every K.
4. **More bytes in flight at decode** (``--sections pipes``). The ``triton-sm90-mma``
   kernel with 8 tokens and 16 rows a warp, as offered (4 K ranges a CTA, L2 prefetch 2
   steps ahead, two steps' loads together), against deeper prefetch (3, 4) and 8 K ranges
   a CTA (twice the warps an SM), split-K 1 and 2 (`PIPES`), on `PIPE_SHAPES`.

GPU time: CUDA graph, L2 flushed before every call (`harness.gpu_time_us`; the ceiling of
1. with a warm L2); eager: back-to-back calls, one synchronisation at the end
(`harness.eager_wall_us`). Every GEMM output is checked against float64 first (poisoned
with NaN; relative error <= 1e-2, else not timed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl
from _common import markdown_table, num, ratio, smoke_or_sm90, write_json
from bench_w4a16_decode import TOL, Shape, baselines, check_and_time, eager, rel_err, timed

from fp4_dispatch import Dispatcher
from fp4_dispatch.harness import gpu_time_us
from fp4_dispatch.tactics import Problem

#: the buffer every program reads: the activations of 256 tokens x K = 8192 in bf16
L2_BUFFER_BYTES = 4 << 20
#: bytes one program reads a loop iteration (int32 x 2048: four 16-byte loads a thread)
L2_BLOCK = 2048
PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
#: dense bf16 tensor-core peak of the H200 (NVIDIA's datasheet: 989 TFLOPS without
#: sparsity), for the MMA-alone time of section 2
TENSOR_PEAK_FLOPS = 989e12
#: (M, N, K, token tile, split-K, CTAs an SM) of section 2: the M = 256 shapes' rs tactics
#: of run 11 (one wave and more), and one M = 64 tactic for contrast
RS_TACTICS = (
    (256, 8192, 8192, 256, 1, 1),
    (256, 8192, 8192, 256, 2, 1),
    (256, 8192, 8192, 128, 1, 1),
    (256, 8192, 8192, 128, 2, 1),
    (256, 13824, 5120, 256, 1, 1),
    (256, 10240, 8192, 256, 1, 1),
    (256, 10240, 8192, 256, 3, 1),
    (256, 5120, 5120, 256, 3, 1),
    (256, 18944, 3584, 128, 1, 1),
    (64, 8192, 8192, 64, 4, 2),
)
#: the W4A16 shapes that miss their target (RESULTS.md "Hopper W4A16" run 12), section 3
MISSED = (
    (1, 5120, 5120),
    (1, 4608, 3584),
    (16, 5120, 5120),
    (16, 4608, 3584),
    (16, 8192, 8192),
    (64, 5120, 5120),
    (64, 4608, 3584),
    (64, 18944, 3584),
)
K_SWEEP = (1024, 2048, 4096, 8192)
#: section 4: (K ranges a CTA, L2 prefetch steps, unroll) of the mma kernel; the first is
#: the offered (8, 16, 4, 2, 2) of ``plugins/sm90/mma.py``
PIPES = ((4, 2, 2), (4, 4, 2), (4, 4, 1), (4, 3, 2), (8, 0, 1), (8, 2, 1), (8, 2, 2),
         (8, 4, 2), (8, 4, 1))  # fmt: skip
PIPE_SHAPES = ((1, 5120, 5120), (1, 4608, 3584), (1, 6144, 4096), (1, 8192, 8192),
               (1, 13824, 5120), (4, 5120, 5120), (8, 6144, 4096), (8, 4096, 14336))  # fmt: skip


@triton.jit
def _l2_read_kernel(src_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
    """Each program reads all ``n_blocks`` blocks of ``src`` once, starting at its own
    block (the programs spread over the L2 slices), and stores the XOR of what it read."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(n_blocks):
        b = (i + pid) % n_blocks
        acc ^= tl.load(src_ptr + b * BLOCK + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def l2_read(src: torch.Tensor, programs: int) -> torch.Tensor:
    """One launch of `_l2_read_kernel` over int32 `src` with `programs` programs."""
    out = torch.empty(programs * L2_BLOCK, dtype=torch.int32, device=src.device)
    _l2_read_kernel[(programs,)](src, out, src.numel() // L2_BLOCK, BLOCK=L2_BLOCK, num_warps=4)
    return out


def l2_ceiling(device: torch.device, sms: int, buffer_bytes: int) -> list[dict]:
    """Section 1: GB/s delivered from L2 for each of `PROGRAMS_PER_SM` (warm L2)."""
    src = torch.randint(-(2**30), 2**30, (buffer_bytes // 4,), dtype=torch.int32, device=device)
    want = torch.zeros(L2_BLOCK, dtype=torch.int32, device=device)
    for block in src.view(-1, L2_BLOCK):
        want ^= block
    want = want.cpu()
    rows = []
    for per_sm in PROGRAMS_PER_SM:
        programs = per_sm * sms
        # every program reads every block once: each lane holds the XOR of its column
        got = l2_read(src, programs).view(programs, L2_BLOCK).cpu()
        same = bool((got == want).all())
        run = lambda p=programs: l2_read(src, p)  # noqa: E731
        if device.type == "cuda":
            us = gpu_time_us(run, cold_l2=False, device=device)
        else:
            us = timed(run, device)
        moved = programs * buffer_bytes
        rows.append({"programs_per_sm": per_sm, "programs": programs, "us": us,
                     "bytes": moved, "gb_s": moved / us / 1e3, "correct": same})  # fmt: skip
    return rows


def rs_l2_bytes(m: int, n: int, k: int, block_m: int) -> int:
    """Bytes a ``triton-sm90-rs`` GEMM loads from L2 by TMA (`gemm_w4a16_rs`): each of its
    ``ceil(N / 128) x ceil(M / block_m)`` tiles loads, every 128-wide K step, the weight
    bytes [128, 64], two 512-byte scale chunks and the activations [block_m, 128] in bf16
    (token rows past M are zero-filled by TMA and read nothing). Split-K divides the steps
    between CTAs, not the bytes."""
    tiles_n, tiles_m = -(-n // 128), -(-m // block_m)
    weights = 128 * 64 + 2 * 512  # a tile's weight bytes and scales a step
    return tiles_n * (k // 128) * (tiles_m * weights + m * 128 * 2)


def rs_traffic(device: torch.device, tactics) -> list[dict]:
    """Section 2: each rs tactic's GEMM alone, its L2 bytes and rate."""
    return [rs_row(device, *t) for t in tactics]


def rs_row(device: torch.device, m: int, n: int, k: int, bm: int, split: int, ctas: int) -> dict:
    """One rs tactic: checked, then the GEMM alone timed; bf16 and FP8 of the shape."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    s = Shape(m, n, k, device, torch.bfloat16)
    row: dict = {"m": m, "n": n, "k": k, "block_m": bm, "split_k": split, "ctas_per_sm": ctas}
    kern = rs.build(rs.RsConfig(block_m=bm, split_k=split, stages=4 if bm == 64 else 3,
                                specialized=True, ctas_per_sm=ctas))  # fmt: skip
    s.out.fill_(math.nan)
    kern(s.ops, s.out)
    row["rel_err"] = rel_err(s.out, s.ref)
    if row["rel_err"] <= TOL:
        xp = kern.permute_activations(s.x).clone()
        row["gemm_us"] = timed(lambda: kern.launch(xp, s.ops, s.out), device)
        row["l2_bytes"] = rs_l2_bytes(m, n, k, bm)
        row["l2_gb_s"] = row["l2_bytes"] / row["gemm_us"] / 1e3
        row["mma_peak_us"] = 2 * (-(-m // bm) * bm) * n * k / TENSOR_PEAK_FLOPS * 1e6
        base = baselines(s)
        row.update(bf16_us=base["bf16_us"], fp8_us=base["fp8_us"])
    return row


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b). Needs two distinct x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError(f"xs: expected two distinct values, got {xs}")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def fixed_cost(device: torch.device, shapes, ks, dispatcher: Dispatcher) -> list[dict]:
    """Section 3: per shape, the untuned pick's kernel at every K of `ks` and the shape's
    own (and its twin with one split, `split_twin`); bf16 and FP8 the same; each a fitted
    line. For an rs pick also its two launches apart: the activations' pass and the GEMM."""
    rows = []
    for m, n, k in shapes:
        problem = Problem(m=m, n=n, k=k, out_dtype="bfloat16", operation="w4a16")
        pick = dispatcher.select(m, n, k, operation="w4a16")
        kernel = dispatcher.kernel_for(pick, problem)
        twin = split_twin(pick.backend, kernel)
        row: dict = {"m": m, "n": n, "k": k, "points": [],
                     "pick": f"{pick.backend} {pick.tactic.canonical_json()}"}  # fmt: skip
        row["points"] = [k_point(kernel, twin, m, n, kk, device) for kk in sorted({*ks, k})]
        row.update(fit_points(row["points"]))
        fit = row.get("fit_us")
        if fit and fit["us_per_1k_k"] > 0:  # weight bytes (0.5625 a value) per µs of slope
            row["stream_gb_s"] = n * 1024 * (0.5 + 1 / 16) / fit["us_per_1k_k"] / 1e3
        rows.append(row)
    return rows


def split_twin(backend: str, kernel):
    """The pick's kernel with one split (None when it has one already): what its fixed
    cost is without the split-K sum."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    builders = {"triton-sm90-rs": rs.build, "triton-sm90-mma": mm.build,
                "triton-sm90-w4a16": w4.build}  # fmt: skip
    cfg = getattr(kernel, "cfg", None)
    if backend not in builders or cfg is None or cfg.split_k == 1:
        return None
    return builders[backend](replace(cfg, split_k=1))


def k_point(kernel, twin, m: int, n: int, k: int, device: torch.device) -> dict:
    """`kernel` at (M, N, K): checked, timed (and `twin`, and an rs kernel's two launches
    apart); bf16 and FP8 at the same shape."""
    s = Shape(m, n, k, device, torch.bfloat16)
    point: dict = {"k": k}
    for name, kern in (("us", kernel), ("split1_us", twin)):
        if kern is not None:
            entry = checked_time(kern, s, device)
            point.update({f"{name}_{key}": v for key, v in entry.items() if key != "us"})
            if "us" in entry:
                point[name] = entry["us"]
    if "us" in point and hasattr(kernel, "permute_activations"):  # rs: pass, GEMM alone
        xp = kernel.permute_activations(s.x).clone()
        point["pass_us"] = timed(lambda: kernel.permute_activations(s.x), device)
        point["gemm_us"] = timed(lambda: kernel.launch(xp, s.ops, s.out), device)
    if "us" in point:
        point["eager_us"] = eager(lambda: kernel(s.ops, s.out), device)
        base = baselines(s)
        point.update({key: base.get(key, math.nan) for key in
                      ("bf16_us", "fp8_us", "bf16_eager_us", "fp8_eager_us")})  # fmt: skip
    return point


def fit_points(points: list[dict]) -> dict:
    """``fit_<column>`` for each timed column (``us``, ``split1_us``, ``pass_us``,
    ``gemm_us``, ``bf16_us``, ``fp8_us``): a line through its points (fixed µs, µs per
    1024 of K), where two K or more were timed."""
    fits = {}
    for name in ("us", "split1_us", "pass_us", "gemm_us", "bf16_us", "fp8_us"):
        pts = [(p["k"], p[name]) for p in points if math.isfinite(p.get(name, math.nan))]
        if len({x for x, _ in pts}) >= 2:
            a, b = fit_line([x for x, _ in pts], [y for _, y in pts])
            fits[f"fit_{name}"] = {"fixed_us": a, "us_per_1k_k": 1024 * b}
    return fits


def pipes(device: torch.device, shapes, variants) -> list[dict]:
    """Section 4: every (K ranges, prefetch, unroll) of `variants` at split-K 1 and 2 on
    each shape, checked then timed; bf16 and FP8 of the shape."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm

    rows = []
    for m, n, k in shapes:
        s = Shape(m, n, k, device, torch.bfloat16)
        base = baselines(s)
        row: dict = {"m": m, "n": n, "k": k, "bf16_us": base["bf16_us"],
                     "fp8_us": base["fp8_us"], "variants": {}}  # fmt: skip
        for warps, prefetch, unroll in variants:
            for split in (1, 2):
                cfg = mm.MmaConfig(block_m=8, warps=warps, split_k=split, block_n=16,
                                   prefetch=prefetch, unroll=unroll)  # fmt: skip
                name = f"{warps} K ranges, prefetch {prefetch}, unroll {unroll}, split {split}"
                row["variants"][name] = checked_time(mm.build(cfg), s, device)
        rows.append(row)
    return rows


def checked_time(kernel, s: Shape, device: torch.device) -> dict:
    """`bench_w4a16_decode.check_and_time` of `kernel` on `s`: ``rel_err`` of a fresh
    output poisoned with NaN (`Shape.check`), ``us`` where it is within `TOL`, ``error``
    if it raised."""
    entry: dict = {}
    check_and_time(entry, lambda: s.check(kernel, s.ops), lambda: kernel(s.ops, s.out), device)
    return entry


def tables(out: dict) -> str:
    """The sections that ran, as markdown tables."""
    makers = (("l2", l2_table), ("rs", rs_table), ("fixed", fixed_table), ("pipes", pipes_table))
    return "\n\n".join(make(out[key]) for key, make in makers if out[key])


def l2_table(rows: list[dict]) -> str:
    return markdown_table(["programs an SM", "programs", "µs", "GB/s"],
                          [[r["programs_per_sm"], r["programs"], num(r["us"]),
                            num(r["gb_s"], ".0f")] for r in rows])  # fmt: skip


def rs_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        body.append([r["m"], f"{r['n']}x{r['k']}", r["block_m"], r["split_k"], r["ctas_per_sm"],
                     num(r.get("gemm_us")), num(r.get("l2_bytes", math.nan) / 1e6, ".0f"),
                     num(r.get("l2_gb_s"), ".0f"), num(r.get("mma_peak_us")),
                     num(r.get("bf16_us")), num(r.get("fp8_us"))])  # fmt: skip
    head = ["M", "N x K", "tokens a tile", "split", "CTAs an SM", "GEMM µs", "L2 MB",
            "L2 GB/s", "MMA at peak µs", "bf16 µs", "FP8 µs"]  # fmt: skip
    return markdown_table(head, body)


def fixed_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        f = {n: r.get(f"fit_{n}", {}) for n in ("us", "bf16_us", "fp8_us")}
        own = next((p for p in r["points"] if p["k"] == r["k"]), {})
        body.append([r["m"], f"{r['n']}x{r['k']}", r["pick"].split(" ")[0],
                     num(own.get("us")), num(f["us"].get("fixed_us")),
                     num(f["us"].get("us_per_1k_k"), ".2f"), num(r.get("stream_gb_s"), ".0f"),
                     num(own.get("bf16_us")), num(f["bf16_us"].get("fixed_us")),
                     num(own.get("fp8_us")), num(f["fp8_us"].get("fixed_us")),
                     ratio(own.get("bf16_us"), own.get("us")),
                     *(num(r.get(f"fit_{c}", {}).get("fixed_us"))
                       for c in ("split1_us", "pass_us", "gemm_us")),
                     *(num(own.get(c))
                       for c in ("eager_us", "bf16_eager_us", "fp8_eager_us"))])  # fmt: skip
    head = ["M", "N x K", "pick", "µs", "fixed µs", "µs / 1K of K", "stream GB/s", "bf16 µs",
            "bf16 fixed", "FP8 µs", "FP8 fixed", "bf16 / pick", "fixed: one split",
            "fixed: pass", "fixed: GEMM alone", "eager µs", "bf16 eager µs",
            "FP8 eager µs"]  # fmt: skip
    return markdown_table(head, body)


def pipes_table(rows: list[dict]) -> str:
    offered = "4 K ranges, prefetch 2, unroll 2, split 1"
    body = []
    for r in rows:
        timed_ = sorted((e["us"], name) for name, e in r["variants"].items() if "us" in e)
        best_us, best = timed_[0] if timed_ else (math.nan, "-")
        body.append([r["m"], f"{r['n']}x{r['k']}", num(r["bf16_us"]), num(r["fp8_us"]),
                     num(r["variants"].get(offered, {}).get("us")), best, num(best_us),
                     len(r["variants"]) - len(timed_)])  # fmt: skip
    head = ["M", "N x K", "bf16 µs", "FP8 µs", "offered variant µs", "best variant",
            "its µs", "not timed"]  # fmt: skip
    return markdown_table(head, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["l2", "rs", "fixed", "pipes"],
                   choices=["l2", "rs", "fixed", "pipes"])  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU: tiny sizes, interpreter")
    return p.parse_args(argv)


def smoke() -> int:
    """CPU: the L2 kernel on a small buffer (every program's XOR against the host's), the
    traffic formula and the line fit on known values; exit 1 if the kernel is wrong."""
    device = torch.device("cpu")
    l2 = l2_ceiling(device, sms=2, buffer_bytes=4 * L2_BLOCK * 4)
    a, b = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    got = {"smoke": True, "l2_correct": all(r["correct"] for r in l2),
           "fit": [round(a, 9), round(b, 9)],
           "rs_bytes_256x256x256": rs_l2_bytes(256, 256, 256, 256)}  # fmt: skip
    write_json("limits.json", got)
    print(got)
    return 0 if got["l2_correct"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := smoke_or_sm90(args.smoke, smoke)) is not None:
        return code
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out: dict = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")},
                 "l2": [], "rs": [], "fixed": [], "pipes": []}  # fmt: skip
    if "l2" in args.sections:
        out["l2"] = l2_ceiling(device, sms, L2_BUFFER_BYTES)
        print(f"L2 ceiling: {max(r['gb_s'] for r in out['l2']):.0f} GB/s", flush=True)
    if "rs" in args.sections:
        out["rs"] = rs_traffic(device, RS_TACTICS)
    if "fixed" in args.sections:
        out["fixed"] = fixed_cost(device, MISSED, K_SWEEP, Dispatcher(cache=False))
    if "pipes" in args.sections:
        out["pipes"] = pipes(device, PIPE_SHAPES, PIPES)
    write_json("limits.json", out)
    print(tables(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
