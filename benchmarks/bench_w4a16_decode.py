"""H200: every W4A16 decode tactic (the wgmma kernel's measured-best family and the new
tensor-core-free gemv kernel) against bf16 cuBLAS and FP8 cuBLASLt, in one device call.

    python3 benchmarks/bench_w4a16_decode.py          # OUT=/dir: also $OUT/w4a16_decode.json
    python3 benchmarks/bench_w4a16_decode.py --smoke  # CPU: tiny shapes, interpreter
    python3 benchmarks/bench_w4a16_decode.py --mid    # M = 32-256: $OUT/w4a16_mid.json

Grid: M in (1, 4, 16) x (N, K) in the issue's four shapes (8192², 5120², 13824x5120,
10240x8192) and two more fixed before any measurement (4608x3584, 18944x3584); then M in
(2, 8) x (6144, 4096), (28672, 8192), (4096, 14336), held out of the direct path's cost
model fit (fixed before it). Per shape:

1. bf16 ``torch.mm(x, w.T)`` and FP8 ``torch._scaled_mm`` (per-tensor scales) on the same
   dequantized weight, same run;
2. every valid ``path="gemv"`` tactic of ``triton-sm90-w4a16`` (M <= 4) and the direct
   (wgmma) kernel's decode family (`_decode_family`: 128 weight rows x 16 tokens x tile_k
   128 at 4 stages, the measured best of RESULTS.md "Hopper W4A16" run 2, and at 3;
   64-row tiles), 4 and 8 warps, every valid split-K, plus the estimate's pick;
3. each tactic's output (poisoned with NaN first) against float64 ``alpha * x @
   dequant(W).T`` of the unquantized bf16 activation: relative Frobenius error <= 1e-2,
   else the tactic counts as failed and is not timed;
4. GPU time `fp4_dispatch.harness.gpu_time_us` (CUDA graph, L2 flushed before every call);
   eager wall per call (`eager_wall_us`: back to back, one synchronisation) of the
   estimate's pick, bf16 and FP8;
   the best gemv and best direct tactic again on sm90-prepared weights;
5. SASS instructions per weight element of the best gemv tactic's main loop (cubin).

Everything compiles first in parallel (`fp4_dispatch.precompile`). A time budget
(``--budget-s``, default 210 s for the whole run, compiling included) skips the tactics
left once it is spent (listed per shape in the JSON, counted in the table): the call
stays inside a 4-minute device slot. Shapes run in grid order (M = 1 first).
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
from _common import failures_by_tactic, markdown_table, precompile_kernels, write_json
from bench_hopper import dequant

from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.device import detect
from fp4_dispatch.harness import eager_wall_us, gpu_time_us, stress_nvfp4
from fp4_dispatch.plugins.sm90.w4a16 import (
    TritonSm90W4A16Backend,
    TritonSm90W4A16Tactic,
    w4a16_min_bytes,
)
from fp4_dispatch.profiles import rated, simulated
from fp4_dispatch.tactics import Problem, tactic_label

MS = (1, 4, 16)
NK = ((8192, 8192), (5120, 5120), (13824, 5120), (10240, 8192), (4608, 3584), (18944, 3584))
#: held out of the direct path's v1 fit (plugins/sm90/cost_model.json): fixed before it
HELD_MS = (2, 8)
HELD_NK = ((6144, 4096), (28672, 8192), (4096, 14336))
#: ``--mid``: M = 32-256 (the mid-M fit of `fit_w4a16_model.py --mid`): in-sample M on the
#: six (N, K) above, held-out M on HELD_NK (both fixed before that fit)
MID_MS = (64, 256)
MID_HELD_MS = (32, 128)
SMOKE_MS = (1, 3)
SMOKE_NK = ((72, 256), (40, 1056))
TOL = 1e-2
HELD = {(m, n, k) for m in (*HELD_MS, *MID_HELD_MS) for n, k in HELD_NK}
#: gemv tactics (the estimate's best) every shape gets before any shape gets the rest
FIRST_PASS_GEMV = 16
#: copy rate of the H200 measured in earlier runs (RESULTS.md), bytes/µs, at 98%
FLOOR_BYTES_PER_US = 4.25e6 * 0.98
BACKEND = TritonSm90W4A16Backend()


def shape_grid(cuda: bool, mid: bool = False) -> list[tuple[int, int, int]]:
    """(M, N, K) of a run: the in-sample M x `NK`, then the held-out M x `HELD_NK`
    (`MID_MS`/`MID_HELD_MS` with ``mid``); the smoke grid without CUDA."""
    if not cuda:
        return [(m, n, k) for m in SMOKE_MS for n, k in SMOKE_NK]
    ms, held_ms = (MID_MS, MID_HELD_MS) if mid else (MS, HELD_MS)
    return [(m, n, k) for m in ms for n, k in NK] + [(m, n, k) for m in held_ms for n, k in HELD_NK]


def decode_tactics(problem: Problem, info) -> list[TritonSm90W4A16Tactic]:
    """The tactics timed for `problem`: the estimate's pick first, then every gemv tactic,
    then the direct kernel's decode family (16x128, tile_k 128, 4 stages, any split); for
    M > 16 (``--mid``) every direct tactic at tile_k 128 and 4 stages instead."""
    valid = list(BACKEND.tactics(problem, info))
    ranked = sorted(valid, key=lambda t: (BACKEND.estimate_us(problem, info, t),
                                          t.canonical_json()))  # fmt: skip
    if problem.m > 16:
        mid = [t for t in valid if t.path == "direct" and (t.tile_k, t.num_stages) == (128, 4)]
        return list(dict.fromkeys([ranked[0], *mid]))
    family = [t for t in valid if t.path == "direct" and _decode_family(t)]
    gemv = [t for t in ranked if t.path == "gemv"]
    return list(dict.fromkeys([ranked[0], *gemv, *family]))


def _decode_family(t: TritonSm90W4A16Tactic) -> bool:
    """The direct kernel's decode tiles timed beside the gemv: 16 tokens x 128 rows x
    tile_k 128 at 4 stages (the measured best, run 2) or 3 (less shared memory: three
    CTAs per SM), and 64-row tiles at 4 stages (more CTAs)."""
    if (t.tile_m, t.tile_k) != (16, 128):
        return False
    return (t.tile_n == 128 and t.num_stages in (3, 4)) or (t.tile_n == 64 and t.num_stages == 4)


def label(t: TritonSm90W4A16Tactic | None) -> str:
    """A table cell: ``gemv``/``direct`` and the tactic's short label."""
    if t is None:
        return "-"
    return f"{t.path} {tactic_label(t).replace(f' path={t.path}', '')}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.nan
    return float((out.double() - ref).norm() / ref.norm())


