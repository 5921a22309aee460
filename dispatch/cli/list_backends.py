"""``fp4-dispatch list-backends``: what is loaded, what is not, and why.

Every plugin appears: loaded backends, failed, disabled and empty plugins (a hook that
registered nothing), the faults its code had at run time (e.g. ``tactics()`` raising on
the sample shape), and its load time when it is slow. The table always prints; with
``--strict`` (or FP4_DISPATCH_STRICT=1) any failure or fault makes the exit status 1.
"""

from __future__ import annotations

import argparse
import logging

from ..guard import PluginFault
from ..registry import SLOW_LOAD_S
from ..tactics import Problem
from .common import add_device_args, add_json_arg, emit_json, format_table, make_dispatcher

log = logging.getLogger(__name__)

SAMPLE = Problem(m=128, n=4096, k=4096)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list-backends", help="backends and plugins, with status and reason")
    add_device_args(p)
    add_json_arg(p)
    p.add_argument("--strict", action="store_true", help="exit non-zero on any plugin failure")
    p.add_argument("--traceback", action="store_true", help="print failed plugins' tracebacks")
    p.set_defaults(func=run)


def _tactic_count(dispatcher, name: str) -> int | str:
    """How many tactics a backend offers for the sample shape ('-' when not available)."""
    backend = dispatcher.registry.backends.get(name)
    if backend is None or backend not in dispatcher.available:
        return "-"
    tactics = dispatcher.guard.tactics(backend, SAMPLE, dispatcher.device)
    if isinstance(tactics, PluginFault):  # recorded: shown under "plugin faults"
        return "error"
    return len(tactics)


def _reason(row: dict) -> str:
    """The row's reason, with its faults counted and a slow load time shown."""
    parts = [row["reason"]] if row["reason"] else []
    if row["faults"]:
        parts.append(f"{len(row['faults'])} fault(s), see below")
    if row["load_s"] > SLOW_LOAD_S:
        parts.append(f"slow to load: {row['load_s']:.1f} s")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    strict = args.strict or _strict_env()
    # never strict while loading: the table is printed first, strictness sets the status
    d = make_dispatcher(args, strict=False)
    rows = []
    statuses = d.backends()
    for st in statuses:
        row = st.to_json()
        row["tactics"] = _tactic_count(d, st.name)
        backend = d.registry.backends.get(st.name)
        row["note"] = getattr(backend, "compile_only_note", "") if backend else ""
        rows.append(row)
    for row, st in zip(rows, statuses, strict=True):  # faults found while counting tactics
        row["faults"] = [f.to_json() for f in d.faults if f.backend == st.name]
    failed = [r for r in rows if r["status"] == "failed"]
    faults = list(d.faults)
    if args.json:
        emit_json(rows)
    else:
        print(f"device: {d.device.name} ({d.device.kind}) {d.device.note}".rstrip())
        print(f"sample shape for the tactic count: M={SAMPLE.m} N={SAMPLE.n} K={SAMPLE.k}\n")
        table = [
            (r["name"], r["family"], f"{r['origin']} {r['version']}", r["status"], r["tactics"],
             _reason(r))
            for r in rows
        ]  # fmt: skip
        print(format_table(table, ("backend", "family", "origin", "status", "tactics", "reason")))
        if faults:
            print("\nplugin faults (contained; the backend or tactic is not used):")
            for f in faults:
                print(f"  {f}")
        notes = sorted({r["note"] for r in rows if r["note"]})
        for note in notes:
            print(f"\nnote: {note}")
        if args.traceback:
            for r in failed:
                if r["error"]:
                    print(f"\n--- {r['plugin']} ---\n{r['error']['traceback']}")
            for f in faults:
                print(f"\n--- {f.plugin} / {f.backend} {f.call} ---\n{f.traceback}")
        elif failed:
            print(f"\n{len(failed)} failed; --traceback shows where they raised.")
    return 1 if (failed or faults) and strict else 0


def _strict_env() -> bool:
    """FP4_DISPATCH_STRICT, read here because the dispatcher itself is built non-strict."""
    from ..registry import strict_default

    return strict_default()
