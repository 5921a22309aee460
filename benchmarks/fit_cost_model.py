"""Fit the sm90 W4A4 cost model (plugins/sm90/cost_model.py) to measured tactic times.

Input: one or more selection files - the committed sweeps' JSON (``rows[*].all``: tactic,
est_us, us, method) or the JSON lines of ``python -m benchmarks ranking --cases selection``
- with every valid tactic of each shape timed ("pruned" rows carry a single-launch probe
time). Output: ``plugins/sm90/cost_model.json`` (the
constants the plugin loads), recording the files and grids it was fitted on, the date
and the cross-validation figures.

Model (documented in the plugin module): a roofline of the busiest SM (latency rounds,
waves at the compiled kernels' occupancy, dequantizer, MMA, memory) times per-knob
efficiency factors ``exp(sum log_factor[feature] * value)``. The roofline constants are
found by coordinate search in log space (steps x2, x1.41, x1.19) starting from
`PRIOR_DIRECT` / `PRIOR_UNPACK` (round physical values, never a previous fit:
``--no-search`` keeps them); for each trial the factors are re-fitted. The objective,
per shape, is the expected log-regret of a soft pick - a softmin over the estimates at
temperature T picks tactic i with probability p_i, the loss is ``sum_i p_i log(us_i /
best)`` - annealed from T = 0.2 to 0.03 (log units) towards the hard pick the dispatcher
makes; plus ``ALPHA`` x a weighted squared log error (weights ``exp(-log(us / best) /
TAU)``, floor ``W_FLOOR``, pruned probes x0.5) that keeps the scale calibrated across
the two backends, and a ridge penalty (``RIDGE``) that pulls rare knobs to factor 1 (the
roofline). Adam on numpy, no scipy (not on the device). A regression-only fit ranked
worse (14/24 in-sample, v4): what decides a pick is the order of the near-best tactics,
not the mean error.

The plugin's formulas are evaluated on numpy arrays (`_Numpy`), so the fit optimizes
exactly the function the plugin computes (`consistent` checks it on every row).

Occupancy (``--occupancy``): every direct kernel config the backend offers is compiled
for sm_90 on the CPU (Triton's target-only driver, ptxas) and its registers per thread,
shared memory and stack frame are written into the data file (``occupancy``): the
measured input of the occupancy and spill terms. Re-run it when the kernel changes.

Quality is counted the way the dispatcher picks (`Ranker.pick`: lowest estimate of the
M bucket, ties by backend and tactic JSON): a shape is a hit when the pick's measured time
is within ``HIT`` (1.15) x the best measured. In-sample, leave-one-(N, K)-out and
leave-one-M-out: per fold the whole fit (constant search and factors, from the same
priors) re-runs without the left-out group; the figures are written into the file.

Usage::

    # fit on the training files, write the plugin's data file, print the CV figures
    python benchmarks/fit_cost_model.py benchmarks/data/sm90_w4a4_train_run3.json \
        benchmarks/data/sm90_w4a4_heldout1_run3.json

    # the held-out check (the CURRENT installed model, never fitted on this file);
    # with --out also the result as JSON
    python benchmarks/fit_cost_model.py --check held_out_selection.json [--out check.json]

    # the compiled kernels' registers / shared memory / spills into the data file
    python benchmarks/fit_cost_model.py --occupancy

    # a small copy of a selection file (only what the fit and the check read)
    python benchmarks/fit_cost_model.py --slim selection.json benchmarks/data/x.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HIT = 1.15
#: the structure of plugins/sm90/cost_model.py this script fits (v5: occupancy, waves,
#: p-norm overlap, knob indicators + spill; v4: per-tile factors with log-M slopes)
MODEL_VERSION = 5
#: calibration weights: exp(-log(us / best) / TAU), at least W_FLOOR; pruned probes x0.5
TAU = 0.25
W_FLOOR = 0.05
PRUNED_WEIGHT = 0.5
#: weight of the calibration term and of the ridge penalty against the selection loss
ALPHA = 0.05
RIDGE = 0.2
#: (softmin temperature in log units, Adam iterations): annealed towards a hard pick
SCHEDULE = ((0.2, 300), (0.1, 300), (0.05, 300), (0.03, 300))
SEARCH_SCHEDULE = ((0.03, 60),)
LEARNING_RATE = 0.01
#: H200 peak bandwidth the selection files' estimates were made with (GB/s): the
#: driver's memory clock x bus width; recovered from the files' own est_us to 1e-4
H200_MEM_BW_GBPS = 4814.4
DIRECT_KNOBS = ("step_us", "a_side_cost", "dequant_elems_per_sm_us", "bw_fraction",
                "in_flight_bytes", "launch_us", "split_reduce_us", "ctas_per_sm",
                "sat_warps", "natural_order_cost", "overlap_p")  # fmt: skip
UNPACK_KNOBS = ("gemm_eff", "bw_fraction", "cta_us", "launch_us", "wave_exp")
#: where every fit's coordinate search starts (the module doc of the plugin says what
#: each is): round physical values, not a previous fit, so that a fit and each
#: cross-validation fold are reproducible from the data alone
PRIOR_DIRECT: dict[str, Any] = {
    "step_us": 1.0,  # one K step's latency, us (a global load under load, ~1 us)
    "ctas_per_sm": 3.0,  # resident CTAs beyond which latency stops hiding
    "a_side_cost": 1.5,  # the A operand's dequantization cost per element vs B's
    "dequant_elems_per_sm_us": 40000.0,  # elements per SM per us at full occupancy
    "mma_eff": {"16": 0.3, "32": 0.4, "64": 0.6, "128": 0.75},  # of the bf16 peak
    "bw_fraction": 0.85,  # of peak HBM bandwidth when enough bytes are in flight
    "in_flight_bytes": 16e6,  # bytes in flight that saturate HBM (Little's law)
    "launch_us": 4.0,  # kernel launch and tail under CUDA graphs
    "split_reduce_us": 1.0,  # per extra split: its partial tile read by the last split
    "sat_warps": 8.0,  # resident warps per SM that saturate dequant and MMA issue
    # the natural-order dequantizer's cost per element vs the dot-order one's (SASS count
    # of issue 13 run 2: 6.1-7.0 vs 4.2 instructions per element)
    "natural_order_cost": 1.5,
    # how the latency, dequant, MMA and memory times combine: the p-norm of the four (p = 1:
    # they add up, nothing overlaps; large p: the largest alone, perfect overlap)
    "overlap_p": 4.0,
}
#: the physical range of each searched constant (the search stays inside): a constant at
#: its bound says the data wants more than the term's physics allows - a missing term
BOUNDS: dict[str, tuple[float, float]] = {
    "step_us": (0.1, 5.0),
    "ctas_per_sm": (1.0, 32.0),  # Hopper's resident CTA limit
    "a_side_cost": (0.5, 2.0),  # both operands run the same dequantizer
    "dequant_elems_per_sm_us": (5e3, 3e5),
    "mma_eff": (0.05, 1.0),  # of the bf16 peak
    "bw_fraction": (0.3, 1.0),  # of the peak HBM bandwidth
    "in_flight_bytes": (1e6, 1e8),
    "launch_us": (1.0, 20.0),  # a launch under CUDA graphs
    "split_reduce_us": (0.01, 10.0),
    "sat_warps": (4.0, 32.0),  # one warp per scheduler up to 8 per scheduler
    "natural_order_cost": (1.0, 2.0),  # the natural order has more instructions per element
    "overlap_p": (1.0, 16.0),
    "unpack.gemm_eff": (0.3, 1.0),
    "unpack.bw_fraction": (0.3, 1.0),
    "unpack.cta_us": (0.0, 1.0),
    "unpack.launch_us": (1.0, 40.0),  # three launches and cuBLAS's
    "unpack.wave_exp": (0.0, 1.0),
}
PRIOR_UNPACK: dict[str, Any] = {"gemm_eff": 1.0, "bw_fraction": 0.85, "cta_us": 0.03,
                                "launch_us": 10.0,
                                # share of cuBLAS's wave quantization it does not hide
                                "wave_exp": 0.5}  # fmt: skip


# ---- data ----------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    tactic: Any
    us: float
    pruned: bool


@dataclass
class Shape:
    m: int
    n: int
    k: int
    rows: list[Row]
    source: str

    @property
    def best_us(self) -> float:
        return min(r.us for r in self.rows)


def backends() -> dict[str, Any]:
    from fp4_dispatch.plugins.sm90 import TritonSm90Backend, TritonSm90UnpackBackend

    return {b.name: b for b in (TritonSm90Backend(), TritonSm90UnpackBackend())}


def load_shapes(paths: list[str]) -> list[Shape]:
    """Every timed shape of the files (failed and untimed tactics dropped)."""
    bs = backends()
    shapes = []
    for path in paths:
        data = _selection_rows(Path(path))
        for row in data["rows"]:
            if "skipped" in row:
                continue
            rows = []
            for x in row["all"]:
                if x["us"] is None or x["method"] == "skipped":
                    continue
                b = bs[x["tactic"]["backend"]]
                rows.append(Row(b.name, b.tactic_type.model_validate(x["tactic"]), float(x["us"]),
                                x["method"] == "pruned"))  # fmt: skip
            if rows:
                shapes.append(Shape(*row["shape"], rows, str(path)))
    return shapes


def _selection_rows(path: Path) -> dict[str, Any]:
    """A selection file: the JSON of the committed sweeps (``{"meta", "rows"}``), or the
    JSON lines of ``python -m benchmarks ranking --cases selection`` (its ``selection
    all`` rows, one per timed tactic, grouped here by shape into the same form)."""
    if path.suffix != ".jsonl":
        return json.loads(path.read_text())
    shapes: dict[tuple[int, int, int], list] = {}
    meta: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("case") != "selection all":
            continue
        meta = {"device": r["device"], "date": r["date"], "commit": r["commit"]}
        shapes.setdefault((r["m"], r["n"], r["k"]), []).append({
            "tactic": json.loads(r["extra"]["tactic_json"]), "us": r["median_us"],
            "method": r["extra"]["method"]})  # fmt: skip
    return {"meta": meta, "rows": [{"shape": list(s), "all": a} for s, a in shapes.items()]}


def device(mem_bw_gbps: float = H200_MEM_BW_GBPS):
    from fp4_dispatch.plugins.sm90 import PROFILE

    return PROFILE.device.model_copy(update={"mem_bw_gbps": mem_bw_gbps, "name": "H200"})


def slim(src: str, dst: str) -> None:
    """Keep what the fit and the check read: meta, shapes, and per tactic (tactic, us,
    method); the tactic's default-valued fields are dropped."""
    data = json.loads(Path(src).read_text())
    rows = []
    for r in data["rows"]:
        if "skipped" in r:
            rows.append({"shape": r["shape"], "skipped": r["skipped"]})
            continue
        rows.append({"shape": r["shape"], "best_us": r["best_us"],
                     "all": [{"tactic": x["tactic"], "us": x["us"], "method": x["method"]}
                             for x in r["all"]]})  # fmt: skip
    meta = {k: v for k, v in data["meta"].items() if k != "precompile"}
    Path(dst).write_text(json.dumps({"meta": meta, "rows": rows}, separators=(",", ":")) + "\n")


