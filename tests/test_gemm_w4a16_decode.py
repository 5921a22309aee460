"""Tests of the W4A16 gemv decode kernel (`backends/sm90/gemm_w4a16_decode.py`) and its
``path="gemv"`` tactics of the ``triton-sm90-w4a16`` backend.

Kernels run under TRITON_INTERPRET=1 (the element-wise twin of the PTX; the kernel has no
``tl.dot``, so bf16 activations run in the interpreter too); the PTX itself is checked on
every byte value by the PTX model (tests/ptx_model.py); a CPU compile for
sm_90 checks that precompiling finds the variant a real call launches. Speed is measured
only by ``python -m benchmarks kernels --cases w4a16-decode`` on the H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TARGET_ONLY, run_interpreted

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.w4a16 import (
    GEMV_MAX_M,
    GEMV_OFFERED_MAX_M,
    GEMV_SPLIT_K,
    GEMV_STAGES,
    GEMV_THREAD_BYTES,
    GEMV_TILE_K,
    GEMV_TILE_N,
    TritonSm90W4A16Backend,
    TritonSm90W4A16Tactic,
    gemv_thread_bytes,
    why_invalid,
)

SM90 = simulated("sm90")

_SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_decode as dec
from fp4_dispatch.format.nvfp4 import dequantize, quantize_nvfp4

assert not w4._USE_ASM, "TRITON_INTERPRET was not honoured"


def rel_err(out, ref):
    if not bool(torch.isfinite(out).all()):  # an unwritten (NaN-poisoned) element
        return float("nan")
    return float((out.double() - ref).norm() / ref.norm())


rows = []
for m, n, k, cfg, dtype_name in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = (torch.randn(m, k, generator=g) * 2.0).to(dtype)
    q = quantize_nvfp4(torch.randn(n, k, generator=g) * 3.0)  # all codes, subnormal scales
    ops = w4.W4A16Operands(x, q.data, q.scale, q.global_scale.reshape(1))
    ref = (x.double() @ dequantize(q).double().T)
    kernel = dec.build_gemv(dec.W4A16GemvConfig(**cfg))
    out = torch.full((m, n), float("nan"), dtype=dtype)
    w4.check_operands(ops, out)
    kernel(ops, out)
    out_t = torch.full((n, m), float("nan"), dtype=dtype)
    kernel(ops, out_t.t())  # a column-major out view
    again = torch.full((m, n), float("nan"), dtype=dtype)
    kernel(ops, again)  # split-K reuses its workspace: the counters must have reset
    counters = sum(int(c.abs().sum()) for _, c in kernel._scratch.pairs())
    same_p = None  # the prepared layout needs K % 64 == 0
    if k % 64 == 0:
        prep = w4.W4A16Operands(x, w4.prepare_weight(q.data), q.scale,
                                q.global_scale.reshape(1), prepared=True)
        out_p = torch.full((m, n), float("nan"), dtype=dtype)
        kernel(prep, out_p)
        same_p = bool(torch.equal(out, out_p))
    # the bias epilogue (DenseOperands.bias): a @ dq(b).T + bias, one rounding
    bias = ((torch.rand(n, generator=g, dtype=torch.float64) + 0.5) * ref.abs().mean()).to(dtype)
    out_b = torch.full((m, n), float("nan"), dtype=dtype)
    kernel(w4.W4A16Operands(x, q.data, q.scale, q.global_scale.reshape(1), bias=bias), out_b)
    rows.append([m, n, k, cfg, dtype_name, rel_err(out, ref), rel_err(out_t.t(), ref),
                 bool(torch.equal(out, again)), counters, same_p,
                 rel_err(out_b, ref + bias.double()),
                 float(bias.double().norm() * m**0.5 / ref.norm())])
print(json.dumps(rows))
"""

# (m, n, k, W4A16GemvConfig kwargs, activation dtype): M 1-5 (M > block_m: several token
# tiles; M < block_m: wrapped rows), ragged N, K tails (K % block_k != 0, K % 64 == 32),
# split-K 1-3 (3 with an empty last split), both stage settings, fp16 and bf16
CASES = [
    (1, 40, 128, dict(block_n=16, block_m=1, block_k=128), "float16"),
    (1, 40, 128, dict(block_n=16, block_m=1, block_k=128, num_stages=1), "bfloat16"),
    (2, 33, 320, dict(block_n=8, block_m=2, block_k=256, split_k=2), "bfloat16"),
    (3, 72, 96, dict(block_n=16, block_m=4, block_k=128, split_k=2), "float16"),
    (4, 24, 512, dict(block_n=8, block_m=4, block_k=128, split_k=3), "bfloat16"),
    (5, 17, 256, dict(block_n=8, block_m=2, block_k=256, num_stages=1), "float16"),
    (1, 1, 32, dict(block_n=16, block_m=1, block_k=256), "bfloat16"),  # the smallest
    (4, 3, 64, dict(block_n=8, block_m=4, block_k=128, num_stages=1), "float16"),
]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_SCRIPT, CASES)


