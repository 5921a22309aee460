"""The one result row of every suite (`benchmarks.results`) and the two tools that read rows
back: ``python -m benchmarks table`` and ``compare``."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys

import pytest
from conftest import bench_module, source_root


@pytest.fixture(scope="module")
def results():
    with pytest.MonkeyPatch.context() as mp:
        yield bench_module("results", mp)


def _row(results, backend: str, us: float | None, spread=None, **kw):
    return results.Row(suite="kernels", case="w4a16", backend=backend, m=1, n=8, k=16,
                       median_us=us, spread_us=spread, device="H200", date="2026-12-06",
                       commit="abc1234", command="python -m benchmarks kernels", **kw)  # fmt: skip


def test_row_round_trip_and_no_nan_in_json(results):
    r = _row(results, "dispatcher", 10.0, (9.0, 11.0), ratios={"bf16": math.inf},
             extra={"method": "cuda-graph"})  # fmt: skip
    line = r.to_json()
    assert json.loads(line)["ratios"] == {"bf16": None}  # JSON has no inf: "did not run"
    back = results.Row.from_json(line)
    assert back.spread_us == (9.0, 11.0) and back.extra == {"method": "cuda-graph"}
    assert back.key() == r.key()
    newer = json.loads(line) | {"something_new": 1}  # a later field is kept, not an error
    assert results.Row.from_json(json.dumps(newer)).extra["something_new"] == 1
    with pytest.raises(ValueError, match="clock: expected one of"):
        results.Row(suite="s", case="c", clock="wall")


def test_table_and_pivot(results):
    rows = [_row(results, "torch.mm bf16", 20.0, ratios={"bf16": 1.0}),
            _row(results, "dispatcher", 10.0, ratios={"bf16": 2.0}),
            _row(results, "dispatcher", 15.0, tactic="other", ratios={"bf16": 4 / 3}),
            _row(results, "w4a16 tactic", None, failure="build: boom")]  # fmt: skip
    flat = results.table(rows)
    assert flat.startswith("Command: `python -m benchmarks kernels` — H200, 2026-12-06")
    assert " 2.00 |" in flat and " 1.33 |" in flat and "build: boom" in flat
    pivot = results.table(rows, pivot=True).splitlines()
    assert "dispatcher µs (x bf16)" in pivot[2]
    assert "10.0 (2.00x)" in pivot[4]  # the fastest tactic of each path


def test_compare_marks_changes_beyond_the_noise(results, tmp_path):
    a = [_row(results, "dispatcher", 10.0, (9.5, 10.5)), _row(results, "bf16", 20.0, (19, 21)),
         _row(results, "gone", 5.0)]  # fmt: skip
    b = [_row(results, "dispatcher", 12.0, (11.5, 12.5)), _row(results, "bf16", 20.5, (20, 21)),
         _row(results, "new", 5.0)]  # fmt: skip
    for name, rows in (("a", a), ("b", b)):
        results.write_rows(tmp_path / f"{name}.jsonl", rows, append=False)
    cmd = [sys.executable, "-m", "benchmarks", "compare", str(tmp_path / "a.jsonl"),
           str(tmp_path / "b.jsonl")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=source_root(), check=True)
    lines = {ln.split("|")[2].strip(): ln for ln in out.stdout.splitlines() if ln.count("|") > 5}
    assert "1.200" in lines["dispatcher"] and lines["dispatcher"].rstrip(" |").endswith("*")
    assert "1.025" in lines["bf16"] and not lines["bf16"].rstrip(" |").endswith("*")
    assert "1 row(s) only in A, 1 only in B" in out.stdout


def test_path_rows_check_the_output_and_record_gaps(results, tmp_path):
    """`common.path_rows`: an output left unwritten (NaN poison) is a failure, a correct
    one carries its error against float64, a path that raises is a gap, not the end."""
    import argparse

    import torch

    common = importlib.import_module("benchmarks.common")
    args = argparse.Namespace(smoke=True, out=str(tmp_path), clocks=["graph", "eager"])
    ctx = common.context("kernels", args, ["--smoke"])
    assert args.clocks == ["eager"]  # a CPU has no GPU clock
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    ref = a.double() @ b.double().T
    out = torch.empty(4, 3)

    def boom(o):
        raise RuntimeError("refused")

    paths = (("mm", lambda o: torch.mm(a, b.T, out=o)), ("nothing", lambda o: None),
             ("boom", boom))  # fmt: skip
    good, unwritten, raised = (common.path_rows(ctx, "c", fn, out, ref, args.clocks, backend=n)
                               for n, fn in paths)  # fmt: skip
    assert good[0].failure is None and good[0].error < 1e-6 and good[0].median_us > 0
    assert "NaN" in unwritten[0].failure
    assert raised[0].failure == "RuntimeError: refused" and raised[0].median_us is None
    assert good[0].command == "python -m benchmarks kernels --smoke"