# ---- the model, vectorized -------------------------------------------------------------


class _Numpy:
    """The element-wise operations of the plugin's formulas on numpy arrays (the plugin's
    `cost_model._Scalar` on floats)."""

    ceil = staticmethod(np.ceil)
    floor = staticmethod(np.floor)
    minimum = staticmethod(np.minimum)
    maximum = staticmethod(np.maximum)

    @staticmethod
    def lookup(table: dict[str, float], key: np.ndarray) -> np.ndarray:
        out = np.empty(len(key))
        for k in np.unique(key):
            out[key == k] = table[str(int(k))]
        return out


class Design:
    """Per-row constant-free terms (from the plugin's own functions) as numpy arrays."""

    def __init__(self, shapes: list[Shape], dev) -> None:
        from fp4_dispatch.contracts.tactics import Problem
        from fp4_dispatch.plugins.sm90 import cost_model as cm

        self.shapes, self.dev = shapes, dev
        terms: dict[str, list[dict]] = {"direct": [], "unpack": []}
        feats: list[dict[str, float]] = []
        self.kind, self.shape_of, self.logus, self.w = [], [], [], []
        for si, s in enumerate(shapes):
            p = Problem(m=s.m, n=s.n, k=s.k)  # train M are buckets; else: see check()
            best = s.best_us
            for r in s.rows:
                if r.backend == "triton-sm90":
                    terms["direct"].append(cm.direct_terms(p, dev, r.tactic))
                    feats.append({"d:" + f: v for f, v in cm.direct_features(p, r.tactic).items()})
                    self.kind.append(0)
                else:
                    terms["unpack"].append(cm.unpack_terms(p, dev, r.tactic))
                    feats.append({"u:" + f: v for f, v in cm.unpack_features(p, r.tactic).items()})
                    self.kind.append(1)
                self.shape_of.append(si)
                self.logus.append(math.log(r.us))
                w = max(W_FLOOR, math.exp(-math.log(r.us / best) / TAU))
                self.w.append(w * (PRUNED_WEIGHT if r.pruned else 1.0))
        self.kind, self.shape_of = np.array(self.kind), np.array(self.shape_of)
        #: first row of each shape (rows are grouped by shape) and log(us / best)
        self.starts = np.flatnonzero(np.r_[True, np.diff(self.shape_of) != 0])
        self.gap = np.array(self.logus) - np.log([shapes[i].best_us for i in self.shape_of])
        self.logus, self.w = np.array(self.logus), np.array(self.w)
        # a fold may hold no rows of one backend (e.g. no M >= 256): its terms stay empty
        self.d = {k: np.array([t[k] for t in terms["direct"]]) for t0 in terms["direct"][:1]
                  for k in t0}  # fmt: skip
        self.u = {k: np.array([t[k] for t in terms["unpack"]]) for t0 in terms["unpack"][:1]
                  for k in t0}  # fmt: skip
        self.names = sorted({f for fs in feats for f in fs})
        col = {f: i for i, f in enumerate(self.names)}
        self.x = np.zeros((len(feats), len(self.names)))
        for i, fs in enumerate(feats):
            for f, v in fs.items():
                self.x[i, col[f]] = v

    def base(self, c: dict[str, Any]) -> np.ndarray:
        """Log of the roofline part of every row: the plugin's own `direct_base_us` /
        `unpack_base_us` evaluated on arrays (`_Numpy`), so fit and plugin share one formula."""
        from fp4_dispatch.plugins.sm90 import cost_model as cm

        out = np.empty(len(self.kind))
        if self.d:
            out[self.kind == 0] = np.log(cm.direct_base_us(self.d, c["direct"], _Numpy))
        if self.u:
            out[self.kind == 1] = np.log(cm.unpack_base_us(self.u, c["unpack"], _Numpy))
        return out

    def objective(self, theta: np.ndarray, logbase: np.ndarray, temp: float):
        """(loss, gradient in theta): expected log-regret of a soft pick + calibration.

        Per shape, a softmin over the estimates (temperature `temp` in log units) picks
        tactic i with probability p_i; the selection loss is sum_i p_i log(us_i / best).
        ``ALPHA`` x the weighted squared log error keeps the scale calibrated (the direct
        and unpack paths compete on it) and ``RIDGE`` pulls factors towards 1.
        """
        le = logbase + self.x @ theta
        z = -le / temp
        seg, starts = self.shape_of, self.starts
        p = np.exp(z - np.maximum.reduceat(z, starts)[seg])
        p /= np.add.reduceat(p, starts)[seg]
        regret = np.add.reduceat(p * self.gap, starts)
        coef = p * (self.gap - regret[seg]) * (-1.0 / temp)
        err = le - self.logus
        loss = regret.sum() + ALPHA * np.sum(self.w * err**2) + RIDGE * theta @ theta
        grad = coef @ self.x + 2 * ALPHA * (self.w * err) @ self.x + 2 * RIDGE * theta
        return float(loss), grad

    def solve(self, logbase: np.ndarray, theta0: np.ndarray | None = None,
              schedule=SCHEDULE) -> np.ndarray:  # fmt: skip
        """Factors minimizing `objective`: Adam, temperature annealed over `schedule`."""
        theta = np.zeros(len(self.names)) if theta0 is None else theta0.copy()
        for temp, iters in schedule:
            m1, m2 = np.zeros_like(theta), np.zeros_like(theta)
            for it in range(1, iters + 1):
                _, g = self.objective(theta, logbase, temp)
                m1 = 0.9 * m1 + 0.1 * g
                m2 = 0.999 * m2 + 0.001 * g * g
                theta -= LEARNING_RATE * (m1 / (1 - 0.9**it)) / (np.sqrt(m2 / (1 - 0.999**it))
                                                                 + 1e-8)  # fmt: skip
        return theta


