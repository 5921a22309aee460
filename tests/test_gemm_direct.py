"""Tests of the Hopper backend: the Triton kernel under TRITON_INTERPRET=1, and the plugin.

The interpreter runs the same kernel with its element-wise dequantizer (the GPU build
uses a packed PTX one that computes the same bits; on the H200 every tactic that
``python -m benchmarks kernels --cases w4a4 --top 0`` times is checked against
float64). GPU tests run only with a CUDA device.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from conftest import run_interpreted

from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.contracts.device import CPU
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.format.nvfp4 import quantize_nvfp4, reference_gemm
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins import sm90
from fp4_dispatch.plugins.sm90 import TritonSm90Backend, TritonSm90Tactic, why_invalid

HAS_CUDA = torch.cuda.is_available()

SM90 = simulated("sm90")


def _operands(m: int, n: int, k: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g))
    b = torch.randn(n, k, generator=g)
    qa, qb = quantize_nvfp4(a), quantize_nvfp4(b)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    ts = [t.to(device) for t in (qa.data, qa.scale, qb.data, qb.scale, alpha)]
    return GemmOperands(*ts), reference_gemm(qa, qb)


def _ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element within ~1 ulp of the exact product (rounding + fp32 accumulation)."""
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite elements"
    bits = 8 if out.dtype == torch.bfloat16 else 11
    tol = ref.abs() * 2.0 ** (1 - bits) + ref.abs().max() * 1e-5
    err = (out.double().cpu() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


# The kernel runs under TRITON_INTERPRET=1 in a fresh interpreter: whether a @triton.jit
# function is interpreted is fixed when its module is imported, and other tests may have
# imported the kernel module already in this process.
_INTERPRETER_SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.backends.sm90 import gemm_direct as mod
from fp4_dispatch.format.nvfp4 import quantize_nvfp4, reference_gemm

assert not mod._USE_ASM, "TRITON_INTERPRET was not honoured"


def operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g))
    b = torch.randn(n, k, generator=g)
    qa, qb = quantize_nvfp4(a), quantize_nvfp4(b)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    return GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha), reference_gemm(qa, qb)


def worst(out, ref):
    # error over ~1 ulp of the output type (+ fp32 accumulation), NaN if unwritten
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    bits = 8 if out.dtype == torch.bfloat16 else 11
    tol = ref.abs() * 2.0 ** (1 - bits) + ref.abs().max() * 1e-5
    return float(((out.double() - ref).abs() / tol).max())


results = []
for m, n, k, cfg in json.loads(sys.argv[1]):
    kernel = mod.build(mod.KernelConfig(**cfg))
    for dtype in (torch.float16, torch.bfloat16):
        ops, ref = operands(m, n, k, seed=m * 1000 + n + k)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        mod.check_operands(ops, out)
        kernel(ops, out)
        out_t = torch.full((n, m), float("nan"), dtype=dtype)
        kernel(ops, out_t.t())  # what the dispatcher passes for swap_ab
        results.append([m, n, k, str(dtype), worst(out, ref), worst(out_t.t(), ref)])
# split-K: both calls reuse the kernel's one kept workspace, so the second call is right
# only if the last split of each tile reset its counter in the first (no memset per call)
kernel = mod.build(mod.KernelConfig(block_m=16, block_n=16, block_k=64, split_k=4))
handed = []
take = kernel._workspace
kernel._workspace = lambda *a: handed.append(take(*a)) or handed[-1]
for seed in (1, 2):
    ops, ref = operands(5, 24, 512, seed)
    out = torch.full((5, 24), float("nan"), dtype=torch.float16)
    kernel(ops, out)
    results.append([5, 24, 512, "split-k call %d" % seed, worst(out, ref), 0.0])
counters = sum(int(cnt.abs().sum()) for _, cnt in handed) if len(handed) == 2 else -1
kept = len(handed) == 2 and handed[0][1] is handed[1][1] and handed[0][0] is handed[1][0]
# alpha as two factors (GemmOperands.alpha_b): the same bits as the product passed whole
g = torch.Generator().manual_seed(7)
qa = quantize_nvfp4(torch.randn(3, 160, generator=g) * 3.7)
qb = quantize_nvfp4(torch.randn(72, 160, generator=g) / 5.3)
kernel = mod.build(mod.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=2))
whole, split = (torch.empty((3, 72), dtype=torch.bfloat16) for _ in range(2))
kernel(GemmOperands(qa.data, qa.scale, qb.data, qb.scale,
                    (qa.global_scale * qb.global_scale).reshape(1)), whole)
