"""The ``ranking`` suite: what ranking costs, how good the picks are, how the models fit.

    python -m benchmarks ranking --cases rank flashinfer fit   # CPU
    python -m benchmarks ranking --cases selection             # H200: every tactic timed

- ``rank`` (CPU; issue 3's targets): enumerate + score + cap ~2,000 candidates of three
  synthetic Blackwell-like families (the tile / cluster / swap / knob grids of the
  FlashInfer SM107 measurements) on a simulated sm107 in <= 10 ms - warm memo, cold memo,
  tactic objects rebuilt on every call - and a memoized ``select`` in <= 5 µs.
- ``selection`` (GPU): per shape, the tuned pick and the heuristic pick against the
  exhaustive best: every valid tactic timed by `Tuner.measure` (at most 200, or ``--top``
  when above 4: best estimates first, then evenly spaced), tuned twice (cold and warm,
  same pick expected). One row per timed tactic (case ``selection all``: the input of the
  W4A4 cost-model fit, ``fit_cost_model.py rows.jsonl``) and one per pick (targets:
  tuned / best <= 1.03, heuristic / best <= 1.15, tuning <= 2 s).
- ``flashinfer`` (CPU, ``.[flashinfer]``): FlashInfer's own mm_fp4 shortlist beside ours
  over the same tactics on simulated SM100 and SM107: kept per family, families starved,
  ranking time.
- ``fit`` (CPU): the committed cost-model constants against the committed H200 sweeps
  they were fitted on (``fit_w4a16_model.py --check`` in every mode, the mma time scale,
  ``fit_cost_model.py --check`` on the held-out W4A4 grid): pick / best per set. Re-fit
  with the scripts themselves (``--write``; their docstrings).
"""

from __future__ import annotations

import contextlib
import gc
import io
import itertools
import math
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Literal

from .common import ROOT, Context, on_cuda_or_smoke

SELECTION_GRID = ((1, 16, 128, 1024, 4096, 16384), ((8192, 8192), (28672, 8192), (8192, 28672)))
RANK_SHAPES = [(m, n, k) for m in (1, 16, 128, 1024, 4096, 8192, 32768)
               for n, k in ((7168, 7168), (4096, 8192))]  # fmt: skip
CLUSTERS = [(m, n) for m in (1, 2, 4) for n in (1, 2, 4)]


def synthetic_backends(fresh: bool) -> list:
    """Three families of ~2,000 valid tactics together; `fresh` rebuilds the pydantic
    objects on every enumeration (the worst case: a cold validation memo for each)."""
    from fp4_dispatch.contracts.backend import Backend, Support
    from fp4_dispatch.contracts.tactics import Tactic

    class Sm100(Tactic):
        backend: Literal["syn-sm100"] = "syn-sm100"
        prefetch: bool = False

    class Sm107(Tactic):
        backend: Literal["syn-sm107"] = "syn-sm107"
        inst_m: Literal[128, 256] = 128
        b_reuse: bool = False
        prefetch: Literal[0, 2, "stages"] = 0

    class StreamK(Tactic):
        backend: Literal["syn-sm107s"] = "syn-sm107s"
        inst_m: Literal[128, 256] = 128
        b_reuse: bool = False
        raster: Literal["m", "n"] = "m"
        stages: Literal[3, 4] = 3

    class Synthetic(Backend):
        version = "0"

        def __init__(self, ttype, specs, axes) -> None:
            self.name, self.tactic_type = ttype.model_fields["backend"].default, ttype
            self.family, self.diversity_axes = self.name[4:], axes
            self.specs = list(specs)
            self.cached = [ttype(**s) for s in self.specs]

        def supports(self, device):
            return Support(device.cc is not None and device.cc >= 100, "synthetic Blackwell")

        def tactics(self, problem, device):
            return [self.tactic_type(**s) for s in self.specs] if fresh else self.cached

        def build(self, tactic, problem, device):
            raise NotImplementedError("synthetic: ranking benchmark only")

    tiles = [(128, n) for n in (8, 16, 32, 64, 128, 192, 256)] + [(256, n) for n in
                                                                   (64, 128, 192, 256)]  # fmt: skip
    sm100 = [dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, swap_ab=s, prefetch=p)
             for (tm, tn), (cm, cn), s, p in itertools.product(tiles, CLUSTERS, (0, 1), (0, 1))
             if not ((tn < 64 and cn != 1) or (tm == 256 and cm % 2))]  # fmt: skip

    def sm107(extra: dict[str, tuple]) -> list[dict]:
        out = []
        grid = ((128, 256), (False, True), (64, 128, 192, 256), CLUSTERS, (False, True))
        for inst, reuse, tn, (cm, cn), s in itertools.product(*grid):
            if inst == 256 and cm % 2:
                continue
            base = dict(tile_m=inst * (2 if reuse else 1), tile_n=tn, cluster_m=cm,
                        cluster_n=cn, swap_ab=s, inst_m=inst, b_reuse=reuse)  # fmt: skip
            out += [{**base, **dict(zip(extra, v, strict=True))}
                    for v in itertools.product(*extra.values())]  # fmt: skip
        return out

    return [Synthetic(Sm100, sm100, ("swap_ab", "prefetch")),
            Synthetic(Sm107, sm107({"prefetch": (0, 2, "stages")}),
                      ("swap_ab", "inst_m", "prefetch")),
            Synthetic(StreamK, sm107({"raster": ("m", "n"), "stages": (3, 4)}),
                      ("swap_ab", "raster"))]  # fmt: skip