def _knobs() -> list[tuple[str, str]]:
    out = [("direct", k) for k in DIRECT_KNOBS] + [("unpack", k) for k in UNPACK_KNOBS]
    return out + [("direct", f"mma_eff.{t}") for t in ("16", "32", "64", "128")]


def _get(c, part, knob):
    if knob.startswith("mma_eff."):
        return c[part]["mma_eff"][knob.split(".")[1]]
    return c[part][knob]


def _set(c, part, knob, value):
    c = json.loads(json.dumps(c))
    if knob.startswith("mma_eff."):
        c[part]["mma_eff"][knob.split(".")[1]] = value
    else:
        c[part][knob] = value
    return c


def fit(design: Design, c0: dict[str, Any], search: bool = True, log=print):
    """Factors by `Design.solve`; with `search`, the roofline constants by coordinate
    search in log space (steps x2, x1.41, x1.19) inside their physical `BOUNDS`, each
    trial scored by the objective at the final temperature after re-fitting the factors
    from the current ones."""
    c = json.loads(json.dumps(c0))
    theta = design.solve(design.base(c))
    final = SCHEDULE[-1][0]
    best, _ = design.objective(theta, design.base(c), final)
    if search:
        for step in (math.log(2.0), math.log(2.0) / 2, math.log(2.0) / 4):
            improved = True
            while improved:
                improved = False
                for part, knob in _knobs():
                    for sign in (1, -1):
                        now = _get(c, part, knob)
                        lo, hi = BOUNDS[
                            knob.split(".")[0] if part == "direct" else part + "." + knob
                        ]
                        value = min(hi, max(lo, now * math.exp(sign * step)))
                        if value == now:
                            continue
                        trial = _set(c, part, knob, value)
                        logbase = design.base(trial)
                        th = design.solve(logbase, theta, SEARCH_SCHEDULE)
                        loss, _ = design.objective(th, logbase, final)
                        if loss < best - 1e-6:
                            c, best, theta, improved = trial, loss, th, True
                            log(f"  {part}.{knob} -> {value:.4g} (loss {loss:.4f})")
        theta = design.solve(design.base(c), theta)
        best, _ = design.objective(theta, design.base(c), final)
    tables: dict[str, dict[str, float]] = {"direct": {}, "unpack": {}}
    for name, value in zip(design.names, theta, strict=True):
        if abs(value) >= 5e-5:
            tables["direct" if name.startswith("d:") else "unpack"][name[2:]] = round(
                float(value), 4
            )
    c["direct"]["log_factor"], c["unpack"]["log_factor"] = tables["direct"], tables["unpack"]
    return c, best


