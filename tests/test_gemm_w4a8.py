"""W4A8 (issue 34): the torch emulation of its roundings, the Triton kernels under
TRITON_INTERPRET=1 against it, the sm90 plugin's tactics, and the GPU check (marked gpu).

The interpreter multiplies float8 ``tl.dot`` operands exactly (checked below), so the
fused kernel and both passes run on the CPU; only ``torch._scaled_mm`` (cuBLASLt) of the
unpack path needs the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TARGET_ONLY, run_interpreted_split, sm90_compile_env

from fp4_dispatch.autotune.harness import CHECK_RTOL_LOSSY
from fp4_dispatch.backends.reference import w4a8 as ref
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.format.nvfp4 import (
    dequantize,
    e2m1_to_float,
    pack_e2m1,
    quantize_nvfp4,
    swizzle_scales,
    unpack_e2m1,
)
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.w4a8 import (
    FUSED_MAX_M,
    UNPACK_MIN_M,
    TritonSm90W4A8Backend,
    TritonSm90W4A8Tactic,
    why_invalid,
)

SM90 = simulated("sm90")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


# ---- the emulation ---------------------------------------------------------------------


def test_pow2_exponent_is_the_smallest_that_fits():
    vals = [0.0, 1e-40, 1e-30, 0.3, 1.0, 447.0, 448.0, 448.0001, 449.0, 896.0, 897.0,
            3.0e38, 6 * 448.0, 2.0**-5]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.tensor(vals), torch.rand(2000, generator=g) * 10.0 ** torch.randint(
        -30, 30, (2000,), generator=g).float()])  # fmt: skip
    e = ref.pow2_exponent(amax).double()
    a = amax.double()
    fits = a <= 448.0 * torch.exp2(e)
    tighter = a > 448.0 * torch.exp2(e - 1)
    clamped = e == ref.MIN_EXP
    assert bool(fits.all())
    assert bool((tighter | clamped).all())
    assert int(ref.pow2_exponent(torch.tensor([448.0]))) == 0
    assert int(ref.pow2_exponent(torch.tensor([448.5]))) == 1
    assert torch.equal(ref.pow2(torch.tensor([-126, 0, 3, 127])),
                       torch.tensor([2.0**-126, 1.0, 8.0, 2.0**127]))  # fmt: skip


def test_activation_codes_never_saturate_and_round_once():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 256, generator=g) * torch.logspace(-8, 8, 16)[:, None]).to(torch.bfloat16)
    q, s = ref.quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert bool((q.float().abs() <= 448).all())
    assert bool((q.float().abs().amax(dim=1) > 224).all())  # the range is used
    # the only rounding: E4M3 of x / s (scale a power of two), relative error <= 2**-4
    back = q.float() * s[:, None]
    big = x.float().abs() >= s[:, None] * 2.0**-6  # E4M3 normal range
    rel = ((back - x.float()).abs() / x.float().abs())[big]
    assert float(rel.max()) <= 2.0**-4
    assert torch.equal(torch.log2(s), torch.log2(s).round())


def test_weight_codes_per_channel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 128, generator=g)
    w[3] *= 1e-5  # a row of small values: a per-tensor scale would flush most of it
    qw = quantize_nvfp4(w)
    wq, sw = ref.weight_to_fp8(qw.data, qw.scale)
    exact = dequantize(qw) / qw.global_scale  # e2m1 * block scale
    assert bool((wq.float().abs() <= 448).all())
    back = wq.float() * sw[:, None]
    rel = float((back[3] - exact[3]).norm() / exact[3].norm())
    assert rel < 0.05, rel  # the small row keeps its values
    per_tensor = (exact[3] / 8).to(torch.float8_e4m3fn).float() * 8
    assert float((per_tensor - exact[3]).norm() / exact[3].norm()) > 0.5  # flushed
    # codes of one significand bit (0.5, 1, 2, 4) times a normal e4m3 scale are E4M3
    # values already (the channel scale is a power of two): kept exactly
    codes = torch.tensor([1, 2, 4, 6, 9, 10, 12, 14], dtype=torch.uint8)
    pick = torch.randint(0, 8, (4, 64), generator=g)
    data = pack_e2m1(codes[pick])
    lin = (torch.rand(4, 4, generator=g) * 100 + 0.1).to(torch.float8_e4m3fn)
    scale = swizzle_scales(lin)
    wq1, sw1 = ref.weight_to_fp8(data, scale)
    exact1 = e2m1_to_float(unpack_e2m1(data)).view(4, 4, 16) * lin.float()[:, :, None]
    assert torch.equal(wq1.float() * sw1[:, None], exact1.view(4, 64))


@pytest.mark.parametrize("kind", ["randn", "outliers"])
def test_w4a8_relative_error(kind):
    """The accuracy the README states (2.9-3.5% against float64 of the bf16 activations
    times the dequantized weight); W4A16 with a bf16 output is ~1.7e-3 there."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 64, 256, 2048
    x = torch.randn(m, k, generator=g)
    if kind == "outliers":
        x = x * torch.exp(torch.randn(k, generator=g))[None, :]
        x[:, :4] *= 50.0
    xb = x.to(torch.bfloat16)
    qw = quantize_nvfp4(torch.randn(n, k, generator=g) * 0.02)
    exact = xb.double() @ dequantize(qw).double().T
    out = torch.empty(m, n, dtype=torch.bfloat16)
    ref.gemm_w4a8(DenseOperands(xb, qw.data, qw.scale, qw.global_scale.reshape(1)), out)
    err = _rel(out, exact)
    assert 0.02 < err < 0.04, err
    assert err < CHECK_RTOL_LOSSY / 1.5  # the tuner's check keeps its headroom


