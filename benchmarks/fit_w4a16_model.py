"""Fit the sm90 W4A16 direct-path constants (plugins/sm90/cost_model.json, "w4a16") to a
decode sweep, and check them on its held-out rows.

A sweep is a committed H200 JSON in benchmarks/data (written by the per-kernel scripts of
the day: bench_w4a16_decode.py, bench_w4a4_decode.py, bench_w4a16_ws.py, _mma.py, _rs.py;
git history at d90e9a7 has them) or the rows of a new one: ``python -m benchmarks kernels
--cases w4a16-decode --top 0 --clocks graph`` (``w4a16-mid``, ``w4a4-decode`` likewise),
passed as ``--data FILE.jsonl`` (`sweep`; the held-out shapes are `HELD_OUT`).

The model is `fp4_dispatch.plugins.sm90.w4a16._estimate_direct` (a smooth maximum of a
latency chain, the weight dequantization, the MMA and memory; residency from registers,
shared memory and warps). Four constants are searched on a grid, the others kept:
``step_us``, ``dequant_elems_per_sm_us``, ``in_flight_bytes``, ``direct_bw_fraction``.
The objective is how the dispatcher picks: per in-sample shape, the measured time of the
tactic with the lowest estimate among the OFFERED timed tactics (`why_invalid`) over the
best offered measured time; the mean of that ratio first, then the mean
``|log(estimate / measured)|`` (calibration) breaks ties. Held-out rows (``held_out`` in
the JSON: fixed in the benchmark before the fit) are only scored, never fitted on.

    python benchmarks/fit_w4a16_model.py                 # fit on the committed sweep
    python benchmarks/fit_w4a16_model.py --check          # score the constants in the file
    python benchmarks/fit_w4a16_model.py --data FILE --write  # fit and write the JSON
    python benchmarks/fit_w4a16_model.py --dense [--write]    # the W4A4 entry (below)
    python benchmarks/fit_w4a16_model.py --mid [--write]      # M = 32-256 (below)
    python benchmarks/fit_w4a16_model.py --ws [--write]       # triton-sm90-ws (below)
    python benchmarks/fit_w4a16_model.py --mma [--write]      # triton-sm90-mma (below)
    python benchmarks/fit_w4a16_model.py --rs [--write]       # triton-sm90-rs (below)
    python benchmarks/fit_w4a16_model.py --mma-scale [--write]  # mma's time_scale

``--mid`` fits the M = 32-256 terms on the mid-M sweep
(``--mid-data``; direct tactics, same objective, its held-out rows only scored):
``mid_step_scale`` (the step of tiles of 32+ tokens is as long as the values a thread
moves) and ``mma_eff`` at tile_m 32, 64 and 128. The decode terms are not touched.

``--dense`` fits the two constants of ``triton-sm90-dense`` (the same model with the
activations expanded too, `plugins.sm90.dense`) on the W4A4 decode
sweep (``--dense-data``), after the four above: ``dense_step_scale`` on a grid by the
same objective (the dense tactics only), then ``dense_time_scale`` so that the in-sample
estimates are right on average (the mean of ``log(estimate / measured)`` is zero: its
estimates compete with ``triton-sm90``'s, which are calibrated). Its held-out rows are
the same (M, N, K) as the W4A16 sweep's.

``--ws`` fits ``triton-sm90-ws`` (`plugins.sm90.ws._estimate_ws`, its "ws" part of the
file) on the ws sweep (``--ws-data``; its ws tactics, same
objective, held-out rows only scored): ``deq_step_us``, ``mma_eff`` and ``fixed_us`` on a
grid (``bw_fraction`` kept: `WS_GRID`). It also reports the pick among both W4A16 backends' timed
tactics (the dispatcher's untuned choice) over the best of both, per set.

``--mma`` fits ``triton-sm90-mma`` (`plugins.sm90.mma._estimate_mma`, its "mma" part) the
same way on the mma sweep (``--mma-data``; the decode grid:
M 1, 4, 16 in-sample, its held-out M 2 and 8 x three (N, K) fixed in run 4, before the
kernel existed): the constants of `MMA_GRID`, one at a time (`descend`; ``bw_fraction``
kept), then the pick among both backends.

``--rs`` fits ``triton-sm90-rs`` (`plugins.sm90.rs._estimate_rs`, its "rs" part) on
the rs sweep (``--rs-data``, the committed JSON's own form; M 64 and 256 x the decode grid's
six (N, K) in-sample, M 128 and 192 held out, chosen before the fit): `RS_GRID`, every
combination; then the pick among it and ``triton-sm90-ws`` (timed in the same run).

Runs on a CPU (no Triton needed); the device is the simulated sm90 part at the H200's
rated figures, as the dispatcher estimates on it: since run 6 the part's bandwidth is
the driver's (4814 GB/s, what `device.detect` reads on the H200). The fits of runs 4-5
were made at the measured copy rate (4250) the part then had, so live their memory
terms were off by that ratio; v3 of the constants refits all four on the live figure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pydantic

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import rated, simulated
from fp4_dispatch.plugins.sm90 import dense, mma, rs, ws
from fp4_dispatch.plugins.sm90 import w4a16 as w4

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "sm90_w4a16_decode_run5.json"
DENSE_DATA = ROOT / "benchmarks" / "data" / "sm90_w4a4_decode_run5.json"
DENSE_GRID = (0.6, 0.8, 1.0, 1.2, 1.5, 1.8, 2.1, 2.4, 2.8, 3.2)
MID_DATA = ROOT / "benchmarks" / "data" / "sm90_w4a16_mid_run5.json"
MID_STEP_GRID = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
MMA_EFF_GRID = (0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.1)
WS_DATA = ROOT / "benchmarks" / "data" / "sm90_w4a16_ws_run6.json"
RS_DATA = ROOT / "benchmarks" / "data" / "sm90_w4a16_rs_run11.json"
#: the held-out token counts of the rs fit, chosen before fitting: M = 128 (run 9's rule,
#: kept since) and M = 192 (run 11, chosen before its sweep: the 256-token tile's first
#: M that is not a whole tile) x the six (N, K)
RS_HELD_MS = (128, 192)
#: mma_eff is a fraction of the device's rated bf16 figure (691 TFLOP/s for the H200,
#: `profiles`), so up to 1.4 stays below the tensor cores' 989 TFLOP/s peak.
#: bw_fraction is kept at the file's 0.8: on the run-6 sweep every value from 0.4 to 0.8
#: scored alike (|log err| 0.053-0.060 in-sample), the HBM bound never binds there
WS_GRID = {
    "deq_step_us": (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6),
    "mma_eff": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4),
    "fixed_us": (2.0, 4.0, 6.0, 8.0, 10.0, 12.0),
}
#: the rs grid (bw_fraction kept at 0.8, as for ws): the step of 128 x 128 values, the
#: fixed cost of two launches, the split-K epilogue per wave and the MMA's share after the
#: expansion (run 11). Narrow (3600 scorings, ~10 s: a CI test re-runs the fit); in run 11
#: it was moved until no in-sample optimum lay on an edge (mma_eff stops at 1.4: the
#: tensor cores' peak)
RS_GRID = {
    "deq_step_us": (0.35, 0.4, 0.45, 0.5, 0.55),
    "mma_eff": (1.1, 1.2, 1.3, 1.4),
    "fixed_us": (4.0, 5.0, 6.0, 7.0),
    "shared_step": (1.5, 1.6, 1.7),
    "split_tile_us": (0.0, 1.0, 2.0, 3.0, 4.0),
    "mma_serial": (0.25, 0.5, 0.75),
}
MMA_DATA = ROOT / "benchmarks" / "data" / "sm90_w4a16_mma_run7.json"
#: searched one constant at a time from the file's values (`descend`): the full product
#: is 10^6 scorings
MMA_GRID = {
    "lat_us": (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0),
    "sat_warps": (16.0, 24.0, 32.0, 40.0, 48.0, 64.0, 96.0),
    "pf_lat": (0.6, 0.7, 0.8, 0.9, 1.0, 1.1),
    "own_per_us": (200.0, 250.0, 300.0, 350.0, 400.0, 500.0, 700.0, 1000.0),
    "issue_per_us": (600.0, 700.0, 800.0, 900.0, 1000.0, 1100.0, 1200.0),
    "fixed_us": (1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
    "cta_us": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
    "split_us": (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0),
}
MODEL = ROOT / "plugins" / "sm90" / "cost_model.json"
KEYS = ("step_us", "dequant_elems_per_sm_us", "in_flight_bytes", "direct_bw_fraction")
GRID = {
    "step_us": (0.3, 0.4, 0.5, 0.7, 0.8, 0.9, 1.0, 1.14),
    "dequant_elems_per_sm_us": (3.0e4, 3.5e4, 4.5e4, 5.5e4, 7.0e4, 8.5e4, 1.0e5),
    "in_flight_bytes": (4e6, 6e6, 8e6, 1e7, 1.2e7, 1.6e7),
    "direct_bw_fraction": (0.6, 0.65, 0.7, 0.75, 0.8, 0.85),
}


#: the held-out shapes of every sweep here, fixed before the fits (only scored): M 2 and 8
#: (decode) and 32 and 128 (mid M) x three (N, K) - `benchmarks.kernels.HELD_NK`
HELD_OUT = {(m, n, k) for m in (2, 8, 32, 128)
            for n, k in ((6144, 4096), (28672, 8192), (4096, 14336))}  # fmt: skip


def sweep(path: Path) -> list[dict]:
    """The shapes of a sweep: a committed JSON (``{"shapes": [{m, n, k, held_out,
    tactics: {tactic JSON: {backend, path, us}}}]}``) or the JSON lines of ``python -m
    benchmarks kernels --cases w4a16-decode|w4a16-mid|w4a4-decode --top 0`` (its tactic
    rows of the graph clock, put in the same form; held out: `HELD_OUT`)."""
    if path.suffix != ".jsonl":
        return json.loads(path.read_text())["shapes"]
    shapes: dict[tuple[int, int, int], dict] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        tj = r.get("extra", {}).get("tactic_json")
        if tj is None or r["clock"] != "graph" or r["median_us"] is None:
            continue
        key = (r["m"], r["n"], r["k"])
        entry = shapes.setdefault(
            key, {"m": key[0], "n": key[1], "k": key[2], "held_out": key in HELD_OUT, "tactics": {}}
        )
        entry["tactics"][tj] = {"backend": r["backend"], "us": r["median_us"],
                                "path": json.loads(tj).get("path")}  # fmt: skip
    return list(shapes.values())


def load_rows(path: Path) -> list[tuple[Problem, bool, dict]]:
    """(problem, held out, {tactic: measured µs}) per shape: timed direct tactics only."""
    rows = []
    for r in sweep(path):
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16", operation="w4a16")
        timed = {w4.TritonSm90W4A16Tactic.model_validate_json(tj): e["us"]
                 for tj, e in r["tactics"].items()
                 if e.get("path") == "direct" and "us" in e}  # fmt: skip
        rows.append((p, bool(r.get("held_out")), timed))
    return rows


def load_dense_rows(path: Path) -> list[tuple[Problem, bool, dict]]:
    """(problem, held out, {tactic: measured µs}) per shape: the dense tactics only."""
    rows = []
    for r in sweep(path):
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16")
        timed = {dense.TritonSm90DenseTactic.model_validate_json(tj): e["us"]
                 for tj, e in r["tactics"].items()
                 if e.get("backend") == "triton-sm90-dense" and "us" in e}  # fmt: skip
        rows.append((p, bool(r.get("held_out")), timed))
    return rows


@dataclass(frozen=True)
class Paired:
    """A backend fitted beside another (``--ws``, ``--mma``: the W4A16 backend; ``--rs``:
    ws): its plugin module (``_c()``, ``why_invalid``), backend class, estimate, grid,
    whether the fit tries every combination of the grid (else `descend`), and the rival
    backend class its untuned pick is scored against."""

    module: ModuleType
    backend: type
    estimate: Callable
    grid: dict
    exhaustive: bool
    rival: type = w4.TritonSm90W4A16Backend


#: the paired backends by their part of the constants file
PAIRED = {
    "ws": Paired(ws, ws.TritonSm90WsBackend, ws._estimate_ws, WS_GRID, True),
    "mma": Paired(mma, mma.TritonSm90MmaBackend, mma._estimate_mma, MMA_GRID, False),
    "rs": Paired(
        rs, rs.TritonSm90RsBackend, rs._estimate_rs, RS_GRID, True, ws.TritonSm90WsBackend
    ),
}


@contextlib.contextmanager
def constants(consts: dict, part: str = "w4a16") -> Iterator[None]:
    """The model's constants (its `part` of the file) with `consts` applied, restored after."""
    table = PAIRED[part].module._c() if part in PAIRED else w4._c()
    saved = dict(table)
    table.update(consts)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def _model(activations: bool | str):
    """(validity rule, estimate, constants part) of the fitted model: the W4A16 direct
    path, its dense (W4A4) entry (``activations`` True), ``"ws"`` or ``"mma"``."""
    if activations in PAIRED:
        paired = PAIRED[activations]
        return paired.module.why_invalid, paired.estimate, activations
    est = lambda t, p, d: w4._estimate_direct(t, p, d, bool(activations))  # noqa: E731
    return (dense.why_invalid if activations else w4.why_invalid), est, "w4a16"


