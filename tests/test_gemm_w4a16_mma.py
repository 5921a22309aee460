"""``triton-sm90-mma``: the register-only W4A16 decode kernel (Gluon) and its backend.

Gluon kernels have no interpreter, so on the CPU these tests check the rules, the estimate
and the conformance kit's static checks, and compile the kernel for sm_90 (Triton's ptxas,
no launch); the numerics run on an sm90 GPU (``-m gpu``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    SASS_LOOP,
    TARGET_ONLY,
    check_w4a16_kernel_on_gpu,
    run_interpreted,
    sm90_compile_env,
)

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import rated, simulated
from fp4_dispatch.plugins.sm90.mma import (
    MMA_MAX_M,
    MMA_VARIANTS,
    TritonSm90MmaBackend,
    TritonSm90MmaTactic,
    residency,
    why_invalid,
)
from fp4_dispatch.testing import check_backend

SM90 = rated(simulated("sm90"))


def _w4a16(m: int, n: int, k: int, dtype: str = "bfloat16") -> Problem:
    return Problem(m=m, n=n, k=k, out_dtype=dtype, operation="w4a16")


def test_config_names_the_bad_knob():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import MmaConfig

    with pytest.raises(ValueError, match="block_m: expected one of"):
        MmaConfig(block_m=4)
    with pytest.raises(ValueError, match="warps: expected one of"):
        MmaConfig(warps=3)
    with pytest.raises(ValueError, match="row_warps: expected one of"):
        MmaConfig(row_warps=3)
    with pytest.raises(ValueError, match="expected <= 8 warps a CTA, got 4 x 4 = 16"):
        MmaConfig(warps=4, row_warps=4)
    with pytest.raises(ValueError, match="split_k: expected >= 1, got 0"):
        MmaConfig(split_k=0)
    with pytest.raises(ValueError, match="prefetch"):
        MmaConfig(prefetch=7)
    with pytest.raises(ValueError, match="unroll: expected one of"):
        MmaConfig(unroll=3)


def test_offered_for_up_to_8_tokens_with_work_for_every_warp():
    b = TritonSm90MmaBackend()
    ts = list(b.tactics(_w4a16(1, 8192, 8192), SM90))
    assert len(ts) == 12 and all(isinstance(t, TritonSm90MmaTactic) for t in ts)
    assert {(t.tile_m, t.tile_k) for t in ts} == {(8, 128)}
    assert {(t.tile_m, t.tile_n, t.num_warps, t.prefetch, t.unroll, t.split_k) for t in ts} == {
        (*v, s) for v in MMA_VARIANTS for s in (1, 2, 3, 4)
    }
    other = TritonSm90MmaTactic(num_warps=8, tile_n=32, prefetch=2, unroll=2)
    assert "one of ((8, 16, 4, 0, 1)" in why_invalid(other, _w4a16(1, 8192, 8192), SM90)
    assert list(b.tactics(_w4a16(MMA_MAX_M, 4096, 4096, "float16"), SM90))
    assert not list(b.tactics(_w4a16(MMA_MAX_M + 1, 8192, 8192), SM90))
    t = ts[0]
    assert "K=100" in why_invalid(t, _w4a16(1, 256, 100), SM90)
    assert "M=16" in why_invalid(t, _w4a16(16, 8192, 8192), SM90)
    # 384 K: 3 K steps; split 2 of 4 warps each leaves warps without a step; no split runs
    # (a warp idles, masked)
    split2 = TritonSm90MmaTactic(split_k=2)
    assert "split_k x K ranges = 8 > 3 K steps" in b.validate(split2, _w4a16(1, 4096, 384), SM90)
    assert b.validate(TritonSm90MmaTactic(), _w4a16(1, 4096, 384), SM90) is None
    # 32 rows of 4 warps: two warps a K range, two K ranges; split 2 gives 4 ranges
    rows32 = TritonSm90MmaTactic(tile_n=32, prefetch=2, unroll=2, split_k=2)
    assert (rows32.row_warps, rows32.k_groups) == (2, 2)
    assert b.validate(rows32, _w4a16(1, 4096, 512), SM90) is None
    assert "= 4 > 3 K steps" in b.validate(rows32, _w4a16(1, 4096, 384), SM90)


def test_space_holds_every_variant_the_kernel_runs():
    """`space` (what the removed ``bench_w4a16_mma.py --space`` timed): every (shape, pipe) of
    `MMA_SPACE` x split, offered or not, on the token tile that covers M; the offered
    tactics are among them; a CTA of more rows than its warps cover is no variant."""
    from fp4_dispatch.plugins.sm90.mma import MMA_SPACE, REGISTERS, space, why_not_run

    p1, p16 = _w4a16(1, 8192, 8192), _w4a16(16, 8192, 8192)
    every = space(p1)
    assert len(every) == 18 * 4 and {t.tile_m for t in every} == {8}
    assert {(t.tile_m, t.tile_n, t.num_warps, t.prefetch, t.unroll) for t in every} == {
        v for v in MMA_SPACE if v[0] == 8
    }
    offered = set(TritonSm90MmaBackend().tactics(p1, SM90))
    assert offered < set(every)
    assert {t.tile_m for t in space(p16)} == {16} and not offered & set(space(p16))
    assert "tile_m=8: M=16 runs 16-token tiles" in why_not_run(TritonSm90MmaTactic(), p16)
    assert set(REGISTERS) == set(MMA_SPACE)  # the register count of every variant it runs
    too_tall = TritonSm90MmaTactic(tile_n=128, num_warps=4)
    assert too_tall.k_groups == 0 and "not a variant of MMA_SPACE" in why_not_run(too_tall, p1)
    # the CTA's 64 rows: four warps of 16 sharing one K range
    t = TritonSm90MmaTactic(tile_n=64, num_warps=4)
    pytest.importorskip("triton")
    cfg = t.kernel_config()
    assert (cfg.block_n, cfg.row_warps, cfg.warps) == (16, 4, 1)


def test_serves_w4a4_by_expanding_the_activations_first():
    """W4A4 problems get the same tactics; the estimate adds the expansion's `EXPAND_US`;
    the kernel object is the W4A4 wrapper, which takes alpha as two factors."""
    from fp4_dispatch.plugins.sm90.mma import EXPAND_US

    b = TritonSm90MmaBackend()
    assert b.operations == ("w4a16", "w4a4")
    w4a4 = Problem(m=4, n=8192, k=8192, out_dtype="bfloat16", operation="w4a4")
    w4a16 = _w4a16(4, 8192, 8192)
    ts = list(b.tactics(w4a4, SM90))
    assert ts == list(b.tactics(w4a16, SM90))
    for t in ts[:3]:
        diff = b.estimate_us(w4a4, SM90, t) - b.estimate_us(w4a16, SM90, t)
        assert diff == pytest.approx(EXPAND_US)
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import W4A4MmaKernel, W4A16MmaKernel

    kernel = b.build(ts[0], w4a4, SM90)
    assert type(kernel) is W4A4MmaKernel and kernel.alpha_factors is True
    assert type(b.build(ts[0], w4a16, SM90)) is W4A16MmaKernel


def test_not_offered_under_the_interpreter(monkeypatch):
    b = TritonSm90MmaBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = b.supports(SM90)
    assert not s.ok and "TRITON_INTERPRET" in s.reason
    monkeypatch.delenv("TRITON_INTERPRET")
    assert b.supports(SM90).ok or "triton" in b.supports(SM90).reason


def test_estimate_follows_residency_and_waves():
    """48 registers a thread: 10 CTAs of 4 warps an SM; 88 with prefetch and unroll: 5
    (`residency`). The estimate grows with the work an SM issues (twice the K, about
    twice the time once issue-bound) and charges a second wave of CTAs."""
    b = TritonSm90MmaBackend()
    t1, t2 = TritonSm90MmaTactic(), TritonSm90MmaTactic(prefetch=2, unroll=2)
    assert residency(t1) == 10 and residency(t2) == 5
    one = b.estimate_us(_w4a16(1, 8192, 8192), SM90, t2)
    two = b.estimate_us(_w4a16(1, 8192, 16384), SM90, t2)
    assert 1.6 * one < two < 2.2 * one, (one, two)
    # 132 SMs x 5 CTAs of 16 rows fill one wave: 10560 rows; one row tile more needs two
    full = b.estimate_us(_w4a16(1, 10560, 1024), SM90, t2)
    over = b.estimate_us(_w4a16(1, 10560 + 16, 1024), SM90, t2)
    assert over > 1.3 * full, (full, over)


def test_passes_the_conformance_kit_on_the_simulated_part():
    problems = [_w4a16(m, n, k) for m, n, k in ((1, 4096, 4096), (5, 1000, 2080))]
    report = check_backend(TritonSm90MmaBackend(), device="sm90", problems=problems)
    assert not report.failures, report.failures
    assert report.passed


_COMPILE = (
    TARGET_ONLY
    + SASS_LOOP
    + r"""
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