# ---- the Triton kernels under the interpreter ---------------------------------------------

_SCRIPT = r"""
import json, sys
import torch
import triton, triton.language as tl
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.backends.reference import w4a8 as ref
from fp4_dispatch.backends.sm90 import gemm_w4a8 as g
from fp4_dispatch.autotune.harness import stress_nvfp4
from fp4_dispatch.format.nvfp4 import quantize_nvfp4

@triton.jit
def _bits(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(o_ptr + offs, g._e4m3_bits_rne(x), mask=offs < n)

@triton.jit
def _dot(a_ptr, b_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    ra, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(a_ptr + ra[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rn[:, None] * BK + rk[None, :])
    acc = tl.dot(a, tl.trans(b), tl.zeros((BM, BN), tl.float32), max_num_imprecise_acc=BK)
    tl.store(o_ptr + ra[:, None] * BN + rn[None, :], acc)

def case(c):
    kind = c["kind"]
    if kind == "round":
        # every E4M3 value, every midpoint (ties) and its float32 neighbours, randoms
        codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (codes[:-1] + codes[1:]) / 2
        near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)),
                          torch.nextafter(mids, torch.tensor(1e9))])
        gen = torch.Generator().manual_seed(0)
        rnd = torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-14, 9, (4000,),
                                                                          generator=gen).float())
        x = torch.cat([codes, near, rnd, torch.tensor([0.0, 1e-30, 447.9, 448.0])])
        x = torch.cat([x, -x]).contiguous()
        out = torch.empty(x.shape, dtype=torch.uint8)
        _bits[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
        want = x.to(torch.float8_e4m3fn).view(torch.uint8)
        return {"mismatch": int((out != want).sum()), "n": x.numel()}
    if kind == "dot":
        gen = torch.Generator().manual_seed(1)
        a = (torch.randn(16, 64, generator=gen) * 30).to(torch.float8_e4m3fn)
        b = (torch.randn(32, 64, generator=gen) * 30).to(torch.float8_e4m3fn)
        o = torch.empty(16, 32)
        _dot[(1,)](a, b, o, BM=16, BN=32, BK=64)
        want = a.double() @ b.double().T
        return {"rel": float((o.double() - want).abs().max() / want.abs().max())}
    m, n, k = c["m"], c["n"], c["k"]
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen))
    x = x.to(getattr(torch, c["dtype"]))
    if c.get("stress"):
        wd, ws = stress_nvfp4(n, k, torch.device("cpu"), gen)
        alpha = torch.tensor([0.01])
    else:
        qw = quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.02)
        wd, ws, alpha = qw.data, qw.scale, qw.global_scale.reshape(1)
    res = {}
    q, s = g.quantize_activations(x)
    rq, rs = ref.quantize_activations(x)
    res["act_bits"] = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    wq, sw = g.weight_to_fp8(wd, ws, alpha, c["block_r"], c["unpack_k"])
    rwq, rsw = ref.weight_to_fp8(wd, ws)
    res["w_bits"] = torch.equal(wq.view(torch.uint8), rwq.view(torch.uint8))
    res["w_scale"] = torch.equal(sw, rsw * alpha)
    bias = torch.randn(n, generator=gen).to(x.dtype) if c["bias"] else None
    ops = DenseOperands(x, wd, ws, alpha, bias=bias)
    out_dtype = getattr(torch, c["out"])
    want = torch.empty(m, n, dtype=out_dtype)
    ref.gemm_w4a8(ops, want)
    kern = g.build(g.W4A8Config(block_n=c["bn"], block_m=c["bm"], block_k=c["bk"],
                                split_k=c["split"]))
    outs = []
    for colmajor in (False, True):
        out = torch.full((n, m) if colmajor else (m, n), float("nan"), dtype=out_dtype)
        out = out.t() if colmajor else out
        for _ in range(2):  # the second call reuses the self-resetting split-K counters
            kern(ops, out)
        d = (out.double() - want.double())
        outs.append(float(d.norm() / want.double().norm()))
        res.setdefault("finite", True)
        res["finite"] = res["finite"] and bool(torch.isfinite(out).all())
    res["rel"] = max(outs)
    if c.get("unpack"):
        # the unpack path: the weight pass, then torch's (CPU) _scaled_mm, bf16 out
        want16 = torch.empty(m, n, dtype=torch.bfloat16)
        ref.gemm_w4a8(DenseOperands(x, wd, ws, alpha), want16)
        out16 = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        g.build_unpack(c["block_r"], c["unpack_k"])(DenseOperands(x, wd, ws, alpha), out16)
        res["unpack_rel"] = float((out16.double() - want16.double()).norm()
                                  / want16.double().norm())
    return res

print(json.dumps([{**case(c), "case": c} for c in json.loads(sys.argv[1])]))
"""

