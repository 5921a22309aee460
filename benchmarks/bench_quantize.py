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

5. **variants** (``--variants``): the kernel's code paths side by side, given and dynamic
   scale, M in {1, 16, 256, 4096} x K in {4096, 8192}, each checked bit for bit against
   `quantize_blocks` run on the GPU (+ `swizzle_scales`): the kernel with ``int-2launch``
   (integer e4m3 and thresholds, one element an operation, two-launch dynamic),
   ``asm-2launch`` (+ PTX conversions), ``pairs-2launch`` (+ bf16 two elements an
   operation), ``new`` (the defaults: + the one-launch cooperative dynamic scale),
   ``new-nofused`` (the barrier also where the one-load fused path would run, M=1)
   and ``new-8k*`` (8192-element tiles: 8 warps, the default rule, or 4 warps, 64
   elements a thread, BK 512 or 1024); for M >= 256 also ``amax-8k`` and ``parts-1k``
   (the partial-amax pass of the two-launch dynamic scale: 8192-element steps, up to
   1024 partial maxima).
6. **SASS** (``--sass``, no GPU needed): instructions per element of the quantize kernel
   compiled for sm_90 on this machine's Triton, default tile: v1 and the current one.

    python benchmarks/bench_quantize.py [--sweep] [--variants] [--sass]
    # JSON to $OUT/quantize.json if OUT is set

Exit status 1 when any equality or graph check fails.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
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
    n, before = 0, len(FAILS)
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
    check(f"bit equality: {n} inputs x 2 layouts x 3 scale kinds vs the CPU reference",
          len(FAILS) == before)  # fmt: skip
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


#: (name, module, knob values) of `variants`: this kernel with knobs changed (the
#: earlier kernel, "v1", ran beside them once - RESULTS.md "Serving hot path" run 4 - from
#: a frozen copy kept in git history only: commit 054de8d, benchmarks/quantize_baseline.py)
VARIANTS = (
    ("int-2launch", "current", {"_USE_ASM": False, "_PAIRS": False, "_COOPERATIVE": False}),
    ("asm-2launch", "current", {"_PAIRS": False, "_COOPERATIVE": False}),
    ("pairs-2launch", "current", {"_COOPERATIVE": False}),
    ("new", "current", {}),
    ("new-nofused", "current", {"_FUSED_ELEMS": 0}),
    ("new-8k", "current", {"_TILE_ELEMS": 8192, "_MAX_BK": 1024}),
    ("new-8k-4w", "current", {"_TILE_ELEMS": 8192, "_MAX_BK": 512, "_NUM_WARPS": 4}),
    ("new-8k1k-4w", "current", {"_TILE_ELEMS": 8192, "_MAX_BK": 1024, "_NUM_WARPS": 4}),
    # the two-launch dynamic scale of large M: the partial-amax pass's tile and count
    ("amax-8k", "current", {"_AMAX_ELEMS": 8192}),
    ("parts-1k", "current", {"_MAX_PARTIALS": 1024}),
)
#: variants measured only from this M up (they change nothing below)
_MIN_M = {"amax-8k": 256, "parts-1k": 256}
_KNOBS = (
    "_USE_ASM",
    "_PAIRS",
    "_COOPERATIVE",
    "_FUSED_ELEMS",
    "_TILE_ELEMS",
    "_MAX_BK",
    "_NUM_WARPS",
    "_AMAX_ELEMS",
    "_MAX_PARTIALS",
)


def gpu_reference(x: torch.Tensor, g: torch.Tensor | None) -> tuple:
    """`quantize_blocks` on the GPU (IEEE division there too), swizzled scales."""
    xf = x.float()
    if g is None:
        finite = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax() / 2688.0
        g = torch.where(finite == 0, torch.ones_like(finite), finite)
    d, s = quantize_blocks(xf, g)
    return d, swizzle_scales(s), g


def _variant_shape(name: str, mod, x: torch.Tensor, g: torch.Tensor, want: dict) -> dict:
    m, k = x.shape
    row = {"variant": name, "m": m, "k": k}
    for kind in ("given", "dynamic"):
        gs = g if kind == "given" else None
        got = mod.quantize_triton(x, gs)  # compiles; allocates the barrier words
        d, s, gw = want[((m, k), kind)]
        ok = torch.equal(got[0], d) and torch.equal(got[2], gw)
        ok = ok and torch.equal(got[1].view(torch.uint8), s.view(torch.uint8))
        check(f"variant {name} {m}x{k} {kind} bit equality", ok)
        row[f"equal_{kind}"] = ok
        plan = mod._plans[(m, k, "swizzled", "tensor" if gs is not None else "dynamic")]
        row[f"g_mode_{kind}"] = plan.g_mode
        row[f"gpu_us_{kind}"] = harness_gpu_us(lambda gs=gs: mod.quantize_triton(x, gs))
    return row


