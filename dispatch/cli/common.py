"""Helpers shared by the subcommands: argument types, device arguments, tables, JSON.

Nothing here imports torch at module level: the top-level ``--help`` and ``--version``
must stay fast (no heavy import before a subcommand runs).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

#: the GEMM's K rule: whole bytes per pair of 16-element scale blocks (see fp4_dispatch.nvfp4)
K_MULTIPLE = 32
#: the largest dimension or count the CLI takes (`fp4_dispatch.checks.MAX_DIM`; the CLI
#: does not import torch, so the value is repeated here and a test keeps them equal)
MAX_INT = 2**31 - 1
DEFAULT_BUDGET = 32  # fp4_dispatch.ranking.DEFAULT_BUDGET, without importing the ranking


class CliError(Exception):
    """A failure the CLI reports as one line; ``code`` is the exit status (1: runtime)."""

    code = 1


class UsageError(CliError):
    """A bad argument value found after parsing (exit status 2, as argparse uses)."""

    code = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE line: ``prog: error: ...; see prog --help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_INT} (2**31 - 1), got {value}")
    return value


def k_dim(text: str) -> int:
    """An argparse type for K: a positive multiple of `K_MULTIPLE`."""
    value = positive_int(text)
    if value % K_MULTIPLE:
        raise argparse.ArgumentTypeError(
            f"expected a multiple of {K_MULTIPLE} (the NVFP4 GEMM's K rule), got {value}"
        )
    return value


_SHAPE = re.compile(r"^\s*(\S+?)\s*[,xX]\s*(\S+?)\s*[,xX]\s*(\S+?)\s*$")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"128,4096,4096"`` or ``"128x4096x4096"`` -> (128, 4096, 4096).

    The one shape parser of the CLI (``doctor --shape``, ``tune --shapes``): positive
    integers, K a multiple of 32. Raises argparse.ArgumentTypeError, so argparse reports
    it as a usage error naming the option.
    """
    match = _SHAPE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected M,N,K or MxNxK (e.g. 128,4096,4096), got {text!r}"
        )
    try:
        m, n = (positive_int(x) for x in match.group(1, 2))
        k = k_dim(match.group(3))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"in shape {text!r}: {exc}") from None
    return m, n, k


def device_arg(text: str) -> str:
    """An argparse type for ``--device``: auto, cpu, cuda, cuda:N or a simulated part.

    The simulated parts are the aliases the installed families declare
    (`fp4_dispatch.profiles`): looked up only when the value is not one of the fixed
    forms, so the common cases cost no plugin loading.
    """
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    from ..profiles import profiles  # noqa: PLC0415 - lazy: start-up time

    known = sorted(profiles())
    if value in known:
        return value
    raise argparse.ArgumentTypeError(
        f"expected auto, cpu, cuda, cuda:N (N an integer) or a simulated part "
        f"({', '.join(known)}), got {text!r}"
    )


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The positional ``M N K`` of one GEMM (same names and rules in every subcommand)."""
    parser.add_argument("m", type=positive_int, metavar="M", help="rows of A and of the output")
    parser.add_argument(
        "n", type=positive_int, metavar="N", help="rows of B (columns of the output)"
    )
    parser.add_argument(
        "k", type=k_dim, metavar="K", help=f"reduction length (a multiple of {K_MULTIPLE})"
    )


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` (auto, cpu, cuda[:N], a simulated part) and ``--sm-count``."""
    parser.add_argument(
        "--device",
        default="auto",
        type=device_arg,
        help="auto (default: the real GPU, else CPU), cpu, cuda[:N], or a simulated part "
        "a family declares (`fp4-dispatch devices` lists them: sm90, sm100, ...)",
    )
    parser.add_argument("--sm-count", type=positive_int, default=None, help="override the SM count")


def add_budget_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--budget``: how many tactics the shortlist keeps (the library default)."""
    parser.add_argument(
        "--budget",
        type=positive_int,
        default=DEFAULT_BUDGET,
        help=f"{what} (default {DEFAULT_BUDGET})",
    )


def add_problem_kind_args(parser: argparse.ArgumentParser) -> None:
    """``--out-dtype``, ``--op`` and ``--precision``: which problem of a shape, under which
    precision policy (the same choices everywhere)."""
    parser.add_argument(
        "--out-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16"),
        help="output dtype (default bfloat16)",
    )
    parser.add_argument(
        "--op",
        default="w4a4",
        choices=("w4a4", "w4a16", "grouped_w4a16", "grouped_w4a4"),
        help="w4a4: both operands NVFP4 (default); w4a16: dense activations, NVFP4 weights; "
        "grouped_w4a16/grouped_w4a4: the mixture-of-experts GEMM over --groups experts "
        "(M = total rows, N x K one expert's weight; docs/grouped.md)",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        metavar="E",
        help="the expert count of a grouped --op (needed by them, refused by the others)",
    )
    parser.add_argument(
        "--precision",
        default="exact",
        choices=("exact", "fp8"),
        help="exact (default): nothing lossy is ever chosen; fp8: a w4a16 call may also run "
        "as w4a8 (activations and weights rounded to FP8 E4M3, FP8 tensor cores)",
    )


def problem_groups(args: argparse.Namespace) -> int | None:
    """``--groups`` checked against ``--op`` (a grouped op needs it, the others refuse it)."""
    grouped = args.op.startswith("grouped_")
    if grouped and (args.groups is None or args.groups < 1):
        raise UsageError(f"--op {args.op}: needs --groups E (the expert count, >= 1), "
                         f"got {args.groups}")  # fmt: skip
    if not grouped and args.groups is not None:
        raise UsageError(f"--groups {args.groups}: only for --op grouped_w4a16 or "
                         f"grouped_w4a4, got --op {args.op}")  # fmt: skip
    return args.groups


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_command(
    sub: argparse._SubParsersAction, name: str, *, help: str, description: str, examples: str
) -> argparse.ArgumentParser:
    """A subcommand parser with a description and an ``examples:`` epilog in its --help."""
    return sub.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def make_dispatcher(args: argparse.Namespace, **kwargs: Any):
    """A `Dispatcher` for the device the command line names."""
    from ..dispatcher import Dispatcher  # noqa: PLC0415 - lazy: start-up time

    if getattr(args, "precision", None) is not None:
        kwargs.setdefault("precision", args.precision)
    return Dispatcher(device=args.device, sm_count=getattr(args, "sm_count", None), **kwargs)


def device_json(device: Any) -> dict[str, Any]:
    """The device a JSON document describes: its `DeviceInfo` fields."""
    return device.model_dump(mode="json")


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


def us(value: object) -> str:
    """Microseconds for a table cell: ``1,234.56`` (``1.235e+06`` from a second up), "-"
    when missing or not a finite number. The CLI's one format for times."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{value:,.2f}" if value < 1e6 else f"{value:.3e}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)
