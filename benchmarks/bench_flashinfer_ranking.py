"""Benchmark (CPU): FlashInfer's own mm_fp4 shortlist beside fp4-dispatch's, same tactics.

For M in {1, 32, 300, 4096, 32768} x (N, K) in {(7168, 2048), (4096, 8192),
(28672, 8192)} on simulated SM100 (148 SMs) and SM107 (212 SMs):

* FlashInfer's shortlist: its runner's valid tactics (``get_valid_tactics``, its rules),
  cut by its own ranking function ``_rank_mm_fp4_autotune_tactics`` called as a library
  with the SM count supplied (one score per tactic, ties in enumeration order, flat
  top 32);
* this project's shortlist over the same tactics: the five ``fi-*`` families of the
  ``flashinfer`` plugin, scored by the shared cost model and cut with per-family floors
  and diversity axes (`fp4_dispatch.ranking.shortlist`, budget 32).

Per row: kept/valid per family for both, the families FlashInfer starves (valid > 0,
kept 0), the swap orientations kept (``T`` swapped, ``F`` not) against those valid,
how much of the budget is filled, and the ranking time (median; FlashInfer: its ranking
call over the enumerated list; ours: ``shortlist()`` with the enumeration memoized, so
both time the score + cut). Enumeration (FlashInfer's runner, cold) is timed apart.
fi-sm103 tactics with ``use_tma_store=False`` are in FlashInfer's list but not in
ours: the installed CuTe-DSL cannot build them (see the plugin); FlashInfer's counts
include them.

    python benchmarks/bench_flashinfer_ranking.py            # print the table
    python benchmarks/bench_flashinfer_ranking.py --record   # and write RESULTS.md
    OUT=dir python benchmarks/bench_flashinfer_ranking.py    # + dir/bench_flashinfer_ranking.json

Needs ``pip install '.[flashinfer]'`` (in the checkout); no GPU (nothing is run or compiled).
"""

from __future__ import annotations

import argparse
import datetime
import logging
from collections import Counter

from _common import markdown_table, record_section, write_json

from fp4_dispatch import harness
from fp4_dispatch.backends import flashinfer as fb
from fp4_dispatch.device import DeviceInfo
from fp4_dispatch.plugins import flashinfer as fip
from fp4_dispatch.profiles import simulated
from fp4_dispatch.progress import progress
from fp4_dispatch.ranking import shortlist
from fp4_dispatch.tactics import Problem

MS = (1, 32, 300, 4096, 32768)
NKS = ((7168, 2048), (4096, 8192), (28672, 8192))
BUDGET = 32
SHORT = {"fi-sm100": "100", "fi-sm100-deepk": "dk", "fi-sm100-splitk": "sk",
         "fi-sm103": "103", "fi-sm107": "107"}  # fmt: skip
HEADING = "## FlashInfer mm_fp4: its own shortlist vs fp4-dispatch's, same tactics"


def _family(fi: tuple) -> str:
    return fip.tactic_of(fi).backend


def _median_ms(fn, repeats: int) -> float:
    """Median host wall ms of single calls (`harness.call_wall_us`)."""
    return harness.call_wall_us(fn, repeats) / 1e3


def _swaps(values) -> str:
    s = set(values)
    return ("T" if True in s else "") + ("F" if False in s else "") or "-"


def one(dev: DeviceInfo, m: int, n: int, k: int, repeats: int) -> dict:
    """One problem on one device: both shortlists and their timings."""
    cc, sms = dev.cc, dev.sm_count
    got: dict = {}
    enum_ms = _median_ms(lambda: got.update(v=fb.valid_tactics(m, n, k, "bfloat16", cc, sms)), 1)
    valid = got["v"]
    own = fb.flashinfer_shortlist(m, n, k, "bfloat16", cc, sms)
    import flashinfer.gemm.gemm_base as gb

    cap = gb._MM_FP4_CUTE_DSL_MAX_TUNING_CONFIGS
    fi_ms = _median_ms(lambda: gb._rank_mm_fp4_autotune_tactics(list(valid), m, n, k, sms, cap),
                       repeats)  # fmt: skip
    backends = [cls() for cls in fip.BACKENDS if cls().supports(dev).ok]
    problem = Problem(m=m, n=n, k=k)
    ours = shortlist(problem, dev, backends, budget=BUDGET)
    our_ms = _median_ms(lambda: shortlist(problem, dev, backends, budget=BUDGET), repeats)
    ours_valid = {b.name: sum(1 for _ in b.tactics(problem, dev)) for b in backends}
    fi_valid = Counter(_family(t) for t in valid)
    fi_kept = Counter(_family(t) for t in own)
    our_kept = Counter(c.family for c in ours.candidates)
    fams = [f for f in SHORT if fi_valid.get(f) or ours_valid.get(f)]
    return {
        "device": dev.name, "sm_count": sms, "m": m, "n": n, "k": k,
        "valid_flashinfer": {f: fi_valid.get(f, 0) for f in fams},
        "valid_ours": {f: ours_valid.get(f, 0) for f in fams},
        "kept_flashinfer": {f: fi_kept.get(f, 0) for f in fams},
        "kept_ours": {f: our_kept.get(f, 0) for f in fams},
        "starved_flashinfer": [f for f in fams if fi_valid.get(f) and not fi_kept.get(f)],
        "starved_ours": [f for f in fams if ours_valid.get(f) and not our_kept.get(f)],
        "swap_valid": _swaps(t[2] for t in valid),
        "swap_flashinfer": _swaps(t[2] for t in own),
        "swap_ours": _swaps(c.tactic.swap_ab for c in ours.candidates),
        "filled_flashinfer": len(own), "filled_ours": len(ours.candidates),
        "enumerate_ms": enum_ms, "rank_ms_flashinfer": fi_ms, "rank_ms_ours": our_ms,
    }  # fmt: skip