def consistent(design: Design, c: dict[str, Any]) -> None:
    """The vectorized model the fit optimized equals the plugin's own `direct_us` /
    `unpack_us` on every row (else the file would not mean what was fitted)."""
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.plugins.sm90 import cost_model as cm

    col = {f: i for i, f in enumerate(design.names)}
    theta = np.zeros(len(design.names))
    for part, prefix in (("direct", "d:"), ("unpack", "u:")):
        for f, v in c[part]["log_factor"].items():
            theta[col[prefix + f]] = v
    fitted = design.base(c) + design.x @ theta
    i = 0
    for s in design.shapes:
        p = Problem(m=s.m, n=s.n, k=s.k)
        for r in s.rows:
            if r.backend == "triton-sm90":
                us = cm.direct_us(p, design.dev, r.tactic, c["direct"])
            else:
                us = cm.unpack_us(p, design.dev, r.tactic, c["unpack"])
            if abs(math.log(us) - fitted[i]) > 1e-6:
                raise RuntimeError(f"fit and plugin disagree on {s.m}x{s.n}x{s.k} "
                                   f"{r.tactic}: {math.exp(fitted[i])} vs {us} us")  # fmt: skip
            i += 1


# ---- picks -------------------------------------------------------------------------------


def picks(shapes: list[Shape], dev, c: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per shape: the dispatcher's heuristic pick with constants `c` (None: the installed
    file) among the backends' tactics, and its measured time against the best."""
    from fp4_dispatch.loading.guard import Guard
    from fp4_dispatch.plugins.sm90 import cost_model as cm
    from fp4_dispatch.policy.ranking import Ranker

    bs = backends()
    saved = cm.constants
    if c is not None:
        cm.constants = lambda: c  # the ranker calls the plugin's estimate_us
    try:
        ranker = Ranker(list(bs.values()), dev, 32, guard=Guard())
        out = []
        for s in shapes:
            pick = ranker.pick(s.m, s.n, s.k)
            times = {(r.backend, r.tactic): r.us for r in s.rows}
            us = times.get((pick.backend, pick.tactic), math.nan)
            out.append({"shape": [s.m, s.n, s.k], "pick_us": us, "best_us": s.best_us,
                        "ratio": us / s.best_us, "pick": f"{pick.backend} {pick.tactic}",
                        "measured": (pick.backend, pick.tactic) in times})  # fmt: skip
        return out
    finally:
        cm.constants = saved