def score(
    rows, device, consts: dict, activations: bool | str = False
) -> tuple[float, float, float, int]:
    """(mean pick/best, worst pick/best, mean |log est/measured|, shapes) under `consts`
    (``activations``: the dense entry's or, ``"ws"``, the ws backend's model, `_model`)."""
    valid, estimate, part = _model(activations)
    ratios, errs = [], []
    with constants(consts, part):
        for p, _, timed in rows:
            offered = {t: us for t, us in timed.items() if valid(t, p, device) is None}
            if not offered:
                continue
            est = {t: estimate(t, p, device) for t in offered}
            pick = min(offered, key=lambda t: (est[t], t.canonical_json()))
            ratios.append(offered[pick] / min(offered.values()))
            errs += [abs(math.log(est[t] / us)) for t, us in offered.items()]
    n = len(ratios)
    if not n:  # no shape of this set (a --space sweep has no held-out shapes)
        return math.nan, math.nan, math.nan, 0
    return sum(ratios) / n, max(ratios), sum(errs) / len(errs), n


def best_on_grid(
    rows, device, candidates: Iterable[dict], activations: bool | str = False
) -> tuple[dict, tuple]:
    """The candidate constants with the best (mean ratio, calibration) on `rows` (the
    first of equals), and its `score`."""
    best = None
    for consts in candidates:
        s = score(rows, device, consts, activations)
        key = (round(s[0], 4), s[2])
        if best is None or key < best[0]:
            best = (key, consts, s)
    return best[1], best[2]