class Shape:
    """Operands, reference and baselines of one (M, N, K)."""

    def __init__(self, m: int, n: int, k: int, device: torch.device, dtype: torch.dtype):
        gen = torch.Generator(device=device)
        gen.manual_seed(1000 * m + n + k)
        self.m, self.n, self.k, self.device, self.dtype = m, n, k, device, dtype
        self.x = torch.randn((m, k), generator=gen, device=device).to(dtype)
        self.wd, self.ws = stress_nvfp4(n, k, device, gen)
        self.alpha = torch.tensor([1.0 / (8.0 * math.sqrt(k))], device=device)
        self.ops = w4.W4A16Operands(self.x, self.wd, self.ws, self.alpha)
        self.prepared = (  # the sm90-prepared layout needs K % 64 == 0
            w4.W4A16Operands(self.x, w4.prepare_weight(self.wd), self.ws, self.alpha, True)
            if k % 64 == 0
            else None
        )
        w64 = dequant(self.wd, self.ws, torch.float64)
        self.ref = (self.x.double() @ w64.T) * float(self.alpha)
        self.w16 = w64.to(dtype)
        del w64
        self.out = torch.empty((m, n), dtype=dtype, device=device)

    def check(self, kernel, ops) -> float:
        poisoned = torch.full((self.m, self.n), float("nan"), dtype=self.dtype, device=self.device)
        kernel(ops, poisoned)
        return rel_err(poisoned, self.ref)