def run(repeats: int) -> list[dict]:
    devices = (simulated("sm100"), simulated("sm107"))
    jobs = [(d, m, n, k) for d in devices for (n, k) in NKS for m in MS]
    rows = []
    for d, m, n, k in progress(jobs, desc="shapes", unit="shape"):
        rows.append(one(d, m, n, k, repeats))
    return rows


def _per_family(row: dict, which: str) -> str:
    kept, valid = row[f"kept_{which}"], row[f"valid_{which}"]
    return " ".join(f"{SHORT[f]}:{kept[f]}/{valid[f]}" for f in kept)


def table(rows: list[dict]) -> str:
    headers = ("device", "M", "N x K", "FlashInfer kept/valid per family", "ours kept/valid",
               "FI starves", "swap valid / FI / ours", "filled FI / ours", "rank ms FI / ours",
               "enum ms")  # fmt: skip
    cells = [
        ("SM100" if r["sm_count"] == 148 else "SM107", r["m"], f"{r['n']}x{r['k']}",
         _per_family(r, "flashinfer"), _per_family(r, "ours"),
         ", ".join(r["starved_flashinfer"]) or "-",
         f"{r['swap_valid']} / {r['swap_flashinfer']} / {r['swap_ours']}",
         f"{r['filled_flashinfer']} / {r['filled_ours']}",
         f"{r['rank_ms_flashinfer']:.2f} / {r['rank_ms_ours']:.2f}", f"{r['enumerate_ms']:.1f}")
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, cells)


def summary(rows: list[dict]) -> str:
    starve = [r for r in rows if r["starved_flashinfer"]]
    ours = [r for r in rows if r["starved_ours"]]
    one_swap = [r for r in rows if len(r["swap_valid"]) == 2 and len(r["swap_flashinfer"]) < 2]
    ours_swap = [r for r in rows if len(r["swap_valid"]) == 2 and len(r["swap_ours"]) < 2]

    def short(r: dict, which: str) -> bool:  # fewer kept than the budget and valid allow
        return r[f"filled_{which}"] < min(BUDGET, sum(r[f"valid_{which}"].values()))

    unfilled = [r for r in rows if short(r, "flashinfer")]
    unfilled_ours = [r for r in rows if short(r, "ours")]
    small = [r for r in rows if r["filled_flashinfer"] < BUDGET]

    def shapes(rs: list[dict]) -> str:
        return ", ".join(f"{'SM100' if r['sm_count'] == 148 else 'SM107'} "
                         f"{r['m']}x{r['n']}x{r['k']}" for r in rs) or "none"  # fmt: skip

    return "\n".join([
        f"- FlashInfer's cut starves a family on {len(starve)} of {len(rows)} rows: "
        f"{shapes(starve)}; ours on {len(ours)}.",
        f"- Both orientations valid but FlashInfer keeps one on {len(one_swap)} rows: "
        f"{shapes(one_swap)}; ours on {len(ours_swap)}.",
        f"- Budget left unfilled while more valid tactics exist: FlashInfer on "
        f"{len(unfilled)} rows ({shapes(unfilled)}), ours on {len(unfilled_ours)}. Fewer "
        f"than {BUDGET} kept because fewer are valid: {shapes(small)}.",
    ])  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per ranking")
    ap.add_argument("--record", action="store_true", help="write benchmarks/RESULTS.md")
    args = ap.parse_args()
    ok, why = fb.availability()
    if not ok:
        raise SystemExit(why)
    rows = run(args.repeats)
    text = table(rows) + "\n\n" + summary(rows)
    print(text)
    write_json("bench_flashinfer_ranking.json", rows)
    if args.record:
        date = datetime.date.today().isoformat()
        body = "\n".join([
            HEADING, "",
            f"{date}, 2-core CPU, no GPU; flashinfer-python {fb.version()}; simulated SM100 "
            "(148 SMs) and SM107 (212 SMs). Nothing run or compiled: this compares the "
            "selection only. Written by `python benchmarks/bench_flashinfer_ranking.py "
            "--record`.", "",
            "Families: 100 = fi-sm100, dk = fi-sm100-deepk, sk = fi-sm100-splitk, 103 = "
            "fi-sm103, 107 = fi-sm107. FlashInfer's counts include the fi-sm103 "
            "`use_tma_store=False` tactics, which the installed CuTe-DSL cannot build "
            "(ours leaves them out). Rank ms: score + cut, median of "
            f"{args.repeats}; enum ms: FlashInfer's runner enumeration (its rules), cold.", "",
            text,
        ])  # fmt: skip
        record_section(body, HEADING)


if __name__ == "__main__":
    main()
