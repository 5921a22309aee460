"""Helpers shared by the subcommands: device arguments, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` (auto, cpu, cuda[:N], sm90, sm100, sm103, sm107) and ``--sm-count``."""
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (default: the real GPU, else CPU), cpu, cuda[:N], or a simulated "
        "family: sm90, sm100, sm103, sm107",
    )
    parser.add_argument("--sm-count", type=int, default=None, help="override the SM count")


def add_budget_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--budget``: how many tactics the shortlist keeps (the library default)."""
    from ..ranking import DEFAULT_BUDGET

    parser.add_argument(
        "--budget", type=int, default=DEFAULT_BUDGET, help=f"{what} (default {DEFAULT_BUDGET})"
    )


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def make_dispatcher(args: argparse.Namespace, **kwargs: Any):
    """A `Dispatcher` for the device the command line names."""
    from ..dispatcher import Dispatcher

    return Dispatcher(device=args.device, sm_count=getattr(args, "sm_count", None), **kwargs)


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain aligned text table (no colour, so it survives pipes and logs)."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)
