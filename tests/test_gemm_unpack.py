"""Tests of the Hopper unpack + cuBLAS backend: the unpack kernel and the whole launcher
under TRITON_INTERPRET=1 (CPU), and the plugin's tactics, support and estimates.

On CPU the launcher's product runs through torch's CPU matmul (bf16, or fp32 for fp16
output) instead of cuBLAS; the unpack kernel is the same Triton code that runs on the
GPU. On the H200, ``python -m benchmarks kernels --cases w4a4 --top 0`` checks the
cuBLAS path's tactics against float64.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import run_interpreted

from fp4_dispatch.contracts.device import CPU
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins import sm90
from fp4_dispatch.plugins.sm90 import (
    Sm90UnpackTactic,
    TritonSm90Backend,
    TritonSm90UnpackBackend,
    why_invalid_unpack,
)

SM90 = simulated("sm90")

# Runs in a fresh interpreter: whether a @triton.jit function is interpreted is fixed when
# its module is imported, and other tests may have imported the kernel module already.
_INTERPRETER_SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.backends.sm90 import gemm_unpack as mod
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.format.nvfp4 import (
    Nvfp4Tensor, dequantize, e2m1_to_float, quantize_nvfp4, reference_gemm, unpack_e2m1,
    unswizzle_scales,
)
from fp4_dispatch.plugins.sm90 import Sm90UnpackTactic, TritonSm90UnpackBackend
from fp4_dispatch.contracts.tactics import Problem

cases = json.loads(sys.argv[1])


def quantized(rows, k, seed, spread=10):
    # rows scaled by 2**-spread..2**spread: exercises e4m3 subnormal and large block scales
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (rows, 1), generator=g).float())
    return quantize_nvfp4(x)


def same_bits(got, want):
    # bit-exact, NaN-aware (NaN payloads may differ): same NaN mask, equal bits elsewhere
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    return torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


out = {"unpack": [], "raw": [], "gemm": [], "plugin": []}
# 1. unpack vs nvfp4.dequantize without the global scale, bit for bit
for rows, k, br, bk in cases["unpack"]:
    q = quantized(rows, k, rows * 7 + k)
    unit = Nvfp4Tensor(q.data, q.scale, torch.ones(()), "swizzled", q.shape)
    want = dequantize(unit).to(torch.bfloat16)
    got = mod.unpack_nvfp4(q.data, q.scale, br, bk)
    out["unpack"].append([rows, k, br, bk, list(got.shape) == [rows, k], same_bits(got, want)])

# 2. raw bit patterns: every e2m1 code and every e4m3 code (subnormals, -0, NaN)
for rows, k, br, bk in cases["raw"]:
    g = torch.Generator().manual_seed(rows + k)
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    rp, kp = -(-rows // 128) * 128, -(-(k // 16) // 4) * 4
    codes = torch.arange(rp * kp, dtype=torch.int64) % 256
    scale = codes[torch.randperm(rp * kp, generator=g)].to(torch.uint8)
    scale = scale.view(rp, kp).view(torch.float8_e4m3fn)
    lin = unswizzle_scales(scale, rows, k).float()
    vals = e2m1_to_float(unpack_e2m1(data)).view(rows, k // 16, 16)
    want = (vals * lin.unsqueeze(-1)).view(rows, k).to(torch.bfloat16)
    got = mod.unpack_nvfp4(data, scale, br, bk)
    n_codes = int(torch.unique(lin.view(-1).to(torch.float8_e4m3fn).view(torch.uint8)).numel())
    out["raw"].append([rows, k, br, bk, n_codes, same_bits(got, want)])

# 3. the whole launcher vs reference_gemm, plain / transposed / strided out
def rel(got, ref):
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got.double() - ref).norm() / ref.norm())

def ulps(got, ref, dtype):
    # worst error over the rounding bound: bf16 out is rounded twice (<= 2 half-ulps),
    # fp16 once; + fp32 accumulation
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    bound = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    tol = ref.abs() * bound * 1.01 + ref.abs().max() * 1e-5
    return float(((got.double() - ref).abs() / tol).max())

for m, n, k, br, bk in cases["gemm"]:
    # |out| stays well inside fp16's range: rows of A spread 2**+-6, B unscaled
    qa, qb = quantized(m, k, m + 3 * k, spread=6), quantized(n, k, n + 5 * k, spread=0)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
    ref = reference_gemm(qa, qb)
    for dtype in (torch.bfloat16, torch.float16):
        plain = torch.full((m, n), float("nan"), dtype=dtype)
        mod.gemm_unpack_cublas(ops, plain, br, bk)
        trans = torch.full((n, m), float("nan"), dtype=dtype).t()
        mod.gemm_unpack_cublas(ops, trans, br, bk)
        big = torch.full((m, n + 8), float("nan"), dtype=dtype)
        strided = big[:, 3 : 3 + n]
        mod.gemm_unpack_cublas(ops, strided, br, bk)
        untouched = bool(torch.isnan(big[:, :3]).all() and torch.isnan(big[:, 3 + n :]).all())
        out["gemm"].append([m, n, k, str(dtype),
                            [rel(o, ref) for o in (plain, trans, strided)],
                            [ulps(o, ref, dtype) for o in (plain, trans, strided)], untouched])

# 4. the plugin's build path (what the dispatcher calls), swapped operands into out.T
b = TritonSm90UnpackBackend()
m, n, k = 260, 40, 224
qa, qb = quantized(m, k, 1, spread=6), quantized(n, k, 2, spread=0)
ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale,
                   (qa.global_scale * qb.global_scale).reshape(1))
ref = reference_gemm(qa, qb)
for t in b.tactics(Problem(m=m, n=n, k=k), simulated("sm90")):
    kern = b.build(t, Problem(m=m, n=n, k=k), simulated("sm90"))
    o = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    kern(ops, o)
    o2 = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    kern(ops.swapped(), o2.t())  # what the dispatcher passes for a swapped tactic
    out["plugin"].append([t.block_r, t.block_k, rel(o, ref), rel(o2, ref)])
print(json.dumps(out))
"""

