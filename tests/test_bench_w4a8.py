"""benchmarks/bench_w4a8.py on the CPU (``--smoke``): the fused W4A8 kernel under the
interpreter and the dispatchers' paths on the portable backends, through the same code
that times and checks the H200 run (``_scaled_mm`` is torch's CPU one there)."""

from __future__ import annotations

from conftest import run_bench_smoke


def test_bench_w4a8_smoke_runs_on_the_cpu(tmp_path):
    got = run_bench_smoke(tmp_path, "bench_w4a8.py", "w4a8.json")
    rows = got["rows"]
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(1, 96, 128), (16, 96, 128)]
    for r in rows:
        # the exact paths round only the output; W4A8 rounds both operands to E4M3
        assert r["bf16"]["rel_err"] < 1e-2 and r["w4a16"]["rel_err"] < 1e-2, r
        assert 0.01 < r["w4a8_fused"]["rel_err"] < 0.06, r
        assert r["w4a16"]["operation"] == "w4a16"
        assert r["fp8_pick"]["operation"] in ("w4a16", "w4a8")
        # both W4A8 paths round the same E4M3 codes: the same error up to summation order
        assert abs(r["w4a8_unpack"]["rel_err"] - r["w4a8_fused"]["rel_err"]) < 2e-3, r
        # _scaled_mm on FP8 weights kept in memory: the same numerics again
        assert abs(r["scaled_mm"]["rel_err"] - r["w4a8_fused"]["rel_err"]) < 2e-3, r
        assert all(
            r[p]["gpu_us"] > 0
            for p in (
                "bf16",
                "w4a16",
                "w4a8_fused",
                "fp8_pick",
                "w4a8_unpack",
                "scaled_mm",
                "scaled_mm_q",
            )
        )
    md = (tmp_path / "w4a8.md").read_text()
    assert "speed relative to bf16" in md and "w4a8_fused x" in md
    lines = (tmp_path / "w4a8.jsonl").read_text().splitlines()
    assert len(lines) == len(rows)