def test_gemv_matches_float64(interpreted):
    """Each token against float64 of the unquantized activation times the dequantized
    weight: only the output rounding (fp16 ~2.4e-4, bf16 ~2e-3 RMS) and fp32 summation."""
    assert len(interpreted) == len(CASES)
    for m, n, k, cfg, dt, plain, transposed, *_ in interpreted:
        bound = 1e-3 if dt == "float16" else 6e-3
        assert plain <= bound, f"{m}x{n}x{k} {cfg} {dt}: rel err {plain}"
        assert transposed <= bound, f"{m}x{n}x{k} {cfg} {dt} (out.T): rel err {transposed}"


def test_gemv_adds_the_bias_in_its_epilogue(interpreted):
    for row in interpreted:
        err, weight = row[10], row[11]
        assert weight > 0.3, row[:5]  # the bias is not negligible next to the product
        assert err <= 1e-2, f"{row[:5]}: rel err {err} against a @ dq(b).T + bias"


def test_gemv_is_deterministic_and_resets_split_k_counters(interpreted):
    for m, n, k, cfg, dt, _, _, same, counters, *_ in interpreted:
        assert same, f"{m}x{n}x{k} {cfg} {dt}: two calls differ"
        assert counters == 0, f"{m}x{n}x{k} {cfg} {dt}: counters left at {counters}"
    assert any(r[3].get("split_k", 1) > 1 for r in interpreted), "no split-K case ran"


def test_gemv_prepared_weights_give_identical_results(interpreted):
    """The sm90-prepared layout is read in the same block and byte order: same bits."""
    checked = [r for r in interpreted if r[9] is not None]
    assert checked, "no case with K % 64 == 0"
    for row in checked:  # column 9: prepared == natural, bit for bit
        assert row[9], f"{row[:5]}: prepared differs from natural"


