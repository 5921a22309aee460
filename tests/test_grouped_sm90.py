"""The Hopper grouped kernel (`backends/sm90/gemm_grouped.py`) and its ``triton-sm90-grouped``
tactics (`plugins/sm90/grouped.py`).

Kernels run under TRITON_INTERPRET=1 with fp16 operands (the interpreter mishandles bf16
operands of ``tl.dot``; fp16 is exact for e2m1 x e4m3 values), against the float64
per-expert reference, expert by expert, for random offsets with empty experts and
experts holding most rows; the GPU tests (bf16, CUDA graphs) run on an H200. Speed is
measured only by ``python -m benchmarks kernels --cases grouped``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import (
    TARGET_ONLY,
    check_grouped_replays,
    run_interpreted,
    run_interpreted_split,
    sm90_compile_env,
)

from fp4_dispatch import Dispatcher
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.grouped import (
    SPLIT_WORKSPACE_MAX,
    TritonSm90GroupedBackend,
    TritonSm90GroupedTactic,
    max_tile_m,
    split_workspace_bytes,
    why_invalid,
)

SM90 = simulated("sm90")

#: what both interpreter scripts share: imports, the experts of a case, and the relative
#: error of each non-empty expert's rows against the float64 reference
_PRELUDE = r"""
import json, sys
import torch
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.backends.sm90 import gemm_grouped as gg
from fp4_dispatch.format.grouped import quantize_experts, reference_output
from fp4_dispatch.format.nvfp4 import quantize_nvfp4


def experts(e, n, k, g):
    spread = torch.logspace(-2, 2, e).view(e, 1, 1)  # experts 1e4 apart: a mix-up shows
    return quantize_experts(torch.randn(e, n, k, generator=g) * spread)


def expert_errs(out, ref, off):
    errs, start = [], 0
    for end in off.tolist():
        if end > start:
            o, r = out[start:end].double(), ref[start:end]
            errs.append(float((o - r).norm() / r.norm()) if bool(torch.isfinite(o).all())
                        else float("nan"))
        start = end
    return errs
"""

_SCRIPT = (
    _PRELUDE
    + r"""
rows = []
for sizes, tail, n, k, cfg, w4a4 in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n + k + 7 * sum(sizes))
    e, t = len(sizes), sum(sizes) + tail  # `tail` rows past the last offset: no expert
    b = experts(e, n, k, g)
    off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    if w4a4:
        qa = quantize_nvfp4(torch.randn(t, k, generator=g) * 3)
        alpha = b.global_scale * qa.global_scale
        ops = GroupedOperands(qa.data, b.data, b.scale, alpha, off, a_scale=qa.scale)
    else:
        a = (torch.randn(t, k, generator=g) * 3).half()
        ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
    out = torch.full((t, n), float("nan"), dtype=torch.float16)
    gg.build(gg.GroupedConfig(**cfg))(ops, out)
    untouched = bool(torch.isnan(out[sum(sizes):]).all())
    rows.append({"errs": expert_errs(out, reference_output(ops), off), "untouched": untouched})
print(json.dumps(rows))
"""
)

CASES = [
    # sizes, tail rows, N, K, config, w4a4
    ([0, 3, 0, 1, 9, 0], 0, 48, 64, {"block_m": 16, "block_n": 16, "block_k": 64}, False),
    ([0, 0, 40, 0, 2, 1], 2, 40, 96, {"block_m": 16, "block_n": 32, "block_k": 64}, False),
    ([1, 1, 0, 1, 0, 1, 1, 1], 0, 24, 128, {"block_m": 1, "block_n": 16, "block_k": 64}, False),
    ([2, 0, 5, 3], 1, 32, 64, {"block_m": 4, "block_n": 16, "block_k": 64}, False),
    ([3, 0, 4, 1], 0, 40, 96, {"block_m": 4, "block_n": 16, "block_k": 64}, False),  # K tail
    ([5, 9, 0, 8], 0, 32, 64, {"block_m": 8, "block_n": 16, "block_k": 64}, False),
    ([2, 0, 5], 0, 40, 128, {"block_m": 16, "block_n": 32, "block_k": 64}, True),
    (
        [0, 20, 0, 3],
        1,
        72,
        96,
        {"block_m": 16, "block_n": 64, "block_k": 64, "weights_on_m": True},
        False,
    ),
    (
        [4, 0, 17],
        0,
        64,
        64,
        {"block_m": 16, "block_n": 64, "block_k": 64, "weights_on_m": True},
        True,
    ),
    ([1, 1, 0, 1], 0, 24, 96, {"block_m": 2, "block_n": 16, "block_k": 64}, True),
]


def test_grouped_kernel_matches_the_reference_per_expert():
    results = run_interpreted(_SCRIPT, CASES)
    for case, res in zip(CASES, results, strict=True):
        sizes = case[0]
        assert len(res["errs"]) == sum(1 for s in sizes if s), case
        assert all(err < 1e-2 for err in res["errs"]), (case, res)
        assert res["untouched"], case  # rows past the last offset are never written


# ---- split-K ----------------------------------------------------------------------------

_SPLIT_SCRIPT = (
    _PRELUDE
    + r"""
