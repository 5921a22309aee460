"""The ``tuning`` suite: what tuning costs and that it never adopts a loser or a wrong kernel.

    python -m benchmarks tuning                        # every routine (H200, ~5 minutes)
    python -m benchmarks tuning --cases fleet
    torchrun --nproc-per-node 2 -m benchmarks tuning --cases fleet    # distributed tuning

- ``cold``: wall time of `Dispatcher.tune` with nothing compiled, each scenario in a
  fresh process with empty Triton, kernel and tuning caches: ``precompile`` (10 shapes
  in one call, kernels compiled first in parallel; target <= 30 s; then one new M bucket
  of a compiled (N, K), target <= 3 s) and ``serial`` (``precompile=False``, the first
  shape and the new bucket only).
- ``fleet``: each shape tuned from scratch under ``measure="graph"`` and ``"eager"``
  (memory only); the winner, the paired ratio winner / default of the never-loses check,
  and an independent check outside the tuner (the adopted pick and the default timed
  again on fresh inputs by the harness: ``check`` <= 1 + band). Under torchrun: every
  rank warms up, rank 0 tunes alone (timed), then the group tunes together; rows per
  rank's picks, whether all agree, and the wall time against rank 0 alone.
- ``checks``: every shortlisted real kernel passes the tuner's float64 check (a false
  "wrong" would drop a good kernel; fails the run otherwise), the seconds the check
  costs, and a second dispatcher on the same cache verifying the cached pick on first use.
- ``first-use``: the first ``Dispatcher.gemm`` of a process through a third-party plugin
  (the reference kernel registered as one) with the first-use check on and off, in fresh
  interpreters (target: the check adds <= 5 %), and the check alone.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from .common import Context, on_cuda_or_smoke, python

COLD_SHAPES = [(1, 8192, 8192), (64, 8192, 8192), (4096, 8192, 8192), (1, 28672, 8192),
               (256, 28672, 8192), (1, 8192, 28672), (512, 8192, 28672), (1, 10240, 8192),
               (128, 10240, 8192), (2048, 10240, 8192)]  # fmt: skip
NEW_BUCKET = (16, 8192, 8192)
SMOKE_SHAPES = [(1, 256, 512), (64, 256, 512)]
FLEET_SHAPES = [(1, 8192, 8192), (16, 28672, 8192), (256, 8192, 28672), (4096, 8192, 8192)]
CHECK_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (128, 4096, 14336), (1024, 8192, 8192),
                (4096, 8192, 8192), (8192, 8192, 28672), (100, 3000, 4096)]  # fmt: skip

COLD_CHILD = """
import json, os, sys, time
from fp4_dispatch import Dispatcher
pc = sys.modules[Dispatcher.tune.__module__]._precompile  # the module tune() is in
shapes, bucket = json.loads(os.environ["SHAPES"]), tuple(json.loads(os.environ["BUCKET"]))
pre = os.environ["SCENARIO"] == "precompile"
reports, real = [], pc.precompile
pc.precompile = lambda *a, **kw: reports.append(real(*a, **kw)) or reports[-1]
d = Dispatcher(device=os.environ["DEV"])
out = {}
for name, todo in (("cold", [tuple(s) for s in shapes]), ("new bucket", [bucket])):
    reports.clear()
    t0 = time.perf_counter()
    results = d.tune(todo, precompile=pre, progress=False)
    out[name] = {"wall_s": time.perf_counter() - t0, "shapes": len(todo),
                 "measured": sum(len(r.measurements) for r in results),
                 "failed_tactics": sum(len(r.failures) for r in results),
                 "compiled": sum(len(r.compiled) for r in reports),
                 "compile_failed": sum(len(r.failed) for r in reports),
                 "compile_s": sum(r.seconds for r in reports)}