CASES = {
    # (rows, K, block_r, block_k): rows not a multiple of 128 or of the block, K % 32 == 0
    # but not a multiple of 64 / 128 / 256
    "unpack": [
        (5, 32, 32, 64),
        (130, 96, 32, 64),
        (200, 160, 64, 128),
        (129, 288, 128, 128),
        (70, 544, 64, 256),
        (256, 256, 128, 64),
    ],
    "raw": [(131, 224, 32, 64), (64, 1024, 64, 256)],
    "gemm": [(300, 72, 96, 64, 128), (257, 130, 160, 32, 64), (129, 33, 544, 128, 128)],
}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_INTERPRETER_SCRIPT, CASES)


def test_unpack_is_bit_exact_dequantize(interpreted):
    rows = interpreted["unpack"]
    assert len(rows) == len(CASES["unpack"])
    for r, k, br, bk, shape_ok, exact in rows:
        assert shape_ok and exact, f"{r}x{k} blocks {br}x{bk}: unpack differs from dequantize"


def test_unpack_decodes_every_code(interpreted):
    rows = interpreted["raw"]
    assert len(rows) == len(CASES["raw"])
    assert max(r[4] for r in rows) == 256, "not every e4m3 code was exercised"
    for r, k, br, bk, _, exact in rows:
        assert exact, f"{r}x{k} blocks {br}x{bk}: raw bit patterns decoded wrongly"


def test_launcher_matches_reference(interpreted):
    rows = interpreted["gemm"]
    assert len(rows) == 2 * len(CASES["gemm"])
    for m, n, k, dtype, rels, ulps, untouched in rows:
        for what, e, u in zip(("plain", "out.T", "strided"), rels, ulps, strict=True):
            assert e < 1e-2, f"{m}x{n}x{k} {dtype} {what}: rel err {e}"
            assert u <= 1.0, f"{m}x{n}x{k} {dtype} {what}: {u:.3g} x the rounding bound"
        assert untouched, f"{m}x{n}x{k} {dtype}: wrote outside the strided out view"