rows = []
for case in json.loads(sys.argv[1]):
    sizes, tail, n, k, cfg, w4a4 = case
    g = torch.Generator().manual_seed(n + k + 7 * sum(sizes))
    e, t = len(sizes), sum(sizes) + tail
    b = experts(e, n, k, g)
    if w4a4:
        qa = quantize_nvfp4(torch.randn(t, k, generator=g) * 3)
    else:
        a = (torch.randn(t, k, generator=g) * 3).half()
    kernel = gg.build(gg.GroupedConfig(**cfg))
    direct = gg.build(gg.GroupedConfig(**{**cfg, "split_k": 1}))
    calls = []
    # two calls in a row, the second with other routing (same T): the counters the first
    # left must be zero again, and both calls use one workspace
    for routing in (sizes, sizes[1:] + sizes[:1]):
        off = torch.tensor(routing, dtype=torch.int32).cumsum(0).to(torch.int32)
        if w4a4:
            ops = GroupedOperands(qa.data, b.data, b.scale, b.global_scale * qa.global_scale,
                                  off, a_scale=qa.scale)
        else:
            ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
        grid = (-(-n // cfg["block_n"]), gg.m_tile_bound(t, e, cfg["block_m"]), cfg["split_k"])
        ws, _ = kernel.workspace(torch.device("cpu"), grid)  # the pair the call will use
        ws.fill_(float("nan"))  # slots the call writes become finite
        out = torch.full((t, n), float("nan"), dtype=torch.float16)
        kernel(ops, out)
        slot_size = cfg["split_k"] * cfg["block_m"] * cfg["block_n"]
        written = torch.isfinite(ws.view(-1, slot_size)).all(dim=1)
        one = torch.full((t, n), float("nan"), dtype=torch.float16)
        direct(ops, one)
        pairs = kernel._scratch.pairs()
        calls.append({
            "errs": expert_errs(out, reference_output(ops), off),
            "untouched": bool(torch.isnan(out[sum(sizes):]).all()),
            "counters_zero": all(bool((c == 0).all()) for _, c in pairs),
            "counters": sum(c.numel() for _, c in pairs),
            "pairs": len(pairs),
            "slots_written": int(written.sum()),
            "work_tiles": grid[0] * sum(-(-s // cfg["block_m"]) for s in routing),
            "same_as_split1": bool(torch.equal(out.view(torch.int16), one.view(torch.int16))),
            "split1_pairs": len(direct._scratch),
        })
    rows.append({"case": case, "calls": calls})
print(json.dumps(rows))
"""
)

#: split-K cases: (sizes, tail rows, N, K, config, w4a4). K=288 with a 64 K tile is 5
#: tiles, the last half full: split 2 owns 3 + 2 tiles, split 4 owns 2 + 2 + 1 + 0 (an
#: empty split); K=64 (one tile) leaves every split past the first empty
SPLIT_CASES = [
    ([1, 0, 1, 1, 0, 1], 0, 24, 288, {"block_m": 1, "block_n": 16, "block_k": 64, "split_k": 4},
     False),
    ([2, 0, 3, 1], 1, 32, 256, {"block_m": 2, "block_n": 16, "block_k": 64, "split_k": 2},
     False),
    ([3, 0, 4, 1], 0, 40, 288, {"block_m": 4, "block_n": 16, "block_k": 64, "split_k": 2},
     False),
    ([5, 9, 0, 8], 0, 32, 288, {"block_m": 8, "block_n": 16, "block_k": 64, "split_k": 4},
     False),
    ([1, 1, 0, 6], 0, 24, 256, {"block_m": 8, "block_n": 16, "block_k": 64, "split_k": 2},
     True),
    ([0, 3, 0, 1, 20], 2, 48, 288, {"block_m": 16, "block_n": 16, "block_k": 64, "split_k": 4},
     False),
    ([2, 0, 17], 0, 40, 288, {"block_m": 16, "block_n": 32, "block_k": 64, "split_k": 2},
     True),
    ([0, 20, 0, 3], 1, 72, 288,
     {"block_m": 16, "block_n": 64, "block_k": 64, "split_k": 4, "weights_on_m": True}, False),
    # one K tile: the split path with nothing to sum but split 0, bit-identical to one split
    ([1, 0, 2, 1], 0, 24, 64, {"block_m": 2, "block_n": 16, "block_k": 64, "split_k": 2},
     False),
    ([3, 0, 9], 0, 24, 64, {"block_m": 8, "block_n": 16, "block_k": 64, "split_k": 4}, True),
    ([0, 18, 3], 0, 32, 64, {"block_m": 16, "block_n": 32, "block_k": 64, "split_k": 2},
     False),
]  # fmt: skip


def test_grouped_split_k_matches_the_reference_and_resets_its_counters():
    """Split 2 and 4 on every path (GEMV 1-4 dense rows, FMA 8 dense and NVFP4 rows, tl.dot
    16 rows, weights_on_m), empty experts, an uneven last split and an empty one, rows past
    the last offset: within the one-split tolerance of the float64 reference, expert by
    expert; each (N tile, M tile) writes its own workspace slot (the interpreter runs
    programs one at a time, so a shared slot would not show in the results) and the
    slots past the routing's tiles stay unwritten; after each of two calls with other
    routing every counter is zero again and one workspace pair (one counter per N tile
    and M-tile slot, a power of two) served both; one split never makes a workspace.
    With one K tile only split 0 sums anything, so the split path must equal one split
    bit for bit; with more it changes the summation order, so only the tolerance is
    checked."""
    results = run_interpreted_split(_SPLIT_SCRIPT, SPLIT_CASES)  # each names its case
    assert sorted(json.dumps(r["case"]) for r in results) == sorted(
        json.dumps(list(c)) for c in SPLIT_CASES
    )
    for result in results:
        case, calls = result["case"], result["calls"]
        sizes, tail, n, k, cfg, _ = case
        slots = -(-n // cfg["block_n"]) * (-(-(sum(sizes) + tail) // cfg["block_m"])
                                           + min(len(sizes), sum(sizes) + tail))  # fmt: skip
        for res in calls:
            assert len(res["errs"]) == sum(1 for s in sizes if s), case
            assert all(err < 1e-2 for err in res["errs"]), (case, res)
            assert res["untouched"], case
            assert res["counters_zero"], (case, res)
            # one slot per (N tile, M tile): none shared, none written by programs that exit
            assert res["slots_written"] == res["work_tiles"], (case, res)
            assert res["pairs"] == 1 and res["split1_pairs"] == 0, (case, res)
            assert res["counters"] == 1 << (slots - 1).bit_length(), (case, res)
            if k <= cfg["block_k"]:
                assert res["same_as_split1"], case


def test_split_k_config_choices():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_grouped import GroupedConfig

    assert GroupedConfig().split_k == 1
    for bad in (0, 3, 16):
        with pytest.raises(ValueError, match="split_k"):
            GroupedConfig(split_k=bad)


# ---- precompile: sm_90 compiles on the CPU, and a real call hits what it compiled ----------

_PRECOMPILE = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.backends.sm90 import gemm_grouped as gg
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90 import PROFILE
from fp4_dispatch.plugins.sm90.grouped import TritonSm90GroupedBackend, TritonSm90GroupedTactic
from fp4_dispatch.contracts.tactics import Problem

backend, dev = TritonSm90GroupedBackend(), PROFILE.device
cache = gg._grouped_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90GroupedTactic(**spec["tactic"])
    t, n, k, e = spec["t"], spec["n"], spec["k"], spec["e"]
    p = Problem(m=t, n=n, k=k, out_dtype=spec["dtype"], operation=spec["op"], groups=e)
    assert backend.validate(tactic, p, dev) is None, spec
    before = len(cache)
    compiled = backend.precompile(tactic, p, dev)
    after = len(cache)
    dtype = getattr(torch, spec["dtype"])
    b = torch.zeros(e, n, k // 2, dtype=torch.uint8)
    bs = torch.zeros(e, *swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn)
    off = torch.zeros(e, dtype=torch.int32)
    if p.dense:
        ops = GroupedOperands(torch.zeros(t, k, dtype=dtype), b, bs, torch.ones(e), off)
    else:
        ops = GroupedOperands(torch.zeros(t, k // 2, dtype=torch.uint8), b, bs, torch.ones(e),
                              off, a_scale=torch.zeros(swizzled_scale_shape(t, k),
                                                       dtype=torch.float8_e4m3fn))
    res = torch.empty(t, n, dtype=dtype)
    kernel = backend.build(tactic, p, dev)
    grid, args, meta = kernel._launch(ops, res)
    kernel._binding(meta).warmup(grid, args)  # the real call's variant
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "type": type(compiled).__name__}
print(json.dumps(out))
"""
)


def test_grouped_precompile_compiles_what_a_call_launches(tmp_path):
    """Every path (GEMV and FMA at decode, tl.dot; one split and split-K), both operations,
    K tails, bf16 and fp16 compile for sm_90 on a CPU without a launch (the PTX
    dequantizer included), and a real call's arguments hit the variant precompile made."""
    pytest.importorskip("triton")
    cases = [
        {"name": "fma-bf16", "t": 8, "n": 256, "k": 512, "e": 128, "dtype": "bfloat16",
         "op": "grouped_w4a16", "tactic": {"tile_m": 1, "tile_n": 64, "tile_k": 128}},
        {"name": "dot-fp16-tail", "t": 600, "n": 192, "k": 1056, "e": 8, "dtype": "float16",
         "op": "grouped_w4a16", "tactic": {"tile_m": 64, "tile_n": 128, "tile_k": 128,
                                           "num_stages": 3, "num_warps": 8}},
        {"name": "w4a4-dot", "t": 512, "n": 256, "k": 512, "e": 16, "dtype": "bfloat16",
         "op": "grouped_w4a4", "tactic": {"tile_m": 16, "tile_n": 64, "tile_k": 256}},
        {"name": "dot-w-on-m", "t": 300, "n": 512, "k": 512, "e": 32, "dtype": "bfloat16",
         "op": "grouped_w4a16", "tactic": {"tile_m": 16, "tile_n": 128, "tile_k": 128,
                                           "weights_on_m": True}},
        {"name": "gemv4-tail", "t": 64, "n": 192, "k": 1056, "e": 16, "dtype": "float16",
         "op": "grouped_w4a16", "tactic": {"tile_m": 4, "tile_n": 32, "tile_k": 128}},
        {"name": "w4a4-fma", "t": 16, "n": 256, "k": 512, "e": 64, "dtype": "bfloat16",
         "op": "grouped_w4a4", "tactic": {"tile_m": 1, "tile_n": 64, "tile_k": 128}},
        {"name": "gemv-split4-tail", "t": 8, "n": 256, "k": 1056, "e": 128,
         "dtype": "bfloat16", "op": "grouped_w4a16",
         "tactic": {"tile_m": 1, "tile_n": 64, "tile_k": 128, "split_k": 4}},
        {"name": "dot-split2", "t": 128, "n": 256, "k": 512, "e": 16, "dtype": "float16",
         "op": "grouped_w4a16", "tactic": {"tile_m": 16, "tile_n": 64, "tile_k": 128,
                                           "split_k": 2}},
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _PRECOMPILE, json.dumps(cases)],
                          capture_output=True, text=True, env=sm90_compile_env(tmp_path),
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in cases:
        assert got[case["name"]] == {"new_by_precompile": 1, "new_by_real_args": 0,
                                     "type": "CompiledKernel"}, got  # fmt: skip


# ---- tactics --------------------------------------------------------------------------


def grouped_problem(m: int, e: int = 128, op: str = "grouped_w4a16") -> Problem:
    return Problem(m=m, n=1536, k=2048, operation=op, groups=e)


def test_tile_m_follows_the_balanced_rows_per_expert():
    assert max_tile_m(grouped_problem(8)) == 16  # decode: 1 row per expert, FMA and MMA
    assert max_tile_m(grouped_problem(4096)) == 32  # 32 rows per expert
    assert max_tile_m(grouped_problem(65536)) == 128
    b = TritonSm90GroupedBackend()
    decode = {t.tile_m for t in b.tactics(grouped_problem(8), SM90)}
    assert decode == {1, 2, 4, 8, 16}
    assert max({t.tile_m for t in b.tactics(grouped_problem(4096), SM90)}) == 32


def test_fma_path_register_rule_and_swap_refused():
    p = grouped_problem(8)
    big = TritonSm90GroupedTactic(tile_m=8, tile_n=128, tile_k=256)
    assert "products per thread" in why_invalid(big, p)
    assert why_invalid(TritonSm90GroupedTactic(tile_m=1, tile_n=64), p) is None
    with pytest.raises(ValueError):
        TritonSm90GroupedTactic(tile_m=1, tile_n=64, swap_ab=True)
    dense = Problem(m=8, n=64, k=64, operation="w4a16")
    assert "grouped operations only" in why_invalid(TritonSm90GroupedTactic(tile_m=1, tile_n=64),
                                                    dense)  # fmt: skip


def test_simulated_sm90_ranks_the_grouped_family_for_both_operations():
    d = Dispatcher("sm90", cache=False)
    for op in ("grouped_w4a16", "grouped_w4a4"):
        for m in (8, 128, 512, 4096):
            sl = d.candidates(m, 1536, 2048, "bfloat16", op, 128)
            assert sl.candidates, (op, m)
            # dense rows at decode also get the grouped mma kernel (tests/test_grouped_mma.py)
            assert "triton-sm90-grouped" in {c.backend for c in sl.candidates}
            assert all(c.operation == op and not c.tactic.swap_ab for c in sl.candidates)
    # within this backend the decode bucket prefers the FMA path, a prefill the tensor cores
    b = TritonSm90GroupedBackend()
    for m, fma in ((8, True), (4096, False)):
        p = grouped_problem(m)
        best = min(b.tactics(p, SM90), key=lambda t, p=p: b.estimate_us(p, SM90, t))
        assert (best.tile_m < 16) == fma, (m, best)


def test_estimate_reads_only_touched_experts():
    b = TritonSm90GroupedBackend()
    t = TritonSm90GroupedTactic(tile_m=1, tile_n=64)
    few = b.estimate_us(grouped_problem(8), SM90, t)
    many = b.estimate_us(grouped_problem(128), SM90, t)
    assert few < many / 4  # 8 experts' weights vs 128


def test_split_k_tactics_only_where_each_split_owns_two_k_tiles():
    b = TritonSm90GroupedBackend()
    decode = list(b.tactics(grouped_problem(8), SM90))  # K=2048
    assert {t.split_k for t in decode} == {1, 2, 4, 8}
    for t in decode:
        assert -(-2048 // t.tile_k) >= 2 * t.split_k, t
    assert {t.split_k for t in decode if t.tile_k == 256} == {1, 2, 4}  # 8 K tiles
    short = Problem(m=8, n=1536, k=256, operation="grouped_w4a16", groups=128)
    assert {(t.tile_k, t.split_k) for t in b.tactics(short, SM90) if t.split_k > 1} == {(64, 2)}
    assert "split_k" in b.diversity_axes  # as the dense sm90 families: the cap keeps splits


def test_validate_refuses_split_k_with_the_reason():
    b, p = TritonSm90GroupedBackend(), grouped_problem(8)
    t = TritonSm90GroupedTactic(tile_m=1, tile_n=64, tile_k=256, split_k=8)
    assert "split_k=8 leaves < 2 K tiles per split (8 K tiles)" in b.validate(t, p, SM90)
    assert b.validate(t.model_copy(update={"split_k": 4}), p, SM90) is None
    # a prefill grid's partials would be GBs: refused by the workspace bound
    big = TritonSm90GroupedTactic(tile_m=128, tile_n=128, tile_k=64, split_k=2)
    prefill = grouped_problem(65536)
    assert split_workspace_bytes(big, prefill) > SPLIT_WORKSPACE_MAX
    assert "workspace bytes" in b.validate(big, prefill, SM90)
    assert b.validate(big.model_copy(update={"split_k": 1}), prefill, SM90) is None


def test_split_k_estimate_helps_a_latency_bound_decode():
    """8 rows over 8 of 128 experts, N=1536, K=2048: few programs each walking 16 K tiles
    (issue 35's measured case) - a split shortens each program's chain."""
    b, p = TritonSm90GroupedBackend(), grouped_problem(8)
    est = {s: b.estimate_us(p, SM90, TritonSm90GroupedTactic(tile_m=1, tile_n=64,
                                                             tile_k=128, split_k=s))
           for s in (1, 2, 4)}  # fmt: skip
    assert est[2] < est[1] and est[4] < est[1], est
    # at prefill the chain is not the bound: a split only adds its partials and sync
    big = grouped_problem(4096)
    one = TritonSm90GroupedTactic(tile_m=32, tile_n=128, tile_k=64)
    two = one.model_copy(update={"split_k": 2})
    assert b.estimate_us(big, SM90, two) > b.estimate_us(big, SM90, one)


def test_split_k_tactic_round_trips_and_reaches_the_kernel_config():
    t = TritonSm90GroupedTactic(tile_m=1, tile_n=64, tile_k=128, split_k=4)
    assert TritonSm90GroupedTactic.model_validate(t.model_dump()) == t
    assert TritonSm90GroupedTactic.model_validate_json(t.model_dump_json()).split_k == 4
    assert TritonSm90GroupedTactic(tile_m=4, tile_n=64).split_k == 1
    with pytest.raises(ValueError):
        TritonSm90GroupedTactic(tile_m=4, tile_n=64, split_k=3)
    pytest.importorskip("triton")
    assert t.kernel_config().split_k == 4
    assert TritonSm90GroupedTactic(tile_m=1, tile_n=64).kernel_config().split_k == 1


# ---- on the GPU ------------------------------------------------------------------------


def _sm90_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_grouped_every_path_bf16_and_graph_replay():
    """A tactic of every path and knob of a decode and a prefill bucket, bf16 rows, within
    the dense W4A16 tolerance of the float64 reference; then the dispatcher's plan: eager
    replays and a CUDA graph replayed with new routing (offsets changed in place)."""
    import torch

    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.contracts.device import detect
    from fp4_dispatch.format.grouped import grouped_reference, quantize_experts
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    backend, info = TritonSm90GroupedBackend(), detect()
    e, n, k = 16, 384, 512
    g = torch.Generator().manual_seed(0)
    b = quantize_experts(torch.randn(e, n, k, generator=g) * torch.logspace(-2, 1, e).view(
        e, 1, 1)).to("cuda")  # fmt: skip
    for sizes in ([0, 1, 0, 2, 1, 0, 0, 1, 3, 0, 0, 0, 1, 0, 0, 1], [40, 0, 3, 0] * 4):
        t = sum(sizes)
        a = (torch.randn(t, k, generator=g) * 3).to(torch.bfloat16).cuda()
        off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        ref = grouped_reference(a, b, off)
        ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
        p = Problem(m=t, n=n, k=k, operation="grouped_w4a16", groups=e)
        # one tactic per (tile_m, weights_on_m, tile_k): every path, ~20 compiles a problem
        one_each = {}
        for tactic in backend.tactics(p, info):
            one_each.setdefault((tactic.tile_m, tactic.weights_on_m, tactic.tile_k), tactic)
        for tactic in one_each.values():
            out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            backend.build(tactic, p, info)(ops, out)
            err = float((out.double().cpu() - ref).norm() / ref.norm())
            assert err < 1e-2, (tactic, err)
    d = Dispatcher(cache=False)
    sizes = [1] * 8 + [0] * 8
    a = torch.randn(8, k, device="cuda").to(torch.bfloat16)
    off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    out = d.grouped_gemm(a, b, off)  # warm the plan
    assert d.cached_plan(8, n, k, "bfloat16", "grouped_w4a16", e).candidate.backend == (
        "triton-sm90-grouped"
    )
    for shift in range(1, 4):  # eager calls: the plan's driver replay, new routing each
        routing = torch.roll(torch.tensor(sizes), shift * 3).cumsum(0).to(torch.int32)
        off.copy_(routing)
        again = d.grouped_gemm(a, b, off)
        ref = grouped_reference(a, b, off)
        assert float((again.double().cpu() - ref).norm() / ref.norm()) < 1e-2, shift
    qa = quantize_nvfp4(a.float())  # grouped W4A4: both operands dequantized in the kernel
    y4 = d.grouped_gemm(qa, b, off)
    ref4 = grouped_reference(qa, b, off)
    assert float((y4.double().cpu() - ref4).norm() / ref4.norm()) < 1e-2
    off.copy_(torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = d.grouped_gemm(a, b, off)
    off.copy_(torch.tensor([0] * 8 + [1] * 8, dtype=torch.int32).cumsum(0).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = grouped_reference(a, b, off)
    assert float((out.double().cpu() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_grouped_split_k_paths_driver_replay_and_graph():
    """Split 2 and 4 on every path (GEMV, FMA, tl.dot, weights_on_m; dense and NVFP4 rows)
    with bf16 rows and a K tail, within the dense W4A16 tolerance of the float64
    reference (a split changes the summation order: not bit-identical to one split);
    every counter zero after each call. Then one split kernel through the plan's
    driver-API replay and a CUDA graph, each replayed with new routing (offsets changed
    in place): the recorded workspace pointers stay valid."""
    import torch

    from fp4_dispatch.backends.sm90 import gemm_grouped as gg
    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.format.grouped import quantize_experts, reference_output
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    e, n, k = 16, 384, 1056  # 1056 = 8.25 K tiles of 128: an uneven last split
    g = torch.Generator().manual_seed(1)
    b = quantize_experts(torch.randn(e, n, k, generator=g) * torch.logspace(-2, 1, e).view(
        e, 1, 1)).to("cuda")  # fmt: skip

    def operands(a, off, w4a4):
        if not w4a4:
            return GroupedOperands(a, b.data, b.scale, b.global_scale, off)
        qa = quantize_nvfp4(a.float())
        return GroupedOperands(qa.data, b.data, b.scale, b.global_scale * qa.global_scale, off,
                               a_scale=qa.scale)  # fmt: skip

    def check(kernel, ops, out):
        ref = reference_output(ops)
        err = float((out.double().cpu() - ref.cpu()).norm() / ref.norm())
        assert err < 1e-2, (kernel.cfg, err)
        assert all(bool((c == 0).all()) for _, c in kernel._scratch.pairs()), kernel.cfg

    configs = [
        (dict(block_m=1, block_n=64), False), (dict(block_m=4, block_n=32), False),
        (dict(block_m=8, block_n=16), False), (dict(block_m=8, block_n=16), True),
        (dict(block_m=16, block_n=64), False), (dict(block_m=16, block_n=64), True),
        (dict(block_m=16, block_n=64, weights_on_m=True), False),
    ]  # fmt: skip
    for sizes in ([0, 1, 0, 2, 1, 0, 0, 1, 3, 0, 0, 0, 1, 0, 0, 1], [40, 0, 3, 0] * 4):
        t = sum(sizes)
        a = (torch.randn(t, k, generator=g) * 3).to(torch.bfloat16).cuda()
        off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        for cfg, w4a4 in configs:
            for split in (2, 4):
                kernel = gg.build(gg.GroupedConfig(block_k=128, split_k=split, **cfg))
                ops = operands(a, off, w4a4)
                out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                kernel(ops, out)
                check(kernel, ops, out)

    kernel = gg.build(gg.GroupedConfig(block_m=1, block_n=64, block_k=128, split_k=4))
    check_grouped_replays(kernel, b, check)
