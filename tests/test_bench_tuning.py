"""`python -m benchmarks tuning --smoke --cases fleet`: each shape tuned from scratch on the
CPU (the reference backend, eager policy), the adopted pick timed again outside the tuner
against the default pick (the never-loses check), one row per bucket."""

from __future__ import annotations

import math

from conftest import run_bench_smoke


def test_tuning_fleet_smoke_rows(tmp_path):
    rows = run_bench_smoke(tmp_path, "tuning", "--cases", "fleet")
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(1, 256, 512), (64, 256, 512)]
    for r in rows:
        x = r["extra"]
        assert r["case"] == "fleet" and r["clock"] == "eager", r  # a CPU measures eagerly
        assert r["backend"] == "torch-reference" and r["median_us"] > 0, r
        assert not r["tactic"].startswith("torch-reference"), r  # the backend is its own field
        assert x["measured"] >= 1 and isinstance(x["kept_default"], bool), r
        # the recheck outside the tuner: 1.0 when the default was kept, else adopted/default
        assert x["check"] > 0 and (x["check"] == 1.0 or not x["kept_default"]), r
        lost = x["check"] > 1 + x["band"]
        assert (r["failure"] is not None) == lost, r
        assert x["paired_ratio"] is None or math.isfinite(x["paired_ratio"]), r