def variants() -> list[dict]:
    """GPU time and bit equality of each `VARIANTS` entry (module docstring, 5.)."""
    saved = {n: getattr(kq, n) for n in _KNOBS}
    mods = {"current": kq}
    rows = []
    shapes = [(m, k) for m in (1, 16, 256, 4096) for k in (4096, 8192)]
    xs = {mk: torch.randn(*mk, device="cuda", dtype=torch.bfloat16) * 3 for mk in shapes}
    g = torch.tensor(0.01, device="cuda")
    want = {(mk, kind): gpu_reference(xs[mk], g if kind == "given" else None)
            for mk in shapes for kind in ("given", "dynamic")}  # fmt: skip
    try:
        for name, mod_name, knobs in VARIANTS:
            for n in _KNOBS:
                setattr(kq, n, knobs.get(n, saved[n]))
            kq._plans.clear()
            for x in xs.values():
                if x.shape[0] < _MIN_M.get(name, 0):
                    continue
                try:
                    r = _variant_shape(name, mods[mod_name], x, g, want)
                except Exception as exc:  # reported (a failed check), the run goes on
                    check(f"variant {name} {tuple(x.shape)}: {type(exc).__name__}: {exc}", False)
                    r = {"variant": name, "m": x.shape[0], "k": x.shape[1], "error": str(exc),
                         "equal_given": False, "equal_dynamic": False, "g_mode_dynamic": -1,
                         "gpu_us_given": float("nan"), "gpu_us_dynamic": float("nan")}  # fmt: skip
                rows.append(r)
                print(
                    f"variant {name:>12} {r['m']:>4}x{r['k']:<5}: given {r['gpu_us_given']:7.2f}"
                    f" us, dynamic {r['gpu_us_dynamic']:7.2f} us (g mode {r['g_mode_dynamic']})",
                    flush=True,
                )
    finally:
        for n, v in saved.items():
            setattr(kq, n, v)
        kq._plans.clear()
    return rows


def print_variants(rows: list[dict]) -> None:
    names = [n for n, _, _ in VARIANTS]
    print("\nvariants: GPU us per call (cold L2), given / dynamic; * = not bit-equal")
    print(f"{'M':>5} {'K':>5} | " + " | ".join(f"{n:>15}" for n in names))
    for m in (1, 16, 256, 4096):
        for k in (4096, 8192):
            cells = []
            for n in names:
                r = next((r for r in rows if r["variant"] == n and r["m"] == m and r["k"] == k),
                         None)  # fmt: skip
                if r is None:
                    cells.append(f"{'-':>16}")
                    continue
                bad = "" if r["equal_given"] and r["equal_dynamic"] else "*"
                cells.append(f"{r['gpu_us_given']:6.2f} /{r['gpu_us_dynamic']:7.2f}{bad:1}")
            print(f"{m:>5} {k:>5} | " + " | ".join(cells))


def _sass_count(kernel, consts: dict) -> tuple[int, int]:
    """SASS instructions of `kernel` compiled for sm_90 on the CPU (bf16 x, aligned):
    all of them, and those up to the first EXIT (the straight path of a program that
    writes no swizzled row padding, without the never-taken division slow path)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    types = {"x_ptr": "*bf16", "stride_xm": "i32", "data_ptr": "*u8", "scale_ptr": "*u8",
             "g_ptr": "*fp32", "g_value": "fp32", "g_out_ptr": "*fp32",
             "part_ptr": "*fp32", "n_part": "i32", "M": "i32", "K": "i32", "M_PAD": "i32",
             "NUM_K_TILES": "i32"}  # fmt: skip
    aligned = ("x_ptr", "stride_xm", "data_ptr", "scale_ptr", "g_ptr", "g_out_ptr", "K", "M")
    src = ASTSource(
        fn=kernel,
        signature={n: "constexpr" if n in consts else types[n] for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout
    ins = [ln for ln in text.splitlines() if re.match(r"/\*[0-9a-f]+\*/\s+\S", ln.strip())]
    first_exit = next((i + 1 for i, ln in enumerate(ins) if "EXIT" in ln), len(ins))
    return len(ins), first_exit


def sass_counts() -> list[dict]:
    """SASS instructions per element of the quantize kernel's code paths,
    compiled for sm_90 on this machine's Triton: the default 8x512 tile at 4 warps (32
    elements a thread), bf16 input, given scale, whole tiles, both layouts."""
    import triton

    rows = []
    for name, kernel, extra in (
        ("int", kq._nvfp4_quantize_kernel, {"USE_ASM": False, "PAIRS": False}),
        ("asm", kq._nvfp4_quantize_kernel, {"USE_ASM": True, "PAIRS": False}),
        ("new", kq._nvfp4_quantize_kernel, {"USE_ASM": True, "PAIRS": True}),
    ):
        for swz in (True, False):
            consts = {"G_MODE": 0, "SWIZZLED": swz, "BM": 8, "NB": 32, "PART_BLOCK": 1,
                      "FM": 1, "FNB": 1, "EVEN": True, **extra}  # fmt: skip
            n, path = _sass_count(kernel, consts)
            rows.append({"kernel": name, "swizzled": swz, "instr": n, "per_elem": n / 32,
                         "path_instr": path, "path_per_elem": path / 32})  # fmt: skip
            print(f"SASS {name:>8} swizzled={swz!s:>5}: {n} instructions, {n / 32:.1f} an "
                  f"element; to the first EXIT {path}, {path / 32:.1f} an element "
                  f"(sm_90, triton {triton.__version__})")  # fmt: skip
    return rows


def main() -> int:
    if "--sass" in sys.argv:
        sass_counts()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for the H200)")
        return 0
    t0 = time.perf_counter()
    swept = sweep() if "--sweep" in sys.argv else []  # first: printed as it goes
    varied = variants() if "--variants" in sys.argv else []
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
    if varied:
        print_variants(varied)
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
                    "variants": varied,
                },
                f,
                indent=1,
            )
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