_GEMMS = [
    dict(kind="gemm", m=5, n=72, k=96, dtype="bfloat16", out="float32", bn=64, bm=16, bk=64,
         split=1, bias=True, block_r=16, unpack_k=128, unpack=True),
    dict(kind="gemm", m=33, n=128, k=256, dtype="float16", out="float16", bn=128, bm=32,
         bk=128, split=2, bias=False, block_r=32, unpack_k=256),
    dict(kind="gemm", m=17, n=64, k=160, dtype="bfloat16", out="float32", bn=64, bm=16, bk=64,
         split=3, bias=True, block_r=64, unpack_k=128, stress=True, unpack=True),
]  # fmt: skip
#: relative error against the emulation by output dtype: float32 sums in another order
#: (~1e-7); fp16's rounding of a value the emulation rounds from float64 (ties apart).
#: No bf16 output here: the interpreter converts float32 to bf16 by truncation (the GPU
#: rounds to nearest even, `test_w4a8_kernels_on_gpu_match_the_emulation`)
_TOL = {"float32": 1e-6, "float16": 1e-3}


def test_kernels_under_the_interpreter_match_the_emulation():
    cases = [{"kind": "round"}, {"kind": "dot"}, *_GEMMS]
    by_case = {json.dumps(r.pop("case"), sort_keys=True): r
               for r in run_interpreted_split(_SCRIPT, cases)}  # fmt: skip
    rounding, dot, *gemms = (by_case[json.dumps(c, sort_keys=True)] for c in cases)
    assert rounding["mismatch"] == 0 and rounding["n"] > 4000, rounding
    assert dot["rel"] < 1e-6, dot  # float8 products exact, summed in float32
    for case, r in zip(_GEMMS, gemms, strict=True):
        assert r["act_bits"] and r["w_bits"] and r["w_scale"], (case, r)
        assert r["finite"], (case, r)
        assert r["rel"] < _TOL[case["out"]], (case, r)
        if case.get("unpack"):  # bf16 out: an ulp apart where fp32 sums round differently
            assert r["unpack_rel"] < 4e-3, (case, r)


