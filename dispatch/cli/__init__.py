"""``fp4-dispatch`` command line. One module per subcommand, each with ``register(sub)``.

Start-up time: only the module of the subcommand being run is imported (``--help`` and
``--version`` import none, hence no torch). Errors: a usage error is one line and exit
status 2 (argparse's convention); a runtime failure is one line and exit status 1, with
the traceback only under ``-v`` or ``--traceback``; a closed stdout (``... | head``)
ends the command quietly with status 141 (128 + SIGPIPE, as a shell reports for tools
that die of SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from fp4_dispatch.cli.common import CliError, Parser
from fp4_dispatch.version import __version__

#: (subcommand, module, one-line help), in the order `--help` lists them
COMMANDS = (
    ("list-backends", "list_backends", "backends and plugins, with status and reason"),
    ("devices", "devices", "the detected device and the simulated ones"),
    ("explain", "explain", "the ranked, capped shortlist for one shape, and why"),
    ("doctor", "doctor", "self-check every backend that loads here"),
    ("compile", "compile", "compile the shortlist's Blackwell/Rubin kernels (no GPU needed)"),
    ("tune", "tune", "measure the shortlist of each shape and cache the winner"),
    ("cache", "cache", "show, locate, clear or move the tuning cache"),
)
SIGPIPE_EXIT = 141


def _add_common(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """-v/-q/--traceback; a subcommand's copies use ``sub_`` dests (summed in `main`)."""
    sup = argparse.SUPPRESS if prefix else None
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, dest=f"{prefix}verbose",
        help=sup or "more logging (-vv: debug); a failure prints its traceback",
    )  # fmt: skip
    parser.add_argument(
        "-q", "--quiet", action="count", default=0, dest=f"{prefix}quiet",
        help=sup or "less logging (errors only)",
    )  # fmt: skip
    parser.add_argument(
        "--traceback", action="store_true", dest=f"{prefix}traceback",
        help=sup or "print the traceback of a failure",
    )  # fmt: skip


def _add_common_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept -v/-q/--traceback after the subcommand too (and after nested actions)."""
    if "--verbose" not in parser._option_string_actions:
        _add_common(parser, prefix="sub_")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_common_everywhere(child)


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first argument that is one)."""
    names = {name for name, _, _ in COMMANDS}
    return next((a for a in argv if a in names), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (all when argv is None)."""
    parser = Parser(
        prog="fp4-dispatch",
        description="Pick and run the fastest NVFP4 GEMM for this GPU, across kernel families.",
        epilog="examples:\n  fp4-dispatch list-backends\n  fp4-dispatch doctor --device sm100\n"
        "  fp4-dispatch explain 128 4096 4096 --device sm107\n"
        "'fp4-dispatch COMMAND --help' describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fp4-dispatch {__version__}")
    _add_common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = None if argv is None else _chosen(argv)
    for name, module_name, help_text in COMMANDS:
        if argv is not None and name != chosen:
            sub.add_parser(name, help=help_text)  # listed in --help; never parsed
            continue
        try:
            module = importlib.import_module(f"{__name__}.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{module_name}":
                raise
            continue  # subcommand not shipped in this build
        module.register(sub)
        if name in sub.choices:
            _add_common_everywhere(sub.choices[name])
    return parser


def _one_line(exc: BaseException) -> str:
    """An exception as one line: type, then its message with newlines folded."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _quiet_broken_pipe() -> int:
    """stdout was closed by the reader: stop writing, say nothing (Python docs' recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    verbose = args.verbose + getattr(args, "sub_verbose", 0)
    quiet = args.quiet + getattr(args, "sub_quiet", 0)
    args.traceback = args.traceback or getattr(args, "sub_traceback", False)
    level = logging.WARNING - 10 * min(verbose, 2) + 10 * min(quiet, 1)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    prog = f"fp4-dispatch {args.command}"
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except CliError as exc:
        if args.traceback:
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.code
    except Exception as exc:  # reported as one line; -v/--traceback shows where
        if args.traceback or verbose:
            raise
        print(f"{prog}: error: {_one_line(exc)} (-v or --traceback shows where)", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