print(json.dumps(out))
"""


def cold(ctx: Context) -> None:
    """Each scenario in a fresh process with empty caches (module docstring)."""
    if not on_cuda_or_smoke(ctx, "cold"):
        return
    shapes = ctx.args.shapes or (SMOKE_SHAPES if ctx.smoke else COLD_SHAPES)
    bucket = (16, 256, 512) if ctx.smoke else NEW_BUCKET
    for scenario in ("precompile", "serial"):
        todo = shapes if scenario == "precompile" else shapes[:1]
        with tempfile.TemporaryDirectory(prefix=f"fp4-cold-{scenario}-") as tmp:
            env = {"TRITON_CACHE_DIR": f"{tmp}/triton", "FP4_DISPATCH_KERNEL_CACHE": f"{tmp}/k",
                   "FP4_DISPATCH_CACHE": f"{tmp}/t.json", "FP4_DISPATCH_PROGRESS": "0",
                   "SHAPES": json.dumps(todo), "BUCKET": json.dumps(bucket),
                   "DEV": str(ctx.device), "SCENARIO": scenario}  # fmt: skip
            got = json.loads(python(COLD_CHILD, env, timeout=900).splitlines()[-1])
        for part, target in (("cold", 30.0), ("new bucket", 3.0)):
            g = got[part]
            late = scenario == "precompile" and g["wall_s"] > target and not ctx.smoke
            ctx.emit([ctx.row(f"cold {part}", backend=scenario, clock="host",
                              median_us=g["wall_s"] * 1e6,
                              failure=f"target <= {target:g} s missed" if late else None,
                              extra={**g, "target_s": target})])  # fmt: skip


def _label(c) -> str:
    from fp4_dispatch.contracts.tactics import tactic_label

    return "-" if c is None else f"{c.backend} {tactic_label(c.tactic)}"


def _recheck(d, r, smoke: bool) -> float | None:
    """Adopted pick / default, timed again outside the tuner (fresh inputs, seed 1)."""
    from fp4_dispatch.autotune import harness
    from fp4_dispatch.loading.guard import launch_candidate

    if r.winner is None:
        return None
    if _label(r.winner) == _label(r.heuristic) and r.winner.tactic == r.heuristic.tactic:
        return 1.0
    p = r.problem
    inputs = harness.make_inputs(p, d.device, seed=1, copies=1)

    def call(c):
        kernel = d.kernel_for(c, p)
        return lambda: launch_candidate(c, kernel, inputs.copies[0], inputs.out)

    if r.measure == "graph":
        times = [harness.gpu_time_us(call(c)) for c in (r.winner, r.heuristic)]
    else:
        calls = 5 if smoke else 200
        times = [harness.eager_wall_us(call(c), calls=calls, warmup=2)
                 for c in (r.winner, r.heuristic)]  # fmt: skip
    return times[0] / times[1] if times[1] > 0 else None


def fleet(ctx: Context) -> None:
    """Both policies on one process, or distributed tuning under torchrun."""
    if not on_cuda_or_smoke(ctx, "fleet"):
        return
    from fp4_dispatch import Dispatcher

    if ctx.smoke:
        os.environ.setdefault("FP4_DISPATCH_PLUGINS", "")  # the built-in reference on a CPU
    shapes = ctx.args.shapes or (SMOKE_SHAPES if ctx.smoke else FLEET_SHAPES)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return distributed(ctx, shapes)
    d = Dispatcher(device=str(ctx.device), cache=False)
    for policy in ("graph", "eager") if ctx.cuda else ("eager",):
        for r in d.tune(shapes, measure=policy, force=True, save=False, progress=False):
            check = _recheck(d, r, ctx.smoke)
            lost = check is not None and check > 1 + r.noise_band
            p = r.problem
            ctx.emit([ctx.row(
                "fleet", backend=r.winner.backend if r.winner else "-",
                tactic=_label(r.winner).split(" ", 1)[-1], operation=p.operation,
                m=p.m, n=p.n, k=p.k,
                clock=policy, median_us=r.winner_us if math.isfinite(r.winner_us) else None,
                failure="tuned pick slower than the default beyond the band" if lost else None,
                ratios={"default": r.heuristic_us / r.winner_us} if r.winner_us else {},
                extra={"default": _label(r.heuristic), "paired_ratio": r.paired_ratio,
                       "kept_default": r.kept_default, "check": check, "band": r.noise_band,
                       "measured": len(r.measurements), "tune_s": round(r.wall_s, 2)},
            )])  # fmt: skip


def distributed(ctx: Context, shapes) -> None:
    import datetime as dt

    import torch.distributed as dist

    from fp4_dispatch import Dispatcher

    cuda = ctx.cuda
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(minutes=10))
    try:
        rank = dist.get_rank()
        d = Dispatcher(device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
                       cache=False)  # fmt: skip
        d.tune(shapes, force=True, save=False, progress=False)  # warm-up: every rank compiles
        dist.barrier()
        t0 = time.perf_counter()
        alone = [_label(r.winner) for r in d.tune(shapes, force=True, save=False, progress=False)
                 ] if rank == 0 else None  # fmt: skip
        alone_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        group = d.tune(shapes, force=True, save=False, group=dist.group.WORLD, progress=False)
        mine = {"picks": [_label(r.winner) for r in group], "s": time.perf_counter() - t0}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    agree = all(e["picks"] == every[0]["picks"] for e in every)
    group_s = max(e["s"] for e in every)
    ctx.emit([ctx.row(
        "fleet distributed", backend=f"{len(every)} ranks", clock="host",
        median_us=group_s * 1e6, ratios={"rank 0 alone": alone_s / group_s},
        failure=None if agree and alone == every[0]["picks"] else "ranks disagree",
        extra={"alone_s": round(alone_s, 2), "picks": every[0]["picks"]},
    )])  # fmt: skip


def checks(ctx: Context) -> None:
    """The tuner's check on every real kernel, its cost, the cached pick on first use."""
    if not on_cuda_or_smoke(ctx, "checks"):
        return
    import sys

    from fp4_dispatch.autotune.tuning import Tuner

    tuning_mod = sys.modules[Tuner.__module__]  # where the tuner looks its check up
    spent = [0.0]
    real = tuning_mod.check_output

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    tuning_mod.check_output = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape in ctx.args.shapes or (SMOKE_SHAPES if ctx.smoke else CHECK_SHAPES):
                spent[0] = 0.0
                ctx.emit([_check_shape(ctx, shape, Path(tmp) / f"{shape}.json", spent)])
    finally:
        tuning_mod.check_output = real
    wrong = sum(r.extra["wrong"] for r in ctx.rows if r.case == "checks")
    assert wrong == 0, f"{wrong} real kernel(s) failed the tuner's check"