def timed(fn, device: torch.device) -> float:
    """GPU µs per call (cold L2, CUDA graph) on CUDA; eager wall µs on the CPU (smoke)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return gpu_time_us(fn, device=device)
    return eager_wall_us(fn, calls=1, warmup=0)


def eager(fn, device: torch.device) -> float:
    """Eager wall µs per call: back-to-back calls, one synchronisation at the end (CUDA)."""
    return eager_wall_us(fn) if device.type == "cuda" else math.nan


def check_and_time(entry: dict, check, run, device: torch.device) -> None:
    """``entry["rel_err"] = check()``, then ``entry["us"]`` = GPU time of ``run`` where the
    error is within `TOL`; an exception is recorded (``entry["error"]``), never fatal for
    the run. Shared by the sm90 sweeps (bench_w4a4_decode.py, bench_w4a16_ws.py)."""
    try:
        entry["rel_err"] = check()
        if entry["rel_err"] <= TOL:
            entry["us"] = timed(run, device)
    except Exception as exc:  # a failing tactic is recorded, never fatal for the run
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def top_by_estimate(backend, problem: Problem, info, n: int) -> list:
    """`backend`'s `n` best tactics for `problem` by its estimate (ties: canonical JSON):
    the untuned candidates a tuner would shortlist."""

    def key(t) -> tuple:
        return backend.estimate_us(problem, info, t), t.canonical_json()

    return sorted(backend.tactics(problem, info), key=key)[:n]


def best_per_backend(row: dict, names) -> None:
    """``row["best_<name>"]`` and ``row["best_<name>_us"]``: the fastest timed tactic of
    each backend in ``row["tactics"]`` (entries carry their ``backend``)."""
    for name in names:
        done = {tj: e["us"] for tj, e in row["tactics"].items()
                if e["backend"] == name and "us" in e}  # fmt: skip
        row[f"best_{name}"] = min(done, key=done.get) if done else None
        row[f"best_{name}_us"] = min(done.values()) if done else math.nan


def failed_tactics(row: dict) -> list[str]:
    """The tactics of ``row["tactics"]`` over `TOL` or failing (no error recorded)."""
    return [tj for tj, e in row["tactics"].items() if not e.get("rel_err", 1) <= TOL]


def time_pairs(row: dict, pairs, problem: Problem, info, deadline: float, names, calls,
               device: torch.device, fields=None) -> None:  # fmt: skip
    """Check and time every (backend, tactic) of `pairs` for `problem` into ``row`` (until
    `deadline`; later ones go to ``row["skipped"]``), then the best of each backend of
    `names` (`best_per_backend`) and ``row["failed"]``. ``calls(kernel, tactic)`` gives
    the (check, run) pair of a built kernel (`check_and_time`); ``fields(tactic)``, extra
    entries recorded per tactic. The two-backend sweeps' loop (bench_w4a4_decode.py,
    bench_w4a16_ws.py)."""
    for backend, t in pairs:
        tj = t.canonical_json()
        if time.time() > deadline:
            row["skipped"].append(tj)
            continue
        check, run = calls(backend.build(t, problem, info), t)
        entry: dict = {"backend": backend.name, **(fields(t) if fields else {}),
                       "est_us": backend.estimate_us(problem, info, t)}  # fmt: skip
        check_and_time(entry, check, run, device)
        row["tactics"][tj] = entry
    best_per_backend(row, names)
    row["failed"] = failed_tactics(row)


def precompile_plans(plans: dict, info, workers: int) -> dict:
    """Compile every (backend, tactic, problem) of `plans` ({shape: (problem, [(backend,
    tactic)])}) in parallel first; the failures by tactic."""
    t0 = time.time()
    jobs = [(b, t, p) for p, pairs in plans.values() for b, t in pairs]
    workers = workers or max(1, min(14, (os.cpu_count() or 2) - 2))
    fails = failures_by_tactic(precompile_kernels(jobs, info, workers))
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f}s; {len(fails)} failed",
          flush=True)  # fmt: skip
    return fails


def baselines(s: Shape) -> dict:
    """bf16 cuBLAS and FP8 cuBLASLt on the dequantized weight (the same run)."""
    bf16 = lambda: torch.mm(s.x, s.w16.t(), out=s.out)  # noqa: E731
    row = {"bf16_us": timed(bf16, s.device), "bf16_eager_us": eager(bf16, s.device)}
    row["bf16_err"] = rel_err(torch.mm(s.x, s.w16.t()), s.ref)
    if s.device.type != "cuda":
        row["fp8_us"] = math.nan
        return row
    one = torch.ones((), dtype=torch.float32, device=s.device)
    a8 = (s.x * 0.125).to(torch.float8_e4m3fn)
    b8 = (s.w16 * 0.125).to(torch.float8_e4m3fn)
    fp8 = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=s.dtype)  # noqa: E731
    try:
        row["fp8_us"] = timed(fp8, s.device)
        row["fp8_eager_us"] = eager(fp8, s.device)
    except RuntimeError as exc:  # recorded: the table says n/a
        row["fp8_us"] = math.nan
        row["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def _problem(s: Shape) -> Problem:
    return Problem(m=s.m, n=s.n, k=s.k, out_dtype=str(s.dtype).split(".")[1],
                   operation="w4a16")  # fmt: skip


def new_row(s: Shape, est_pick: TritonSm90W4A16Tactic) -> dict:
    """A shape's row: baselines, floor, the estimate's pick (tactics come later)."""
    row: dict = {"m": s.m, "n": s.n, "k": s.k, **baselines(s), "tactics": {}, "skipped": [],
                 "held_out": (s.m, s.n, s.k) in HELD}  # fmt: skip
    row["est_pick"] = est_pick.canonical_json()
    row["floor_us"] = w4a16_min_bytes(_problem(s)) / FLOOR_BYTES_PER_US
    return row


def measure(row: dict, s: Shape, info, deadline: float, tactics) -> None:
    """Check and time each tactic of `tactics` on `s` into ``row`` (until `deadline`)."""
    problem = _problem(s)
    for t in tactics:
        tj = t.canonical_json()
        if time.time() > deadline:
            row["skipped"].append(tj)
            continue
        kernel = BACKEND.build(t, problem, info)
        entry: dict = {"path": t.path, "est_us": BACKEND.estimate_us(problem, info, t)}
        check_and_time(entry, lambda kernel=kernel: s.check(kernel, s.ops),
                       lambda kernel=kernel: kernel(s.ops, s.out), s.device)  # fmt: skip
        row["tactics"][tj] = entry


def finish(row: dict, s: Shape, info, deadline: float) -> None:
    """Best per path (again on sm90-prepared weights), the gemv SASS, errors, failures."""
    problem = _problem(s)
    for path in ("gemv", "direct"):
        done = {tj: e["us"] for tj, e in row["tactics"].items() if e["path"] == path and "us" in e}
        best = min(done, key=done.get) if done else None
        row[f"best_{path}"] = best
        row[f"best_{path}_us"] = done[best] if best else math.nan
        if best and s.prepared is not None and time.time() < deadline:
            t = TritonSm90W4A16Tactic.model_validate_json(best)
            kernel = BACKEND.build(t, problem, info)
            row[f"best_{path}_prepared_err"] = s.check(kernel, s.prepared)
            row[f"best_{path}_prepared_us"] = timed(lambda k=kernel: k(s.prepared, s.out),
                                                    s.device)  # fmt: skip
            if path == "gemv":
                row["gemv_sass"] = sass(kernel)
    est = row["tactics"].get(row["est_pick"], {})
    row["est_pick_us"] = est.get("us", math.nan)
    if "us" in est:  # the pick as the dispatcher runs it eagerly: the kernel object's call
        kernel = BACKEND.build(TritonSm90W4A16Tactic.model_validate_json(row["est_pick"]),
                               problem, info)  # fmt: skip
        row["est_pick_eager_us"] = eager(lambda: kernel(s.ops, s.out), s.device)
    errs = [e.get("rel_err", math.nan) for e in row["tactics"].values()]
    row["failed"] = failed_tactics(row)
    row["max_err"] = max((e for e in errs if math.isfinite(e)), default=math.nan)


def split_passes(tactics: list, first_gemv: int) -> tuple[list, list]:
    """(first pass, second pass): the estimate's pick, every direct tactic and the
    estimate's `first_gemv` best gemv tactics first on every shape, the other gemv
    tactics after (so a spent budget cuts the long tail, not the M = 16 shapes)."""
    gemv = [t for t in tactics[1:] if t.path == "gemv"]
    first = [tactics[0], *[t for t in tactics[1:] if t.path != "gemv"], *gemv[:first_gemv]]
    rest = [t for t in tactics if t not in first]
    return first, rest


def sass(kernel) -> dict | None:
    """SASS instructions per weight element of the kernel's main loop (nvdisasm)."""
    try:
        from bench_w4a16 import sass_per_element
    except ImportError as exc:  # recorded in the JSON
        return {"error": str(exc)}
    return sass_per_element(kernel)


