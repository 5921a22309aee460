"""Where the host time of one eager call goes: each layer of the launch path timed alone.

A decode step runs eagerly unless it is captured, so every microsecond of host time per
call is GPU idle time. This breaks an eager `Dispatcher.gemm` / `Nvfp4Linear` call into
its layers - torch allocations and small ops, Triton's compiled-kernel runner, the
launcher below it - beside `torch._scaled_mm` and bf16 `nn.Linear` from the same run,
and profiles the whole calls (cProfile, top functions by own time). Eager walls are
`fp4_dispatch.harness.eager_wall_us` (back-to-back calls, synchronised once at the end).

The ``--paths`` section compares the two launch paths on the calls users make - each
call with replays (a warm plan relaunching its recorded kernels through
``cuLaunchKernelEx``, `fp4_dispatch.backends.driver_launch`) and without
(``Dispatcher(replay=False)``: Triton's launcher) - beside ``nn.Linear`` and
``torch._scaled_mm``, each the median of 5 samples of 200 back-to-back calls, and times the
replay's own layers (the driver launch alone, the replay with its patching, the plan's
run, the dispatcher's run).

Run on the H200 (writes ``$OUT/launch_overhead.json``)::

    python benchmarks/bench_launch_overhead.py [--n 4096] [--k 4096] [--paths]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import logging
import os
import pstats
import sys
from pathlib import Path

import torch
from torch import nn

from fp4_dispatch import Dispatcher, quantize_nvfp4
from fp4_dispatch.harness import eager_wall_us
from fp4_dispatch.nn import Nvfp4Linear

log = logging.getLogger("bench_launch_overhead")


def _source_head(obj: object, lines: int = 40) -> str:
    """The first lines of `obj`'s source (what this Triton's launch path does)."""
    try:
        return "\n".join(inspect.getsource(obj).splitlines()[:lines])
    except (OSError, TypeError) as exc:
        return f"<no source: {exc}>"


def _profile(fn, calls: int = 2000, top: int = 22) -> str:
    """cProfile of `calls` calls of `fn`, the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def _plan_launch(d: Dispatcher, key: tuple):
    """The plan of `key` and the Triton pieces of its kernel's launch (or Nones)."""
    plan = d._plans.get(key)
    kernel = getattr(plan, "kernel", None)
    bound = getattr(kernel, "_bound", None)
    if isinstance(bound, dict):
        bound = next(iter(b for b in bound.values() if b._runners), None)
    return plan, bound