def test_plugin_kernels_run(interpreted):
    rows = interpreted["plugin"]
    assert len(rows) >= 4
    for br, bk, plain, swapped in rows:
        assert plain < 1e-2 and swapped < 1e-2, f"block {br}x{bk}: {plain} / {swapped}"


def test_unpack_rejects_bad_inputs():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_unpack import build, unpack_nvfp4
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    q = quantize_nvfp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="block_r"):
        unpack_nvfp4(q.data, q.scale, block_r=48)
    with pytest.raises(ValueError, match="scale"):
        unpack_nvfp4(q.data, q.scale[:, :2].contiguous())
    with pytest.raises(ValueError, match="multiple of 32"):
        unpack_nvfp4(q.data[:, :8].contiguous(), q.scale)
    with pytest.raises(ValueError, match="block_k"):
        build(64, 96)


# ---- plugin ---------------------------------------------------------------------------


def test_registered_next_to_the_other_sm90_backends():
    got = []
    sm90.fp4_dispatch_register_backends(got.append)
    names = [b.name for b in got]
    assert names == [
        "triton-sm90",
        "triton-sm90-unpack",
        "triton-sm90-w4a16",
        "triton-sm90-dense",
        "triton-sm90-ws",
        "triton-sm90-mma",
        "triton-sm90-rs",
        "triton-sm90-w4a8",
        "triton-sm90-grouped",
        "triton-sm90-grouped-mma",
        "triton-sm90-grouped-rs",
    ]
    assert {b.family for b in got} == {"sm90"}


def test_supports_same_rules_as_direct_backend():
    u, d = TritonSm90UnpackBackend(), TritonSm90Backend()
    cpu = u.supports(CPU)
    assert not cpu.ok and "9.x" in cpu.reason
    for other in ("sm100", "sm103", "sm107"):
        s = u.supports(simulated(other))
        assert not s.ok and "9.x" in s.reason
    ampere = SM90.model_copy(update={"compute_capability": (8, 0)})
    assert not u.supports(ampere).ok and "8.0" in u.supports(ampere).reason
    for dev in (CPU, SM90, ampere, simulated("sm100")):
        assert u.supports(dev) == d.supports(dev)
    if importlib.util.find_spec("triton") is not None:
        assert u.supports(SM90).ok


def test_supports_without_triton_gives_install_hint(monkeypatch):
    sm90._triton_status.cache_clear()
    monkeypatch.setattr(sm90.importlib.util, "find_spec", lambda name: None)
    try:
        s = TritonSm90UnpackBackend().supports(SM90)
    finally:
        sm90._triton_status.cache_clear()
    assert not s.ok and "pip install '.[triton]' in the fp4-dispatch checkout" in s.reason


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(256, 8192, 8192), (4096, 8192, 28672), (1000, 1000, 4160), (300, 72, 96), (16384, 28672, 32)],
)
def test_tactics_are_valid_and_small(m, n, k):
    b = TritonSm90UnpackBackend()
    problem = Problem(m=m, n=n, k=k)
    tactics = list(b.tactics(problem, SM90))
    assert (3 if k <= 64 else 4) <= len(tactics) <= 9
    assert len(set(tactics)) == len(tactics)
    assert tactics == list(b.tactics(problem, SM90))
    for t in tactics:
        assert b.validate(t, problem, SM90) is None
        assert Sm90UnpackTactic.model_validate_json(t.canonical_json()) == t
        assert t.swap_ab is False and (t.tile_m, t.tile_n) == (128, 128)
        assert t.block_r * t.block_k <= 128 * 128
        est = b.estimate_us(problem, SM90, t)
        assert est is not None and 0 < est < 1e6
    assert len({t.block_k for t in tactics}) >= 2 or k <= 64


@pytest.mark.parametrize("m", [1, 16, 128, 255])
def test_no_tactics_below_m_256(m):
    b = TritonSm90UnpackBackend()
    problem = Problem(m=m, n=8192, k=8192)
    assert list(b.tactics(problem, SM90)) == []
    assert "direct kernel" in b.validate(Sm90UnpackTactic(), problem, SM90)


