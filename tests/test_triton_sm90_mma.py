"""``triton-sm90-mma``: the register-only W4A16 decode kernel (Gluon) and its backend.

Gluon kernels have no interpreter, so on the CPU these tests check the rules, the estimate
and the conformance kit's static checks, and compile the kernel for sm_90 (Triton's ptxas,
no launch); the numerics run on an sm90 GPU (``-m gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TARGET_ONLY, check_w4a16_kernel_on_gpu, run_interpreted

from fp4_dispatch.plugins.sm90.mma import (
    MMA_MAX_M,
    MMA_VARIANTS,
    TritonSm90MmaBackend,
    TritonSm90MmaTactic,
    residency,
    why_invalid,
)
from fp4_dispatch.profiles import rated, simulated
from fp4_dispatch.tactics import Problem
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
        MmaConfig(warps=2)
    with pytest.raises(ValueError, match="split_k: expected >= 1, got 0"):
        MmaConfig(split_k=0)
    with pytest.raises(ValueError, match="prefetch"):
        MmaConfig(prefetch=7)
    with pytest.raises(ValueError, match="unroll: expected one of"):
        MmaConfig(unroll=3)


def test_offered_for_up_to_8_tokens_with_work_for_every_warp():
    b = TritonSm90MmaBackend()
    ts = list(b.tactics(_w4a16(1, 8192, 8192), SM90))
    assert len(ts) == 8 and all(isinstance(t, TritonSm90MmaTactic) for t in ts)
    assert {(t.tile_m, t.tile_n, t.tile_k) for t in ts} == {(8, 16, 128)}
    assert {(t.num_warps, t.prefetch, t.unroll, t.split_k) for t in ts} == {
        (*v, s) for v in MMA_VARIANTS for s in (1, 2, 3, 4)
    }
    other = TritonSm90MmaTactic(num_warps=8, prefetch=2, unroll=2)
    assert "one of ((4, 0, 1), (4, 2, 2))" in why_invalid(other, _w4a16(1, 8192, 8192), SM90)
    assert list(b.tactics(_w4a16(MMA_MAX_M, 4096, 4096, "float16"), SM90))
    assert not list(b.tactics(_w4a16(MMA_MAX_M + 1, 8192, 8192), SM90))
    t = ts[0]
    assert "K=100" in why_invalid(t, _w4a16(1, 256, 100), SM90)
    assert "M=16" in why_invalid(t, _w4a16(16, 8192, 8192), SM90)
    # 384 K: 3 K steps; split 2 of 4 warps each leaves warps without a step; no split runs
    # (a warp idles, masked)
    split2 = TritonSm90MmaTactic(split_k=2)
    assert "8 > 3 K steps" in b.validate(split2, _w4a16(1, 4096, 384), SM90)
    assert b.validate(TritonSm90MmaTactic(), _w4a16(1, 4096, 384), SM90) is None


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
    + r"""
import collections, pathlib, re, subprocess
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
from fp4_dispatch.nvfp4 import swizzled_scale_shape

nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
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
    path = pathlib.Path(os.environ["TRITON_CACHE_DIR"]) / f"{spec['name']}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True,
                          text=True).stdout
    # the main loop: the longest backward branch
    labels, seq = {}, []
    for line in sass.splitlines():
        s = line.strip()
        lab = re.match(r"\.(L_x_\d+):", s)
        if lab:
            labels[lab.group(1)] = len(seq)
        ins = re.match(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;", s)
        if ins:
            seq.append(ins.group(1))
    body = []
    for i, ins in enumerate(seq):
        br = re.search(r"BRA[^`]*`\(\.(L_x_\d+)\)", ins)
        if br and labels.get(br.group(1), 1 << 30) <= i and i + 1 - labels[br.group(1)] > len(body):
            body = seq[labels[br.group(1)]: i + 1]
    ops_ = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for t in body)
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "loop": len(body), "hmma": ops_["HMMA"],
                         "loop_shared_or_barrier": ops_["LDS"] + ops_["STS"] + ops_["BAR"]
                                                   + ops_["LDSM"],
                         "spills": len(re.findall(r"\b(STL|LDL)\b", sass))}
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
    ]  # fmt: skip
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    for var in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        env.pop(var, None)
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

    assert abs(got["even"]["loop"] - STEP_INSTRUCTIONS) <= 4, got["even"]


_FALLBACK = r"""
import json, math, sys
import torch
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
from fp4_dispatch.harness import stress_nvfp4
from fp4_dispatch.nvfp4 import Nvfp4Tensor, dequantize

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
    ]  # fmt: skip


@pytest.mark.gpu
def test_kernel_on_the_gpu_matches_float64():
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as kern

    cases = _edge_cases()
    check_w4a16_kernel_on_gpu(lambda knobs: kern.build(kern.MmaConfig(**knobs)), cases)


@pytest.mark.gpu
def test_passes_the_conformance_kit_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    problems = [_w4a16(m, n, k) for m, n, k in ((1, 4096, 4096), (5, 1000, 2080))]
    report = check_backend(TritonSm90MmaBackend(), device="cuda", problems=problems)
    assert not report.failures, report.failures
    assert [c for c in report.of("numerics") if c.status == "PASS"], report.checks


def test_bench_w4a16_mma_smoke_runs_on_the_cpu(tmp_path):
    """The H200 benchmark's --smoke mode: the mma backend offers nothing under the
    interpreter; the W4A16 backend's candidates are checked against float64, the JSON
    written."""
    pytest.importorskip("triton")
    from test_w4a16_decode import _source_root

    root = _source_root()
    if root is None:
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_w4a16_mma.py"),
                           "--smoke"], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    got = json.loads((tmp_path / "w4a16_mma.json").read_text())
    assert got["smoke"] is True and got["shapes"]
    for row in got["shapes"]:
        assert {e["backend"] for e in row["tactics"].values()} == {"triton-sm90-w4a16"}, row
        assert not row["failed"] and row["dispatcher_err"] <= 1e-2, row