def quality(rows: list[dict[str, Any]]) -> str:
    ratios = [r["ratio"] for r in rows if math.isfinite(r["ratio"])]
    hits = sum(x <= HIT for x in ratios)
    geo = statistics.geometric_mean(ratios) if ratios else math.nan
    missing = sum(not r["measured"] for r in rows)
    return (f"{hits}/{len(rows)} shapes within {HIT - 1:.0%} of the best (geomean "
            f"{geo:.3f}, worst {max(ratios, default=math.nan):.3f})"
            + (f"; {missing} picks not in the measured set" if missing else ""))  # fmt: skip


def cross_validate(
    shapes: list[Shape], start: dict[str, Any], dev, key, search: bool = True, log=print
) -> list[dict[str, Any]]:
    """Leave one group out (`key`: shape -> group): the whole fit (roofline constants with
    `search`, and the factors) re-run on the other groups from the same starting constants
    `start` as the full fit, then the picks on the left-out group."""
    out: list[dict[str, Any]] = []
    groups = sorted({key(s) for s in shapes})
    for i, g in enumerate(groups):
        train = Design([s for s in shapes if key(s) != g], dev)
        fold, _ = fit(train, start, search=search, log=lambda *a: None)
        rows = picks([s for s in shapes if key(s) == g], dev, fold)
        log(f"  fold {i + 1}/{len(groups)} (without {g}): {quality(rows)}")
        out += rows
    return out