kernel(GemmOperands(qa.data, qa.scale, qb.data, qb.scale, qa.global_scale.reshape(1),
                    qb.global_scale.reshape(1)), split)
factors = [bool(torch.equal(whole, split)), float(qa.global_scale * qb.global_scale) != 1.0]
print(json.dumps({"results": results, "counters": counters, "kept": kept, "factors": factors}))
"""


@pytest.fixture(scope="module")
def interpreted():
    """Run every CASES entry (both dtypes, plain and transposed out) in the interpreter."""
    return run_interpreted(_INTERPRETER_SCRIPT, CASES)


# (m, n, k, config kwargs): tails in M, N and K, split-K, raster groups
CASES = [
    (1, 40, 96, dict(block_m=16, block_n=16, block_k=64)),
    (3, 72, 160, dict(block_m=16, block_n=32, block_k=128, split_k=2)),
    (33, 20, 256, dict(block_m=32, block_n=16, block_k=64, split_k=3)),
    (70, 48, 128, dict(block_m=16, block_n=16, block_k=64, group_m=2)),
    # wgmma-sized M tiles: both operands in the dot's byte order (DOT_ORDER), K tail
    (70, 24, 192, dict(block_m=64, block_n=16, block_k=64)),
    (5, 40, 160, dict(block_m=64, block_n=16, block_k=128, split_k=2)),
]


def test_interpreter_matches_reference_within_an_ulp(interpreted):
    rows = interpreted["results"]
    assert len(rows) == 2 * len(CASES) + 2
    for m, n, k, what, plain, transposed in rows:
        assert plain <= 1.0, f"{m}x{n}x{k} {what}: error {plain:.3g} ulp-tolerances"
        assert transposed <= 1.0, f"{m}x{n}x{k} {what} (out.T): error {transposed:.3g}"


def test_interpreter_alpha_factors_equal_the_whole_product(interpreted):
    equal, nontrivial = interpreted["factors"]
    assert nontrivial  # the scales' product is not 1: the second factor matters
    assert equal


def test_interpreter_split_k_counters_reset(interpreted):
    assert interpreted["counters"] == 0
    assert interpreted["kept"]  # one workspace for the kernel's life: no per-call allocation


def test_kernel_config_rejects_bad_blocks():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_direct import KernelConfig

    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(block_m=24, block_n=16, block_k=64)
    with pytest.raises(ValueError, match="block_k"):
        KernelConfig(block_m=16, block_n=16, block_k=32)


def test_check_operands_names_the_problem():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_direct import check_operands

    ops, _ = _operands(4, 8, 64, seed=3)
    with pytest.raises(ValueError, match="out: expected shape"):
        check_operands(ops, torch.empty(8, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_operands(ops, torch.empty(4, 8, dtype=torch.float32))


# ---- plugin ---------------------------------------------------------------------------


def test_supports_by_device():
    b = TritonSm90Backend()
    cpu = b.supports(CPU)
    # the reason names what is needed and what a user without the GPU can do (no test-only
    # hints such as TRITON_INTERPRET in user text)
    assert not cpu.ok and "9.x" in cpu.reason and "--device sm90" in cpu.reason
    assert "TRITON_INTERPRET" not in cpu.reason
    for other in ("sm100", "sm103", "sm107"):
        s = b.supports(simulated(other))
        assert not s.ok and "9.x" in s.reason
    ampere = SM90.model_copy(update={"compute_capability": (8, 0)})
    assert not b.supports(ampere).ok
    if importlib.util.find_spec("triton") is not None:
        assert b.supports(SM90).ok


def test_supports_without_triton_gives_install_hint(monkeypatch):
    sm90._triton_status.cache_clear()
    monkeypatch.setattr(sm90.importlib.util, "find_spec", lambda name: None)
    try:
        s = TritonSm90Backend().supports(SM90)
    finally:
        sm90._triton_status.cache_clear()
    assert not s.ok and "pip install '.[triton]' in the fp4-dispatch checkout" in s.reason


def test_plugin_module_imports_without_triton(monkeypatch):
    """The plugin must load where triton is absent (it is an optional extra)."""
    monkeypatch.setitem(sys.modules, "triton", None)  # any `import triton` now fails
    monkeypatch.delitem(sys.modules, "fp4_dispatch.plugins.sm90", raising=False)
    mod = importlib.import_module("fp4_dispatch.plugins.sm90")
    assert mod.TritonSm90Backend.name == "triton-sm90"
    monkeypatch.delitem(sys.modules, "fp4_dispatch.plugins.sm90", raising=False)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 8192, 8192), (16, 28672, 8192), (100, 8192, 8192), (4096, 8192, 28672), (3, 1000, 4160)],
)
def test_tactics_are_valid_modest_and_cover_axes(m, n, k):
    b = TritonSm90Backend()
    problem = Problem(m=m, n=n, k=k)
    tactics = list(b.tactics(problem, SM90))
    assert 10 <= len(tactics) <= 300
    assert len(set(tactics)) == len(tactics)
    for t in tactics:
        assert b.validate(t, problem, SM90) is None
        assert TritonSm90Tactic.model_validate_json(t.canonical_json()) == t
        est = b.estimate_us(problem, SM90, t)
        assert est is not None and 0 < est < 1e6
    assert {t.swap_ab for t in tactics} == {False, True}
    if m <= 16:  # decode shapes have fewer tiles than SMs: split-K must be offered
        assert any(t.split_k > 1 for t in tactics)


def test_validity_uses_the_swapped_problem():
    """128x16 tiles fit an M=1 problem only in the swapped orientation (8192 x 1)."""
    problem = Problem(m=1, n=8192, k=8192)
    t = TritonSm90Tactic(tile_m=128, tile_n=16, tile_k=128, swap_ab=True)
    assert why_invalid(t, problem, SM90) is None
    assert "does not fit" in why_invalid(t.model_copy(update={"swap_ab": False}), problem, SM90)
    assert "multiple of 32" in why_invalid(t, Problem(m=1, n=64, k=48), SM90)


def test_tactic_fields_are_typed():
    with pytest.raises(ValueError):
        TritonSm90Tactic(tile_m=96, tile_n=16)
    with pytest.raises(ValueError):
        TritonSm90Tactic(tile_m=64, tile_n=16, split_k=3)
    with pytest.raises(ValueError):
        TritonSm90Tactic(tile_m=64, tile_n=16, cluster_m=2)
    t = TritonSm90Tactic(tile_m=64, tile_n=16, split_k=4, swap_ab=True)
    assert json.loads(t.canonical_json())["backend"] == "triton-sm90"


def test_estimate_prefers_split_k_for_decode():
    """A 1 x 8192 x 8192 GEMM has 64 tiles of 128 outputs: split-K fills the 132 SMs."""
    b = TritonSm90Backend()
    p = Problem(m=1, n=8192, k=8192)
    best = min(b.tactics(p, SM90), key=lambda t: b.estimate_us(p, SM90, t))
    assert best.split_k > 1


# ---- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_every_tactic_small_shape():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs compute capability 9.x")
    from fp4_dispatch.contracts.device import detect

    b = TritonSm90Backend()
    info = detect()
    m, n, k = 3, 256, 1024
    ops, ref = _operands(m, n, k, seed=11, device="cuda")
    for t in b.tactics(Problem(m=m, n=n, k=k), info):
        kernel = b.build(t, Problem(m=m, n=n, k=k), info)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        if t.swap_ab:
            kernel(ops.swapped(), out.t())
        else:
            kernel(ops, out)
        _ulp_close(out, ref)


def test_misaligned_pointers_take_the_full_specialization_path():
    """Aligned calls launch by a short key (sizes, strides); a call with any pointer off
    16 bytes goes through the full specialization key, so it never reuses a binary
    compiled for aligned vector loads."""
    from fp4_dispatch.backends.sm90 import gemm_direct

    kernel = gemm_direct.build(gemm_direct.KernelConfig(block_m=16, block_n=16, block_k=64))
    seen: list[str] = []

    class Recorder:
        def launch_keyed(self, key, grid, args):
            seen.append("keyed")

        def __call__(self, grid, args):
            seen.append("full")

    kernel._bound = {False: Recorder(), True: Recorder()}
    ops, _ = _operands(2, 16, 64, seed=3)
    kernel(ops, torch.empty(2, 16, dtype=torch.bfloat16))
    wide = torch.empty(2 * 16 + 1, dtype=torch.bfloat16)
    kernel(ops, wide[1:].view(2, 16))  # out 2 bytes off alignment
    assert seen == ["keyed", "full"]
