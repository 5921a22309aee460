"""``fp4-dispatch cache show [--json] | path | clear | export FILE | import FILE``.

``show --json`` prints ``{"path", "metadata", "entries": [...]}``, one entry per tuned
problem bucket (device fingerprint, N, K, M bucket, output dtype, operation). The table
shows each entry's measurement policy and its paired check against the default (ratio;
"kept" when the default stayed). ``show`` displays
whatever the loader accepts: optional fields may be missing or of odd types (shown as
``?``/``-``). ``export FILE [--device D]`` writes the entries (of one device: a
fingerprint such as ``"NVIDIA H200|9.0|132"``, or a device spec such as ``cuda:0``) to
a cache file; ``import FILE [--replace]`` merges a file's entries that fit this machine
(device, backends, environment), keeps every existing entry (unless ``--replace``
lets an imported one replace the entry of its bucket) and reports what was taken and
skipped and why (table, or ``--json``).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Mapping
from typing import Any

from fp4_dispatch.cli import common
from fp4_dispatch.store.cache import (
    CacheFormatError,
    ExportTargetError,
    ImportReport,
    TuningCache,
    default_path,
)

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="show, locate, clear, export or import the tuning cache")
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="one row per tuned problem bucket")
    common.add_json_arg(show)
    show.set_defaults(func=run)
    path = actions.add_parser("path", help="print the cache file's path")
    path.set_defaults(func=run)
    clear = actions.add_parser("clear", help="delete the cache file")
    clear.set_defaults(func=run)
    export = actions.add_parser("export", help="write the cache's entries to FILE")
    export.add_argument("file", metavar="FILE")
    export.add_argument(
        "--device",
        default=None,
        help="only this device's entries: a fingerprint (name|cc|SMs) or a device spec "
        "(auto, cpu, cuda[:N]); default: every device",
    )
    common.add_json_arg(export)
    export.set_defaults(func=run)
    imp = actions.add_parser("import", help="merge FILE's entries that fit this machine")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument(
        "--replace", action="store_true", help="an imported entry replaces its bucket's entry"
    )
    common.add_json_arg(imp)
    imp.set_defaults(func=run)


def _knobs(tactic: object) -> str:
    """``128x64 swap k_chunk=0``: the stored tactic's label (`tactics.tactic_label`)."""
    if not isinstance(tactic, Mapping):
        return "?"
    from fp4_dispatch.contracts.tactics import tactic_label  # noqa: PLC0415 - lazy: start-up time (--help)

    return tactic_label(tactic)