def fit(rows, device) -> tuple[dict, tuple]:
    """The decode constants (`KEYS`) on their grid."""
    grid = itertools.product(*(GRID[k] for k in KEYS))
    return best_on_grid(rows, device, (dict(zip(KEYS, v, strict=True)) for v in grid))


def fit_dense(rows, device) -> tuple[dict, tuple]:
    """``dense_step_scale`` by `score` on `rows` (time scale 1), then the time scale
    that zeroes the mean log error (module docstring)."""
    steps = ({"dense_step_scale": step, "dense_time_scale": 1.0} for step in DENSE_GRID)
    consts, _ = best_on_grid(rows, device, steps, activations=True)
    with constants(consts):
        logs = [math.log(w4._estimate_direct(t, p, device, True) / us)
                for p, _, timed in rows for t, us in timed.items()]  # fmt: skip
    consts = {**consts, "dense_time_scale": round(math.exp(-sum(logs) / len(logs)), 3)}
    return consts, score(rows, device, consts, True)


def fit_mid(rows, device) -> tuple[dict, tuple]:
    """``mid_step_scale`` and ``mma_eff`` at tile_m 32/64/128 by `score` on `rows`."""

    def candidates() -> Iterator[dict]:
        for step, *eff in itertools.product(MID_STEP_GRID, *[MMA_EFF_GRID] * 3):
            mma = {**w4._c()["mma_eff"], **dict(zip(("32", "64", "128"), eff, strict=True))}
            yield {"mid_step_scale": step, "mma_eff": mma}

    return best_on_grid(rows, device, candidates())


