"""`python -m benchmarks ranking --smoke`: the ranking cost of ~2,000 synthetic Blackwell
candidates and a memoized select, and the committed W4A16 constants scored on the sweep
they were fitted on (the `fit` routine's rows)."""

from __future__ import annotations

from conftest import run_bench_smoke


def test_ranking_smoke_rows(tmp_path):
    rows = run_bench_smoke(tmp_path, "ranking")
    rank = {r["backend"]: r for r in rows if r["case"] == "rank"}
    assert {"rank, warm memo", "rank, cold memo", "Ranker.pick memoized (select)"} <= set(rank)
    assert rank["rank, warm memo"]["extra"]["candidates"] == 1956
    for r in rank.values():
        assert r["median_us"] > 0 and r["spread_us"][0] <= r["median_us"], r
    # a cold memo validates every tactic again: never cheaper than the warm steady state
    assert rank["rank, cold memo"]["median_us"] > rank["rank, warm memo"]["median_us"]
    fit = {r["backend"]: r["extra"] for r in rows if r["case"] == "fit w4a16 direct"}
    assert fit["in-sample"]["mean"] <= 1.03 and fit["held-out"]["worst"] <= 1.05, fit
