"""The one result row of every benchmark suite, and the tools that read rows back.

Every suite writes `Row`s as JSON lines (``<out>/<suite>.jsonl``), one row per measured
(case, path, shape, clock); RESULTS.md's tables are rendered from those files
(``python -m benchmarks table FILE.jsonl``) and two runs are compared row by row
(``python -m benchmarks compare A.jsonl B.jsonl``). A row carries what reproduces it:
the device, the date, the commit and the command.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: the clocks a row can be measured with (`fp4_dispatch.autotune.harness`): GPU time of CUDA-graph
#: replays with a cold L2, eager wall per call back to back, eager wall of a
#: ``torch.compile``d call, host wall of single cold calls (first contact, loading)
CLOCKS = ("graph", "eager", "compile", "host")
#: the fields that identify a measurement across runs (what `compare` joins on)
KEY = ("suite", "case", "backend", "tactic", "operation", "m", "n", "k", "clock")


@dataclasses.dataclass
class Row:
    """One measurement. ``backend``: the path timed (a backend name, or a baseline such
    as ``torch.mm bf16``; a model variant in the model suite). ``median_us`` and
    ``spread_us`` (min, max of the samples) are None when it did not run, and
    ``failure`` says why. ``error``: relative Frobenius error against the float64
    reference where one was computed. ``ratios``: name -> that path's time over this
    one (> 1: this one is faster), e.g. ``{"bf16": 1.8}``. ``extra``: the case's own
    figures (counts, cosines, bytes)."""

    suite: str
    case: str
    backend: str = ""
    tactic: str = ""
    operation: str = ""
    m: int | None = None
    n: int | None = None
    k: int | None = None
    clock: str = "graph"
    median_us: float | None = None
    spread_us: tuple[float, float] | None = None
    error: float | None = None
    failure: str | None = None
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    device: str = ""
    date: str = ""
    commit: str = ""
    command: str = ""

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock: expected one of {CLOCKS}, got {self.clock!r}")

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in KEY)

    def to_json(self) -> str:
        def clean(x: Any) -> Any:  # JSON has no NaN/inf: they are "did not run" here
            return None if isinstance(x, float) and not math.isfinite(x) else x

        d = dataclasses.asdict(self)
        d["ratios"] = {k: clean(v) for k, v in self.ratios.items()}
        d["extra"] = {k: clean(v) for k, v in self.extra.items()}
        return json.dumps({k: clean(v) for k, v in d.items()}, default=str)

    @classmethod
    def from_json(cls, line: str) -> Row:
        d = json.loads(line)
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in d.items() if k not in names}  # older or newer fields
        row = cls(**{k: v for k, v in d.items() if k in names})
        row.spread_us = tuple(row.spread_us) if row.spread_us else None  # type: ignore[assignment]
        row.extra.update(extra)
        return row


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a JSON-lines file (blank lines skipped)."""
    lines = Path(path).read_text().splitlines()
    return [Row.from_json(ln) for ln in lines if ln.strip()]


def write_rows(path: Path, rows: Iterable[Row], append: bool = True) -> None:
    with path.open("a" if append else "w") as f:
        f.writelines(r.to_json() + "\n" for r in rows)


