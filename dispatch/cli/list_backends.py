"""``fp4-dispatch list-backends``: what is loaded, what is not, and why."""

from __future__ import annotations

import argparse
import logging

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
    try:
        return sum(1 for _ in backend.tactics(SAMPLE, dispatcher.device))
    except Exception as exc:  # shown in the table, not hidden
        log.warning("backend %s: tactics() raised %r", name, exc)
        return f"error: {type(exc).__name__}: {exc}"


def run(args: argparse.Namespace) -> int:
    d = make_dispatcher(args, strict=args.strict or None)
    rows = []
    for st in d.backends():
        row = st.to_json()
        row["tactics"] = _tactic_count(d, st.name)
        backend = d.registry.backends.get(st.name)
        row["note"] = getattr(backend, "compile_only_note", "") if backend else ""
        rows.append(row)
    failed = [r for r in rows if r["status"] == "failed"]
    if args.json:
        emit_json(rows)
    else:
        print(f"device: {d.device.name} ({d.device.kind}) {d.device.note}".rstrip())
        print(f"sample shape for the tactic count: M={SAMPLE.m} N={SAMPLE.n} K={SAMPLE.k}\n")
        table = [
            (r["name"], r["family"], f"{r['origin']} {r['version']}", r["status"], r["tactics"],
             r["reason"])
            for r in rows
        ]  # fmt: skip
        print(format_table(table, ("backend", "family", "origin", "status", "tactics", "reason")))
        notes = sorted({r["note"] for r in rows if r["note"]})
        for note in notes:
            print(f"\nnote: {note}")
        if args.traceback:
            for r in failed:
                if r["error"]:
                    print(f"\n--- {r['plugin']} ---\n{r['error']['traceback']}")
        elif failed:
            print(f"\n{len(failed)} failed; --traceback shows where they raised.")
    return 1 if failed and d.strict else 0