def table(rows: list[dict]) -> str:
    def f(x: float) -> str:
        return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f}"

    def r(a: float, b: float) -> str:
        ok = a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and b > 0
        return f"{a / b:.2f}" if ok else "n/a"

    def short(tj: str | None) -> str:
        return label(TritonSm90W4A16Tactic.model_validate_json(tj)) if tj else "-"

    head = ["M", "N", "K", "set", "bf16 µs", "FP8 µs", "gemv best µs", "gemv tactic",
            "direct best µs", "direct tactic", "est pick µs", "est pick", "floor µs",
            "bf16 / best", "FP8 / best", "bf16 / est pick", "eager: est pick µs",
            "eager: bf16 µs", "eager: FP8 µs", "timed", "failed", "max err"]  # fmt: skip
    body = []
    for x in rows:
        best = min(x["best_gemv_us"], x["best_direct_us"], key=lambda v: v if v == v else 1e30)
        timed_n = sum("us" in e for e in x["tactics"].values())
        body.append([str(x["m"]), str(x["n"]), str(x["k"]),
                     "held-out" if x.get("held_out") else "issue", f(x["bf16_us"]), f(x["fp8_us"]),
                     f(x["best_gemv_us"]), short(x["best_gemv"]), f(x["best_direct_us"]),
                     short(x["best_direct"]), f(x["est_pick_us"]), short(x["est_pick"]),
                     f(x["floor_us"]), r(x["bf16_us"], best), r(x["fp8_us"], best),
                     r(x["bf16_us"], x["est_pick_us"]), f(x.get("est_pick_eager_us")),
                     f(x.get("bf16_eager_us")), f(x.get("fp8_eager_us")),
                     f"{timed_n}+{len(x['skipped'])} skipped",
                     str(len(x["failed"])), f"{x['max_err']:.2e}"])  # fmt: skip
    return markdown_table(head, body)


