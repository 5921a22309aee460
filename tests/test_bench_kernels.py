"""`python -m benchmarks kernels --smoke --cases w4a8`: the suite's GEMM routine on the CPU,
through the code that times and checks the H200 run - baselines, both dispatchers, the
shortlist's tactics through the tuner's `Tuner.measure`, the fused W4A8 kernel under the
Triton interpreter (``_scaled_mm`` is torch's CPU one) - writing one row per path."""

from __future__ import annotations

from conftest import run_bench_smoke


def test_kernels_w4a8_smoke_rows(tmp_path):
    rows = run_bench_smoke(tmp_path, "kernels", "--cases", "w4a8")
    by = {r["backend"]: r for r in rows}
    for r in rows:
        assert (r["suite"], r["case"], r["clock"]) == ("kernels", "w4a8", "eager"), r
        assert (r["m"], r["n"], r["k"]) == (1, 96, 128), r
        assert r["device"] == "cpu (smoke)" and r["date"] and r["commit"], r
        assert "kernels --smoke" in r["command"], r
        assert r["failure"] is None and r["median_us"] > 0, r
        low, high = r["spread_us"]
        assert low <= r["median_us"] <= high, r
        assert r["ratios"]["bf16"] > 0, r
    # the exact paths round only the output; W4A8 rounds both operands to E4M3
    assert by["torch.mm bf16"]["error"] < 1e-2 and by["dispatcher"]["error"] < 1e-2
    assert by["torch.mm bf16"]["ratios"]["bf16"] == 1.0
    fused = by["triton-sm90-w4a8 fused 64x16x64"]["error"]
    assert 0.01 < fused < 0.06
    # every W4A8 path rounds the same E4M3 codes: the same error up to summation order
    assert abs(by["_scaled_mm fp8 rowwise"]["error"] - fused) < 2e-3
    assert abs(by["_scaled_mm fp8 rowwise + quantize"]["error"] - fused) < 2e-3
    assert by["dispatcher fp8"]["operation"] in ("w4a16", "w4a8")
    # the shortlist's W4A8 tactics: built, checked and timed by the tuner (method named)
    tactics = [r for r in rows if "method" in r["extra"]]
    assert tactics and all(r["operation"] == "w4a8" for r in tactics), tactics
    md = (tmp_path / "kernels.md").read_text()
    assert md.startswith("Command: `python -m benchmarks kernels --smoke") and "x bf16" in md
