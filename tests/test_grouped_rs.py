"""The grouped rs kernel (`backends/sm90/gemm_grouped_rs.py`) and its
``triton-sm90-grouped-rs`` tactics (`plugins/sm90/grouped_rs.py`).

Gluon has no interpreter: on a CPU the kernel is compiled for sm_90 (Triton's ptxas, no
launch); the numerics against the float64 per-expert reference and a CUDA graph with new
routing run on a GPU (``-m gpu``). Speed is measured only by ``python -m benchmarks
kernels --cases grouped``.
"""

from __future__ import annotations

import re

import pytest
from conftest import compile_grouped_gluon

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
    got = compile_grouped_gluon(tmp_path, "fp4_dispatch.plugins.sm90.grouped_rs",
                                "TritonSm90GroupedRsBackend", "TritonSm90GroupedRsTactic",
                                cases)  # fmt: skip
    for name, row in got.items():  # wgmma with its A operand (the weights) in registers
        assert len(re.findall(r"HGMMA\S* R\d+, R\d+, gdesc", row["sass"])) >= 8, name


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