def rank(ctx: Context) -> None:
    """Ranking and select cost against issue 3's targets (module docstring)."""
    from fp4_dispatch.autotune import harness
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.loading.profiles import simulated
    from fp4_dispatch.policy import ranking
    from fp4_dispatch.policy.ranking import Ranker, shortlist

    def cold() -> None:  # forget every memo of the ranking module
        ranking._CHECKED.clear()
        ranking._BY_ID.clear()
        ranking._shared_us.cache_clear()

    device = simulated("sm107")
    cached, fresh = synthetic_backends(False), synthetic_backends(True)
    repeats = 3 if ctx.smoke else 15
    problems = [Problem(m=m, n=n, k=k) for m, n, k in (RANK_SHAPES[:2] if ctx.smoke
                                                        else RANK_SHAPES)]  # fmt: skip
    cases = {
        "enumerate, cached objects": (lambda p: [list(b.tactics(p, device)) for b in cached], None),
        "enumerate, fresh objects": (lambda p: [list(b.tactics(p, device)) for b in fresh], None),
        "rank, warm memo": (lambda p: shortlist(p, device, cached), None),
        "rank, cold memo": (lambda p: shortlist(p, device, cached), cold),
        "rank, fresh objects, cold memo": (lambda p: shortlist(p, device, fresh), cold),
    }
    count = sum(len(b.cached) for b in cached)
    for name, (fn, before) in cases.items():
        got = []
        for p in problems:
            fn(p)
            got.append(harness.call_wall_us(lambda p=p, fn=fn: fn(p), repeats, before))
        late = name.startswith("rank") and statistics.median(got) > 10_000 and not ctx.smoke
        ctx.emit([ctx.row("rank", backend=name, clock="host", median_us=statistics.median(got),
                          spread_us=(min(got), max(got)), extra={"candidates": count},
                          failure="target <= 10 ms missed" if late else None)])  # fmt: skip
    r = Ranker(cached, device)
    r.pick(3000, 7168, 7168)  # fills the bucket and the exact-M memo
    gc.disable()
    try:
        per = harness.eager_wall_samples(
            lambda: r.pick(3000, 7168, 7168), calls=1000 if ctx.smoke else 100_000, warmup=1
        )
    finally:
        gc.enable()
    med = statistics.median(per)
    ctx.emit(
        [
            ctx.row(
                "rank",
                backend="Ranker.pick memoized (select)",
                clock="eager",
                median_us=med,
                spread_us=(min(per), max(per)),
                failure="target <= 5 µs missed" if med > 5 and not ctx.smoke else None,
            )
        ]
    )


