"""What every benchmark driver shares: shapes, JSON to ``$OUT``, tables, RESULTS.md sections.

The measuring itself is `fp4_dispatch.harness` (one GPU clock with a cold L2, one eager
wall clock, one host wall clock for single cold calls, one numerics check), so a figure
here compares with the tuner's; compiling ahead of the timed loop is the library's one
parallel precompile (`fp4_dispatch.precompile`, wrapped by `precompile_kernels`). This
module is only the plumbing around it, so that each ``bench_*.py`` / check script reads
as what it measures. Scripts import it as
``from _common import ...`` (Python puts the script's folder first on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fp4_dispatch import precompile as pc

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"M,N,K"`` or ``"MxNxK"`` -> (M, N, K); ValueError naming the text otherwise."""
    parts = text.lower().replace("x", ",").split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape: expected M,N,K or MxNxK (positive integers), got {text!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def parse_shapes(texts: Iterable[str]) -> list[tuple[int, int, int]]:
    return [parse_shape(t) for t in texts]


def out_dir(folder: str | os.PathLike[str] | None = None) -> Path | None:
    """`folder`, else ``$OUT``, created; None when neither is set."""
    where = folder if folder is not None else os.environ.get("OUT")
    if not where:
        return None
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    return path


def precompile_kernels(
    planned: Iterable[tuple[Any, Any, Any]],
    info: Any,
    workers: int,
    deadline_s: float | None = None,
) -> pc.PrecompileReport:
    """Compile every distinct kernel of the planned (backend, tactic, caller's problem)
    triples in `workers` spawned processes (`fp4_dispatch.precompile`: Triton ``warmup``
    for the sm90 backends, no launch; a backend without its own ``precompile`` only
    builds), so the timed code loads kernels from the disk caches. Off (every job
    ``skipped``) unless `info` is a CUDA device: on a CPU the Triton interpreter
    compiles nothing. The report has one outcome per distinct kernel."""
    jobs = pc.jobs_for(planned, skip_ready=False)
    count = workers if info.kind == "cuda" else 0
    return pc.precompile(jobs, info, workers=count, deadline_s=deadline_s)


def failures_by_tactic(report: pc.PrecompileReport) -> dict[str, str]:
    """{tactic JSON: why} of the kernels that failed to compile (the scripts' JSON field)."""
    return {o.job.tactic.canonical_json(): o.reason for o in report.failed}


def write_json(name: str, obj: object, folder: str | os.PathLike[str] | None = None) -> Path | None:
    """Write `obj` as ``<folder or $OUT>/<name>`` (indented; non-JSON values as str)."""
    return write_text(name, json.dumps(obj, indent=1, default=str), folder)


def write_text(name: str, text: str, folder: str | os.PathLike[str] | None = None) -> Path | None:
    """Write `text` as ``<folder or $OUT>/<name>`` (a markdown table, say)."""
    where = out_dir(folder)
    if where is None:
        return None
    path = where / name
    path.write_text(text)
    return path


def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> str:
    """A markdown table, columns padded to their widest cell. `align`: one character per
    column, ``l`` or ``r`` (default all left)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    align = align or "l" * len(headers)

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if a == "r" else v.ljust(w)
                  for v, w, a in zip(values, widths, align, strict=True))  # fmt: skip
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else "-" * (w + 2)
                          for w, a in zip(widths, align, strict=True)) + "|"  # fmt: skip
    return "\n".join([line([str(h) for h in headers]), rule, *(line(r) for r in cells)])


def num(x: float, spec: str = ".1f") -> str:
    """`x` formatted, ``n/a`` when it is None, NaN or infinite."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def ratio(x: float, y: float, spec: str = ".2f") -> str:
    """``x / y`` formatted, ``n/a`` unless both are finite and ``y > 0``."""
    ok = x is not None and y is not None and math.isfinite(x) and math.isfinite(y) and y > 0
    return format(x / y, spec) if ok else "n/a"


def record_section(text: str, heading: str, path: Path = RESULTS_MD) -> None:
    """Replace (or append) the section of RESULTS.md that starts with `heading` (a
    ``## ...`` line, the first line of `text`), leaving the other sections alone."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))  # fmt: skip
        new = "\n".join([*lines[:start], *text.rstrip("\n").splitlines(), "", *lines[end:]])
        new = new.rstrip("\n") + "\n"
    path.write_text(new)


def smoke_or_sm90(smoke: bool, run_smoke: Callable[[], int]) -> int | None:
    """The first step of a Hopper-only driver's ``main``: with ``--smoke`` (`smoke`) the
    exit code of `run_smoke` (its CPU check); without an sm90 GPU 2 (`on_sm90` says why
    on stderr); else None: go on with the H200 run."""
    if smoke:
        return run_smoke()
    return None if on_sm90() else 2


def on_sm90() -> bool:
    """Whether this process sees an sm90 GPU (H100/H200); if not, says so on stderr with
    the ``--smoke`` hint (the Hopper-only drivers then exit 2)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return True
    print("needs an sm90 GPU (H100/H200): run with --smoke on a CPU", file=sys.stderr)
    return False
