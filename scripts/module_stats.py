"""Lines per module and the longest functions of the library code at a git revision.

For issue 10's closing note (how the restructuring changed module and function sizes):

    python scripts/module_stats.py 286798e          # before the restructuring
    python scripts/module_stats.py HEAD --top 15    # now
    python scripts/module_stats.py HEAD --json      # the same, as JSON

Reads the files from git (``git ls-tree`` / ``git show``), never the working tree, so
any revision can be measured from one checkout. Library code is every ``.py`` file under
``dispatch/`` (the core), ``backends/`` and ``plugins/``; ``--paths`` changes that. A
function's length is its ``def`` line through its last line (decorators and docstring
included), from the ``ast`` of the file; methods and nested functions count on their own
(a method is named ``Class.method``).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = ("dispatch", "backends", "plugins")


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    line: int
    lines: int


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def python_files(rev: str, paths: tuple[str, ...]) -> list[str]:
    listed = git("ls-tree", "-r", "--name-only", rev, "--", *paths).splitlines()
    return sorted(p for p in listed if p.endswith(".py"))


def functions(path: str, source: str) -> list[Function]:
    """Every function and method of one file, with its length in lines."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append(Function(path, prefix + child.name, child.lineno, size))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=path), "")
    return found


def stats(rev: str, paths: tuple[str, ...], top: int) -> dict:
    modules: dict[str, int] = {}
    funcs: list[Function] = []
    for path in python_files(rev, paths):
        source = git("show", f"{rev}:{path}")
        modules[path] = len(source.splitlines())
        funcs += functions(path, source)
    longest = sorted(funcs, key=lambda f: (-f.lines, f.path, f.line))[:top]
    core = {p: n for p, n in modules.items() if p.startswith("dispatch/")}
    return {
        "revision": git("rev-parse", "--short", rev).strip(),
        "modules": modules,
        "total_lines": sum(modules.values()),
        "core_modules": len(core),
        "core_lines": sum(core.values()),
        "largest_core_module": max(core.items(), key=lambda kv: kv[1]) if core else None,
        "functions": len(funcs),
        "longest": [asdict(f) for f in longest],
    }


def render(s: dict, core_only: bool) -> str:
    rows = [f"revision {s['revision']}: {len(s['modules'])} modules, {s['total_lines']} lines; "
            f"core (dispatch/) {s['core_modules']} modules, {s['core_lines']} lines; "
            f"{s['functions']} functions", "", "| module | lines |", "|---|---:|"]  # fmt: skip
    for path, n in sorted(s["modules"].items(), key=lambda kv: (-kv[1], kv[0])):
        if not core_only or path.startswith("dispatch/"):
            rows.append(f"| {path} | {n} |")
    rows += ["", f"{len(s['longest'])} longest functions:", "",
             "| function | where | lines |", "|---|---|---:|"]  # fmt: skip
    for f in s["longest"]:
        rows.append(f"| {f['name']} | {f['path']}:{f['line']} | {f['lines']} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", nargs="?", default="HEAD", help="git revision (default HEAD)")
    p.add_argument("--top", type=int, default=15, help="longest functions shown")
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), help="folders measured")
    p.add_argument("--core-only", action="store_true", help="module table: dispatch/ only")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    s = stats(args.rev, tuple(args.paths), args.top)
    sys.stdout.write(json.dumps(s, indent=1) + "\n" if args.json else render(s, args.core_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