def selection(ctx: Context) -> None:
    """Tuned and heuristic picks against every tactic timed (module docstring)."""
    if not on_cuda_or_smoke(ctx, "selection"):
        return
    grid = ctx.grid(*(((1, 16), ((256, 512),)) if ctx.smoke else SELECTION_GRID))
    cap = ctx.args.top if ctx.args.top > 4 else 200  # the runner's default 4: 200 tactics
    deadline = time.monotonic() + ctx.args.budget_s
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(grid):
            ctx.emit(_selection_shape(ctx, shape, Path(tmp) / str(i), cap, deadline))


def _selection_shape(ctx: Context, shape, cache: Path, cap: int, deadline: float) -> list:
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.autotune.tuning import Tuner
    from fp4_dispatch.contracts.tactics import Problem, tactic_label
    from fp4_dispatch.policy.ranking import shortlist

    (m, n, k), clock = shape, "graph" if ctx.cuda else "eager"
    p = Problem(m=m, n=n, k=k)
    d1 = Dispatcher(str(ctx.device), cache=cache.with_suffix(".a.json"))
    heuristic = d1.select(m, n, k)
    t0 = time.perf_counter()
    (first,) = d1.tune([shape], progress=False)
    first_s = time.perf_counter() - t0
    every = shortlist(p, d1.device, d1.available, budget=10**9).candidates
    todo = sample(every, cap)
    measured = Tuner(d1).measure(p, todo, deadline=deadline)
    d2 = Dispatcher(str(ctx.device), cache=cache.with_suffix(".b.json"))
    t0 = time.perf_counter()
    (warm,) = d2.tune([shape], progress=False)
    warm_s = time.perf_counter() - t0
    rows = [ctx.row("selection all", backend=x.candidate.backend, clock=clock,
                    tactic=tactic_label(x.candidate.tactic), m=m, n=n, k=k,
                    operation=p.operation, median_us=x.us if x.ok else None,
                    failure=x.error or None, extra={
                        "method": x.method, "est_us": x.candidate.est_us,
                        "tactic_json": x.candidate.tactic.canonical_json()})
            for x in measured]  # fmt: skip
    timed = {(x.candidate.backend, x.candidate.tactic): x.us for x in measured if x.ok}
    best = min(timed.values(), default=math.nan)
    same = _same(warm.winner, first.winner)
    for name, c, target, secs in (("tuned", warm.winner, 1.03, warm_s),
                                  ("tuned first", first.winner, 1.03, first_s),
                                  ("heuristic", heuristic, 1.15, None)):  # fmt: skip
        us = timed.get((c.backend, c.tactic), math.nan) if c is not None else math.nan
        over = us / best if best > 0 else math.nan
        rows.append(ctx.row(
            "selection", backend=name, m=m, n=n, k=k, clock=clock,
            tactic="-" if c is None else f"{c.backend} {tactic_label(c.tactic)}",
            median_us=us if math.isfinite(us) else None,
            ratios={"best": best / us} if us > 0 else {},
            failure=f"pick / best {over:.3f} > {target}" if over > target else None,
            extra={"tune_s": secs, "valid": len(every), "timed": len(todo), "same_pick": same},
        ))  # fmt: skip
    return rows


def _same(a, b) -> bool:
    return a is not None and b is not None and (a.backend, a.tactic) == (b.backend, b.tactic)


