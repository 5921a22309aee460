"""`python -m benchmarks serving --smoke --cases layer load compiled`: every call a user
makes, with the dispatcher's replays and without, beside bf16 ``nn.Linear`` (its error
against the float64 product); loading a tiny ModelOpt checkpoint in a fresh process; the
layer under torch.compile and what Inductor's code does per call."""

from __future__ import annotations

import pytest
from conftest import bench_module, run_bench_smoke

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


def test_serving_compiled_rows_count_what_inductors_code_does(tmp_path):
    """On a CPU the W4A16 call stays the custom op (Inductor launches kernels on CUDA only):
    one custom op and nothing else in the layer's compiled call; the bf16 layer is one
    extern ``mm`` into one allocation."""
    rows = run_bench_smoke(tmp_path, "serving", "--cases", "compiled")
    got = {r["backend"]: r for r in rows}
    assert set(got) == {"Nvfp4Linear compiled", "nn.Linear bf16 compiled", "x + 1 compiled"}
    for r in got.values():
        assert r["failure"] is None and r["median_us"] > 0 and r["clock"] == "eager", r
        assert r["error"] < 1e-2, r
    assert got["Nvfp4Linear compiled"]["extra"] == {
        "allocations": 0, "launches": 0, "extern_calls": 0, "custom_ops": 1}  # fmt: skip
    assert got["nn.Linear bf16 compiled"]["extra"]["extern_calls"] == 1
    assert got["nn.Linear bf16 compiled"]["ratios"]["nn.Linear"] == 1.0


def test_inductor_calls_counts_the_call_body_only(monkeypatch):
    serving = bench_module("serving", monkeypatch)
    module = (
        "def kernel_src():\n    empty_strided_cuda((4,), (1,))  # not in call\n"
        "class Runner:\n"
        "    def call(self, args):\n"
        "        buf0 = empty_strided_cuda((16, 8), (8, 1), torch.float32)\n"
        "        # a comment: torch.ops.x.y(1) and k.run(2)\n"
        "        triton_poi_fused_zeros_0.run(buf0, 128, stream=stream0)\n"
        "        _w4a16_kernel_0.run(arg0_1, buf0, stream=stream0)\n"
        "        buf1 = torch.ops.fp4_dispatch.quantize.default(arg0_1)\n"
        "        extern_kernels.mm(arg0_1, arg1_1, out=buf0)\n"
        "        return (buf0, )\n"
    )
    assert serving.inductor_calls([module, module]) == {
        "allocations": 2, "launches": 4, "extern_calls": 2, "custom_ops": 2}  # fmt: skip
