"""``fp4-dispatch list-backends``: what is loaded, what is not, and why.

``--json`` prints a list with one object per backend (or per plugin that failed or was
disabled), with stable types: ``name``, ``family``, ``origin``, ``version``, ``status``,
``reason``, ``plugin`` (strings), ``tactics`` (int: tactics offered for the sample shape;
null when the backend is not available or its ``tactics()`` raised, the error then in
``tactics_error``), ``note`` (string), ``error`` (object or null) and ``device`` (the
`DeviceInfo` the row describes, the same object in every row).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .common import (
    CliError,
    add_command,
    add_device_args,
    add_json_arg,
    device_json,
    emit_json,
    format_table,
    make_dispatcher,
)

log = logging.getLogger(__name__)

#: the shape the tactic count is taken at (M, N, K)
SAMPLE = (128, 4096, 4096)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "list-backends",
        help="backends and plugins, with status and reason",
        description="Every backend the installed plugins register, and every plugin that "
        "failed to load or was disabled: family, origin, version, status (available, "
        "unsupported, failed, disabled), the reason, and how many tactics each offers "
        "at a sample shape on this device.",
        examples="""fp4-dispatch list-backends
fp4-dispatch list-backends --device sm100 --json
fp4-dispatch list-backends --strict --traceback   # fail (exit 1) if a plugin failed""",
    )
    add_device_args(p)
    add_json_arg(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 after the table if any plugin failed (or FP4_DISPATCH_STRICT=1)",
    )
    p.set_defaults(func=run)


def _tactic_count(dispatcher, name: str) -> tuple[int | None, str]:
    """Tactics a backend offers for the sample shape, or (None, why not)."""
    from ..tactics import Problem  # noqa: PLC0415 - lazy: start-up time

    backend = dispatcher.registry.backends.get(name)
    if backend is None or backend not in dispatcher.available:
        return None, ""
    m, n, k = SAMPLE
    try:
        return sum(1 for _ in backend.tactics(Problem(m=m, n=n, k=k), dispatcher.device)), ""
    except Exception as exc:  # shown in the table and the JSON, not hidden
        log.warning("backend %s: tactics() raised %r", name, exc)
        return None, f"{type(exc).__name__}: {exc}"


def rows(dispatcher) -> list[dict[str, Any]]:
    """One JSON-ready row per backend status (see the module docstring for the keys)."""
    device = device_json(dispatcher.device)
    out = []
    for st in dispatcher.backends():
        row = st.to_json()
        row["tactics"], row["tactics_error"] = _tactic_count(dispatcher, st.name)
        backend = dispatcher.registry.backends.get(st.name)
        row["note"] = getattr(backend, "compile_only_note", "") if backend else ""
        row["device"] = device
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    from ..registry import strict_default  # noqa: PLC0415 - lazy: start-up time

    strict = args.strict or strict_default()
    d = make_dispatcher(args, strict=False)  # load everything, show it, then fail if strict
    table_rows = rows(d)
    failed = [r for r in table_rows if r["status"] == "failed"]
    if args.json:
        emit_json(table_rows)
    else:
        _print_table(d, table_rows, failed, args.traceback)
    if failed and strict:
        names = ", ".join(f"{r['name']} ({r['reason']})" for r in failed)
        raise CliError(f"--strict: {len(failed)} failed: {names}")
    return 0


def _print_table(d, table_rows: list[dict], failed: list[dict], tracebacks: bool) -> None:
    print(f"device: {d.device.name} ({d.device.kind}) {d.device.note}".rstrip())
    m, n, k = SAMPLE
    print(f"sample shape for the tactic count: M={m} N={n} K={k}\n")
    table = [
        (r["name"], r["family"], f"{r['origin']} {r['version']}", r["status"],
         "error" if r["tactics_error"] else r["tactics"], r["reason"] or r["tactics_error"])
        for r in table_rows
    ]  # fmt: skip
    print(format_table(table, ("backend", "family", "origin", "status", "tactics", "reason")))
    for note in sorted({r["note"] for r in table_rows if r["note"]}):
        print(f"\nnote: {note}")
    if tracebacks:
        for r in failed:
            if r["error"]:
                print(f"\n--- {r['plugin']} ---\n{r['error']['traceback']}")
    elif failed:
        print(f"\n{len(failed)} failed; --traceback shows where they raised.")
