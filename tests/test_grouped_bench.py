"""`benchmarks/bench_grouped.py --smoke`: the grouped benchmark runs end to end on a CPU
(tiny config) and writes what its docstring promises: per case the grouped W4A16 call
(checked against the float64 reference), bf16 ``torch._grouped_mm`` on the same routing
and the dense loop, with ratios, JSON lines and a markdown table."""

from __future__ import annotations

import math

from conftest import run_bench_smoke


def test_smoke_rows_ratios_and_table(tmp_path):
    rows = run_bench_smoke(tmp_path, "bench_grouped.py", "grouped.jsonl")
    variants = ("grouped-w4a16", "bf16-grouped-mm", "dense-loop")
    cases = {(r["proj"], r["tokens"]) for r in rows}
    assert cases == {("gate_up", 1), ("gate_up", 4), ("down", 1), ("down", 4)}
    for proj, tokens in cases:
        case = {r["variant"]: r for r in rows if (r["proj"], r["tokens"]) == (proj, tokens)}
        assert set(case) == set(variants)
        g = case["grouped-w4a16"]
        assert g["error"] is None and g["backend"] == "torch-reference", g
        assert g["rows"] == tokens * 2 and 1 <= g["touched"] <= min(g["rows"], g["E"])
        for v in variants:
            assert case[v]["error"] is None and case[v]["gpu_us"] > 0, case[v]
            assert case[v]["device"] == "cpu (smoke)" and case[v]["date"] and case[v]["command"]
        assert math.isclose(g["vs_bf16"], case["bf16-grouped-mm"]["gpu_us"] / g["gpu_us"])
        assert math.isclose(g["vs_loop"], case["dense-loop"]["gpu_us"] / g["gpu_us"])
        assert case["dense-loop"]["gemms"] == g["touched"]
    table = (tmp_path / "grouped.md").read_text().splitlines()
    assert len(table) == 2 + 4, table  # header, rule, one line per case
