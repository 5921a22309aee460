"""GPU check and benchmark of the fused NVFP4 quantize kernel (one H200 run, < 90 s).

1. **bit equality**: `quantize_triton` on the GPU vs the torch reference on the CPU
   (`quantize_nvfp4` of the CPU copy: `quantize_blocks` + `swizzle_scales`), bytes of
   data and scales and the global scale, on random and adversarial inputs (exact ties,
   huge/tiny magnitudes, zero blocks, -0, NaN/inf in one row, odd shapes, strided
   rows), both layouts, given and dynamic scale; plus a large case against the torch
   reference run on the GPU.
2. **CUDA graph**: ``quantize_nvfp4(x)`` (dynamic and given scale) captured in a
   ``torch.cuda.CUDAGraph``; replays after copying new inputs into the static ``x``
   must equal eager quantization of those inputs (and change with them).
3. **table**: M in {1, 16, 256, 4096} x K in {4096, 5120, 8192}, bf16 input. GPU time
   per call = `fp4_dispatch.harness.gpu_time_us` (a CUDA graph of 20 x (L2 flush +
   call) minus a graph of the 20 flushes: cold L2, graph launch amortised; the same
   method as bench_serving), and "1-replay" = CUDA events around the replay of a graph
   holding one call after a flush (the previous round's method, which includes the
   graph launch); eager wall = back-to-back calls, synchronised at the end, per call.
   GB/s = (bf16 bytes read + data + scale bytes written) / GPU time, and the fraction
   of the measured device copy rate.
4. **sweep** (``--sweep``): the kernel's tile knobs (elements per program, widest K
   tile, warps) at 1x8192, 16x8192 and 4096x8192, given and dynamic scale, so that the
   next change of the defaults rests on a measurement.

    python benchmarks/bench_quantize.py [--sweep]   # JSON to $OUT/quantize.json if OUT is set

Exit status 1 when any equality or graph check fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from fp4_dispatch.backends import quantize as kq
from fp4_dispatch.backends.quantize import quantize_triton
from fp4_dispatch.harness import gpu_time_us as harness_gpu_us
from fp4_dispatch.nvfp4 import quantize_blocks, quantize_nvfp4, swizzle_scales

MID = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
FAILS: list[str] = []


def check(name: str, ok: bool) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}")
    if not ok:
        FAILS.append(name)


def adversarial(kind: str, m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(2 * torch.randn(m, k, generator=gen))
    if kind == "ties":
        row = ([6.0] + MID + [-v for v in MID] + [1.0]) * (k // 16)
        x = torch.tensor(row[:k]).repeat(m, 1)
    elif kind == "huge":
        x = x.sign() * 3.0e38 * torch.rand(m, k, generator=gen).clamp(min=0.5)
        x[:, :16] = 1.0e6
    elif kind == "tiny":
        x = x * 2.0**-14
        x[:, :16] = 1.0e-40
    elif kind == "zeros":
        x[:, 16:48] = 0.0
        x[0] = 0.0
    elif kind == "negzero":
        x[:, :16] = -0.0
        x[:, 16:32] = torch.tensor([-0.0, 0.0] * 8)
    elif kind == "nonfinite":
        x[1, 3], x[1, 20], x[1, k - 1] = float("nan"), float("inf"), float("-inf")
    elif kind == "neartie":
        x = near_ties(m, k, 0.37, gen)
    return x


def near_ties(m: int, k: int, g: float, gen: torch.Generator) -> torch.Tensor:
    """Blocks with a random e4m3 scale s (first element 6 * s * g) whose other values
    are the float32 numbers 0..2 ulps around t * (s * g) for every e2m1 midpoint t: the
    quotients straddle every rounding boundary (tests/test_quantize_kernel.py's case)."""
    x = torch.zeros(m, k)
    sbytes = torch.randint(0x08, 0x7F, (m, k // 16), generator=gen, dtype=torch.uint8)
    x[:, 0::16] = 6.0 * sbytes.view(torch.float8_e4m3fn).to(torch.float32) * g
    ref = quantize_nvfp4(x, g, "linear").scale.to(torch.float32)
    d = (ref * torch.tensor(g, dtype=torch.float32)).repeat_interleave(16, 1)
    v = torch.tensor(MID)[torch.arange(k) % 7] * d
    steps = torch.randint(-2, 3, (m, k), generator=gen)
    for _ in range(2):
        v = torch.where(steps > 0, torch.nextafter(v, torch.tensor(float("inf"))), v)
        v = torch.where(steps < 0, torch.nextafter(v, torch.tensor(0.0)), v)
        steps = steps - steps.sign()
    sign = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    return torch.where(torch.arange(k) % 16 == 0, x, sign * v)


def same(fields: tuple, q) -> bool:
    d, s, g = (t.cpu() for t in fields)
    return (
        torch.equal(d, q.data.cpu())
        and torch.equal(s.view(torch.uint8), q.scale.view(torch.uint8).cpu())
        and torch.equal(g, q.global_scale.cpu())
    )


def equality_checks() -> None:
    # Each (shape, dtype, layout, scale kind) is a Triton compile (~1 s): the matrix is
    # chosen to cover every input kind and dtype without compiling 100 variants.
    inputs = [("random", 1, 8192, torch.bfloat16), ("random", 16, 5120, torch.bfloat16),
              ("random", 3, 64, torch.float16)]  # fmt: skip
    for kind in ("random", "ties", "huge", "tiny", "zeros", "negzero", "nonfinite"):
        inputs.append((kind, 130, 80, torch.float32))
    inputs += [("neartie", 64, 2048, torch.float32), ("neartie", 33, 512, torch.float32)]
    n = 0
    for kind, m, k, dtype in inputs:
        n += 1
        x = adversarial(kind, m, k, n).to(dtype)
        xg = x.cuda()
        if n % 2:  # strided rows: a slice of a wider tensor
            wide = torch.zeros(m, k + 32, dtype=dtype, device="cuda")
            wide[:, 16 : 16 + k] = xg
            xg = wide[:, 16 : 16 + k]
        for layout in ("swizzled", "linear"):
            for gs in (None, 0.01, "t"):
                g_dev = torch.tensor(0.02, device="cuda") if gs == "t" else gs
                g_cpu = torch.tensor(0.02) if gs == "t" else gs
                want = quantize_nvfp4(x, g_cpu, layout)
                if not same(quantize_triton(xg, g_dev, layout), want):
                    check(f"equal {kind} {m}x{k} {dtype} {layout} g={gs}", False)
    check(f"bit equality: {n} inputs x 2 layouts x 3 scale kinds vs the CPU reference", not FAILS)
    # large: against the torch reference on the GPU (IEEE division there too)
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) * 3
    x[7, 100] = float("nan")
    for layout in ("swizzled", "linear"):
        finite = torch.where(torch.isfinite(x.float()), x.float().abs(), 0.0)
        g = finite.amax() / 2688.0
        d, s = quantize_blocks(x.float(), g)
        s = swizzle_scales(s) if layout == "swizzled" else s
        dk, sk, gk = quantize_triton(x, None, layout)
        ok = torch.equal(d, dk) and torch.equal(s.view(torch.uint8), sk.view(torch.uint8))
        check(
            f"bit equality 4096x8192 bf16 dynamic {layout} vs torch-on-GPU",
            ok and torch.equal(g, gk),
        )


def graph_checks() -> None:
    for gs in (None, torch.tensor(0.05, device="cuda")):
        x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                quantize_nvfp4(x, gs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q = quantize_nvfp4(x, gs)
        prev = None
        ok = True
        for i in range(4):
            x.copy_(torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16) * (i + 1))
            if i == 2:
                x[3, 5] = float("nan")
            graph.replay()
            want = quantize_nvfp4(x.clone(), gs)
            ok &= same((q.data, q.scale, q.global_scale), want)
            if prev is not None:
                ok &= not torch.equal(prev, q.data)
            prev = q.data.clone()
        check(
            f"CUDA graph capture + replay of quantize_nvfp4(x, {'None' if gs is None else 'g'})",
            ok,
        )


def copy_rate() -> float:
    """Device-to-device copy GB/s (read + write) of a 1 GiB buffer: the roofline."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (a.elapsed_time(b) * 1e-3) / 1e9


def gpu_time_us(fn, flush: torch.Tensor, reps: int) -> float:
    """Median GPU time of one graph replay of ``fn`` after an L2 flush."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for a, b in events:
        flush.zero_()
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


def eager_us(fn, n: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def table(rate: float) -> list[dict]:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    flush = torch.empty(2 * l2 // 4 + 1, dtype=torch.float32, device="cuda")
    rows = []
    for m in (1, 16, 256, 4096):
        for k in (4096, 5120, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            g = torch.tensor(0.01, device="cuda")
            nbytes = m * k * 2 + m * k // 2 + (-(-m // 128) * 128) * (-(-(k // 16) // 4) * 4)
            reps = 50 if m < 4096 else 20
            n = 300 if m < 4096 else 50
            row = {"m": m, "k": k}
            row["replay_us_given"] = gpu_time_us(
                lambda x=x, g=g: quantize_triton(x, g), flush, reps
            )
            row["replay_us_dynamic"] = gpu_time_us(lambda x=x: quantize_triton(x), flush, reps)
            row["gpu_us_given"] = harness_gpu_us(lambda x=x, g=g: quantize_triton(x, g))
            row["gpu_us_dynamic"] = harness_gpu_us(lambda x=x: quantize_triton(x))
            row["eager_us_given"] = eager_us(lambda x=x, g=g: quantize_nvfp4(x, g), n)
            row["eager_us_dynamic"] = eager_us(lambda x=x: quantize_nvfp4(x), n)
            row["gbps_given"] = nbytes / (row["gpu_us_given"] * 1e-6) / 1e9
            row["copy_frac_given"] = row["gbps_given"] / rate
            row["gbps_dynamic"] = nbytes / (row["gpu_us_dynamic"] * 1e-6) / 1e9
            rows.append(row)
    return rows


#: (elements per program, widest K tile, warps or None for the default rule); the first
#: is the default (4096, 512), the others smaller tiles (fewer registers, more programs
#: an SM) and the 8-warp variant. The previous sweep (run 1 of issue 11's second round)
#: measured 8192/1024, 16384/2048, 16384/1024, 32768/2048 and 8192/512 too.
SWEEP = ((4096, 512, None), (2048, 256, 4), (2048, 512, 4), (4096, 512, 8))


def sweep() -> list[dict]:
    """GPU time of the tile knobs (module docstring, 4.); restores the defaults."""
    saved = (kq._TILE_ELEMS, kq._MAX_BK, kq._NUM_WARPS)
    rows = []
    try:
        for elems, max_bk, warps in SWEEP:
            kq._TILE_ELEMS, kq._MAX_BK, kq._NUM_WARPS = elems, max_bk, warps
            kq._plans.clear()
            for m, k in ((1, 8192), (16, 8192), (4096, 8192)):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                g = torch.tensor(0.01, device="cuda")
                ok = same(quantize_triton(x, g), quantize_nvfp4(x.cpu(), g.cpu()))
                rows.append({
                    "elems": elems, "max_bk": max_bk, "warps": warps, "m": m, "k": k,
                    "equal": ok,
                    "gpu_us_given": harness_gpu_us(lambda x=x, g=g: quantize_triton(x, g)),
                    "gpu_us_dynamic": harness_gpu_us(lambda x=x: quantize_triton(x)),
                })  # fmt: skip
                check(f"sweep {elems}/{max_bk}/{warps} {m}x{k} bit equality", ok)
                r = rows[-1]
                print(
                    f"sweep elems={elems:>5} max_bk={max_bk:>4} warps={warps} {m:>4}x{k}: "
                    f"given {r['gpu_us_given']:7.2f} us, dynamic {r['gpu_us_dynamic']:7.2f} us",
                    flush=True,
                )
    finally:
        kq._TILE_ELEMS, kq._MAX_BK, kq._NUM_WARPS = saved
        kq._plans.clear()
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for the H200)")
        return 0
    t0 = time.perf_counter()
    swept = sweep() if "--sweep" in sys.argv else []  # first: printed as it goes
    equality_checks()
    graph_checks()
    rate = copy_rate()
    rows = table(rate)
    print(f"\ndevice {torch.cuda.get_device_name()}, copy rate {rate:.0f} GB/s (read+write)")
    print(
        f"{'M':>5} {'K':>5} | {'GPU given':>9} {'GPU dyn':>8} us | {'1-replay g':>10} "
        f"{'1-replay d':>10} | {'eager given':>11} {'eager dyn':>9} us | GB/s  %copy"
    )
    for r in rows:
        print(
            f"{r['m']:>5} {r['k']:>5} | {r['gpu_us_given']:9.2f} {r['gpu_us_dynamic']:8.2f}    | "
            f"{r['replay_us_given']:10.2f} {r['replay_us_dynamic']:10.2f} | "
            f"{r['eager_us_given']:11.1f} {r['eager_us_dynamic']:9.1f}    | {r['gbps_given']:5.0f} "
            f"{100 * r['copy_frac_given']:4.0f}%"
        )
    print(f"\n{len(FAILS)} failed checks; {time.perf_counter() - t0:.1f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "quantize.json"), "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_gbps": rate,
                    "fails": FAILS,
                    "rows": rows,
                    "sweep": swept,
                },
                f,
                indent=1,
            )
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
