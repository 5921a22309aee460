"""``fp4-dispatch explain M N K``: the capped shortlist, its scores, why each was kept.

Shows the cut per family, so a family that loses every slot can never go unnoticed, and
the bucket's tuned entry when the cache has one: its tactic, measurement policy and the
paired check against the default (ratio; whether the default was kept).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..buckets import bucket_key
from . import common

if TYPE_CHECKING:
    from ..ranking import Candidate, Shortlist


def register(sub: argparse._SubParsersAction) -> None:
    p = common.add_command(
        sub,
        "explain",
        help="the ranked, capped shortlist for one shape, and why",
        description="Rank every valid tactic of every available backend for one GEMM shape "
        "(out[M, N] = A[M, K] @ B[N, K].T), keep the best --budget with a floor per "
        "family, and show the scores, why each was kept and the cut per family. Runs "
        "nothing: works for simulated devices.",
        examples="""fp4-dispatch explain 128 4096 4096
fp4-dispatch explain 32768 4096 8192 --device sm107 --budget 16
fp4-dispatch explain 1 8192 8192 --device sm90 --json
fp4-dispatch explain 16 4096 4096 --op w4a16
fp4-dispatch explain 1024 5120 5120 --op w4a16 --precision fp8 --device sm90
fp4-dispatch explain 64 1536 2048 --op grouped_w4a16 --groups 128 --device sm90""",
    )
    common.add_shape_args(p)
    common.add_device_args(p)
    common.add_budget_arg(p, "tactics kept for measurement")
    common.add_problem_kind_args(p)
    common.add_json_arg(p)
    p.set_defaults(func=run)


def _extra(c: Candidate) -> str:
    """Family-specific fields (`fp4_dispatch.tactics.tactic_knobs`), "-" when none."""
    from ..tactics import tactic_knobs  # noqa: PLC0415 - lazy: start-up time (--help)

    return tactic_knobs(c.tactic) or "-"


def render(sl: Shortlist, sm_count: int | None = None) -> str:
    """The shortlist as text for a terminal: header, ranked table, cut, skipped, warnings."""
    p = sl.problem
    sms = f", {sm_count} SMs" if sm_count else ""
    floor = f", floor {sl.floor} per family" if sl.cut else ""
    experts = "" if p.groups is None else f" over E={p.groups} experts"
    lines = [
        f"explain M={p.m} N={p.n} K={p.k}{experts} ({p.out_dtype}{_op_note(p.operation)}) "
        f"on {sl.device}{sms}",
        f"kept {len(sl.candidates)} of {sl.total} valid tactics (budget {sl.budget}{floor})",
        "",
        _ranked(sl),
    ]
    if any(c.lossy for c in sl.candidates):
        lines += ["", "lossy: the candidate rounds the activations (and weights) to FP8 E4M3 "
                  "(precision='fp8'; docs/PRECISION.md)"]  # fmt: skip
    if sl.cut:
        lines += _per_family(sl)
    if sl.skipped:
        lines += ["", "skipped backends:"]
        lines += [f"  {name}: {why}" for name, why in sorted(sl.skipped.items())]
    if sl.warnings:
        lines += ["", "warnings:"]
        lines += [f"  {w}" for w in sl.warnings]
    return "\n".join(lines)


def _op_note(operation: str) -> str:
    """The header's note on the problem's operation ("" for w4a4, the default)."""
    if operation == "w4a8":
        return ", w4a8: dense activations under precision fp8"
    return "" if operation == "w4a4" else f", {operation}"


def tuned_entry(
    dispatcher, m: int, n: int, k: int, dtype: str, op: str, groups: int | None = None
) -> dict | None:
    """The bucket's cache entry as recorded (None: not tuned), with ``usable``/``stale``.

    Read, never run: explain works on simulated devices, so a cached winner's output is
    not verified here (the dispatcher does that on its first use)."""
    winners = getattr(dispatcher, "winners", None)
    if winners is None:
        return None
    from ..winners import StaleEntry  # noqa: PLC0415 - imports torch

    entry = winners.entries().get(bucket_key(m, n, k, dtype, op, groups))
    if entry is None:
        return None
    row = entry.to_json()
    row["measure"], row["operation"] = entry.policy, entry.op
    row["winner_operation"] = entry.winner_operation or entry.op
    try:
        winners.validate(entry)
        row["usable"], row["stale"] = True, None
    except StaleEntry as exc:
        row["usable"], row["stale"] = False, str(exc)
    return row


def render_tuned(row: dict | None) -> str:
    """One paragraph: the tuned tactic, its policy, the paired check against the default."""
    if row is None:
        return "tuned: no cache entry for this bucket (an untuned call runs the heuristic pick)"
    from ..tactics import tactic_label  # noqa: PLC0415 - lazy: start-up time (--help)

    tactic = row.get("tactic") if isinstance(row.get("tactic"), dict) else {}
    ratio, pairs = row.get("paired_ratio"), row.get("pairs") or 0
    if isinstance(ratio, (int, float)):
        kept = "default kept" if row.get("kept_default") else "winner adopted"
        check = f"paired ratio {ratio:.3f} over {pairs} pairs, {kept}"
    else:
        check = row.get("decision") or "no paired check recorded"
    lines = [
        f"tuned: {row['backend']} {tactic_label(tactic)}: {row['us']:.4g} µs "
        f"(measure {row['measure']})",
        f"  vs default: {check}",
    ]
    if row.get("kept_default") and isinstance(row.get("challenger"), dict):
        lines.append(f"  the challenger that lost: {row['challenger'].get('backend')} "
                     f"{row['challenger'].get('tactic')}")  # fmt: skip
    if not row["usable"]:
        lines.append(f"  stale here, not used: {row['stale']}")
    return "\n".join(lines)


def _ranked(sl: Shortlist) -> str:
    """The ranked table of the kept candidates (estimate relative to the first)."""
    if not sl.candidates:
        return "no candidates: no available backend offers a valid tactic for this shape"
    best = sl.candidates[0].est_us
    rows = []
    for i, c in enumerate(sl.candidates, 1):
        t = c.tactic
        rel = f"+{(c.est_us / best - 1) * 100:.1f}%" if best > 0 and i > 1 else ""
        op = f"{c.operation} (lossy)" if c.lossy else c.operation
        rows.append((i, c.backend, c.family, op, f"{t.tile_m}x{t.tile_n}",
                     f"{t.cluster_m}x{t.cluster_n}", "swap" if t.swap_ab else "-", _extra(c),
                     common.us(c.est_us), rel, c.reason))  # fmt: skip
    headers = ("#", "backend", "family", "operation", "tile", "cluster", "swap", "knobs", "est µs",
               "vs #1", "kept because")  # fmt: skip
    return common.format_table(rows, headers)


def _per_family(sl: Shortlist) -> list[str]:
    """Kept / cut / valid per family, and a note naming the families left without a slot."""
    kept: dict[str, int] = {}
    for c in sl.candidates:
        kept[c.family] = kept.get(c.family, 0) + 1
    rows = [(fam, kept.get(fam, 0), cut, kept.get(fam, 0) + cut) for fam, cut in sl.cut.items()]
    lines = ["", "per family:", common.format_table(rows, ("family", "kept", "cut", "valid"))]
    starved = [fam for fam, _, _, _ in rows if kept.get(fam, 0) == 0]
    if starved:
        lines.append(
            f"note: budget {sl.budget} is below the number of families; "
            f"no slot for: {', '.join(starved)}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    groups = common.problem_groups(args)
    dispatcher = common.make_dispatcher(args, budget=args.budget)
    grouped = {} if groups is None else {"groups": groups}  # dense: the call as before
    sl = dispatcher.candidates(args.m, args.n, args.k, out_dtype=args.out_dtype,
                               operation=args.op, **grouped)  # fmt: skip
    faults = list(getattr(dispatcher, "faults", ()))
    op = sl.problem.operation  # the call's operation under the precision policy
    tuned = tuned_entry(dispatcher, args.m, args.n, args.k, args.out_dtype, op, groups)
    if args.json:
        common.emit_json({**sl.to_json(), "tuned": tuned, "faults": [f.to_json() for f in faults]})
    else:
        device = getattr(dispatcher, "device", None)
        gpu = device is not None and device.compute_capability is not None
        print(render(sl, device.sm_count if gpu else None))
        print("\n" + render_tuned(tuned))
        if not sl.candidates:
            print(_not_available(dispatcher))
        if faults:
            print(_faults(faults))
    return 0


def _faults(faults: list) -> str:
    """Contained plugin faults (supports/tactics/estimate_us/validate...), with their plugin."""
    return "\n".join(["", "plugin faults (contained):", *[f"  {f}" for f in faults]])


def _not_available(dispatcher) -> str:
    """Why each backend offers nothing here (the usual cause of an empty shortlist)."""
    rows = [f"  {s.name} [{s.status}] {s.reason}" for s in dispatcher.backends()
            if s.status != "available"]  # fmt: skip
    return "\n".join(["backends not available on this device:", *rows]) if rows else ""
