"""``triton-sm90-ws``: the warp-specialized W4A16 kernel (Gluon) and its backend.

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
    TARGET_ONLY,
    check_w4a16_kernel_on_gpu,
    run_interpreted,
    sm90_compile_env,
)

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import rated, simulated
from fp4_dispatch.plugins.sm90.ws import (
    WS_MAX_M,
    WS_MIN_M,
    TritonSm90WsBackend,
    TritonSm90WsTactic,
    why_invalid,
)
from fp4_dispatch.testing import check_backend

SM90 = rated(simulated("sm90"))


def _w4a16(m: int, n: int, k: int, dtype: str = "bfloat16") -> Problem:
    return Problem(m=m, n=n, k=k, out_dtype=dtype, operation="w4a16")


def test_config_names_the_bad_knob():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16_ws import WsConfig

    with pytest.raises(ValueError, match="block_m: expected one of"):
        WsConfig(block_m=48)
    with pytest.raises(ValueError, match="split_k: expected >= 1, got 0"):
        WsConfig(split_k=0)
    with pytest.raises(ValueError, match="deq_parts"):
        WsConfig(deq_parts=4)


def test_offered_for_32_to_256_bf16_tokens_within_one_wave():
    b = TritonSm90WsBackend()
    ts = list(b.tactics(_w4a16(64, 8192, 8192), SM90))
    assert ts and all(isinstance(t, TritonSm90WsTactic) for t in ts)
    # 64 tokens: 32- and 64-token tiles; 64 weight-row tiles x split stays within 132 SMs
    assert {t.tile_m for t in ts} == {32, 64}
    assert {(t.tile_n, t.tile_k, t.num_stages, t.num_warps) for t in ts} == {(128, 64, 4, 4)}
    assert {t.split_k for t in ts if t.tile_m == 64} == {1, 2}
    assert not list(b.tactics(_w4a16(WS_MIN_M - 1, 8192, 8192), SM90))
    assert not list(b.tactics(_w4a16(WS_MAX_M + 1, 8192, 8192), SM90))
    assert not list(b.tactics(_w4a16(64, 8192, 8192, "float16"), SM90))
    t = ts[0]
    assert "K=100" in why_invalid(t, _w4a16(64, 256, 100), SM90)
    assert "measured range" in why_invalid(t, _w4a16(16, 8192, 8192), SM90)
    big = TritonSm90WsTactic(tile_m=64, split_k=4)
    assert "beyond 1 CTAs per SM (64 tiles x 4 > 132)" in b.validate(
        big, _w4a16(64, 8192, 8192), SM90
    )


def test_not_offered_under_the_interpreter(monkeypatch):
    b = TritonSm90WsBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = b.supports(SM90)
    assert not s.ok and "TRITON_INTERPRET" in s.reason
    monkeypatch.delenv("TRITON_INTERPRET")
    assert b.supports(SM90).ok or "triton" in b.supports(SM90).reason


def test_estimate_charges_a_second_wave():
    """One CTA an SM: 132 tiles of 128 rows fill the H200 once, 133 need a second round
    for one CTA (RESULTS.md "Hopper W4A16" run 6: 256x10240x8192, 160 CTAs, ran 2.0x the
    time of 256x8192x8192 with 128)."""
    b = TritonSm90WsBackend()
    t = TritonSm90WsTactic(tile_m=128, split_k=1)
    one = b.estimate_us(_w4a16(128, 132 * 128, 4096), SM90, t)
    two = b.estimate_us(_w4a16(128, 133 * 128, 4096), SM90, t)
    assert two > 1.7 * one, (one, two)


def test_passes_the_conformance_kit_on_the_simulated_part():
    problems = [_w4a16(m, n, k) for m, n, k in ((64, 4096, 4096), (200, 5120, 2080))]
    report = check_backend(TritonSm90WsBackend(), device="sm90", problems=problems)
    assert not report.failures, report.failures
    assert report.passed


_COMPILE = (
    TARGET_ONLY
    + r"""