def _launch_layers(d: Dispatcher, op: str, key: tuple, call, wall) -> None:
    """Time the plan of `key`, its `BoundLaunch`, Triton's runner and the launcher below."""
    plan, bound = _plan_launch(d, key)
    log.info("%s plan: %r", op, plan)
    if plan is None:
        return
    wall(f"{op} plan(...) (kernel object + launch)", lambda: call(plan))
    if bound is None:
        return
    (key_grid, runner) = next(iter(bound._runners.items()))
    grid = key_grid[1]
    captured: dict[str, tuple] = {}
    real_launch = bound._launch

    def spy(r, g, a):
        captured["args"] = tuple(a)
        return real_launch(r, g, a)

    bound._launch = spy
    call(plan)
    bound._launch = real_launch
    rt = captured["args"]
    full = tuple(bound._all_args(rt))
    wall(f"{op} BoundLaunch(grid, args)", lambda: bound(grid, rt))
    wall(f"{op} runner(*all_args) (CompiledKernel[grid])", lambda: runner(*full))
    compiled = next(iter(bound._compiled.values()))
    log.info("--- %s CompiledKernel.run type %s\n%s", op, type(compiled.run).__name__,
             _source_head(type(compiled.run).__call__, 60))  # fmt: skip
    g3 = (*grid, 1, 1)[:3]
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(g3[0], g3[1], g3[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *full)  # fmt: skip

    ptrs = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in full)

    def direct_ints():  # pointers as ints: no data_ptr() call or pointer check in C
        compiled.run(g3[0], g3[1], g3[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *ptrs)  # fmt: skip

    for name, fn in (("fixed stream", direct), ("int pointers", direct_ints)):
        try:
            wall(f"{op} compiled.run(...) {name}", fn)
        except Exception as exc:  # a different runner signature: recorded
            log.warning("compiled.run %s failed: %s: %s", name, type(exc).__name__, exc)
    log.info("%s launcher .launch: %r; scratch %s/%s", op, getattr(compiled.run, "launch", None),
             getattr(compiled.run, "global_scratch_size", "?"),
             getattr(compiled.run, "profile_scratch_size", "?"))  # fmt: skip


def _median_wall(fn) -> float:
    """Eager µs per call: the median of 5 samples of 200 back-to-back calls."""
    import statistics

    from fp4_dispatch.harness import eager_wall_samples

    return statistics.median(eager_wall_samples(fn, calls=200, warmup=50, replays=5))


def launch_paths(dev: torch.device) -> dict[str, float]:
    """Each user-facing eager call with replays and without, beside nn.Linear and
    ``_scaled_mm`` (the issue's table), then the replay's layers."""
    walls: dict[str, float] = {}

    def wall(name: str, fn) -> None:
        fn()
        torch.cuda.synchronize()
        walls[name] = round(_median_wall(fn), 2)
        log.info("%-58s %8.2f us", name, walls[name])

    on, off = Dispatcher(cache=False, replay=True), Dispatcher(cache=False, replay=False)
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in ((4096, 4096), (14336, 4096)):
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        layers = {"replay": Nvfp4Linear.from_linear(lin, dispatcher=on),
                  "triton": Nvfp4Linear.from_linear(lin, dispatcher=off)}  # fmt: skip
        with torch.inference_mode():
            for shape in ((1, k), (1, 1, k), (16, k), (16, 1, k)):
                x = torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)
                wall(f"nn.Linear {shape} -> {n}", lambda x=x, lin=lin: lin(x))
                for path, layer in layers.items():
                    for _ in range(3):  # warm: plan, recording, the layer's fast call
                        layer(x)
                    wall(f"Nvfp4Linear {shape} -> {n} [{path}]", lambda x=x, q=layer: q(x))
    k = n = 4096
    qb = quantize_nvfp4(torch.randn(n, k, device=dev, generator=gen) * 0.02)
    x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
    qa = quantize_nvfp4(x)
    f8 = torch.float8_e4m3fn
    one = torch.ones((), device=dev)
    x8, w8 = x.to(f8), torch.randn(n, k, device=dev, generator=gen).to(f8)
    wall("torch._scaled_mm 1x4096x4096", lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))  # fmt: skip
    for path, d in (("replay", on), ("triton", off)):
        for _ in range(3):
            d.gemm(qa, qb), d.gemm(x, qb)
        wall(f"Dispatcher.gemm(qa, qb) 1x4096x4096 [{path}]", lambda d=d: d.gemm(qa, qb))
        wall(f"Dispatcher.gemm(x, qb) w4a16 1x4096x4096 [{path}]", lambda d=d: d.gemm(x, qb))
    wall("quantize_nvfp4(x) one row", lambda: quantize_nvfp4(x))
    # the replay's layers, on the W4A16 plan of 1x4096x4096
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    alpha = qb.global_scale.reshape(1)
    args = (x, qb.data, qb.scale, alpha, out, None, None)
    key = (1, n, k, "bfloat16", "w4a16")
    plan = on.cached_plan(*key)
    replay = on.replay_of(key, args)
    log.info("plan %r replay %r", plan, replay)
    if replay is not None:
        launch = replay.launches[-1]
        stream = torch._C._cuda_getCurrentRawStream(dev.index or 0)
        wall("DriverLaunch.launch (kept buffer, one kernel)", lambda: launch.launch(stream))
        wall("Replay((x, out)) (patch + launches)", lambda: replay((x, out)))
        wall("Plan.run(args) (key + replay)", lambda: plan.run(args))
        wall("Dispatcher._run (plan look-up + run)", lambda: on._run(key, args))
        wall("torch.empty((1, N)) bf16", lambda: torch.empty((1, n), dtype=torch.bfloat16,
                                                             device=dev))  # fmt: skip
    return walls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--paths", action="store_true",
                   help="only the two launch paths (replay, Triton) on users' calls")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.paths:
        res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "walls_us": launch_paths(torch.device("cuda"))}  # fmt: skip
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "launch_paths.json").write_text(json.dumps(res, indent=1))
        return 0
    import triton
    from triton.compiler import compiler as tcomp

    dev = torch.device("cuda")
    n, k, calls = args.n, args.k, args.calls
    res: dict[str, object] = {"triton": triton.__version__, "torch": torch.__version__}
    log.info("triton %s torch %s %s", triton.__version__, torch.__version__,
             torch.cuda.get_device_name())  # fmt: skip
    log.info("--- CompiledKernel.__getitem__\n%s", _source_head(tcomp.CompiledKernel.__getitem__))

    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    qa, qb = quantize_nvfp4(x), quantize_nvfp4(w)
    d = Dispatcher()
    walls: dict[str, float] = {}

    def wall(name: str, fn) -> None:
        fn()
        torch.cuda.synchronize()
        walls[name] = round(eager_wall_us(fn, calls=calls, warmup=50), 2)
        log.info("%-44s %8.2f us", name, walls[name])

    ga, gb = qa.global_scale, qb.global_scale
    wall("torch.empty(1, N) bf16", lambda: torch.empty((1, n), dtype=torch.bfloat16, device=dev))
    wall("x.new_empty((1, N))", lambda: x.new_empty((1, n)))
    wall("ga * gb (one small kernel)", lambda: ga * gb)
    wall("torch.cuda.current_stream().cuda_stream",
         lambda: torch.cuda.current_stream().cuda_stream)  # fmt: skip
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_stream is not None:
        wall("torch._C._cuda_getCurrentRawStream(0)", lambda: raw_stream(0))
    drv = triton.runtime.driver.active
    wall("triton driver get_current_stream", lambda: drv.get_current_stream(0))
    wall("torch.cuda.is_current_stream_capturing", torch.cuda.is_current_stream_capturing)

    f8 = torch.float8_e4m3fn
    x8, w8 = x.to(f8), w.to(f8)
    one = torch.ones((), device=dev)
    wall("torch._scaled_mm 1xNxK fp8", lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))  # fmt: skip
    lin = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        wall("nn.Linear bf16 M=1 (bias)", lambda: lin(x))
    wall("quantize_nvfp4(x) M=1", lambda: quantize_nvfp4(x))
    wall("Dispatcher.gemm(qa, qb) w4a4", lambda: d.gemm(qa, qb))
    wall("Dispatcher.gemm(x, qb) w4a16", lambda: d.gemm(x, qb))
    for acts in ("bf16", "nvfp4"):
        layer = Nvfp4Linear.from_linear(lin, activations=acts)
        with torch.inference_mode():
            wall(f"Nvfp4Linear M=1 activations={acts}", lambda layer=layer: layer(x))

    # the layers of each plan's launch
    out = torch.empty((1, n), dtype=torch.bfloat16, device=dev)
    alpha = (ga * gb).reshape(1)
    calls4 = {
        "w4a4": lambda plan: plan(qa.data, qa.scale, qb.data, qb.scale, alpha, out),
        "w4a16": lambda plan: plan(x, qb.data, qb.scale, gb.reshape(1), out),
    }
    for op, call in calls4.items():
        _launch_layers(d, op, (1, n, k, "bfloat16", op), call, wall)

    res["walls_us"] = walls
    with torch.inference_mode():
        layer = Nvfp4Linear.from_linear(lin, activations="bf16")
        profiles = {
            "gemm_w4a4": _profile(lambda: d.gemm(qa, qb), calls),
            "nvfp4linear_bf16": _profile(lambda: layer(x), calls),
            "quantize": _profile(lambda: quantize_nvfp4(x), calls),
        }
    for name, text in profiles.items():
        log.info("=== cProfile %s (%d calls)\n%s", name, calls, text)
    res["profiles"] = profiles
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "launch_overhead.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
