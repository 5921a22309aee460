"""`python -m benchmarks serving --smoke --cases layer load`: every call a user makes, with
the dispatcher's replays and without, beside bf16 ``nn.Linear`` (its error against the
float64 product), and loading a tiny ModelOpt checkpoint in a fresh process."""

from __future__ import annotations

import pytest
from conftest import run_bench_smoke

pytest.importorskip("transformers")


def test_serving_layer_and_load_rows(tmp_path):
    rows = run_bench_smoke(tmp_path, "serving", "--cases", "layer", "load")
    layer = {r["backend"]: r for r in rows if r["case"] == "layer"}
    layers = ["Nvfp4Linear"]
    if layer["Nvfp4Linear"]["operation"] != "w4a4":  # "auto" is W4A16: the W4A4 layer too
        layers.append("Nvfp4Linear w4a4")
        assert layer["Nvfp4Linear w4a4"]["operation"] == "w4a4"
    paths = {"quantize_nvfp4", "nn.Linear bf16", "_scaled_mm fp8", "Nvfp4Linear 3-D",
             "nn.Linear bf16 3-D"} | {
        f"{p}{s}" for p in ("Dispatcher.gemm w4a4", "Dispatcher.gemm w4a16", *layers)
        for s in ("", " [no replay]")}  # fmt: skip
    assert set(layer) == paths
    for r in layer.values():
        assert r["failure"] is None and r["median_us"] > 0 and r["clock"] == "eager", r
        assert r["ratios"]["nn.Linear"] > 0 and r["extra"]["tuned"] is False, r
    assert layer["nn.Linear bf16"]["ratios"]["nn.Linear"] == 1.0
    assert layer["nn.Linear bf16 3-D"]["ratios"]["nn.Linear 3-D"] == 1.0
    # a [M, 1, K] input: the layer's own operation and the 2-D layer's error
    assert layer["Nvfp4Linear 3-D"]["operation"] == layer["Nvfp4Linear"]["operation"]
    assert layer["Nvfp4Linear 3-D"]["error"] == pytest.approx(layer["Nvfp4Linear"]["error"])
    assert layer["nn.Linear bf16"]["error"] < 1e-2  # bf16 weights: its own exact product
    for name in paths - {
        "quantize_nvfp4",
        "nn.Linear bf16",
        "nn.Linear bf16 3-D",
        "_scaled_mm fp8",
    }:
        assert layer[name]["error"] < 1e-2, layer[name]  # against the dequantized operands
    (load,) = [r for r in rows if r["case"] == "load"]
    x = load["extra"]
    assert load["clock"] == "host" and x["shards"] >= 2 and x["layers"] == 2, load
    assert x["peak_above_base_mib"] >= x["model_on_host_mib"] >= 0, load
