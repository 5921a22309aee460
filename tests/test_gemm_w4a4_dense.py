"""Tests of ``triton-sm90-dense``: W4A4 through the W4A16 kernel (activations expanded
in-kernel). The kernel under TRITON_INTERPRET=1 (fp16 products: the interpreter's tl.dot
mishandles bf16; the bf16 PTX path is checked on the H200 by the GPU test below and by
``python -m benchmarks kernels --cases w4a4-decode``), the plugin's rules, estimate and
precompile, and the conformance kit on the simulated sm90 part."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TARGET_ONLY, run_interpreted

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.dense import (
    DENSE_MAX_M,
    TritonSm90DenseBackend,
    TritonSm90DenseTactic,
    why_invalid,
)
from fp4_dispatch.testing import check_backend

SM90 = simulated("sm90")

_KERNEL_SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.backends.sm90 import gemm_direct, gemm_w4a4_dense as dense, gemm_w4a16 as w4
from fp4_dispatch.autotune.harness import dequant, stress_operands

assert not w4._USE_ASM, "TRITON_INTERPRET was not honoured"


def rel_err(out, ref):
    if not bool(torch.isfinite(out).all()):  # poisoned with NaN: an unwritten element
        return float("nan")
    return float((out.double() - ref).norm() / ref.norm())


rows = []
for m, n, k, cfg in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    ops = stress_operands(m, n, k, torch.device("cpu"), g)
    half = torch.tensor([0.5])  # alpha as two factors: alpha_b multiplied in the epilogue
    two = GemmOperands(ops.a_data, ops.a_scale, ops.b_data, ops.b_scale, ops.alpha * 2, half)
    ref = (dequant(ops.a_data, ops.a_scale, torch.float64)
           @ dequant(ops.b_data, ops.b_scale, torch.float64).T) * float(ops.alpha)
    kernel = dense.build(w4.W4A16Config(**cfg))
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    kernel(ops, out)
    again = torch.full((m, n), float("nan"), dtype=torch.float16)
    kernel(ops, again)  # split-K reuses its workspace: the counters must have been reset
    counters = sum(int(c.abs().sum()) for _, c in kernel._scratch.pairs())
    out_t = torch.full((n, m), float("nan"), dtype=torch.float16)
    kernel(two, out_t.t())  # a column-major out view, alpha in two factors
    w4a4 = torch.full((m, n), float("nan"), dtype=torch.float16)
    gemm_direct.build(gemm_direct.KernelConfig(block_m=16, block_n=64, block_k=64))(ops, w4a4)
    rows.append([m, n, k, cfg, rel_err(out, ref), rel_err(out_t.t(), ref),
                 bool(torch.equal(out, again)), counters, rel_err(w4a4, ref)])
print(json.dumps(rows))
"""

# (m, n, k, W4A16Config kwargs): one token, masked token rows, more tokens than a tile,
# ragged N (wrapped weight rows), K tails, split-K with uneven shares and one empty split
# (11 K tiles over 5 splits of 3: the last split has none)
CASES = [
    (1, 40, 64, dict(block_n=64, block_m=16, block_k=64)),
    (3, 80, 256, dict(block_n=64, block_m=16, block_k=128, split_k=2)),
    (17, 64, 192, dict(block_n=64, block_m=16, block_k=128)),
    (5, 130, 96, dict(block_n=128, block_m=16, block_k=64, split_k=2)),
    (2, 72, 704, dict(block_n=64, block_m=16, block_k=64, split_k=5)),
    (4, 48, 224, dict(block_n=64, block_m=16, block_k=128, split_k=3)),
]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_KERNEL_SCRIPT, CASES)


def test_dense_kernel_matches_float64_and_the_w4a4_kernel(interpreted):
    """Within fp16 output rounding of the float64 product (both operands dequantized), as
    close as ``triton-sm90``'s own kernel is, for a row-major and a column-major out."""
    assert len(interpreted) == len(CASES)
    for m, n, k, cfg, plain, transposed, _, _, direct in interpreted:
        assert plain <= 1e-3, f"{m}x{n}x{k} {cfg}: rel err {plain}"
        assert transposed <= 1e-3, f"{m}x{n}x{k} {cfg} (out.T, alpha_b): rel err {transposed}"
        assert plain <= 2 * direct + 1e-6, f"{m}x{n}x{k} {cfg}: {plain} vs triton-sm90 {direct}"


def test_dense_kernel_is_deterministic_and_resets_split_k_counters(interpreted):
    for m, n, k, cfg, _, _, same, counters, _ in interpreted:
        assert same, f"{m}x{n}x{k} {cfg}: two calls differ"
        assert counters == 0, f"{m}x{n}x{k} {cfg}: counters left at {counters}"


