"""``fp4-dispatch list-backends``: what is loaded, what is not, and why.

Every plugin appears: loaded backends, failed, disabled and empty plugins (a hook that
registered nothing), the faults its code had at run time (e.g. ``tactics()`` raising on
the sample shape), and its load time when it is slow. The table always prints; with
``--strict`` (or FP4_DISPATCH_STRICT=1) any failure or fault makes the exit status 1.

``--json`` prints a list with one object per backend (or per plugin that failed, was
disabled or registered nothing), with stable types: ``name``, ``family``, ``origin``,
``version``, ``status``, ``reason``, ``plugin`` (strings), ``tactics`` (int: tactics
offered for the sample shape; null when the backend is not available or its
``tactics()`` faulted, the error then in ``tactics_error``), ``operations`` (list),
``note`` (string), ``error`` (object or null), ``faults`` (list), ``load_s`` (float: the
plugin's import and hook), ``hooks`` (object: ``{call: {"calls", "seconds", "max_s"}}``,
the time in this backend's ``supports``/``tactics``/``validate``/``build``) and ``device``
(the `DeviceInfo` the row describes, the same object in every row). The table's
``load+hooks s`` column sums them; a call over `SLOW_CALL_S` is named in the reason.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from fp4_dispatch.cli.common import (
    CliError,
    add_command,
    add_device_args,
    add_json_arg,
    device_json,
    emit_json,
    format_table,
    make_dispatcher,
)
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading import guard as _guard
from fp4_dispatch.loading.guard import PluginFault
from fp4_dispatch.loading.registry import SLOW_LOAD_S, strict_default

log = logging.getLogger(__name__)

#: the shape the tactic count is taken at
SAMPLE = Problem(m=128, n=4096, k=4096)


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
    backend = dispatcher.registry.backends.get(name)
    if backend is None or backend not in dispatcher.available:
        return None, ""
    problem = (
        SAMPLE
        if "w4a4" in backend.operations
        else SAMPLE.model_copy(update={"operation": backend.operations[0]})
    )
    tactics = dispatcher.guard.tactics(backend, problem, dispatcher.device)
    if isinstance(tactics, PluginFault):  # recorded: shown under "plugin faults"
        return None, tactics.fault.what
    return len(tactics), ""


def _reason(row: dict) -> str:
    """The row's reason, with its faults counted and a slow load time shown."""
    parts = (
        [row["reason"] or row["tactics_error"]] if (row["reason"] or row["tactics_error"]) else []
    )
    if row["faults"]:
        parts.append(f"{len(row['faults'])} fault(s), see below")
    if row["load_s"] > SLOW_LOAD_S:
        parts.append(f"slow to load: {row['load_s']:.1f} s")
    parts += [f"slow {call}: {v['max_s']:.1f} s" for call, v in row["hooks"].items()
              if v["max_s"] > _guard.SLOW_CALL_S]  # fmt: skip
    return "; ".join(parts)


def _times(row: dict) -> str:
    """``load+hooks`` seconds: the plugin's import and hook, then this backend's calls."""
    hooks = sum(v["seconds"] for v in row["hooks"].values())
    return f"{row['load_s']:.2f}+{hooks:.2f}"


def rows(dispatcher) -> list[dict[str, Any]]:
    """One JSON-ready row per backend status (see the module docstring for the keys)."""
    device = device_json(dispatcher.device)
    out = []
    statuses = dispatcher.backends()
    for st in statuses:
        row = st.to_json()
        row["tactics"], row["tactics_error"] = _tactic_count(dispatcher, st.name)
        backend = dispatcher.registry.backends.get(st.name)
        row["operations"] = list(backend.operations) if backend else []
        row["note"] = getattr(backend, "compile_only_note", "") if backend else ""
        row["device"] = device
        out.append(row)
    for row, st in zip(out, statuses, strict=True):  # faults found while counting tactics
        row["faults"] = [f.to_json() for f in dispatcher.faults if f.backend == st.name]
    return out


def run(args: argparse.Namespace) -> int:
    strict = args.strict or strict_default()
    # never strict while loading: the table is printed first, strictness sets the status
    d = make_dispatcher(args, strict=False)
    table_rows = rows(d)
    failed = [r for r in table_rows if r["status"] == "failed"]
    faults = list(d.faults)
    if args.json:
        emit_json(table_rows)
    else:
        _print_table(d, table_rows, failed, faults, args.traceback)
    if (failed or faults) and strict:
        names = ", ".join(f"{r['name']} ({r['reason']})" for r in failed)
        names += ", ".join(f"{f.plugin}/{f.backend} {f.call}" for f in faults)
        raise CliError(f"--strict: {len(failed)} failed, {len(faults)} fault(s): {names}")
    return 0


def _print_table(d, table_rows: list[dict], failed: list[dict], faults: list,
                 tracebacks: bool) -> None:  # fmt: skip
    print(f"device: {d.device.name} ({d.device.kind}) {d.device.note}".rstrip())
    print(f"sample shape for the tactic count: M={SAMPLE.m} N={SAMPLE.n} K={SAMPLE.k}\n")
    table = [
        (r["name"], r["family"], f"{r['origin']} {r['version']}", r["status"],
         "error" if r["tactics_error"] else ("-" if r["tactics"] is None else r["tactics"]),
         _times(r), _reason(r))
        for r in table_rows
    ]  # fmt: skip
    headers = ("backend", "family", "origin", "status", "tactics", "load+hooks s", "reason")
    print(format_table(table, headers))
    if faults:
        print("\nplugin faults (contained; the backend or tactic is not used):")
        for f in faults:
            print(f"  {f}")
    for note in sorted({r["note"] for r in table_rows if r["note"]}):
        print(f"\nnote: {note}")
    if tracebacks:
        for r in failed:
            if r["error"]:
                print(f"\n--- {r['plugin']} ---\n{r['error']['traceback']}")
        for f in faults:
            print(f"\n--- {f.plugin} / {f.backend} {f.call} ---\n{f.traceback}")
    elif failed:
        print(f"\n{len(failed)} failed; --traceback shows where they raised.")