def load_paired_rows(path: Path, part: str) -> list[tuple[Problem, bool, dict, dict]]:
    """(problem, held out, {new tactic: µs}, {rival tactic: µs}) per shape of a
    ws sweep or, ``part`` "mma", an mma sweep (timed tactics only);
    ``part`` "rs": `load_rs_rows`."""
    if part == "rs":
        return load_rs_rows(path)
    backend = _backends(part)[0]
    rows, dropped = [], 0
    for r in sweep(path):
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16", operation="w4a16")
        timed = {backend.name: {}, "triton-sm90-w4a16": {}}
        for tj, e in r["tactics"].items():
            if "us" not in e:
                continue
            kind = backend.tactic_type if e["backend"] == backend.name else (
                w4.TritonSm90W4A16Tactic)  # fmt: skip
            try:
                timed[e["backend"]][kind.model_validate_json(tj)] = e["us"]
            except pydantic.ValidationError:  # measured, no longer a tactic (mma's 16 tokens)
                dropped += 1
        rows.append((p, bool(r.get("held_out")), timed[backend.name],
                     timed["triton-sm90-w4a16"]))  # fmt: skip
    if dropped:
        print(f"{path.name}: {dropped} timed tactics are not tactics of {backend.name} now")
    return rows


def load_rs_rows(path: Path) -> list[tuple[Problem, bool, dict, dict]]:
    """The rows of the committed rs sweep (bench_w4a16_rs.py's JSON): its variants that
    are rs tactics (by name: "64 tokens, split 2, 4 stages, specialized[, 2 CTAs an SM]")
    and its ws tactics ("64 tokens, split 2"); held out: M in `RS_HELD_MS`."""
    rows = []
    for r in json.loads(path.read_text())["rows"]:
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16", operation="w4a16")
        mine, rival = {}, {}
        for name, e in r["rs"].items():
            if "us" not in e or ", specialized" not in name:
                continue
            tm, split, stages, *ctas = (int(v) for v in re.findall(r"\d+", name))
            if rs.RS_STAGES.get(tm) == stages:
                t = rs.TritonSm90RsTactic(tile_m=tm, split_k=split, num_stages=stages,
                                          ctas_per_sm=ctas[0] if ctas else 1)  # fmt: skip
                mine[t] = e["us"]
        for name, e in r["ws"].items():
            tm, split = (int(v) for v in re.findall(r"\d+", name))
            rival[ws.TritonSm90WsTactic(tile_m=tm, split_k=split)] = e["us"]
        rows.append((p, r["m"] in RS_HELD_MS, mine, rival))
    return rows