def _num(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _field(obj: object, key: str) -> Any:
    """``obj[key]`` when `obj` is a mapping, else None (optional fields may be anything)."""
    return obj.get(key) if isinstance(obj, Mapping) else None


def _env(entry: Mapping[str, Any]) -> str:
    """``torch 2.13 triton 3.9 driver 12.4``: the recorded environment, short."""
    env = entry.get("env")
    if not isinstance(env, Mapping):
        return "(none recorded)"
    short = {"torch": "torch", "triton": "triton", "cutlass_dsl": "cute-dsl",
             "cutlass_operators": "cutlass-ops", "cuda_driver": "driver"}  # fmt: skip
    parts = [f"{label} {env[k]}" for k, label in short.items() if env.get(k) is not None]
    return " ".join(parts) or "-"


def _vs_default(entry: Mapping[str, Any]) -> str:
    """The paired check: ``0.812`` (adopted at that ratio), ``kept 0.990``, ``-`` (none)."""
    ratio = _num(entry.get("paired_ratio"))
    text = "" if ratio is None else f"{ratio:.3f}"
    if entry.get("kept_default") is True:
        return f"kept {text}".strip()
    return text or "-"


def _measure(entry: Mapping[str, Any]) -> str:
    """The measurement policy; older entries without one: read from ``method``."""
    measure = entry.get("measure")
    if measure in ("graph", "eager"):
        return measure
    return "eager" if entry.get("method") in ("wall-clock", "cuda-eager") else "graph"


def _row(e: Mapping[str, Any], devices: object) -> tuple:
    dev = _field(devices, e["device"])
    heur_us, us = _num(_field(e.get("heuristic"), "us")), _num(e["us"])
    regret = f"{(heur_us / us - 1) * 100:+.1f}%" if heur_us is not None and us else "-"
    return (
        _field(dev, "name") or e["device"],
        e["n"],
        e["k"],
        f"M<={e['m_bucket']}",
        e["out_dtype"],
        e.get("operation") if isinstance(e.get("operation"), str) else "w4a4",
        f"{e['backend']} {e['backend_version']}",
        _knobs(e["tactic"]),
        common.us(e["us"]),
        common.us(_field(e.get("runner_up"), "us")),
        regret,
        _vs_default(e),
        _measure(e),
        _env(e),
        e.get("timestamp", "?"),
    )


def show(cache: TuningCache, as_json: bool) -> int:
    data = cache.load()
    entries = data.to_json()["entries"]
    if as_json:
        common.emit_json({"path": str(cache.path), "metadata": data.metadata, "entries": entries})
        return 0
    print(
        f"tuning cache: {cache.path}"
        + (f" (read-only: {data.read_only})" if data.read_only else "")
    )
    if not entries:
        print("no entries" + ("" if cache.path.exists() else " (the file does not exist yet)"))
        return 0
    md = data.metadata
    print(f"library {md.get('library_version', '?')}, torch {md.get('torch', '?')}, "
          f"updated {md.get('updated', '?')}\n")  # fmt: skip
    rows = [_row(e, md.get("devices")) for e in entries]
    headers = ("device", "N", "K", "bucket", "dtype", "op", "backend", "tactic", "µs",
               "runner-up µs", "heuristic regret", "vs default", "measure", "environment",
               "tuned at")  # fmt: skip
    print(common.format_table(rows, headers))
    return 0


def _device_filter(spec: str | None) -> str | None:
    """A fingerprint for ``--device``: given as one, or the fingerprint of a device spec."""
    if spec is None or "|" in spec:
        return spec
    from fp4_dispatch.loading.profiles import resolve  # noqa: PLC0415 - lazy: start-up time
    from fp4_dispatch.store.cache import device_fingerprint  # noqa: PLC0415 - lazy: start-up time

    d = resolve(spec, None)
    return device_fingerprint(d.name, d.compute_capability, d.sm_count)


def export(cache: TuningCache, file: str, device: str | None, as_json: bool) -> int:
    fingerprint = _device_filter(device)
    count = cache.export_to(file, device=fingerprint)
    if as_json:
        common.emit_json({"path": str(cache.path), "file": file, "device": fingerprint,
                          "exported": count})  # fmt: skip
    else:
        which = f" of {fingerprint}" if fingerprint else ""
        print(f"exported {count} entries{which} from {cache.path} to {file}")
    return 0


def _report_rows(report: ImportReport) -> list[tuple]:
    def key(e: Mapping[str, Any] | None) -> tuple:
        if e is None:
            return ("?", "?", "?", "?", "?", "?")
        return (e["device"], e["n"], e["k"], f"M<={e['m_bucket']}", e["out_dtype"], e["backend"])

    rows = [("taken", *key(e), "") for e in report.taken]
    rows += [("skipped", *key(e), why) for e, why in report.skipped]
    return rows


def import_(file: str, replace: bool, as_json: bool) -> int:
    from fp4_dispatch.engine.dispatcher import Dispatcher  # noqa: PLC0415 - lazy: start-up time

    d = Dispatcher()
    try:
        report = d.winners.import_from(file, replace=replace)
    except (CacheFormatError, OSError, TimeoutError) as exc:
        log.warning("cache import %s failed: %s", file, exc)
        if as_json:
            common.emit_json({"source": file, "error": f"{type(exc).__name__}: {exc}"})
        else:
            print(f"cannot import {file}: {exc}")
        return 1
    if as_json:
        common.emit_json({"path": str(d.cache.path), **report.to_json()})
        return 0
    print(f"imported into {d.cache.path}: {len(report.taken)} taken, "
          f"{len(report.skipped)} skipped")  # fmt: skip
    if report.taken or report.skipped:
        headers = ("result", "device", "N", "K", "bucket", "dtype", "backend", "reason")
        print(common.format_table(_report_rows(report), headers))
    return 0


def run(args: argparse.Namespace) -> int:
    cache = TuningCache(default_path())
    try:
        return _run(cache, args)
    except BrokenPipeError:  # the reader closed stdout (`| head`): not the cache's fault
        raise
    except ExportTargetError as exc:  # the destination's fault: name it, not the cache
        log.warning("cache export: %s", exc)
        print(f"fp4-dispatch cache export: {exc}")
        return 1
    except (OSError, TimeoutError, CacheFormatError) as exc:  # name the file, no traceback
        log.warning("tuning cache %s: %s: %s", cache.path, type(exc).__name__, exc)
        print(f"fp4-dispatch cache {args.cache_action}: {cache.path}: {exc}")
        return 1


def _run(cache: TuningCache, args: argparse.Namespace) -> int:
    if args.cache_action == "path":
        print(cache.path)
        return 0
    if args.cache_action == "clear":
        removed = cache.clear()
        print(f"removed {cache.path} ({removed} entries)")
        return 0
    if args.cache_action == "export":
        return export(cache, args.file, args.device, args.json)
    if args.cache_action == "import":
        return import_(args.file, args.replace, args.json)
    return show(cache, args.json)