import pathlib, re, subprocess
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_ws as ws
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90.ws import TritonSm90WsBackend, TritonSm90WsTactic
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.contracts.tactics import Problem

backend, dev = TritonSm90WsBackend(), simulated("sm90")
nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
cache = ws._w4a16_ws_kernel.device_caches[0][0]
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90WsTactic(**spec["tactic"])
    m, n, k = spec["m"], spec["n"], spec["k"]
    problem = Problem(m=m, n=n, k=k, operation="w4a16")
    assert backend.validate(tactic, problem, dev) is None, spec
    before = len(cache)
    compiled = backend.precompile(tactic, problem, dev)
    after = len(cache)
    kernel = backend.build(tactic, problem, dev)
    seen = []
    kernel._launch = lambda grid, args, key, tensors: seen.append((grid, args))
    ops = w4.W4A16Operands(torch.zeros(m, k, dtype=torch.bfloat16),
                           torch.zeros(n, k // 2, dtype=torch.uint8),
                           torch.zeros(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                           torch.ones(1))
    kernel(ops, torch.empty(m, n, dtype=torch.bfloat16))
    (grid, args), = seen
    kernel._binding().warmup(grid, args)
    path = pathlib.Path(os.environ["TRITON_CACHE_DIR"]) / f"{spec['name']}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True,
                          text=True).stdout
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "hgmma": len(re.findall(r"HGMMA", sass)),
                         "spills": len(re.findall(r"\b(STL|LDL)\b", sass)),
                         "shared": compiled.metadata.shared}
