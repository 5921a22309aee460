"""The grouped mma kernel (`backends/sm90/gemm_grouped_mma.py`) and its
``triton-sm90-grouped-mma`` tactics (`plugins/sm90/grouped_mma.py`).

Gluon has no interpreter: on a CPU the kernel is compiled for sm_90 (Triton's ptxas, no
launch) and its main loop checked in SASS; the numerics against the float64 per-expert
reference, split-K's counters, a driver-API replay and a CUDA graph with new routing run
on a GPU (``-m gpu``). Speed is measured only by ``python -m benchmarks kernels --cases
grouped``.
"""

from __future__ import annotations

import pytest
from conftest import check_grouped_replays, compile_grouped_gluon

from fp4_dispatch import Dispatcher
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90 import grouped as gp
from fp4_dispatch.plugins.sm90 import mma
from fp4_dispatch.plugins.sm90.grouped_mma import (
    GROUPED_MMA_VARIANTS,
    LOOKUP_US,
    TritonSm90GroupedMmaBackend,
    TritonSm90GroupedMmaTactic,
    dense_view,
)

SM90 = simulated("sm90")
BACKEND = TritonSm90GroupedMmaBackend()


def grouped(m: int, e: int = 128, n: int = 1536, k: int = 2048, op: str = "grouped_w4a16"):
    return Problem(m=m, n=n, k=k, operation=op, groups=e)


# ---- tactics --------------------------------------------------------------------------


def test_token_tile_follows_the_balanced_rows_per_expert():
    """8-token tiles up to 8 rows per expert, 16-token tiles up to 16, nothing above."""
    for m, tile in ((8, 8), (128, 8), (1024, 8), (1025, 16), (2048, 16)):
        got = {t.tile_m for t in BACKEND.tactics(grouped(m), SM90)}
        assert got == {tile}, (m, got)
    assert list(BACKEND.tactics(grouped(2049), SM90)) == []  # 17 rows per expert
    why = BACKEND.validate(TritonSm90GroupedMmaTactic(tile_m=16), grouped(4096), SM90)
    assert "32 balanced rows per expert > 16" in why


def test_dense_rows_only_and_grouped_only():
    t = TritonSm90GroupedMmaTactic()
    assert "grouped_w4a16 (dense rows) only" in BACKEND.validate(t, grouped(8, op="grouped_w4a4"),
                                                                 SM90)  # fmt: skip
    assert "grouped_w4a16" in BACKEND.validate(t, Problem(m=8, n=64, k=64), SM90)
    assert BACKEND.operations == ("grouped_w4a16",)


def test_offers_the_dense_kernels_variants_with_known_registers():
    """Every offered variant is one the dense kernel's sweep compiled (its registers are
    known to the estimate), and splits stop where a K range would get no step."""
    assert set(GROUPED_MMA_VARIANTS) <= set(mma.MMA_SPACE)
    assert all(v in mma.REGISTERS for v in GROUPED_MMA_VARIANTS)
    tactics = list(BACKEND.tactics(grouped(8, k=512), SM90))  # 4 K steps
    # 4 K ranges a CTA at 16 rows: no split; 2 at 32 rows: split 2
    assert {t.split_k for t in tactics} == {1, 2}
    assert all(t.split_k * t.k_groups <= 4 for t in tactics if t.split_k > 1)
    assert (
        TritonSm90GroupedMmaTactic.model_validate_json(tactics[-1].model_dump_json())
        == (tactics[-1])
    )


def test_split_workspace_is_bounded():
    """256 experts, 128 rows, N=7168: one slot per (N tile, M-tile slot) of the grid;
    a split whose partials pass the bound is refused with the bytes."""
    p = grouped(128, e=256, n=7168, k=2048)
    t = TritonSm90GroupedMmaTactic(tile_m=8, tile_n=16, num_warps=4, split_k=4)
    assert gp.split_workspace_bytes(t, p) == 2 * gp.SPLIT_WORKSPACE_MAX  # 16384 slots x 4 x 8 x 16
    assert "workspace bytes" in BACKEND.validate(t, p, SM90)
    assert BACKEND.validate(t.model_copy(update={"split_k": 2}), p, SM90) is None


def test_estimate_is_the_dense_estimate_of_the_touched_experts():
    t = TritonSm90GroupedMmaTactic()
    for m in (8, 128):
        p = grouped(m)
        view = dense_view(p)
        assert (view.m, view.n, view.k) == (1, p.touched_groups * 1536, 2048)
        want = mma._estimate_mma(t, view, SM90) + LOOKUP_US
        assert BACKEND.estimate_us(p, SM90, t) == pytest.approx(want)
    few, many = (BACKEND.estimate_us(grouped(m), SM90, t) for m in (8, 128))
    assert few < many / 4  # 8 experts' weights against 128