def test_gemv_config_rejects_bad_knobs():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16_decode import W4A16GemvConfig

    for kwargs, word in (
        ({"block_n": 128}, "block_n"),
        ({"block_m": 3}, "block_m"),
        ({"block_k": 64}, "block_k"),
        ({"split_k": 0}, "split_k"),
        ({"num_warps": 16}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
    ):
        with pytest.raises(ValueError, match=word):
            W4A16GemvConfig(**kwargs)


# ---- tactics --------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(1, 8192, 8192), (3, 5120, 5120), (4, 72, 96)])
def test_gemv_tactics_are_valid_and_round_trip(m, n, k):
    b = TritonSm90W4A16Backend()
    p = Problem(m=m, n=n, k=k, operation="w4a16")
    offered = [t for t in b.tactics(p, SM90) if t.path == "gemv"]
    assert bool(offered) == (m <= GEMV_OFFERED_MAX_M), f"gemv offered for {p}: {len(offered)}"
    # every combination of the kernel's knobs that the rules accept, offered or not
    tm = 1 << (m - 1).bit_length()
    gemv = [t for tn in (16, 32, 64) for tk in (256, 512, 1024) for s in (1, 2, 4)
            for t in [TritonSm90W4A16Tactic(path="gemv", tile_m=tm, tile_n=tn, tile_k=tk,
                                            split_k=s, num_stages=1)]
            if b.validate(t, p, SM90) is None]  # fmt: skip
    assert gemv, f"no valid gemv tactic for {p}"
    low, high = GEMV_THREAD_BYTES
    for t in gemv:
        assert b.validate(t, p, SM90) is None
        assert t.tile_m == 1 << (m - 1).bit_length()
        assert low <= gemv_thread_bytes(t) <= high
        assert TritonSm90W4A16Tactic.model_validate_json(t.model_dump_json()) == t
        est = b.estimate_us(p, SM90, t)
        assert est is not None and est > 0
    pytest.importorskip("triton")
    for t in gemv:
        cfg = t.gemv_config()
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (t.tile_m, t.tile_n, t.tile_k)


def test_gemv_only_for_decode():
    b = TritonSm90W4A16Backend()
    p = Problem(m=GEMV_MAX_M + 1, n=8192, k=8192, operation="w4a16")
    assert not [t for t in b.tactics(p, SM90) if t.path == "gemv"]
    t = TritonSm90W4A16Tactic(path="gemv", tile_m=4, tile_n=16, tile_k=512, num_stages=1)
    assert "M=5" in why_invalid(t, p, SM90)


def test_gemv_and_direct_rules_keep_their_knobs_apart():
    p1 = Problem(m=1, n=8192, k=8192)
    gemv = dict(path="gemv", tile_m=1, tile_n=16, tile_k=512, num_stages=1)
    assert why_invalid(TritonSm90W4A16Tactic(**gemv), p1, SM90) is None
    # a gemv tile_m on the direct kernel, a direct tile on the gemv kernel
    assert "tile_m" in why_invalid(TritonSm90W4A16Tactic(tile_m=1), p1, SM90)
    for bad in ({"tile_n": 16}, {"tile_k": 512}, {"num_stages": 1}):
        assert "direct tiles" in why_invalid(TritonSm90W4A16Tactic(**bad), p1, SM90)
    assert "padded" in why_invalid(TritonSm90W4A16Tactic(**{**gemv, "tile_m": 2}), p1, SM90)
    assert "gemv:" in why_invalid(TritonSm90W4A16Tactic(**{**gemv, "tile_n": 128}), p1, SM90)
    assert "gemv:" in why_invalid(TritonSm90W4A16Tactic(**{**gemv, "num_stages": 3}), p1, SM90)
    # 16 x 1024 / 2 bytes over 8 warps = 32 per thread: fine; 64 rows x 1024 at 4 warps: 256
    wide = TritonSm90W4A16Tactic(**{**gemv, "tile_n": 64, "tile_k": 1024})
    assert "per thread" in why_invalid(wide, p1, SM90)
    tall = TritonSm90W4A16Tactic(**{**gemv, "split_k": 8, "tile_k": 512})
    assert "K steps" in why_invalid(tall, Problem(m=1, n=1024, k=4096), SM90)
    unpack = TritonSm90W4A16Tactic(path="unpack", tile_m=128, tile_n=128, tile_k=512)
    assert "unpack tile_k" in why_invalid(unpack, Problem(m=512, n=8192, k=8192), SM90)


def test_gemv_estimate_grows_with_tokens_and_pipeline():
    """The (unfitted) issue model: each token and the cp.async pipeline cost instructions
    (split_k=4: 2048 CTAs keep enough bytes in flight, so issue, not memory, bounds it);
    a grid too small to keep the bytes in flight is memory-bound (split_k=1: 512 CTAs)."""
    b = TritonSm90W4A16Backend()
    kw = dict(path="gemv", tile_n=16, tile_k=512, num_warps=4, split_k=4)
    ests = []
    for m in (1, 2, 4):
        p = Problem(m=m, n=8192, k=8192)
        tm = 1 << (m - 1).bit_length()
        ests.append(b.estimate_us(p, SM90, TritonSm90W4A16Tactic(tile_m=tm, num_stages=1, **kw)))
    assert ests[0] < ests[1] < ests[2], ests
    p = Problem(m=1, n=8192, k=8192)
    plain = b.estimate_us(p, SM90, TritonSm90W4A16Tactic(tile_m=1, num_stages=1, **kw))
    piped = b.estimate_us(p, SM90, TritonSm90W4A16Tactic(tile_m=1, num_stages=2, **kw))
    assert plain < piped
    small = TritonSm90W4A16Tactic(tile_m=1, num_stages=1, **{**kw, "split_k": 1})
    assert b.estimate_us(p, SM90, small) > plain


# ---- precompile: what a call launches is what precompile compiled (sm_90 on the CPU) ----

_PRECOMPILE = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.backends.sm90 import gemm_w4a16_decode as dec
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90 import PROFILE
from fp4_dispatch.plugins.sm90.w4a16 import TritonSm90W4A16Backend, TritonSm90W4A16Tactic
from fp4_dispatch.contracts.tactics import Problem


backend, dev = TritonSm90W4A16Backend(), PROFILE.device
cache = dec._w4a16_gemv_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90W4A16Tactic(**spec["tactic"])
    problem = Problem(m=spec["m"], n=spec["n"], k=spec["k"], out_dtype=spec["dtype"],
                      operation="w4a16")
    assert backend.validate(tactic, problem, dev) is None, spec
    before = len(cache)
    compiled = backend.precompile(tactic, problem, dev)
    after = len(cache)
    kernel = backend.build(tactic, problem, dev)
    dtype = getattr(torch, spec["dtype"])
    m, n, k = problem.m, problem.n, problem.k
    ops = DenseOperands(torch.zeros(m, k, dtype=dtype), torch.zeros(n, k // 2, dtype=torch.uint8),
                        torch.zeros(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                        torch.ones(1))
    res = torch.empty(m, n, dtype=dtype)
    compile_real_call(kernel, ops, res, k, dtype)
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "type": type(compiled).__name__}
print(json.dumps(out))
"""
)


def test_gemv_precompile_compiles_what_a_call_launches(tmp_path):
    """The gemv kernel compiles for sm_90 on a CPU without a launch (both stage settings,
    with and without split-K, a K tail, bf16 and fp16), and a real call's arguments hit
    the variant precompile made: nothing is left to JIT on first use."""
    pytest.importorskip("triton")
    gemv = {"path": "gemv", "tile_m": 1, "tile_n": 16, "tile_k": 512}
    cases = [
        {"name": "bf16-s1", "m": 1, "n": 512, "k": 1024, "dtype": "bfloat16",
         "tactic": {**gemv, "num_stages": 1}},
        {"name": "fp16-s2-splitk", "m": 2, "n": 512, "k": 4096, "dtype": "float16",
         "tactic": {**gemv, "tile_m": 2, "num_stages": 2, "split_k": 2}},
        {"name": "bf16-tail-m4", "m": 3, "n": 256, "k": 1056, "dtype": "bfloat16",
         "tactic": {**gemv, "tile_m": 4, "tile_n": 32, "tile_k": 256, "num_stages": 1}},
    ]  # fmt: skip
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _PRECOMPILE, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in cases:
        assert got[case["name"]] == {"new_by_precompile": 1, "new_by_real_args": 0,
                                     "type": "CompiledKernel"}, got  # fmt: skip


# ---- GPU (the PTX path; the lead runs these with -m gpu) -------------------------------


def gemv_space(m: int) -> list[TritonSm90W4A16Tactic]:
    """Every gemv tactic of the kernel's own choices for M tokens (one token tile)."""
    import itertools

    tm = 1 << (m - 1).bit_length()
    return [TritonSm90W4A16Tactic(path="gemv", tile_m=tm, tile_n=tn, tile_k=tk, split_k=sk,
                                  num_warps=w, num_stages=st)
            for tn, tk, sk, w, st in itertools.product(GEMV_TILE_N, GEMV_TILE_K, GEMV_SPLIT_K,
                                                       (4, 8), GEMV_STAGES)]  # fmt: skip


def _sm90_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_gemv_tactics_natural_and_prepared():
    """The estimate's 12 best gemv tactics of small decode shapes (M 1-4, a K tail, split-K),
    bf16 and fp16 activations, natural and prepared weights: within 1e-2 of float64 (the
    PTX nibble expansion, not the interpreter's twin), prepared bit-identical to natural."""
    import torch

    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
    from fp4_dispatch.contracts.device import detect
    from fp4_dispatch.format.nvfp4 import dequantize, quantize_nvfp4

    b = TritonSm90W4A16Backend()
    info = detect()
    for m, n, k in ((1, 320, 1024), (3, 200, 2112), (4, 4096, 4096)):
        g = torch.Generator().manual_seed(m + n + k)
        q = quantize_nvfp4(torch.randn(n, k, generator=g)).to("cuda")
        x32 = torch.randn(m, k, generator=g)
        w64 = dequantize(q.to("cpu")).double()
        prep = mod.prepare_weight(q.data) if k % 64 == 0 else None
        alpha = q.global_scale.reshape(1)
        p = Problem(m=m, n=n, k=k, operation="w4a16")
        # offered at M = 1 only; the kernel's rules (why_invalid) take up to GEMV_MAX_M
        gemv = [t for t in gemv_space(m) if why_invalid(t, p, info) is None]
        assert gemv, p
        for dtype in (torch.bfloat16, torch.float16):
            x = x32.to(dtype).cuda()
            ref = x.double().cpu() @ w64.T  # dequantize applies the global scale (alpha)
            for t in sorted(gemv, key=lambda t: b.estimate_us(p, info, t))[:12]:
                kern = b.build(t, p, info)
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                kern(mod.W4A16Operands(x, q.data, q.scale, alpha), out)
                err = float((out.double().cpu() - ref).norm() / ref.norm())
                assert err <= 1e-2, f"{t.canonical_json()} {dtype} {m}x{n}x{k}: {err}"
                if prep is not None:
                    out_p = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                    kern(mod.W4A16Operands(x, prep, q.scale, alpha, True), out_p)
                    assert torch.equal(out, out_p), f"{t.canonical_json()} {dtype}: prepared"