def sample(cands: list, cap: int) -> list:
    """At most `cap` candidates: the best half by estimate, then evenly spaced others."""
    if len(cands) <= cap:
        return cands
    head, rest = cands[: cap // 2], cands[cap // 2 :]
    step = len(rest) / (cap - len(head))
    return head + [rest[int(i * step)] for i in range(cap - len(head))]


def flashinfer(ctx: Context) -> None:
    """FlashInfer's mm_fp4 shortlist beside ours over the same tactics (simulated)."""
    try:
        import flashinfer.gemm.gemm_base as gb
    except ImportError as exc:
        ctx.emit([ctx.row("flashinfer", clock="host", failure=f"needs .[flashinfer]: {exc}")])
        return
    from fp4_dispatch.loading.profiles import simulated
    from fp4_dispatch.plugins import flashinfer as fip

    del gb  # imported to say whether FlashInfer is here
    ms, nks = ((1,), ((7168, 2048),)) if ctx.smoke else (
        (1, 32, 300, 4096, 32768), ((7168, 2048), (4096, 8192), (28672, 8192)))  # fmt: skip
    for dev in (simulated("sm100"), simulated("sm107")):
        backends = [cls() for cls in fip.BACKENDS if cls().supports(dev).ok]
        for m, n, k in ctx.grid(ms, nks):
            ctx.emit(_flashinfer_rows(ctx, dev, backends, m, n, k))


def _flashinfer_rows(ctx: Context, dev, backends: list, m: int, n: int, k: int) -> list:
    """Both shortlists of one problem: kept per family, starved families, ranking time."""
    import flashinfer.gemm.gemm_base as gb

    from fp4_dispatch.autotune import harness
    from fp4_dispatch.backends import flashinfer as fb
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.plugins import flashinfer as fip
    from fp4_dispatch.policy.ranking import shortlist

    cc, sms, p = dev.cc, dev.sm_count, Problem(m=m, n=n, k=k)
    valid = fb.valid_tactics(m, n, k, "bfloat16", cc, sms)
    own = fb.flashinfer_shortlist(m, n, k, "bfloat16", cc, sms)
    cap = gb._MM_FP4_CUTE_DSL_MAX_TUNING_CONFIGS
    fi_us = harness.call_wall_us(lambda: gb._rank_mm_fp4_autotune_tactics(
        list(valid), m, n, k, sms, cap), 3)  # fmt: skip
    ours = shortlist(p, dev, backends, budget=32)
    our_us = harness.call_wall_us(lambda: shortlist(p, dev, backends, budget=32), 3)
    valid_n = Counter(fip.tactic_of(t).backend for t in valid)
    rows = []
    for who, us, kept in (
        ("flashinfer", fi_us, Counter(fip.tactic_of(t).backend for t in own)),
        ("fp4-dispatch", our_us, Counter(c.family for c in ours.candidates)),
    ):
        starved = sorted(f for f in valid_n if valid_n[f] and not kept.get(f))
        rows.append(ctx.row("flashinfer", backend=who, m=m, n=n, k=k, clock="host",
                            median_us=us, extra={"device": dev.name, "kept": dict(kept),
                                                 "valid": dict(valid_n), "starved": starved,
                                                 "filled": sum(kept.values())}))  # fmt: skip
    return rows


def fit(ctx: Context) -> None:
    """Score the committed constants on the committed sweeps (module docstring)."""
    from . import fit_cost_model, fit_w4a16_model

    runs = [
        (f"w4a16 {mode or 'direct'}", fit_w4a16_model.main, ["--check", *mode.split()])
        for mode in ("", "--dense", "--mid", "--ws", "--rs", "--mma", "--mma-scale")
    ]
    held = ROOT / "benchmarks" / "data" / "sm90_w4a4_heldout2_run3.json"
    runs.append(("w4a4 held-out", fit_cost_model.main, ["--check", str(held)]))
    for name, main, argv in runs[:1] if ctx.smoke else runs:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            code = main(argv)
        for line in text.getvalue().splitlines():
            if "pick/best" not in line and "held-out grid" not in line:
                continue
            words = line.split()
            figures = {w.rstrip(",;:"): v for w, v in itertools.pairwise(words)}
            ctx.emit([ctx.row(f"fit {name}", backend=line.split(":")[0][:60], clock="host",
                              failure=None if code == 0 else f"exit {code}",
                              extra={"line": line.strip()[:300], **{
                                  k: float(v.rstrip(",;")) for k, v in figures.items()
                                  if k in ("mean", "worst") and _float(v)}})])  # fmt: skip


def _float(text: str) -> bool:
    try:
        float(text.rstrip(",;"))
    except ValueError:
        return False
    return True


ROUTINES = {"rank": rank, "selection": selection, "flashinfer": flashinfer, "fit": fit}
SMOKE = ("rank", "fit")