def num(x: float | None, spec: str = ".1f") -> str:
    """`x` formatted, ``n/a`` when it is None, NaN or infinite."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; columns after the first text ones right-aligned when numeric."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    right = [bool(cells) and all(_numeric(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        cols = (v.rjust(w) if r else v.ljust(w)
                for v, w, r in zip(values, widths, right, strict=True))  # fmt: skip
        return "| " + " | ".join(cols) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if r else "-" * (w + 2)
                          for w, r in zip(widths, right, strict=True)) + "|"  # fmt: skip
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def _numeric(text: str) -> bool:
    return text in ("n/a", "") or text.lstrip("-").replace(".", "", 1).rstrip("x").isdigit()


def _label(r: Row) -> str:
    return f"{r.backend} {r.tactic}".strip()


def _shape(r: Row) -> str:
    return "x".join(str(v) for v in (r.m, r.n, r.k) if v is not None)


def table(rows: Sequence[Row], pivot: bool = False) -> str:
    """RESULTS.md table of `rows`: one line per row (median, spread, error, ratios,
    failure), or with `pivot` one line per (case, shape, clock) and a column per path
    (µs, and x the first ratio's path). The command and device of the run go first."""
    if not rows:
        return "(no rows)"
    runs = dict.fromkeys(f"`{r.command}` — {r.device}, {r.date}, commit {r.commit}" for r in rows)
    head = "\n".join(f"Command: {run}" for run in runs) + "\n\n"
    if pivot:
        return head + _pivot(rows)
    ratio_names = list(dict.fromkeys(name for r in rows for name in r.ratios))
    headers = ["case", "path", "op", "M x N x K", "clock", "median µs", "spread µs", "rel err",
               *[f"x {name}" for name in ratio_names], "note"]  # fmt: skip
    body = []
    for r in rows:
        spread = f"{r.spread_us[0]:.1f}-{r.spread_us[1]:.1f}" if r.spread_us else "n/a"
        note = r.failure or ", ".join(f"{k}={v}" for k, v in r.extra.items() if _short(v))
        body.append([r.case, _label(r), r.operation, _shape(r), r.clock, num(r.median_us),
                     spread, num(r.error, ".2e"),
                     *[num(r.ratios.get(name), ".2f") for name in ratio_names], note])  # fmt: skip
    return head + markdown_table(headers, body)


def _short(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) and len(str(v)) <= 40


def _pivot(rows: Sequence[Row]) -> str:
    paths = list(dict.fromkeys(r.backend for r in rows))
    lines = list(dict.fromkeys((r.case, _shape(r), r.clock) for r in rows))
    best: dict[tuple, Row] = {}
    for r in rows:  # the fastest tactic of each path
        key = (r.case, _shape(r), r.clock, r.backend)
        old = best.get(key)
        if old is None or (r.median_us or math.inf) < (old.median_us or math.inf):
            best[key] = r
    base = next((name for r in rows for name in r.ratios), None)
    body = []
    for case, shape, clock in lines:
        cells = [case, shape, clock]
        for p in paths:
            r = best.get((case, shape, clock, p))
            ratio = r.ratios.get(base) if r is not None and base else None
            cells.append("" if r is None else num(r.median_us)
                         + ("" if ratio is None else f" ({ratio:.2f}x)"))  # fmt: skip
        body.append(cells)
    suffix = f" (x {base})" if base else ""
    return markdown_table(["case", "M x N x K", "clock", *[f"{p} µs{suffix}" for p in paths]],
                          body)  # fmt: skip


def compare(a: Sequence[Row], b: Sequence[Row]) -> str:
    """Rows of two runs joined on `KEY`: both medians and B / A (> 1: B is slower); a
    change is marked ``*`` when the two spreads do not overlap (beyond the noise)."""
    first = {r.key(): r for r in a}
    headers = ["case", "path", "M x N x K", "clock", "A µs", "B µs", "B / A", ""]
    body, only_b = [], 0
    for r in b:
        old = first.pop(r.key(), None)
        if old is None:
            only_b += 1
            continue
        x, y = old.median_us, r.median_us
        ratio = y / x if x and y else None
        apart = bool(old.spread_us and r.spread_us and (
            r.spread_us[0] > old.spread_us[1] or r.spread_us[1] < old.spread_us[0]))  # fmt: skip
        body.append([r.case, _label(r), _shape(r), r.clock, num(x), num(y), num(ratio, ".3f"),
                     "*" if apart else ""])  # fmt: skip
    tail = f"\n\n{len(first)} row(s) only in A, {only_b} only in B"
    return markdown_table(headers, body) + tail
