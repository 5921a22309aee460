"""`python -m benchmarks kernels --smoke --cases w4a8`: the suite's GEMM routine on the CPU,
through the code that times and checks the H200 run - baselines, both dispatchers, the
shortlist's tactics through the tuner's `Tuner.measure`, the fused W4A8 kernel under the
Triton interpreter (``_scaled_mm`` is torch's CPU one) - writing one row per path; and
``--cases grouped``, the MoE grouped GEMM against bf16 ``torch._grouped_mm`` and the
dense loop on a tiny config."""

from __future__ import annotations

import math

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


def test_kernels_grouped_smoke_rows(tmp_path):
    """``kernels --smoke --cases grouped``: the tiny MoE config (E=8, top-2, hidden 64,
    intermediate 32) at 1 and 4 tokens, each projection's three paths - the grouped
    W4A16 dispatcher, bf16 ``torch._grouped_mm`` on the same offsets, the dense loop -
    checked against the float64 grouped reference, with both ratios."""
    rows = run_bench_smoke(tmp_path, "kernels", "--cases", "grouped")
    paths = {"dispatcher", "torch._grouped_mm bf16", "dense loop"}
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        assert (r["suite"], r["case"], r["clock"]) == ("kernels", "grouped", "eager"), r
        assert r["device"] == "cpu (smoke)" and "--cases grouped" in r["command"], r
        assert r["failure"] is None and r["median_us"] > 0, r
        # every path computes the same exact products: bf16 output rounding only
        assert 0 < r["error"] < 1e-2, r
        x = r["extra"]
        cases.setdefault((x["proj"], x["tokens"]), {})[r["backend"]] = r
    assert set(cases) == {("gate_up", 1), ("gate_up", 4), ("down", 1), ("down", 4)}
    for (proj, tokens), case in cases.items():
        assert set(case) == paths, case
        g, bf, loop = case["dispatcher"], case["torch._grouped_mm bf16"], case["dense loop"]
        assert (g["n"], g["k"]) == ((64, 64) if proj == "gate_up" else (64, 32))
        assert g["m"] == tokens * 2 and 1 <= g["extra"]["touched"] <= min(g["m"], 8), g
        assert g["operation"] == "grouped_w4a16" and g["tactic"].startswith("torch-reference")
        assert loop["extra"]["gemms"] == g["extra"]["touched"], loop
        assert math.isclose(g["ratios"]["bf16"], bf["median_us"] / g["median_us"])
        assert math.isclose(g["ratios"]["loop"], loop["median_us"] / g["median_us"])
        assert bf["ratios"]["bf16"] == 1.0 and loop["ratios"]["loop"] == 1.0
    assert "x loop" in (tmp_path / "kernels.md").read_text()


def test_kernels_moe_layer_both_routings(tmp_path):
    """``--fused-routing`` times `Nvfp4MoE` under each routing in one run (a row each,
    beside the bf16 block's), so the default is chosen on one machine's figures. On a
    CPU the fused kernels do not apply: both rows route through torch, as labelled."""
    rows = run_bench_smoke(tmp_path, "kernels", "--cases", "moe-layer", "--fused-routing")
    by: dict[int, dict[str, dict]] = {}
    for r in rows:
        assert r["failure"] is None and r["median_us"] > 0, r
        by.setdefault(r["extra"]["tokens"], {})[r["backend"]] = r
    assert set(by) == {1, 4}
    for paths in by.values():
        assert set(paths) == {"transformers MoE block bf16 grouped_mm", "Nvfp4MoE torch routing",
                              "Nvfp4MoE fused routing"}, paths  # fmt: skip
        for name in ("Nvfp4MoE torch routing", "Nvfp4MoE fused routing"):
            assert paths[name]["extra"]["routing"] == "torch", paths[name]
            assert paths[name]["ratios"]["bf16"] > 0 and 0 < paths[name]["error"] < 3e-2


def test_kernels_moe_layer_smoke_rows(tmp_path):
    """``kernels --smoke --cases moe-layer``: the tiny MoE model's layer (E=8, top-2,
    hidden 256) at 1 and 4 tokens, `Nvfp4MoE` against transformers' bf16 block holding
    the same (dequantized) weights: both rows timed, ours close to the bf16 block's output
    (weight-only: the activations stay bf16) and its ratio the bf16 time over ours."""
    rows = run_bench_smoke(tmp_path, "kernels", "--cases", "moe-layer")
    by: dict[int, dict[str, dict]] = {}
    for r in rows:
        assert (r["suite"], r["case"], r["clock"]) == ("kernels", "moe-layer", "eager"), r
        assert r["failure"] is None and r["median_us"] > 0, r
        assert r["extra"]["config"] == "tiny" and r["extra"]["experts"] == 8, r
        assert r["extra"]["routing"] == "torch", r  # the default
        by.setdefault(r["extra"]["tokens"], {})[r["backend"]] = r
    assert set(by) == {1, 4}
    for tokens, pair in by.items():
        bf = pair["transformers MoE block bf16 grouped_mm"]
        ours = pair["Nvfp4MoE"]
        assert (ours["m"], ours["n"], ours["k"]) == (tokens, 256, 256), ours
        assert bf["error"] == 0.0 and 0 < ours["error"] < 3e-2, (bf, ours)
        assert math.isclose(ours["ratios"]["bf16"], bf["median_us"] / ours["median_us"])
