"""``fp4-dispatch cache show [--json] | path | clear``: the tuning cache file.

``show --json`` prints ``{"path", "metadata", "entries": [...]}``, one entry per tuned
problem bucket (device fingerprint, N, K, M bucket, output dtype).
"""

from __future__ import annotations

import argparse
import math

from ..cache import TuningCache, default_path
from . import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="show, locate or clear the tuning cache")
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="one row per tuned problem bucket")
    common.add_json_arg(show)
    show.set_defaults(func=run)
    path = actions.add_parser("path", help="print the cache file's path")
    path.set_defaults(func=run)
    clear = actions.add_parser("clear", help="delete the cache file")
    clear.set_defaults(func=run)


#: fields shown elsewhere, or left out at their usual value
_QUIET = {"backend": None, "tile_m": None, "tile_n": None, "cluster_m": 1, "cluster_n": 1,
          "swap_ab": False}  # fmt: skip


def _knobs(tactic: dict) -> str:
    """``128x64 swap k_chunk=0``: tile, then fields not at their usual value."""
    tile = f"{tactic.get('tile_m', '?')}x{tactic.get('tile_n', '?')}"
    rest = []
    for key, value in sorted(tactic.items()):
        if key in _QUIET and (_QUIET[key] is None or _QUIET[key] == value):
            continue
        rest.append("swap" if key == "swap_ab" else f"{key}={value}")
    return " ".join([tile, *rest])


def _us(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:,.2f}"
    return "-"


def show(cache: TuningCache, as_json: bool) -> int:
    data = cache.load()
    entries = data.to_json()["entries"]
    if as_json:
        common.emit_json({"path": str(cache.path), "metadata": data.metadata, "entries": entries})
        return 0
    print(f"tuning cache: {cache.path}")
    if not entries:
        print("no entries" + ("" if cache.path.exists() else " (the file does not exist yet)"))
        return 0
    devices = data.metadata.get("devices", {}) if isinstance(data.metadata, dict) else {}
    md = data.metadata
    print(f"library {md.get('library_version', '?')}, torch {md.get('torch', '?')}, "
          f"updated {md.get('updated', '?')}\n")  # fmt: skip
    rows = []
    for e in entries:
        dev = devices.get(e["device"], {})
        runner = e.get("runner_up") or {}
        heur = e.get("heuristic") or {}
        regret = "-"
        if isinstance(heur.get("us"), (int, float)) and e["us"] > 0:
            regret = f"{(heur['us'] / e['us'] - 1) * 100:+.1f}%"
        rows.append(
            (
                dev.get("name", e["device"]),
                e["n"],
                e["k"],
                f"M<={e['m_bucket']}",
                e["out_dtype"],
                f"{e['backend']} {e['backend_version']}",
                _knobs(e["tactic"]),
                _us(e["us"]),
                _us(runner.get("us")),
                regret,
                e.get("timestamp", "?"),
            )
        )
    headers = ("device", "N", "K", "bucket", "dtype", "backend", "tactic", "µs",
               "runner-up µs", "heuristic regret", "tuned at")  # fmt: skip
    print(common.format_table(rows, headers))
    return 0


def run(args: argparse.Namespace) -> int:
    cache = TuningCache(default_path())
    if args.cache_action == "path":
        print(cache.path)
        return 0
    if args.cache_action == "clear":
        removed = cache.clear()
        print(f"removed {cache.path} ({removed} entries)")
        return 0
    return show(cache, args.json)