_COMPILE = r"""
import re

from fp4_dispatch.backends.sm90 import gemm_w4a8 as g


def longest_loop(ptx):
    # PTX instructions in the longest loop Triton marks (its header comment to its branch)
    lines, best = ptx.splitlines(), 0
    for head in (i for i, x in enumerate(lines) if "Loop Header" in x):
        tail = next(i for i in range(head, len(lines)) if " bra" in lines[i])
        body = [x.strip() for x in lines[head + 1 : tail]]
        best = max(best, sum(1 for x in body if x and x[0].isalpha() or x.startswith("@")))
    return best


res = {}
for bn, bm, split in ((128, 64, 1), (64, 16, 4)):
    ck = g.build(g.W4A8Config(block_n=bn, block_m=bm, split_k=split)).precompile(
        256, 5120, 5120, torch.bfloat16)
    ptx = ck.asm["ptx"]
    res[f"{bn}x{bm}"] = {"wgmma": ptx.count("wgmma.mma_async"), "cvt": "e4m3x2" in ptx,
                         "cubin": len(ck.asm["cubin"]), "loop": longest_loop(ptx),
                         "imprecise": sorted({int(v) for v in re.findall(
                             r"warp_group_dot .*maxNumImpreciseAcc = (\d+)", ck.asm["ttgir"])})}
g.build_unpack(32, 128).precompile(256, 5120, 5120, torch.bfloat16)
wk = g.build_unpack(16, 256).precompile(256, 13824, 5120, torch.bfloat16)
res["weight_loop"] = longest_loop(wk.asm["ptx"])
print(json.dumps(res))
"""


