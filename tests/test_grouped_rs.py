"""The grouped rs kernel (`backends/sm90/gemm_grouped_rs.py`) and its
``triton-sm90-grouped-rs`` tactics (`plugins/sm90/grouped_rs.py`).

Gluon has no interpreter: on a CPU the kernel is compiled for sm_90 (Triton's ptxas, no
launch); the numerics against the float64 per-expert reference and a CUDA graph with new
routing run on a GPU (``-m gpu``). Speed is measured only by ``python -m benchmarks
kernels --cases grouped``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import TARGET_ONLY, sm90_compile_env

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90 import grouped_mma as gm
from fp4_dispatch.plugins.sm90 import rs
from fp4_dispatch.plugins.sm90.grouped_rs import (
    TritonSm90GroupedRsBackend,
    TritonSm90GroupedRsTactic,
)

SM90 = simulated("sm90")
BACKEND = TritonSm90GroupedRsBackend()


def grouped(m: int, e: int = 128, n: int = 1536, k: int = 2048, op: str = "grouped_w4a16"):
    return Problem(m=m, n=n, k=k, operation=op, groups=e)


def test_offered_from_16_rows_per_expert_with_fitting_tiles():
    """Nothing below 16 balanced rows per expert (the grouped mma kernel's range); token
    tiles up to the rows padded to a power of two (64 at least), with their stages."""
    assert list(BACKEND.tactics(grouped(1024), SM90)) == []  # 8 rows per expert
    assert "8 balanced rows per expert < 16" in BACKEND.validate(
        TritonSm90GroupedRsTactic(tile_m=64, num_stages=4), grouped(1024), SM90
    )
    tiles = {m: {(t.tile_m, t.ctas_per_sm) for t in BACKEND.tactics(grouped(m), SM90)}
             for m in (2048, 16384, 32768)}  # fmt: skip
    assert tiles[2048] == {(64, 1), (64, 2)}  # 16 rows per expert
    assert tiles[16384] == {(64, 1), (64, 2), (128, 1)}  # 128
    assert tiles[32768] == {(64, 1), (64, 2), (128, 1), (256, 1)}  # 256
    for t in BACKEND.tactics(grouped(32768), SM90):
        assert t.num_stages == rs.RS_STAGES[t.tile_m] and t.split_k == 1


def test_refuses_what_the_kernel_cannot_read():
    t = TritonSm90GroupedRsTactic(tile_m=64, num_stages=4)
    assert "grouped_w4a16 (dense rows) only" in BACKEND.validate(
        t, grouped(4096, op="grouped_w4a4"), SM90
    )
    assert "K=2080 must be a multiple of 128" in BACKEND.validate(t, grouped(4096, k=2080), SM90)
    split = t.model_copy(update={"split_k": 2})
    assert "split_k 1" in BACKEND.validate(split, grouped(4096), SM90)


def test_estimate_is_the_dense_rs_estimate_of_the_touched_experts():
    t = TritonSm90GroupedRsTactic(tile_m=128, num_stages=3)
    p = grouped(16384)
    want = rs._estimate_rs(t, gm.dense_view(p), SM90) + gm.LOOKUP_US
    assert BACKEND.estimate_us(p, SM90, t) == pytest.approx(want)


_COMPILE = (
    TARGET_ONLY
    + r"""
import pathlib, re, subprocess
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.backends.sm90 import gemm_grouped_rs as gr
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90 import PROFILE
from fp4_dispatch.plugins.sm90.grouped_rs import TritonSm90GroupedRsBackend
from fp4_dispatch.plugins.sm90.grouped_rs import TritonSm90GroupedRsTactic
from fp4_dispatch.contracts.tactics import Problem

nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
backend, dev = TritonSm90GroupedRsBackend(), PROFILE.device
cache = gr._grouped_rs_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90GroupedRsTactic(**spec["tactic"])
    t, n, k, e = spec["t"], spec["n"], spec["k"], spec["e"]
    dtype = getattr(torch, spec["dtype"])
    p = Problem(m=t, n=n, k=k, out_dtype=spec["dtype"], operation="grouped_w4a16", groups=e)
    assert backend.validate(tactic, p, dev) is None, (spec, backend.validate(tactic, p, dev))
    before = len(cache)
    compiled = backend.precompile(tactic, p, dev)
    after = len(cache)
    ops = GroupedOperands(torch.zeros(t, k, dtype=dtype),
                          torch.zeros(e, n, k // 2, dtype=torch.uint8),
                          torch.zeros(e, *swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                          torch.ones(e), torch.zeros(e, dtype=torch.int32))
    kernel = backend.build(tactic, p, dev)
    grid, args, meta = kernel._launch(ops, torch.empty(t, n, dtype=dtype))
    kernel._binding(meta).warmup(grid, args)  # the real call's variant
    path = pathlib.Path(os.environ["TRITON_CACHE_DIR"]) / f"{spec['name']}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True,
                          text=True).stdout
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "sass": sass}
print(json.dumps(out))
"""
)


def test_compiles_for_sm90_with_the_weights_from_registers(tmp_path):
    """Every token tile, bf16 and fp16, compiles for sm_90 on a CPU: wgmma takes its A
    operand (the expanded weights) from registers, no register spills; a real call's
    arguments hit the variant precompile made."""
    pytest.importorskip("triton")
    cases = [
        {"name": "t256", "t": 32768, "n": 1536, "k": 2048, "e": 128, "dtype": "bfloat16",
         "tactic": {"tile_m": 256, "num_stages": 3}},
        {"name": "t128-fp16", "t": 16384, "n": 2048, "k": 768, "e": 128, "dtype": "float16",
         "tactic": {"tile_m": 128, "num_stages": 3}},
        {"name": "t64-2cta", "t": 4096, "n": 1000, "k": 2048, "e": 128, "dtype": "bfloat16",
         "tactic": {"tile_m": 64, "num_stages": 4, "ctas_per_sm": 2}},
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)],
                          capture_output=True, text=True, env=sm90_compile_env(tmp_path),
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {c["name"] for c in cases}, got.keys()
    for name, row in got.items():
        assert row["new_by_precompile"] == 1 and row["new_by_real_args"] == 0, name
        assert len(re.findall(r"HGMMA\S* R\d+, R\d+, gdesc", row["sass"])) >= 8, name
        assert not re.findall(r"\b(STL|LDL)\b", row["sass"]), name


# ---- on the GPU ------------------------------------------------------------------------


def _sm90_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_grouped_rs_matches_the_reference_and_graph_replay():
    """Every token tile, bf16 and fp16 rows, an N that is not a tile multiple, routings
    with empty experts, experts of a few rows and of several tiles: within the dense W4A16
    tolerance of the float64 per-expert reference, rows of no expert left untouched. Then
    a CUDA graph replayed with new routing (offsets changed in place)."""
    import torch

    from fp4_dispatch.backends.sm90 import gemm_grouped_rs as gr
    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.format.grouped import quantize_experts, reference_output

    e, n, k = 8, 400, 512
    g = torch.Generator().manual_seed(3)
    b = quantize_experts(torch.randn(e, n, k, generator=g) * torch.logspace(-2, 1, e).view(
        e, 1, 1)).to("cuda")  # fmt: skip

    def check(kernel, ops, out, rows):
        ref = reference_output(ops).cpu()
        got = out.double().cpu()
        err = float((got[:rows] - ref[:rows]).norm() / ref[:rows].norm())
        assert err < 1e-2, (kernel.cfg, err)
        assert bool(got[rows:].isnan().all()), kernel.cfg  # rows past offsets[-1]

    routings = ([0, 300, 1, 0, 70, 0, 2, 140], [64, 0, 0, 513, 5, 0, 0, 0])
    for sizes, dtype in zip(routings, (torch.bfloat16, torch.float16), strict=True):
        rows = sum(sizes)
        t = rows + 3  # three rows past the last expert: never written
        a = (torch.randn(t, k, generator=g) * 3).to(dtype).cuda()
        off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
        for tile_m, ctas in ((64, 1), (64, 2), (128, 1), (256, 1)):
            cfg = TritonSm90GroupedRsTactic(
                tile_m=tile_m, num_stages=rs.RS_STAGES[tile_m], ctas_per_sm=ctas
            ).kernel_config()
            kernel = gr.build(cfg)
            out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
            kernel(ops, out)
            check(kernel, ops, out, rows)

    kernel = gr.build(TritonSm90GroupedRsTactic(tile_m=64, num_stages=4).kernel_config())
    sizes = [100, 0, 28, 0, 0, 0, 0, 0]
    a = torch.randn(128, k, device="cuda").to(torch.bfloat16)
    off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
    out = torch.full((128, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel(ops, out)  # makes the kept activation buffer, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(ops, out)
    off.copy_(torch.tensor([0, 0, 0, 64, 0, 0, 64, 0], dtype=torch.int32).cumsum(0).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(kernel, ops, out, 128)
    with pytest.raises(ValueError, match="NVFP4 activations"):
        kernel(GroupedOperands(a, b.data, b.scale, b.global_scale, off, a_scale=b.scale), out)
