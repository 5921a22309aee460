"""``fp4-dispatch`` command line. One module per subcommand, each with ``register(sub)``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: subcommand modules, in the order `--help` lists them
COMMANDS = (
    "list_backends",
    "devices",
    "explain",
    "doctor",
    "compile",
    "tune",
    "cache",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4-dispatch",
        description="Pick and run the fastest NVFP4 GEMM for this GPU, across kernel families.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            continue  # subcommand not shipped in this build
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