def cv_record(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A cross-validation's figures as the data file keeps them (summary, hits, misses)."""
    return {"summary": quality(rows), "hits": sum(r["ratio"] <= HIT for r in rows),
            "shapes": len(rows), "misses": [[*r["shape"], round(r["ratio"], 3)]
                                            for r in rows if not r["ratio"] <= HIT]}  # fmt: skip


# ---- occupancy: the compiled kernels' registers and shared memory -----------------------

#: shapes whose valid direct tactics span the kernel configs the backend offers (decode to
#: prefill, narrow and wide N and K): `occupancy` compiles each config once
OCCUPANCY_SHAPES = tuple((m, n, k) for m in (1, 16, 32, 64, 128, 256, 512, 4096)
                         for n, k in ((4096, 4096), (28672, 8192), (3584, 18944)))  # fmt: skip
#: ELF attributes of a cubin's ``.nv.info`` section: (symbol, registers per thread) and
#: (symbol, stack frame bytes per thread - where spilled registers live)
EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack frame bytes per thread) of the one kernel in `cubin`:
    the ``EIATTR_REGCOUNT`` and ``EIATTR_FRAME_SIZE`` records of its ``.nv.info`` section
    (what ``ptxas -v`` prints as "Used N registers" and "N bytes stack frame")."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, strndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = heads[strndx][4]
    found: dict[int, int] = {}
    for name_off, _, _, _, off, size in heads:
        if cubin[names + name_off : cubin.index(b"\0", names + name_off)] != b".nv.info":
            continue
        p = off
        while p < off + size:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, then (symbol, value) for these two
                n = struct.unpack_from("<H", cubin, p + 2)[0]
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
                    found[attr] = struct.unpack_from("<II", cubin, p + 4)[1]
                p += 4 + n
            else:  # EIFMT_HVAL (u16 value) or EIFMT_NVAL (none)
                p += 4 if fmt == 0x03 else 2
    if EIATTR_REGCOUNT not in found:
        raise ValueError("cubin: no EIATTR_REGCOUNT record in .nv.info")
    return found[EIATTR_REGCOUNT], found.get(EIATTR_FRAME_SIZE, 0)