def _backends(part: str) -> tuple:
    """(the `part` backend, its rival): the rows' order of `load_paired_rows`."""
    return PAIRED[part].backend(), PAIRED[part].rival()


def fit_paired(rows, device, part: str) -> tuple[dict, tuple]:
    """The `part` backend's constants on its grid by `score` on `rows`: every combination
    (ws) or one constant at a time from the file's values (mma, `descend`)."""
    paired = PAIRED[part]
    if not paired.exhaustive:
        start = {k: paired.module._c()[k] for k in paired.grid}
        return descend(rows, device, paired.grid, start, part)
    keys = tuple(paired.grid)
    grid = itertools.product(*(paired.grid[k] for k in keys))
    cands = (dict(zip(keys, v, strict=True)) for v in grid)
    return best_on_grid(rows, device, cands, activations=part)


def descend(rows, device, grid: dict, start: dict, part: str) -> tuple[dict, tuple]:
    """Coordinate descent: each constant in turn set to its best grid value (`best_on_grid`)
    with the others held, until a pass changes nothing (at most 8 passes)."""
    consts = dict(start)
    for _ in range(8):
        before = dict(consts)
        for key, values in grid.items():
            cands = ({**consts, key: v} for v in values)
            consts, _ = best_on_grid(rows, device, cands, part)
        if consts == before:
            break
    return consts, score(rows, device, consts, part)


def pick_over_best(p: Problem, device, timed: list[tuple]) -> float:
    """The measured time of the (backend, tactic, µs) of `timed` with the lowest estimate
    (the untuned pick across backends; ties by the tactic's JSON) over the best measured."""
    pick = min(timed, key=lambda x: (x[0].estimate_us(p, device, x[1]), x[1].canonical_json()))
    return pick[2] / min(us for *_, us in timed)


def both_backends(rows, device, consts: dict, part: str) -> tuple[float, float, int]:
    """(mean, worst, shapes) of the untuned pick among both backends' timed tactics (the
    lower estimate) over the best of both, with the `part` constants `consts`."""
    ratios = []
    backends = _backends(part)
    with constants(consts, part):
        for p, _, *timed in rows:
            pairs = zip(backends, timed, strict=True)
            offered = [(b, t, us) for b, tactics in pairs for t, us in tactics.items()
                       if b.validate(t, p, device) is None]  # fmt: skip
            if offered:
                ratios.append(pick_over_best(p, device, offered))
    if not ratios:
        return math.nan, math.nan, 0
    return sum(ratios) / len(ratios), max(ratios), len(ratios)


