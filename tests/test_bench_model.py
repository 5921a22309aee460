"""`python -m benchmarks model --smoke`: the whole-model yardstick runs end to end on a CPU
(tiny Llama and tiny Qwen3-MoE, eager) and writes what its docstring promises: one row
per variant, step and clock, ratios to bf16, logits cosines against the dequantized
twin, a table, a plot."""

from __future__ import annotations

import pytest
from conftest import run_bench_smoke

#: the smoke's variants: all but FP8 (no FP8 GEMM in torch on a CPU)
VARIANTS = ("bf16", "w4a16", "w4a4", "nvfp4-fp8")
#: the MoE config's: transformers' grouped_mm and loop, grouped NVFP4, a loop of NVFP4 gemms
MOE_VARIANTS = ("bf16", "bf16-loop", "w4a16", "nvfp4-loop")

pytest.importorskip("transformers")


def test_smoke_rows_cosines_table_and_plot(tmp_path):
    rows = run_bench_smoke(tmp_path, "model")
    got = {(r["backend"], r["case"], r["clock"]) for r in rows}
    steps = ("decode 1", "decode 4", "prefill 64")
    assert got == {(v, f"tiny {c}", "eager") for v in VARIANTS for c in steps} | {
        (v, f"tiny-moe {c}", "eager") for v in MOE_VARIANTS for c in steps
    }
    for r in rows:
        x = r["extra"]
        assert r["suite"] == "model" and r["failure"] is None, r
        assert r["median_us"] > 0 and x["tokens_per_s"] > 0 and r["m"] == x["tokens"], r
        low, high = r["spread_us"]
        assert low <= r["median_us"] <= high, r
        assert r["device"] == "cpu (smoke)" and r["date"] and r["command"], r
        if r["backend"] == "bf16":
            assert r["ratios"]["bf16"] == pytest.approx(1.0) and x["cosine"] is None, r
        # W4A16 multiplies by exactly the twin's weights: cosine >= 0.999 (the target);
        # W4A4 also rounds the activations to NVFP4: lower, but far from noise
        elif r["backend"] == "w4a16":
            assert x["cosine"] >= 0.999, r
        elif r["backend"] == "w4a4":
            assert 0.9 < x["cosine"] < 0.9999, r
        elif r["backend"] == "bf16-loop":  # the same bf16 weights, another experts loop
            assert x["cosine"] >= 0.9999, r
        elif r["backend"] == "nvfp4-loop":  # the grouped layer's weights, one gemm each
            assert x["cosine"] >= 0.999, r
        else:  # under precision="fp8": W4A16, or W4A8 (FP8 rounding, docs/PRECISION.md)
            assert x["cosine"] >= 0.99, r
    table = (tmp_path / "model.md").read_text().splitlines()
    assert len(table) == 2 + 3 + 3, table  # header, rule, one line per config and step
    assert all("x)" in line for line in table[2:]), table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "model_tiny.png").stat().st_size > 1000
    assert (tmp_path / "model_tiny-moe.png").stat().st_size > 1000


def test_the_compile_clock_compiles_each_step_for_its_shapes_without_inductors_caches(
    monkeypatch,
):
    """`model._compiled`: Dynamo's caches reset, ``dynamic=False`` (a symbolic M keeps the
    W4A16 op), Inductor's FX-graph and AOTAutograd caches off (their keys hold neither
    this project's code nor ``FP4_DISPATCH_INDUCTOR``)."""
    import torch
    from conftest import bench_module

    model = bench_module("model", monkeypatch)
    calls: list = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda m, **kw: calls.append(kw) or m)
    monkeypatch.setattr(model, "make_step", lambda m, step, device: (m, step))
    import torch._functorch.config as aot_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=True), aot_config.patch(enable_autograd_cache=True):
        got = model._compiled({"bf16": "A", "w4a16": "B"}, "step", torch.device("cpu"))
        assert not inductor_config.fx_graph_cache and not aot_config.enable_autograd_cache
    assert got == {"bf16": ("A", "step"), "w4a16": ("B", "step")}
    assert calls == ["reset", {"dynamic": False}, {"dynamic": False}]
