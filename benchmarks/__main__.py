"""The one benchmark runner: ``python -m benchmarks SUITE [options]`` (from the repository).

Suites (one module each, routines as entries of its ``ROUTINES``):

- ``kernels``: dense GEMMs per operation (w4a4, w4a16, w4a8) and the quantize kernel,
  each backend's tactics and the dispatcher's pick beside bf16 cuBLAS and FP8 cuBLASLt;
  the grouped MoE GEMM beside bf16 ``torch._grouped_mm`` and a loop of dense GEMMs;
- ``serving``: the layer a user swaps in (eager and CUDA graph), graph/compile checks,
  first contact on a CPU, loading a checkpoint;
- ``model``: one step of a Llama decoder, bf16 vs NVFP4 vs FP8;
- ``tuning``: cold tuning, the never-loses check under both policies (and distributed),
  the tuner's result check, the first-use check of third-party kernels;
- ``ranking``: cost of ranking and selecting, selection quality against the exhaustive
  best, FlashInfer's shortlist beside ours, the cost-model fits' checks;
- ``blackwell``: the CuTe-DSL families on Blackwell/Rubin hardware (compiled, not run
  on hardware by this project: the acceptance run for a user who has it).

Options every suite takes (a suite's own follow them, e.g. ``model --configs 8b``):
``--cases`` (routines, default all), ``--shapes M,N,K ...`` or ``--m ...``/``--nk N,K ...``
(the grid), ``--clocks graph eager``, ``--top`` (tactics
per backend), ``--budget-s``, ``--workers``, ``--out DIR`` (default ``$OUT``, else .),
``--smoke`` (each suite's smallest cases on the CPU, Triton interpreter: a script check,
its times mean nothing). Each run writes ``<out>/<suite>.jsonl`` (`results.Row` lines)
and ``<out>/<suite>.md`` (the table), and exits 1 when a routine failed.

Two tools read the rows back: ``python -m benchmarks table FILE.jsonl [--pivot]`` (the
markdown for RESULTS.md) and ``python -m benchmarks compare A.jsonl B.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from . import results

SUITES = ("kernels", "serving", "model", "tuning", "ranking", "blackwell")
log = logging.getLogger("benchmarks")


def _ints(count: int):
    """An argparse type: ``"M,N,K"`` (or ``"N,K"``) -> ints (argparse names the option)."""

    def parse(text: str) -> tuple[int, ...]:
        parts = text.lower().replace("x", ",").split(",")
        if len(parts) != count or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            form = ",".join("MNK"[3 - count :])
            raise argparse.ArgumentTypeError(f"expected {form} (positive integers), got {text!r}")
        return tuple(int(p) for p in parts)

    return parse


_shape, _nk = _ints(3), _ints(2)


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", default=None, help="routines to run (default: all)")
    p.add_argument("--shapes", nargs="+", type=_shape, default=None, metavar="M,N,K")
    p.add_argument("--m", nargs="+", type=int, default=None, help="M values of the grid")
    p.add_argument("--nk", nargs="+", type=_nk, default=None, metavar="N,K")
    p.add_argument("--clocks", nargs="+", default=["graph", "eager"],
                   choices=results.CLOCKS[:3])  # fmt: skip
    p.add_argument("--top", type=int, default=4, help="tactics per backend (0: the shortlist)")
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds, then skip the rest")
    p.add_argument("--workers", type=int, default=8, help="precompile processes")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else .)")
    p.add_argument("--smoke", action="store_true", help="smallest cases on the CPU")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUITES:
        s = sub.add_parser(name, help=f"the {name} suite")
        common_options(s)
    t = sub.add_parser("table", help="markdown table of a JSON-lines file")
    t.add_argument("file")
    t.add_argument("--pivot", action="store_true", help="one column per path")
    c = sub.add_parser("compare", help="two runs row by row")
    c.add_argument("a")
    c.add_argument("b")
    return p


def run_suite(name: str, args: argparse.Namespace, rest: list[str], argv: Sequence[str]) -> int:
    if args.smoke:  # before the first triton import: the interpreter reads it then
        os.environ["TRITON_INTERPRET"] = "1"
    from .common import context

    module = importlib.import_module(f"benchmarks.{name}")
    extra = getattr(module, "options", None)
    if extra is not None:
        extra(args, rest)
    elif rest:
        raise SystemExit(f"{name}: unknown options {rest}")
    routines = module.ROUTINES
    chosen = args.cases or (list(module.SMOKE) if args.smoke else list(routines))
    unknown = [c for c in chosen if c not in routines]
    if unknown:
        raise SystemExit(f"--cases: {unknown} not in the {name} suite's {list(routines)}")
    ctx = context(name, args, argv)
    failed = []
    for case in chosen:
        log.info("%s: %s", name, case)
        try:
            routines[case](ctx)
        except Exception:  # one routine's failure is reported; the others still run
            log.exception("%s: %s failed", name, case)
            failed.append(case)
    render = getattr(module, "render", results.table)
    text = render(ctx.rows)
    ctx.out.with_suffix(".md").write_text(text + "\n")
    sys.stdout.write(text + "\n")
    if failed:
        log.error("failed routines: %s", failed)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fp4_dispatch").setLevel(logging.WARNING)  # one line per plan otherwise
    # which compiled linears Inductor launches itself: one line per plan key
    logging.getLogger("fp4_dispatch.engine.inductor").setLevel(logging.INFO)
    if rest and args.command not in SUITES:
        raise SystemExit(f"{args.command}: unknown options {rest}")
    if args.command == "table":
        sys.stdout.write(results.table(results.read_rows(args.file), args.pivot) + "\n")
        return 0
    if args.command == "compare":
        a, b = results.read_rows(args.a), results.read_rows(args.b)
        sys.stdout.write(results.compare(a, b) + "\n")
        return 0
    return run_suite(args.command, args, rest, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