def report(name: str, s: tuple) -> str:
    mean, worst, err, shapes = s
    return (f"{name}: pick/best mean {mean:.3f}, worst {worst:.3f}, |log err| {err:.3f} "
            f"({shapes} shapes)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA, help="a sweep: JSON or JSON lines")
    ap.add_argument("--check", action="store_true", help="score the file's constants only")
    ap.add_argument("--write", action="store_true", help="write the fitted constants")
    ap.add_argument("--dense", action="store_true", help="the triton-sm90-dense constants")
    ap.add_argument("--dense-data", type=Path, default=DENSE_DATA,
                    help="the W4A4 decode sweep")  # fmt: skip
    ap.add_argument("--ws", action="store_true", help="the triton-sm90-ws constants")
    ap.add_argument("--ws-data", type=Path, default=WS_DATA, help="the ws sweep")
    ap.add_argument("--rs", action="store_true", help="the triton-sm90-rs constants")
    ap.add_argument("--rs-data", type=Path, default=RS_DATA, help="the rs sweep (JSON)")
    ap.add_argument("--mma", action="store_true", help="the triton-sm90-mma constants")
    ap.add_argument("--mma-data", type=Path, default=MMA_DATA, help="the mma sweep")
    ap.add_argument("--mma-scale", action="store_true", help="mma's time_scale (below)")
    ap.add_argument("--mid", action="store_true", help="the M = 32-256 terms")
    ap.add_argument("--mid-data", type=Path, default=MID_DATA,
                    help="the mid-M sweep")  # fmt: skip
    args = ap.parse_args(argv)
    device = rated(simulated("sm90"))
    if args.mma_scale:
        return main_mma_scale(args, device)
    if args.dense:
        return main_dense(args, device)
    if args.mid:
        return main_mid(args, device)
    if args.ws or args.mma or args.rs:
        return main_paired(args, device)
    rows = load_rows(args.data)
    train = [r for r in rows if not r[1]]
    held = [r for r in rows if r[1]]
    current = {k: w4._c()[k] for k in KEYS}
    if args.check:
        print(json.dumps(current))
        print(report("in-sample", score(train, device, current)))
        print(report("held-out", score(held, device, current)))
        return 0
    consts, s = fit(train, device)
    print(json.dumps(consts))
    print(report("in-sample", s))
    print(report("held-out", score(held, device, consts)))
    if args.write:
        data = json.loads(MODEL.read_text())
        data["w4a16"].update(consts)
        MODEL.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {MODEL}")
    return 0


#: ``--mma-scale``: run 8's two H200 sweeps of device call 2, measured with the factor at 1
#: (W4A16: mma beside the direct kernel's best 6; W4A4: mma, dense, triton-sm90's best 6)
MMA_SCALE_DATA = {
    "w4a16": ROOT / "benchmarks" / "data" / "sm90_w4a16_mma_run8_call2.json",
    "w4a4": ROOT / "benchmarks" / "data" / "sm90_w4a4_decode_run8_call2.json",
}
#: factors searched (0.70 .. 1.00)
MMA_SCALE_GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(31))


def load_all_backends(path: Path, operation: str, device) -> list[tuple[Problem, bool, list]]:
    """(problem, held out, [(backend, tactic, measured µs)]) per shape: the timed tactics
    of every sm90 backend that offers them for the shape."""
    from fp4_dispatch.plugins.sm90 import TritonSm90Backend

    kinds = (mma.TritonSm90MmaBackend, w4.TritonSm90W4A16Backend, dense.TritonSm90DenseBackend,
             TritonSm90Backend)  # fmt: skip
    backends = {b.name: b for b in (kind() for kind in kinds)}
    rows = []
    for r in sweep(path):
        p = Problem(m=r["m"], n=r["n"], k=r["k"], out_dtype="bfloat16", operation=operation)
        timed = []
        for tj, e in r["tactics"].items():
            b = backends[e["backend"]]
            t = b.tactic_type.model_validate_json(tj)
            if "us" in e and b.validate(t, p, device) is None:
                timed.append((b, t, e["us"]))
        rows.append((p, bool(r["held_out"]), timed))
    return rows