def test_validity_rules():
    p = Problem(m=512, n=512, k=96)
    assert why_invalid_unpack(Sm90UnpackTactic(block_k=128), p) is None  # K pads to 128
    assert "exceeds K" in why_invalid_unpack(Sm90UnpackTactic(block_k=256), p)
    assert "multiple of 32" in why_invalid_unpack(Sm90UnpackTactic(), Problem(m=512, n=8, k=48))
    big = Sm90UnpackTactic(block_r=128, block_k=256)
    assert "exceeds" in why_invalid_unpack(big, Problem(m=512, n=512, k=4096))


def test_tactic_fields_are_typed():
    for bad in (
        {"swap_ab": True},
        {"tile_m": 64},
        {"block_r": 16},
        {"block_k": 32},
        {"cluster_m": 2},
    ):
        with pytest.raises(ValueError):
            Sm90UnpackTactic(**bad)
    t = Sm90UnpackTactic(block_r=32, block_k=256)
    assert json.loads(t.canonical_json())["backend"] == "triton-sm90-unpack"


def _best(backend, problem):
    return min(backend.estimate_us(problem, SM90, t) for t in backend.tactics(problem, SM90))


def test_estimate_prefers_unpack_for_prefill_and_direct_for_decode():
    u, d = TritonSm90UnpackBackend(), TritonSm90Backend()
    prefill = Problem(m=4096, n=8192, k=8192)
    assert _best(u, prefill) < _best(d, prefill)
    # the unpack path never beats bf16 cuBLAS alone (the GEMM is inside its estimate)
    assert _best(u, prefill) > prefill.flops / (SM90.bf16_tflops * 1e6 * 1.1)
    decode = Problem(m=16, n=8192, k=8192)
    unpack_decode = min(
        u.estimate_us(decode, SM90, Sm90UnpackTactic(block_r=br, block_k=bk))
        for br in (32, 64, 128)
        for bk in (64, 128)
    )
    assert _best(d, decode) < unpack_decode


def test_estimate_fp16_out_costs_more():
    u = TritonSm90UnpackBackend()
    t = Sm90UnpackTactic()
    bf = u.estimate_us(Problem(m=4096, n=8192, k=512), SM90, t)
    fp = u.estimate_us(Problem(m=4096, n=8192, k=512, out_dtype="float16"), SM90, t)
    assert fp > bf


def test_build_returns_a_kernel_per_block_shape():
    pytest.importorskip("triton")
    u = TritonSm90UnpackBackend()
    p = Problem(m=4096, n=8192, k=8192)
    t = Sm90UnpackTactic(block_r=32, block_k=64)
    k1 = u.build(t, p, SM90)
    assert k1 is u.build(t, p, SM90)
    assert (k1.block_r, k1.block_k) == (32, 64)
    assert u.build(Sm90UnpackTactic(), p, SM90) is not k1


# ---- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_every_tactic_matches_reference():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs compute capability 9.x")
    from fp4_dispatch.contracts.backend import GemmOperands
    from fp4_dispatch.contracts.device import detect
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4, reference_gemm

    b = TritonSm90UnpackBackend()
    info = detect()
    m, n, k = 300, 264, 1056
    g = torch.Generator().manual_seed(5)
    qa = quantize_nvfp4(torch.randn(m, k, generator=g))
    qb = quantize_nvfp4(torch.randn(n, k, generator=g))
    ref = reference_gemm(qa, qb)
    qa, qb = qa.to("cuda"), qb.to("cuda")
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
    for t in b.tactics(Problem(m=m, n=n, k=k), info):
        kernel = b.build(t, Problem(m=m, n=n, k=k), info)
        for dtype in (torch.bfloat16, torch.float16):
            out = torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t()
            kernel(ops, out)
            o = out.double().cpu()
            assert torch.isfinite(o).all()
            assert float((o - ref).norm() / ref.norm()) < 1e-2