cache = mm._w4a16_mma_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    m, n, k = spec["m"], spec["n"], spec["k"]
    dtype = getattr(torch, spec["dtype"])
    kernel = mm.build(mm.MmaConfig(**spec["cfg"]))
    before = len(cache)
    compiled = kernel.precompile(m, n, k, dtype)
    after = len(cache)
    ops = w4.W4A16Operands(torch.zeros(m, k, dtype=dtype),
                           torch.zeros(n, k // 2, dtype=torch.uint8),
                           torch.zeros(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                           torch.ones(1))
    compile_real_call(kernel, ops, torch.empty(m, n, dtype=dtype), k, dtype)
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         **loop_stats(compiled, spec["name"])}
print(json.dumps(out))
"""
)


def test_compiles_for_sm90_without_shared_memory_in_the_loop(tmp_path):
    """The kernel compiles for sm_90 on a CPU (Triton's ptxas, no launch) for whole and
    partial K ranges, split-K, prefetch, 16-token and 32-row tiles and fp16: mma.sync in
    the main loop, which touches no shared memory and has no barrier (the point of the
    design), no register spills; and a real call's arguments hit the variant precompile
    made, so nothing is left to JIT on first use. The 8-token, 16-row step runs 235 SASS
    instructions (bf16): the estimate's `STEP_INSTRUCTIONS`."""
    pytest.importorskip("triton")
    base = {"m": 1, "n": 4096, "k": 4096, "dtype": "bfloat16"}
    specs = [
        {**base, "name": "even", "cfg": {"warps": 4}},
        {**base, "name": "split-prefetch", "k": 4128, "cfg": {"warps": 8, "split_k": 3,
                                                                 "prefetch": 2}},
        {**base, "name": "unroll", "k": 4224, "cfg": {"split_k": 2, "unroll": 2,
                                                      "prefetch": 2}},
        {**base, "name": "m16-rows32", "m": 16, "cfg": {"block_m": 16, "block_n": 32}},
        {**base, "name": "fp16", "n": 1000, "dtype": "float16", "cfg": {"split_k": 2}},
        {**base, "name": "row-warps", "cfg": {"warps": 2, "row_warps": 2, "prefetch": 2,
                                              "unroll": 2}},
        {**base, "name": "row-warps-only", "m": 16, "cfg": {"block_m": 16, "warps": 1,
                                                           "row_warps": 4}},
    ]  # fmt: skip
    env = sm90_compile_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(specs)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {s["name"] for s in specs}, got
    for name, row in got.items():
        assert row["new_by_precompile"] == 1 and row["new_by_real_args"] == 0, (name, row)
        assert row["hmma"] >= 8 and row["spills"] == 0, (name, row)
        assert row["loop_shared_or_barrier"] == 0, (name, row)
    from fp4_dispatch.plugins.sm90.mma import STEP_INSTRUCTIONS

    assert abs(got["even"]["loop"] - STEP_INSTRUCTIONS[8]) <= 4, got["even"]
    assert abs(got["row-warps-only"]["loop"] - STEP_INSTRUCTIONS[16]) <= 8, got["row-warps-only"]


_FALLBACK = r"""
import json, math, sys
import torch
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
from fp4_dispatch.autotune.harness import stress_nvfp4
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize

m, n, k = json.loads(sys.argv[1])
gen = torch.Generator().manual_seed(m + n + k)
x = torch.randn((m, k), generator=gen).to(torch.float16)
wd, wsc = stress_nvfp4(n, k, torch.device("cpu"), gen)
alpha = torch.tensor([1.0 / (8 * math.sqrt(k))])
ref = (x.double() @ dequantize(Nvfp4Tensor(wd, wsc, torch.ones(()), "swizzled",
                                           (n, k))).double().T) * float(alpha)
res = torch.full((m, n), float("nan"), dtype=torch.float16)
ops = w4.W4A16Operands(x, w4.prepare_weight(wd), wsc, alpha, prepared=True)
mm.build(mm.MmaConfig())(ops, res)
print(json.dumps(float((res.double() - ref).norm() / ref.norm())))
"""


def test_prepared_bytes_run_the_direct_kernel():
    """Operands whose bytes are sm90-prepared (the kernel reads natural bytes only) run the
    direct kernel (here under the interpreter, fp16) instead of raising: a raised error
    would mark the tactic broken for every later call."""
    pytest.importorskip("triton")
    err = run_interpreted(_FALLBACK, [3, 64, 256])
    assert err <= 1e-2, err


def _edge_cases() -> list[tuple[int, int, int, dict, str, bool, bool]]:
    """(M, N, K, MmaConfig knobs, dtype, bias, column-major out): tails of M, N and K
    (K % 128 == 32, NaN in the padded scales must not leak; warps whose range is past K),
    split-K, prefetch, 16-token and 32-row tiles, fp16, M over one token tile."""
    return [
        (1, 4616, 3584, {}, "bfloat16", False, False),
        (3, 5120, 5152, {"split_k": 2, "prefetch": 2}, "bfloat16", True, False),
        (8, 2048, 8192, {"warps": 8}, "bfloat16", False, True),
        (7, 1000, 4128, {"warps": 8, "split_k": 3, "block_n": 32, "prefetch": 2}, "bfloat16",
         False, False),
        (16, 1000, 4096, {"block_m": 16, "split_k": 3}, "bfloat16", True, False),
        (20, 512, 2048, {"block_m": 16}, "bfloat16", False, False),
        (2, 1536, 4096, {"split_k": 4}, "float16", True, False),
        (5, 3000, 4224, {"split_k": 2, "unroll": 2, "prefetch": 2}, "bfloat16", False, False),
        (1, 4096, 4096, {"warps": 8, "unroll": 2}, "bfloat16", True, True),
        (1, 256, 256, {"unroll": 2, "prefetch": 2}, "bfloat16", False, False),
        # row warps: CTAs of 32-128 rows over N tails and N under one CTA (rows wrap)
        (16, 1000, 4096, {"block_m": 16, "warps": 1, "row_warps": 4}, "bfloat16", True,
         False),
        (5, 3000, 4224, {"warps": 2, "row_warps": 4, "split_k": 2, "prefetch": 2},
         "bfloat16", False, False),
        (12, 2000, 8192, {"block_m": 16, "warps": 2, "row_warps": 2, "unroll": 2,
                          "prefetch": 2}, "bfloat16", True, True),
        (3, 72, 1024, {"warps": 1, "row_warps": 8, "split_k": 2}, "float16", False, False),
    ]  # fmt: skip


@pytest.mark.gpu
def test_kernel_on_the_gpu_matches_float64():
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as kern

    cases = _edge_cases()
    check_w4a16_kernel_on_gpu(lambda knobs: kern.build(kern.MmaConfig(**knobs)), cases)


@pytest.mark.gpu
def test_w4a4_kernel_on_the_gpu_matches_float64():
    """`W4A4MmaKernel` on stress operands (every e2m1 code in both, NaN in the padded
    scales), alpha as one and as two factors, bf16 and fp16 out, M tails, split-K and
    row warps, twice a case (kept buffers, self-resetting counters): relative error
    against the float64 product of the dequantized operands <= 1e-2."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from fp4_dispatch.autotune.harness import stress_operands
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as kern
    from fp4_dispatch.contracts.backend import GemmOperands
    from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize

    dev = torch.device("cuda")
    cases = [
        (1, 4096, 4096, {}, "bfloat16", False),
        (3, 1000, 4128, {"split_k": 2, "prefetch": 2}, "float16", True),
        (8, 5120, 5120, {"warps": 2, "row_warps": 2, "unroll": 2, "prefetch": 2},
         "bfloat16", True),
        (5, 72, 1024, {"warps": 1, "row_warps": 4}, "bfloat16", False),
    ]  # fmt: skip
    one = torch.ones((), device=dev)
    for m, n, k, knobs, dtype, two in cases:
        gen = torch.Generator(device=dev)
        gen.manual_seed(3 * m + n + k)
        o = stress_operands(m, n, k, dev, gen)
        a64 = dequantize(Nvfp4Tensor(o.a_data, o.a_scale, one, "swizzled", (m, k))).double()
        b64 = dequantize(Nvfp4Tensor(o.b_data, o.b_scale, one, "swizzled", (n, k))).double()
        alpha_b = torch.tensor([0.75], device=dev) if two else None
        ref = (a64 @ b64.T) * float(o.alpha) * (0.75 if two else 1.0)
        ops = GemmOperands(o.a_data, o.a_scale, o.b_data, o.b_scale, o.alpha, alpha_b)
        kernel = kern.build_w4a4(kern.MmaConfig(**knobs))
        out = torch.empty((m, n), dtype=getattr(torch, dtype), device=dev)
        for _ in range(2):
            out.fill_(float("nan"))
            kernel(ops, out)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err <= 1e-2, (m, n, k, knobs, err)


@pytest.mark.gpu
def test_passes_the_conformance_kit_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    problems = [_w4a16(m, n, k) for m, n, k in ((1, 4096, 4096), (5, 1000, 2080))]
    problems += [Problem(m=m, n=n, k=k, out_dtype="bfloat16", operation="w4a4")
                 for m, n, k in ((1, 4096, 4096), (5, 1000, 2080))]  # fmt: skip
    report = check_backend(TritonSm90MmaBackend(), device="cuda", problems=problems)
    assert not report.failures, report.failures
    assert [c for c in report.of("numerics") if c.status == "PASS"], report.checks