def _check_shape(ctx: Context, shape: tuple[int, int, int], path: Path, spent: list):
    """Tune one bucket into `path` (every candidate checked), then a second dispatcher on
    that cache: its first ``select`` re-validates and verifies the cached pick."""
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.autotune import harness

    d, got = Dispatcher(str(ctx.device), cache=path), {}
    tune_us = harness.call_wall_us(lambda: got.update(r=d.tune([shape], progress=False)), 1)
    (r,) = got["r"]
    wrong = [f"{m.candidate.backend} {m.candidate.tactic}: {m.error}"
             for m in r.measurements if m.method == "wrong"]  # fmt: skip
    d2 = Dispatcher(str(ctx.device), cache=path)
    first_us = harness.call_wall_us(lambda: got.update(p=d2.select(*shape)), 1)
    return ctx.row(
        "checks", backend=_label(r.winner), m=shape[0], n=shape[1], k=shape[2],
        clock="host", median_us=tune_us, failure="; ".join(wrong)[:500] or None,
        extra={"measured": len(r.measurements), "wrong": len(wrong),
               "check_s": round(spent[0], 3), "first_use_s": round(first_us / 1e6, 3),
               "cached_pick_used": got["p"].reason.startswith("tuned")},
    )  # fmt: skip


FIRST_USE_CHILD = """
import json, os, time
from typing import Literal
import torch
import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Dispatcher, firstuse, quantize_nvfp4
from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic

class ExtTactic(ReferenceTactic):
    backend: Literal["ext-reference"] = "ext-reference"

class Ext(ReferenceBackend):
    name, family, tactic_type = "ext-reference", "ext", ExtTactic
    def tactics(self, problem, device):
        yield ExtTactic(compute_dtype="float32")
    def estimate_us(self, problem, device, tactic):
        return 0.001

real = registry_mod.load
def load(strict=None):
    reg = real(strict=strict)
    reg.backends["ext-reference"] = Ext()
    reg.plugin_of["ext-reference"] = registry_mod.PluginReport(
        "ext", "ext-dist", "bench", "1", builtin=False)
    return reg
registry_mod.load = load
m, n, k = json.loads(os.environ["SHAPE"])
verify = os.environ["VERIFY"] == "on"
g = torch.Generator().manual_seed(0)
qa = quantize_nvfp4(torch.randn(m, k, generator=g))
qb = quantize_nvfp4(torch.randn(n, k, generator=g))
d = Dispatcher(device="cpu", cache=False, verify_plugins=verify)
assert d.select(m, n, k).backend == "ext-reference"
t0 = time.perf_counter()
out = d.gemm(qa, qb)
first = time.perf_counter() - t0
args = (qa.data, qa.scale, qb.data, qb.scale, qa.global_scale, out, qb.global_scale)
t0 = time.perf_counter()
why = firstuse.wrong_output("w4a4", args)
print(json.dumps({"first_s": first, "check_s": time.perf_counter() - t0, "why": why}))
"""


def first_use(ctx: Context) -> None:
    """The first-use check's cost on a process's first call (CPU, fresh interpreters)."""
    shape = (ctx.args.shapes or [(16, 256, 512) if ctx.smoke else (128, 4096, 4096)])[0]
    runs = 1 if ctx.smoke else 5
    env = {"FP4_DISPATCH_CACHE": os.devnull, "FP4_DISPATCH_PROGRESS": "0",
           "SHAPE": json.dumps(shape)}  # fmt: skip
    got = {v: [json.loads(python(FIRST_USE_CHILD, {**env, "VERIFY": v}).splitlines()[-1])
               for _ in range(runs)] for v in ("off", "on")}  # fmt: skip
    off = min(g["first_s"] for g in got["off"])
    rows = []
    for v in ("off", "on"):
        first = [g["first_s"] * 1e6 for g in got[v]]
        rows.append(ctx.row("first-use", backend=f"first gemm, check {v}", m=shape[0],
                            n=shape[1], k=shape[2], clock="host", median_us=min(first),
                            spread_us=(min(first), max(first))))  # fmt: skip
    on = rows[1].median_us / 1e6
    check = min(g["check_s"] for g in got["on"])
    added = on / off - 1
    rows[1].extra = {"added": round(added, 3), "check_alone_s": round(check, 4)}
    if added > 0.05 and not ctx.smoke:
        rows[1].failure = f"the check adds {added:.1%} (target <= 5 %)"
    if any(g["why"] for g in got["on"]):
        rows[1].failure = f"the check rejected a correct output: {got['on'][0]['why']}"
    ctx.emit(rows)


ROUTINES = {"cold": cold, "fleet": fleet, "checks": checks, "first-use": first_use}
SMOKE = ("fleet", "first-use")