def main_mma_scale(args: argparse.Namespace, device) -> int:
    """``--mma-scale``: ``time_scale`` of ``triton-sm90-mma``, so the untuned pick ACROSS
    backends takes the mma kernel where it is faster (``--mma`` fits the pick among mma
    tactics, which a common factor never changes). Objective on the in-sample rows of
    both sweeps (M 1, 4, 16 x six (N, K)): the mean measured time of the lowest estimate
    among every timed offered tactic over the best; ties go to the factor nearest 1. The
    held-out rows (M 2 and 8, fixed in run 4) are only scored. Before it the W4A4 pick
    took the dense kernel on 8 of 18 decode shapes where mma was 1.17-1.46x faster
    (RESULTS.md "Hopper W4A16" run 8)."""

    def mean(rows, scale: float) -> float:
        with constants({"time_scale": scale}, "mma"):
            ratios = [pick_over_best(p, device, timed) for p, _, timed in rows]
        return sum(ratios) / len(ratios)

    rows = {op: load_all_backends(path, op, device) for op, path in MMA_SCALE_DATA.items()}
    train = [r for rs in rows.values() for r in rs if not r[1]]
    current = json.loads(MODEL.read_text())["mma"]["time_scale"]
    scale = current if args.check else min(MMA_SCALE_GRID, key=lambda s: (mean(train, s), -s))
    print(f"time_scale {scale}")
    for op, per_op in rows.items():
        for name, held in (("in-sample", False), ("held-out", True)):
            part = [r for r in per_op if r[1] == held]
            print(f"{op} {name}: pick/best mean {mean(part, scale):.3f} "
                  f"({len(part)} shapes; factor 1: {mean(part, 1.0):.3f})")  # fmt: skip
    if args.write and not args.check:
        data = json.loads(MODEL.read_text())
        data["mma"]["time_scale"] = scale
        MODEL.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {MODEL}")
    return 0


def main_dense(args: argparse.Namespace, device) -> int:
    """``--dense``: check or fit (and ``--write``) the dense entry's two constants."""
    current = {k: w4._c()[k] for k in ("dense_step_scale", "dense_time_scale")}
    _check_or_fit(load_dense_rows(args.dense_data), device, args, current, fit_dense,
                  activations=True)  # fmt: skip
    return 0


def main_mid(args: argparse.Namespace, device) -> int:
    """``--mid``: check or fit (and ``--write``) the M = 32-256 terms."""
    current = {"mid_step_scale": w4._c()["mid_step_scale"], "mma_eff": w4._c()["mma_eff"]}
    _check_or_fit(load_rows(args.mid_data), device, args, current, fit_mid)
    return 0


def main_paired(args: argparse.Namespace, device) -> int:
    """``--ws`` / ``--mma`` / ``--rs``: check or fit (and ``--write``) that backend's
    constants; then the pick among it and its rival (`Paired.rival`) under them."""
    part = "mma" if args.mma else "rs" if args.rs else "ws"
    data = {"mma": args.mma_data, "rs": args.rs_data, "ws": args.ws_data}[part]
    rows = load_paired_rows(data, part)
    current = {k: PAIRED[part].module._c()[k] for k in PAIRED[part].grid}
    fit_fn = lambda r, d: fit_paired(r, d, part)  # noqa: E731
    consts = _check_or_fit([r[:3] for r in rows], device, args, current, fit_fn, part)
    for name, held in (("in-sample", False), ("held-out", True)):
        mean, worst, n = both_backends([r for r in rows if r[1] == held], device, consts, part)
        print(f"{name}, both backends: pick/best mean {mean:.3f}, worst {worst:.3f} ({n} "
              f"shapes) beside {_backends(part)[1].name}")  # fmt: skip
    return 0


def _check_or_fit(
    rows, device, args, current: dict, fit_fn, activations: bool | str = False
) -> dict:
    """Score `current` (``--check``) or `fit_fn`'s constants on the rows' in-sample and
    held-out shapes; ``--write`` stores a fit in cost_model.json. Returns the constants."""
    train = [r for r in rows if not r[1]]
    held = [r for r in rows if r[1]]
    consts = current if args.check else fit_fn(train, device)[0]
    print(json.dumps(consts))
    print(report("in-sample", score(train, device, consts, activations)))
    print(report("held-out", score(held, device, consts, activations)))
    if args.write and not args.check:
        part = _model(activations)[2]
        data = json.loads(MODEL.read_text())
        data[part].update(consts)
        MODEL.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {MODEL}")
    return consts


if __name__ == "__main__":
    sys.exit(main())