def test_offered_for_decode_shapes_only_with_the_measured_knobs():
    b = TritonSm90DenseBackend()
    decode = Problem(m=DENSE_MAX_M, n=8192, k=8192)
    ts = list(b.tactics(decode, SM90))
    assert ts and all(isinstance(t, TritonSm90DenseTactic) for t in ts)
    assert {(t.tile_m, t.tile_k, t.num_stages, t.num_warps) for t in ts} == {(16, 128, 4, 4)}
    assert {t.tile_n for t in ts} == {64, 128} and not any(t.swap_ab for t in ts)
    assert {3, 5, 6, 7} <= {t.split_k for t in ts}  # the widths between powers of two
    assert not list(b.tactics(Problem(m=DENSE_MAX_M + 1, n=8192, k=8192), SM90))
    why = why_invalid(ts[0], Problem(m=64, n=8192, k=8192), SM90)
    assert "M=64" in why and "decode" in why
    other = ts[0].model_copy(update={"num_stages": 3})
    assert "measured knobs" in b.validate(other, decode, SM90)
    assert "K=100" in why_invalid(ts[0], Problem(m=1, n=64, k=100), SM90)


def test_estimate_prefers_filling_one_round_of_ctas():
    """The H200 W4A4 decode sweep (RESULTS.md "Hopper W4A16" run 5): at 1x8192² 64-row
    tiles ran 25.9 µs at split 6 (768 CTAs: one round at 6 per SM), 27.5 at 5 and 30.3
    at 8 (a second round). The estimate ranks them in that order."""
    b = TritonSm90DenseBackend()
    p = Problem(m=1, n=8192, k=8192)
    est = {t.split_k: b.estimate_us(p, SM90, t) for t in b.tactics(p, SM90) if t.tile_n == 64}
    assert est[6] < est[5] < est[8], est
    best = min(b.tactics(p, SM90), key=lambda t: b.estimate_us(p, SM90, t))
    assert (best.tile_n, best.split_k) == (64, 6), best


def test_passes_the_conformance_kit_on_the_simulated_part():
    """Tactic types, JSON round trips, validity and estimates (the simulated part builds
    and runs nothing)."""
    problems = [Problem(m=m, n=n, k=k) for m, n, k in ((1, 4096, 4096), (16, 5120, 5120))]
    report = check_backend(TritonSm90DenseBackend(), device="sm90", problems=problems)
    assert not report.failures, report.failures
    assert report.passed


_PRECOMPILE = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90.dense import TritonSm90DenseBackend, TritonSm90DenseTactic
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.contracts.tactics import Problem


backend, dev = TritonSm90DenseBackend(), simulated("sm90")
cache = w4._w4a16_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90DenseTactic(**spec["tactic"])
    problem = Problem(m=spec["m"], n=spec["n"], k=spec["k"], out_dtype=spec["dtype"])
    assert backend.validate(tactic, problem, dev) is None, spec
    before = len(cache)
    backend.precompile(tactic, problem, dev)
    after = len(cache)
    kernel = backend.build(tactic, problem, dev)
    m, n, k = problem.m, problem.n, problem.k
    ops = GemmOperands(torch.zeros(m, k // 2, dtype=torch.uint8),
                       torch.zeros(swizzled_scale_shape(m, k), dtype=torch.float8_e4m3fn),
                       torch.zeros(n, k // 2, dtype=torch.uint8),
                       torch.zeros(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                       torch.ones(1), torch.ones(1))
    res = torch.empty(m, n, dtype=getattr(torch, spec["dtype"]))
    compile_real_call(kernel, ops, res, k, res.dtype)
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after}
print(json.dumps(out))
"""
)


def test_precompile_compiles_what_a_call_launches(tmp_path):
    """The dense variant compiles for sm_90 on a CPU without a launch (split-K on and off,
    a K tail, both output dtypes), and a real call's arguments hit the variant precompile
    made: nothing is left to JIT on first use."""
    pytest.importorskip("triton")
    base = {"tile_m": 16, "tile_k": 128, "num_stages": 4, "num_warps": 4}
    specs = [
        {"name": "split6", "m": 1, "n": 8192, "k": 8192, "dtype": "bfloat16",
         "tactic": {**base, "tile_n": 64, "split_k": 6}},
        {"name": "plain-fp16", "m": 16, "n": 4096, "k": 4096, "dtype": "float16",
         "tactic": {**base, "tile_n": 128, "split_k": 1}},
        {"name": "k-tail", "m": 3, "n": 4096, "k": 4160, "dtype": "bfloat16",
         "tactic": {**base, "tile_n": 64, "split_k": 4}},
    ]  # fmt: skip
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _PRECOMPILE, json.dumps(specs)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {s["name"] for s in specs}, got
    for name, row in got.items():
        assert row["new_by_precompile"] == 1, (name, row)
        assert row["new_by_real_args"] == 0, (name, row)


@pytest.mark.gpu
def test_dense_kernel_on_the_gpu_matches_the_reference():
    """The bf16 PTX path on a real sm90 device: the conformance kit's numerics (every
    sampled tactic against the reference)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    problems = [Problem(m=m, n=n, k=k) for m, n, k in ((1, 4096, 4096), (7, 1536, 2112))]
    report = check_backend(TritonSm90DenseBackend(), device="cuda", problems=problems)
    assert not report.failures, report.failures
    assert [c for c in report.of("numerics") if c.status == "PASS"], report.checks