def test_compiles_for_sm90_to_fp8_wgmma(tmp_path):
    """The fused kernel (a prefill and a split-K decode tile) and the unpack path's
    passes compile for sm_90 on the CPU (Triton's ptxas): FP8 wgmma, and the rounding to
    E4M3 is the conversion instruction (``cvt.rn.satfinite.e4m3x2``), not the
    interpreter's integer twin; the weight pass's loop stays short. And what
    docs/PRECISION.md says of the fused kernel's accumulation: Triton splits its dot and
    compiles every part with ``max_num_imprecise_acc = 2**30`` (no promotion), though
    the kernel asks for one K step; a Triton that keeps the promotion fails here, and
    that paragraph is to be revised."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", TARGET_ONLY + _COMPILE], capture_output=True,
                          text=True, env=sm90_compile_env(tmp_path), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the unpack pass's loop at a 16 x 256 tile (32 elements a thread): 269 PTX
    # instructions with the paired conversion, 663 with the fp32 expansion before it
    # (docs/PRECISION.md); an edit that brings the expansion back fails here
    loop = got.pop("weight_loop")
    assert 100 < loop <= 320, loop
    # the fused kernel's K step expands in bf16 pairs too: 864 PTX instructions at 128x64
    # and 462 at 64x16 (Triton 3.9), 2,203 and 1,433 with the fp32 expansion before it
    for tile, row in got.items():
        assert row["wgmma"] > 0 and row["cvt"] and row["cubin"] > 1000, (tile, row)
        assert row["imprecise"] == [2**30], (tile, row)  # docs/PRECISION.md, "Accumulation"
    assert 200 < got["128x64"]["loop"] <= 1100 and got["64x16"]["loop"] <= 600, got


# ---- the plugin ----------------------------------------------------------------------------


def test_tactics_paths_and_rules():
    b = TritonSm90W4A8Backend()
    assert b.operations == ("w4a8",)
    small = list(b.tactics(Problem(m=16, n=5120, k=5120, operation="w4a8"), SM90))
    large = list(b.tactics(Problem(m=4096, n=5120, k=5120, operation="w4a8"), SM90))
    assert small and {t.path for t in small} == {"fused"}
    assert large and {t.path for t in large} == {"unpack", "rs"}
    mid = {t.path for t in b.tactics(Problem(m=512, n=5120, k=5120, operation="w4a8"), SM90)}
    assert mid == {"fused", "unpack", "rs"}
    assert FUSED_MAX_M >= 512 >= UNPACK_MIN_M
    for t in small + large:
        assert not t.swap_ab
        assert b.validate(t, Problem(m=16 if t in small else 4096, n=5120, k=5120,
                                     operation="w4a8"), SM90) is None  # fmt: skip
    fp16 = Problem(m=4096, n=5120, k=5120, out_dtype="float16", operation="w4a8")
    # no unpack (bf16 only), no fused past 1024: the rs kernel only
    assert {t.path for t in b.tactics(fp16, SM90)} == {"rs"}
    unpack = TritonSm90W4A8Tactic(path="unpack", tile_m=128, tile_n=128, tile_k=128)
    assert "bfloat16" in why_invalid(unpack, fp16, SM90)
    assert "multiple of 32" in why_invalid(unpack, Problem(m=256, n=64, k=48), SM90)
    large = [t for t in large if t.path == "unpack"]
    est = [b.estimate_us(Problem(m=m, n=5120, k=5120, operation="w4a8"), SM90, t)
           for m, t in ((16, small[0]), (4096, large[0]))]  # fmt: skip
    assert all(e > 0 for e in est) and est[1] > est[0]


def test_unsupported_without_hopper():
    from fp4_dispatch.contracts.device import CPU

    assert not TritonSm90W4A8Backend().supports(CPU)
    assert not TritonSm90W4A8Backend().supports(simulated("sm100"))


# ---- on the GPU (the lead's H200 run) ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fused", "unpack"])
def test_w4a8_kernels_on_gpu_match_the_emulation(path):
    """Both paths on an sm90 GPU against the emulation (fp32 accumulation order and the
    output's rounding only), stress weights included, twice per call (split-K counters)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from fp4_dispatch.autotune.harness import stress_nvfp4
    from fp4_dispatch.backends.sm90 import gemm_w4a8 as g

    dev = torch.device("cuda")
    for m, n, k in ((1, 5120, 5120), (64, 13824, 5120), (300, 3584, 18944), (1024, 4096, 4096)):
        gen = torch.Generator(device=dev).manual_seed(m + n)
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        wd, ws = stress_nvfp4(n, k, dev, gen)
        alpha = torch.tensor([1.0 / k], device=dev)
        ops = DenseOperands(x, wd, ws, alpha)
        want = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        ref.gemm_w4a8(ops, want)
        if path == "fused":
            kern = g.build(g.W4A8Config(block_n=128, block_m=64 if m > 16 else 16,
                                        split_k=1 if m > 16 else 4))  # fmt: skip
        else:
            kern = g.build_unpack(32, 128)
        for _ in range(2):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            kern(ops, out)
            assert _rel(out, want.double()) < 4e-3, (path, m, n, k)


@pytest.mark.parametrize(("n", "k", "block_r", "block_k"),
                         [(13824, 5120, 32, 128), (3584, 18944, 16, 256), (72, 96, 16, 128),
                          (4096, 4096, 64, 128), (64, 160, 64, 128)])  # fmt: skip
def test_unpack_grid_spans_cover_k_once(n, k, block_r, block_k):
    """The weight pass's K spans cover every K tile exactly once, none is empty, and a
    large weight gets about `UNPACK_PROGRAMS` programs (the pass was latency-bound with
    one program per row block)."""
    g = pytest.importorskip("fp4_dispatch.backends.sm90.gemm_w4a8")
    (rows, spans), per = g.unpack_grid(n, k, block_r, block_k)
    k_tiles = -(-k // block_k)
    assert rows == -(-n // block_r)
    covered = [t for s in range(spans) for t in range(s * per, min((s + 1) * per, k_tiles))]
    assert covered == list(range(k_tiles))
    assert (spans - 1) * per < k_tiles  # the last span is not empty
    if rows * k_tiles >= g.UNPACK_PROGRAMS:
        assert g.UNPACK_PROGRAMS // 2 <= rows * spans <= 2 * g.UNPACK_PROGRAMS