def occupancy(log=print) -> dict[str, Any]:
    """Registers per thread, shared memory bytes and stack frame (spill) bytes per thread
    of every direct kernel config
    (``TMxTNxTK/wW``, with and without split-K) compiled for sm_90 by this process's
    Triton and ptxas, no GPU needed (a target-only driver, as tests/test_precompile.py)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class TargetOnly:  # compile for sm_90, launch nothing
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    driver.set_active(TargetOnly())
    from fp4_dispatch.contracts.backend import kernel_problem
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.plugins.sm90 import cost_model as cm

    b, dev = backends()["triton-sm90"], device()
    configs: dict[str, Any] = {}
    for m, n, k in OCCUPANCY_SHAPES:
        for t in b.tactics(Problem(m=m, n=n, k=k), dev):
            key = cm.occupancy_key(t)
            if key not in configs:
                configs[key] = t.model_copy(update={"swap_ab": False, "group_m": 1})
    table: dict[str, list[int]] = {}
    for i, (key, t) in enumerate(sorted(configs.items())):
        p = kernel_problem(Problem(m=256, n=4096, k=4096), t)
        compiled = b.precompile(t, p, dev)
        regs, frame = cubin_resources(compiled.asm["cubin"])
        table[key] = [regs, int(compiled.metadata.shared), frame]
        log(f"  [{i + 1}/{len(configs)}] {key}: {regs} registers, {table[key][1]} B shared, "
            f"{frame} B stack frame")  # fmt: skip
    return {"source": f"compiled for sm_90 by Triton {triton.__version__} (ptxas) on a CPU: "
            "benchmarks/fit_cost_model.py --occupancy", "date": time.strftime("%Y-%m-%d"),
            "kernels": table}  # fmt: skip


# ---- held-out check ------------------------------------------------------------------


def check(
    path: str, mem_bw_gbps: float = H200_MEM_BW_GBPS, model: str | None = None
) -> dict[str, Any]:
    """The held-out check: the installed model's (or `model` file's) heuristic pick on
    shapes it was never fitted on (every measured tactic re-estimated by the plugin)."""
    from fp4_dispatch.plugins.sm90 import cost_model as cm

    shapes = load_shapes([path])
    c = None if model is None else cm.load(Path(model))
    rows = picks(shapes, device(mem_bw_gbps), c)
    fitted_on = (cm.constants() if c is None else c).get("fitted_on", {})
    meta = _selection_rows(Path(path))["meta"]
    overlap = sorted({(s.n, s.k) for s in shapes}
                     & {tuple(x) for x in fitted_on.get("nk", [])})  # fmt: skip
    return {"file": str(path), "grid_nk": sorted({(s.n, s.k) for s in shapes}),
            "grid_m": sorted({s.m for s in shapes}), "held_out": not overlap,
            "overlap_with_fit": overlap, "model": fitted_on, "measured_on": meta.get("device"),
            "summary": quality(rows), "hits": sum(r["ratio"] <= HIT for r in rows),
            "shapes": len(rows), "rows": rows}  # fmt: skip


# ---- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global RIDGE, ALPHA
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("train", nargs="*", help="selection JSON files to fit on")
    ap.add_argument(
        "--out", default=None, help="data file (default: the plugin's); with --check: result JSON"
    )
    ap.add_argument("--check", default=None, help="held-out selection JSON: check only")
    ap.add_argument(
        "--model", default=None, help="with --check: this model file, not the installed one"
    )
    ap.add_argument("--occupancy", action="store_true",
                    help="compile every direct kernel for sm_90 (no GPU) and write its "
                    "registers and shared memory into the data file")  # fmt: skip
    ap.add_argument("--slim", nargs=2, metavar=("SRC", "DST"), help="write a small copy")
    ap.add_argument("--mem-bw", type=float, default=H200_MEM_BW_GBPS, help="GB/s of the GPU")
    ap.add_argument("--no-cv", action="store_true", help="skip the cross-validation")
    ap.add_argument(
        "--no-search",
        action="store_true",
        help="keep the PRIOR_* roofline constants (default: search them)",
    )
    ap.add_argument("--ridge", type=float, default=RIDGE, help="ridge weight on the factors")
    ap.add_argument("--alpha", type=float, default=ALPHA, help="calibration weight")
    args = ap.parse_args(argv)
    RIDGE, ALPHA = args.ridge, args.alpha
    if args.slim:
        slim(*args.slim)
        return 0
    if args.occupancy:
        from fp4_dispatch.plugins.sm90 import cost_model as cm

        out = Path(args.out) if args.out else cm.MODEL_FILE
        c = json.loads(out.read_text())
        c["occupancy"] = occupancy()
        out.write_text(json.dumps(c, indent=1) + "\n")
        print(f"wrote {len(c['occupancy']['kernels'])} kernels' occupancy into {out}")
        return 0
    if args.check:
        res = check(args.check, args.mem_bw, args.model)
        for r in res["rows"]:
            print(f"  {r['shape']}: pick x{r['ratio']:.3f} ({r['pick_us']:.1f} / "
                  f"{r['best_us']:.1f} us) {r['pick']}")  # fmt: skip
        print(f"held-out grid N,K {res['grid_nk']} x M {res['grid_m']} "
              f"({'never fitted on' if res['held_out'] else 'OVERLAPS the fit'}): "
              f"{res['summary']}")  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0
    if not args.train:
        ap.error("give training files (or --check / --slim / --occupancy)")
    return fit_files(args.train, Path(args.out) if args.out else None, args.mem_bw,
                     search=not args.no_search, cv=not args.no_cv)  # fmt: skip


def starting_constants(c_file: dict[str, Any]) -> dict[str, Any]:
    """What every fit starts from: the data file with its direct and unpack parts reset to
    `PRIOR_DIRECT` / `PRIOR_UNPACK` (no factors), so that a fit does not depend on the
    previous fit and a cross-validation fold sees nothing of its left-out group."""
    c = json.loads(json.dumps(c_file))
    c["direct"] = {**json.loads(json.dumps(PRIOR_DIRECT)), "log_factor": {}}
    c["unpack"] = {**json.loads(json.dumps(PRIOR_UNPACK)), "log_factor": {}}
    return c


def at_bounds(c: dict[str, Any]) -> list[str]:
    """The searched constants of `c` that sit at a `BOUNDS` end (the data pulls them past
    what the term's physics allows: the term stands in for something it does not model)."""
    out = []
    for part, knob in _knobs():
        lo, hi = BOUNDS[knob.split(".")[0] if part == "direct" else part + "." + knob]
        value = _get(c, part, knob)
        if math.isclose(value, lo, rel_tol=1e-6) or math.isclose(value, hi, rel_tol=1e-6):
            out.append(f"{part}.{knob}={value:.4g}")
    return out


def grid_of(shapes: list[Shape]) -> dict[str, Any]:
    return {"nk": sorted({(s.n, s.k) for s in shapes}), "m": sorted({s.m for s in shapes}),
            "shapes": len(shapes)}  # fmt: skip


def fit_files(paths: list[str], out: Path | None, mem_bw: float, search: bool = True,
              cv: bool = True) -> int:  # fmt: skip
    """Fit on the selection files `paths`, write the data file `out` (default the plugin's)
    with what it was fitted on and the cross-validation figures."""
    from fp4_dispatch.plugins.sm90 import cost_model as cm

    out = cm.MODEL_FILE if out is None else out
    dev = device(mem_bw)
    shapes = load_shapes(paths)
    design = Design(shapes, dev)
    c_file = cm.load(out if out.exists() else cm.MODEL_FILE)
    before = quality(picks(shapes, dev, c_file))
    start = starting_constants(c_file)
    t0 = time.time()
    c, loss = fit(design, start, search=search)
    consistent(design, c)
    after = picks(shapes, dev, c)
    c["version"] = MODEL_VERSION
    c["note"] = ("fitted by benchmarks/fit_cost_model.py: roofline constants by coordinate "
                 "search from its PRIOR_* constants, log_factor by the regret objective "
                 "(module doc); occupancy from --occupancy (compiled kernels)")  # fmt: skip
    c["fitted_on"] = {
        "files": [Path(p).name for p in paths],
        "grids": {Path(p).name: grid_of([s for s in shapes if s.source == str(p)])
                  for p in paths},
        **grid_of(shapes),
        "rows": len(design.kind), "device": "H200 (132 SMs)", "mem_bw_gbps": mem_bw,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    c["in_sample"] = quality(after)
    c["at_bounds"] = at_bounds(c)
    print(f"fitted in {time.time() - t0:.0f} s on {len(shapes)} shapes, {len(design.kind)} "
          f"tactics; loss {loss:.3f}")  # fmt: skip
    print(f"in-sample with the file's previous constants: {before}")
    print(f"in-sample after: {c['in_sample']}; constants at a bound: {c['at_bounds']}")
    if cv:
        c["cv_protocol"] = ("leave one group out; per fold the whole fit (constants "
                            + ("searched" if search else "kept") + " from PRIOR_*, factors) "
                            "re-run without the group, picks counted on it")  # fmt: skip
        for name, key in (("leave_one_nk_out", lambda s: (s.n, s.k)),
                          ("leave_one_m_out", lambda s: s.m)):  # fmt: skip
            c[name] = cv_record(cross_validate(shapes, start, dev, key, search))
            print(f"{name}: {c[name]['summary']}; misses {c[name]['misses']}")
    out.write_text(json.dumps(c, indent=1) + "\n")
    for r in after:
        if r["ratio"] > HIT:
            print(f"  in-sample miss {r['shape']}: x{r['ratio']:.3f} {r['pick']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