print(json.dumps(out))
"""
)


def test_compiles_for_sm90_and_precompile_matches_a_call(tmp_path):
    """The kernel compiles for sm_90 on a CPU (Triton's ptxas, no launch) for each token
    tile, with split-K and a K tail: wgmma in the SASS, no register spills, shared memory
    within the 227 KiB of a CTA; and a real call's arguments hit the variant precompile
    made (meta-tensor descriptors), so nothing is left to JIT on first use.

    With Triton's own ptxas (what the H200 runs used): importing FlashInfer points
    Triton's sm_90+ compiles at the system's ptxas (``TRITON_PTXAS_BLACKWELL_PATH``),
    and CUDA 13.0's spills the 128-token tile (134 STL/LDL) where 12.9's does not."""
    pytest.importorskip("triton")
    specs = [
        {"name": "m64", "m": 64, "n": 4096, "k": 4096, "tactic": {"tile_m": 64, "split_k": 1}},
        {"name": "m256-split2", "m": 256, "n": 4096, "k": 8192,
         "tactic": {"tile_m": 128, "split_k": 2}},
        {"name": "k-tail", "m": 40, "n": 200, "k": 2080, "tactic": {"tile_m": 32, "split_k": 3}},
    ]  # fmt: skip
    env = sm90_compile_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(specs)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {s["name"] for s in specs}, got
    for name, row in got.items():
        assert row["new_by_precompile"] == 1 and row["new_by_real_args"] == 0, (name, row)
        assert row["hgmma"] > 0 and row["spills"] == 0, (name, row)
        assert row["shared"] <= 227 * 1024, (name, row)


def _edge_cases() -> list[tuple[int, int, int, dict, str, bool, bool]]:
    """(M, N, K, WsConfig knobs, dtype, bias, column-major out): tails of M, N and K
    (K % 64 == 32: NaN in the padded scales must not leak), split-K with an empty last
    split, each token tile."""
    return [
        (50, 200, 96, {"block_m": 32}, "bfloat16", True, False),
        (130, 384, 1024, {"block_m": 128, "split_k": 3}, "bfloat16", False, True),
        (64, 4096, 4160, {"block_m": 64, "split_k": 2}, "bfloat16", True, False),
        (7, 640, 2080, {"block_m": 16, "split_k": 4}, "bfloat16", False, False),
        (256, 1024, 192, {"block_m": 128, "split_k": 4}, "bfloat16", False, False),
    ]


@pytest.mark.gpu
def test_kernel_on_the_gpu_matches_float64():
    from fp4_dispatch.backends.sm90 import gemm_w4a16_ws as kern

    cases = _edge_cases()
    check_w4a16_kernel_on_gpu(lambda knobs: kern.build(kern.WsConfig(**knobs)), cases)


@pytest.mark.gpu
def test_passes_the_conformance_kit_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    problems = [_w4a16(m, n, k) for m, n, k in ((64, 4096, 4096), (200, 1536, 2112))]
    report = check_backend(TritonSm90WsBackend(), device="cuda", problems=problems)
    assert not report.failures, report.failures
    assert [c for c in report.of("numerics") if c.status == "PASS"], report.checks


def test_launch_key_separates_descriptor_specializations():
    """`triton_launch.specialization_key` on host TMA descriptors: equal for descriptors
    that share dtype, block, layout and the sizes' divisibility (one compiled binary),
    different when any of those differs (a binary compiled for one is never reused)."""
    pytest.importorskip("triton")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4_dispatch.backends.triton_launch import specialization_key

    lay = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)

    def desc(rows: int, cols: int, block=(64, 64), dtype=torch.bfloat16) -> object:
        t = torch.empty((rows, cols), dtype=dtype)
        return TensorDescriptor(t, [rows, cols], [cols, 1], list(block), lay)

    base = specialization_key([desc(64, 256), 3])
    assert specialization_key([desc(128, 512), 3]) == base  # sizes both % 16 == 0
    assert specialization_key([desc(72, 256), 3]) != base  # 72 % 16 != 0
    assert specialization_key([desc(64, 256, block=(32, 64)), 3]) != base
    assert specialization_key([desc(64, 256, dtype=torch.float16), 3]) != base


_FALLBACK = r"""
import json, math, sys
import torch
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_ws as ws
from fp4_dispatch.autotune.harness import stress_nvfp4
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize

out = {}
for name, m, n, k, act, stride in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(m + n + k)
    big = torch.randn((m, stride), generator=gen).to(getattr(torch, act))
    x = big[:, :k]  # row stride `stride` (elements)
    wd, wsc = stress_nvfp4(n, k, torch.device("cpu"), gen)
    alpha = torch.tensor([1.0 / (8 * math.sqrt(k))])
    ref = (x.double() @ dequantize(Nvfp4Tensor(wd, wsc, torch.ones(()), "swizzled",
                                               (n, k))).double().T) * float(alpha)
    res = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    ws.build(ws.WsConfig(block_m=64))(w4.W4A16Operands(x, wd, wsc, alpha), res)
    out[name] = float((res.double() - ref).norm() / ref.norm())
print(json.dumps(out))
"""


def test_inputs_the_kernel_cannot_read_run_the_direct_kernel():
    """What TMA cannot read (`check_tma`: fp16 activations with a bf16 output, as
    `Dispatcher.gemm(x16, w, out_dtype=bf16)` passes them; a row stride that is no
    multiple of 16 bytes) runs the direct kernel (here under the interpreter, fp16: it
    mishandles bf16 dots) instead of raising: a raised error would mark the tactic
    broken for every later call."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16_ws import check_tma

    assert "bfloat16" in check_tma(torch.zeros(4, 64, dtype=torch.float16))
    odd = torch.zeros(4, 131, dtype=torch.bfloat16)[:, :128]
    assert "multiple of 8 elements" in check_tma(odd)
    assert check_tma(torch.zeros(4, 136, dtype=torch.bfloat16)[:, :128]) is None
    cases = [("fp16", 40, 96, 256, "float16", 256), ("fp16-strided", 24, 64, 128, "float16", 131)]
    got = run_interpreted(_FALLBACK, cases)
    assert set(got) == {"fp16", "fp16-strided"}, got
    assert all(err <= 1e-2 for err in got.values()), got