def model_check(rows: list[dict]) -> str:
    """How the (unfitted) estimate did, per path: the median of measured / estimated µs
    over every timed tactic (a scale error), and on how many shapes the estimate's own
    best tactic of the path is within 10% of the measured best (a ranking check)."""
    lines = []
    for path in ("gemv", "direct"):
        ratios, hits, shapes = [], 0, 0
        for row in rows:
            timed_ = {tj: e for tj, e in row["tactics"].items()
                      if e["path"] == path and "us" in e}  # fmt: skip
            if not timed_:
                continue
            shapes += 1
            ratios += [e["us"] / e["est_us"] for e in timed_.values() if e["est_us"]]
            by_est = min(timed_.values(), key=lambda e: e["est_us"])
            hits += by_est["us"] <= 1.1 * min(e["us"] for e in timed_.values())
        if shapes:
            ratios.sort()
            med = ratios[len(ratios) // 2] if ratios else math.nan
            lines.append(f"{path}: measured / estimate median {med:.2f} over {len(ratios)} "
                         f"tactics; estimate's best within 10% of the best on "
                         f"{hits}/{shapes} shapes")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: tiny shapes, interpreter, fp16")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="seconds for the whole run (compile included), then skip")  # fmt: skip
    ap.add_argument("--max-tactics", type=int, default=0,
                    help="time the first N tactics per shape (0: all; --smoke: 4)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=0,
                    help="parallel compile processes (0: CPU count - 2, <= 14)")  # fmt: skip
    ap.add_argument("--mid", action="store_true",
                    help="M = 32-256 instead (MID_MS, MID_HELD_MS): every direct tactic at "
                         "tile_k 128 and 4 stages; writes w4a16_mid.json")  # fmt: skip
    return ap.parse_args(argv)


def run_setup(smoke: bool) -> tuple[bool, torch.device, object, torch.dtype] | None:
    """(on CUDA, device, the device info ranked on, activation dtype) of a run; None (a
    message printed) without CUDA unless ``smoke``. Shared with bench_w4a4_decode.py and
    bench_w4a16_ws.py."""
    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        print("no CUDA device: run on an H200, or pass --smoke for a CPU check", file=sys.stderr)
        return None
    # the rated device, as the dispatcher sees it (`detect` alone leaves the compute rates
    # at their placeholders: the first run's estimates were off by 10^4 for that reason)
    info = rated(detect(0)) if cuda else simulated("sm90")
    if cuda and (info.cc is None or not 90 <= info.cc < 100):
        print(f"warning: {info.name} is not sm90; using the simulated sm90 rules", flush=True)
        info = simulated("sm90")
    # fp16 under the interpreter: it mishandles bf16 operands of tl.dot (the direct kernel)
    dtype = torch.bfloat16 if cuda else torch.float16
    return cuda, torch.device("cuda" if cuda else "cpu"), info, dtype


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    setup = run_setup(args.smoke)
    if setup is None:
        return 2
    cuda, device, info, dtype = setup
    grid = shape_grid(cuda, mid=args.mid)
    name = "w4a16_mid.json" if args.mid else "w4a16_decode.json"
    plans = {}
    for m, n, k in grid:
        p = Problem(m=m, n=n, k=k, out_dtype=str(dtype).split(".")[1], operation="w4a16")
        cap = args.max_tactics or (4 if args.smoke else 0)
        ts = decode_tactics(p, info)
        plans[(m, n, k)] = (p, ts[:cap] if cap else ts)
    jobs = [(BACKEND, t, p) for p, ts in plans.values() for t in ts]
    workers = args.workers or max(1, min(14, (os.cpu_count() or 2) - 2))
    fails = failures_by_tactic(precompile_kernels(jobs, info if cuda else simulated("sm90"),
                                                  workers))  # fmt: skip
    print(f"precompiled {len({t for _, t, _ in jobs})} tactics for {len(grid)} shapes in "
          f"{time.time() - t0:.0f}s; {len(fails)} failed", flush=True)  # fmt: skip
    deadline = t0 + args.budget_s  # the whole run, compiling included
    result = {"device": info.name, "torch": torch.__version__, "smoke": args.smoke,
              "compile_failures": fails, "shapes": []}  # fmt: skip
    shapes, rows = {}, {}
    for pass_no in (0, 1):
        for key, (_, tactics) in plans.items():
            t1 = time.time()
            if key not in shapes:
                shapes[key] = Shape(*key, device, dtype)
                rows[key] = new_row(shapes[key], tactics[0])
            measure(rows[key], shapes[key], info, deadline,
                    split_passes(tactics, FIRST_PASS_GEMV)[pass_no])  # fmt: skip
            print(
                f"pass {pass_no + 1} {'x'.join(map(str, key))}: "
                f"{len(rows[key]['tactics'])} checked [{time.time() - t1:.0f}s]",
                flush=True,
            )
    for key, row in rows.items():
        finish(row, shapes[key], info, deadline)
        result["shapes"].append(row)
        print(f"{'x'.join(map(str, key))}: bf16 {row['bf16_us']:.1f} us, gemv "
              f"{row['best_gemv_us']:.1f}, direct {row['best_direct_us']:.1f}, est pick "
              f"{row['est_pick_us']:.1f}; {len(row['failed'])} failed, "
              f"{len(row['skipped'])} skipped", flush=True)  # fmt: skip
        write_json(name, result)  # after every shape: a cut run keeps its rows
    shapes.clear()
    print("\n" + table(result["shapes"]))
    result["model_check"] = model_check(result["shapes"])
    print("\n" + result["model_check"])
    bad = sum(len(r["failed"]) for r in result["shapes"])
    print(f"\n{bad} tactic(s) over rel err {TOL} or failing; total {time.time() - t0:.0f}s")
    path = write_json(name, result)
    if path:
        print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