def test_simulated_sm90_ranks_the_grouped_backends_by_rows_per_expert():
    """Dense rows at decode get the Triton grouped kernel and this one; a prefill bucket
    (32 rows per expert) the Triton kernel and the rs one; NVFP4 rows the Triton one."""
    d = Dispatcher("sm90", cache=False)
    for m, op, want in (
        (128, "grouped_w4a16", {"triton-sm90-grouped", "triton-sm90-grouped-mma"}),
        (4096, "grouped_w4a16", {"triton-sm90-grouped", "triton-sm90-grouped-rs"}),
        (128, "grouped_w4a4", {"triton-sm90-grouped"}),
    ):
        sl = d.candidates(m, 1536, 2048, "bfloat16", op, 128)
        assert {c.backend for c in sl.candidates} == want, (m, op)


# ---- sm_90 compile on the CPU ---------------------------------------------------------


def test_compiles_for_sm90_without_shared_memory_in_the_loop(tmp_path):
    """8- and 16-token tiles, split-K with prefetch and unrolled steps, fp16 and a K that
    leaves partial K ranges compile for sm_90 on a CPU: mma.sync in the main loop, which
    touches no shared memory and has no barrier (the dense kernel's loop, unchanged), no
    register spills; a real call's arguments hit the variant precompile made."""
    pytest.importorskip("triton")
    cases = [
        {"name": "decode", "t": 128, "n": 1536, "k": 2048, "e": 128, "dtype": "bfloat16",
         "tactic": {"tile_m": 8, "tile_n": 16, "num_warps": 4}},
        {"name": "split-unroll", "t": 8, "n": 1536, "k": 2048, "e": 128, "dtype": "bfloat16",
         "tactic": {"tile_m": 8, "tile_n": 32, "num_warps": 4, "prefetch": 2, "unroll": 2,
                    "split_k": 2}},
        {"name": "tile16-fp16-tail", "t": 1500, "n": 1000, "k": 2080, "e": 128,
         "dtype": "float16", "tactic": {"tile_m": 16, "tile_n": 16, "num_warps": 4}},
    ]  # fmt: skip
    got = compile_grouped_gluon(tmp_path, "fp4_dispatch.plugins.sm90.grouped_mma",
                                "TritonSm90GroupedMmaBackend", "TritonSm90GroupedMmaTactic",
                                cases)  # fmt: skip
    for name, row in got.items():
        assert row["new_by_precompile"] == 1 and row["new_by_real_args"] == 0, (name, row)
        assert row["hmma"] >= 8 and row["spills"] == 0, (name, row)
        assert row["loop_shared_or_barrier"] == 0, (name, row)


# ---- on the GPU ------------------------------------------------------------------------


def _sm90_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_grouped_mma_matches_the_reference_replays_and_graph():
    """Every offered variant, splits 1-4, bf16 and fp16 rows, a K that leaves partial K
    ranges, routings with empty experts and experts of 1-16 rows: within the dense W4A16
    tolerance of the float64 per-expert reference, every split counter back at zero.
    Then one split kernel through a driver-API replay and a CUDA graph, each replayed
    with new routing (offsets changed in place)."""
    import torch

    from fp4_dispatch.backends.sm90 import gemm_grouped_mma as gm
    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.format.grouped import quantize_experts, reference_output

    e, n, k = 16, 400, 1056  # N not a tile multiple; 1056: K % 128 == 32
    g = torch.Generator().manual_seed(2)
    b = quantize_experts(torch.randn(e, n, k, generator=g) * torch.logspace(-2, 1, e).view(
        e, 1, 1)).to("cuda")  # fmt: skip

    def check(kernel, ops, out):
        ref = reference_output(ops)
        err = float((out.double().cpu() - ref.cpu()).norm() / ref.norm())
        assert err < 1e-2, (kernel.cfg, err)
        assert all(bool((c == 0).all()) for _, c in kernel._scratch.pairs()), kernel.cfg

    routings = ([0, 1, 0, 2, 1, 0, 0, 1, 3, 0, 0, 0, 1, 0, 0, 1], [9, 0, 16, 0, 3, 0, 0, 12] * 2)
    for sizes, dtype in zip(routings, (torch.bfloat16, torch.float16), strict=True):
        t = sum(sizes)
        a = (torch.randn(t, k, generator=g) * 3).to(dtype).cuda()
        off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
        for v in GROUPED_MMA_VARIANTS:
            for split in (1, 2, 4):
                tactic = TritonSm90GroupedMmaTactic(
                    tile_m=v[0],
                    tile_n=v[1],
                    num_warps=v[2],
                    prefetch=v[3],
                    unroll=v[4],
                    split_k=split,
                )
                kernel = gm.build(tactic.kernel_config())
                out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
                kernel(ops, out)
                check(kernel, ops, out)

    tactic = TritonSm90GroupedMmaTactic(tile_m=8, tile_n=16, split_k=2)
    kernel = gm.build(tactic.kernel_config())
    check_grouped_replays(kernel, b, check)
    a, off = ops.a, ops.offsets
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device="cuda")
    with pytest.raises(ValueError, match="NVFP4 activations"):
        kernel(GroupedOperands(a, b.data, b.scale, b.global_scale, off, a_scale=b.scale), out)
