"""Dispatcher.gemm / mm_fp4 on the CPU: results, and a clear error for every bad input."""

from __future__ import annotations

import pytest
import torch

from fp4_dispatch import Dispatcher, dequantize, quantize_nvfp4, reference_gemm

FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


@pytest.fixture(scope="module")
def dispatcher():
    return Dispatcher(device="cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 64), (37, 96, 128), (130, 40, 256)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_gemm_matches_reference(dispatcher, operands, m, n, k, out_dtype):
    qa, qb = operands(m, n, k, seed=m + n)
    out = dispatcher.gemm(qa, qb, out_dtype=out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert rel_err(out, reference_gemm(qa, qb)) < 5e-3


def test_gemm_into_out_and_linear_layout(dispatcher, operands):
    qa, qb = operands(20, 48, 64)
    out = torch.full((20, 48), float("nan"), dtype=torch.bfloat16)
    got = dispatcher.gemm(qa.with_layout("linear"), qb, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any()
    assert rel_err(out, reference_gemm(qa, qb)) < 5e-3


def flashinfer_args(qa, qb):
    """a, b (transposed view), swizzled descales, alpha: FlashInfer's mm_fp4 convention."""
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    return qa.data, qb.data.T, qa.scale, qb.scale, alpha


def test_mm_fp4_matches_gemm(dispatcher, operands):
    qa, qb = operands(33, 64, 96)
    out = dispatcher.mm_fp4(*flashinfer_args(qa, qb))
    assert torch.equal(out, dispatcher.gemm(qa, qb))


@pytest.mark.skipif(FP4X2 is None, reason="torch without float4_e2m1fn_x2")
def test_mm_fp4_accepts_float4_dtype_and_flat_scales(dispatcher, operands):
    qa, qb = operands(8, 32, 64)
    a, b, sa, sb, alpha = flashinfer_args(qa, qb)
    out = dispatcher.mm_fp4(a.view(FP4X2), b.T.view(FP4X2).T, sa.flatten(), sb.flatten(), alpha)
    assert rel_err(out, reference_gemm(qa, qb)) < 5e-3


def test_select_returns_an_available_backend(dispatcher):
    cand = dispatcher.select(100, 256, 512)
    assert cand.backend in {b.name for b in dispatcher.available}
    assert cand.tactic.backend == cand.backend


def test_simulated_device_runs_nothing(operands):
    qa, qb = operands(4, 32, 64)
    with pytest.raises(RuntimeError, match="simulated"):
        Dispatcher(device="sm100").gemm(qa, qb)


# ---- bad input: every case names the argument, and nothing is written to `out` ---------

M, N, K = 16, 32, 64


def good():
    g = torch.Generator().manual_seed(1)
    qa = quantize_nvfp4(torch.randn(M, K, generator=g))
    qb = quantize_nvfp4(torch.randn(N, K, generator=g))
    return qa, qb


def inference_copy(t):
    with torch.inference_mode():
        return t.clone()


def q_other_k():
    return quantize_nvfp4(torch.randn(N, 2 * K))


def q_k48():
    return quantize_nvfp4(torch.randn(M, 48))


def meta_like(t):
    return torch.empty_like(t, device="meta")


class Call:
    """Good arguments for both entry points; each bad case overrides one of them."""

    def __init__(self, d):
        self.d = d
        self.qa, self.qb = good()
        self.a, self.b, self.sa, self.sb, self.alpha = flashinfer_args(self.qa, self.qb)
        self.out = torch.full((M, N), 7.0, dtype=torch.bfloat16)

    def gemm(self, **kw):
        args = {"qa": self.qa, "qb": self.qb, "out_dtype": torch.bfloat16, "out": None} | kw
        return self.d.gemm(**args)

    def mm(self, **kw):
        args = {"a": self.a, "b": self.b, "a_descale": self.sa, "b_descale": self.sb}
        return self.d.mm_fp4(**(args | {"alpha": self.alpha} | kw))


BF16 = torch.bfloat16
# (label, call, exception, text the message must contain)
GEMM_CASES = [
    ("qa not Nvfp4Tensor", lambda c: c.gemm(qa=torch.zeros(M, K)), TypeError, "qa"),
    ("qb not Nvfp4Tensor", lambda c: c.gemm(qb="w"), TypeError, "qb"),
    ("out_dtype float32", lambda c: c.gemm(out_dtype=torch.float32), TypeError, "out_dtype"),
    ("out_dtype string", lambda c: c.gemm(out_dtype="bf16"), TypeError, "out_dtype"),
    ("K mismatch", lambda c: c.gemm(qb=q_other_k()), ValueError, "K must match"),
    ("K % 32", lambda c: c.gemm(qa=q_k48(), qb=q_k48()), ValueError, "multiple of 32"),
    ("out shape", lambda c: c.gemm(out=c.out[:, :-1]), ValueError, "out: expected shape"),
    (
        "out dtype",
        lambda c: c.gemm(out_dtype=torch.float16, out=c.out),
        TypeError,
        "out: expected dtype",
    ),
    ("out not a tensor", lambda c: c.gemm(out=[1]), TypeError, "out"),
    ("out strided", lambda c: c.gemm(out=torch.empty(N, M, dtype=BF16).T), ValueError, "contig"),
    ("out device", lambda c: c.gemm(out=meta_like(c.out)), ValueError, "out: expected a tensor"),
    ("qa device", lambda c: c.gemm(qa=c.qa.to("meta")), ValueError, "qa"),
    ("qb device", lambda c: c.gemm(qb=c.qb.to("meta")), ValueError, "qb"),
    (
        "out requires grad",
        lambda c: c.gemm(out=c.out.clone().requires_grad_()),
        ValueError,
        "out: expected a tensor that does not require grad",
    ),
    (
        "out inference",
        lambda c: c.gemm(out=inference_copy(c.out)),
        ValueError,
        "out: expected a normal tensor",
    ),
    (
        "qa dense on meta",
        lambda c: c.gemm(qa=torch.empty(M, K, dtype=BF16, device="meta")),
        ValueError,
        "qa: expected a tensor on",
    ),
]
MM_CASES = [
    ("a float", lambda c: c.mm(a=c.a.float()), TypeError, "a: expected dtype"),
    ("b int32", lambda c: c.mm(b=c.b.int()), TypeError, "b: expected dtype"),
    ("a list", lambda c: c.mm(a=c.a.tolist()), TypeError, "a: expected a torch.Tensor"),
    ("a 3-D", lambda c: c.mm(a=c.a[None]), ValueError, "a: expected a 2-D"),
    ("b row-major", lambda c: c.mm(b=c.b.contiguous()), ValueError, "transposed view"),
    (
        "a strided",
        lambda c: c.mm(a=torch.cat([c.a, c.a], 1)[:, ::2]),
        ValueError,
        "a: expected a contiguous",
    ),
    ("K mismatch", lambda c: c.mm(a=c.a[:, :16].contiguous()), ValueError, "K must match"),
    ("a_descale dtype", lambda c: c.mm(a_descale=c.sa.float()), TypeError, "a_descale: expected"),
    (
        "b_descale dtype",
        lambda c: c.mm(b_descale=c.sb.view(torch.uint8)),
        TypeError,
        "b_descale: expected dtype",
    ),
    (
        "a_descale linear",
        lambda c: c.mm(a_descale=c.qa.linear_scale()),
        ValueError,
        "a_descale: expected the swizzled",
    ),
    (
        "b_descale rows",
        lambda c: c.mm(b_descale=c.sb[:, :2].contiguous()),
        ValueError,
        "b_descale: expected the swizzled",
    ),
    (
        "a_descale strided",
        lambda c: c.mm(a_descale=torch.cat([c.sa, c.sa], 1)[:, ::2]),
        ValueError,
        "a_descale: expected a contiguous",
    ),
    ("alpha float64", lambda c: c.mm(alpha=c.alpha.double()), TypeError, "alpha: expected dtype"),
    ("alpha 2 elems", lambda c: c.mm(alpha=c.alpha.repeat(2)), ValueError, "alpha: expected one"),
    ("alpha float", lambda c: c.mm(alpha=1.0), TypeError, "alpha"),
    ("alpha device", lambda c: c.mm(alpha=c.alpha.to("meta")), ValueError, "alpha: expected a"),
    ("b device", lambda c: c.mm(b=c.b.to("meta")), ValueError, "b: expected a tensor on cpu"),
    ("out shape", lambda c: c.mm(out=c.out.T.contiguous()), ValueError, "out: expected shape"),
    ("out dtype", lambda c: c.mm(out=c.out.half()), TypeError, "out: expected dtype"),
    ("out_dtype int8", lambda c: c.mm(out_dtype=torch.int8), TypeError, "out_dtype"),
    (
        "a_descale list",
        lambda c: c.mm(a_descale=c.sa.tolist()),
        TypeError,
        "a_descale: expected a torch.Tensor",
    ),
    (
        "b_descale list",
        lambda c: c.mm(b_descale=[1.0]),
        TypeError,
        "b_descale: expected a torch.Tensor",
    ),
    ("out list", lambda c: c.mm(out=[0.0]), TypeError, "out: expected a torch.Tensor"),
    ("b list", lambda c: c.mm(b=[[0]]), TypeError, "b: expected a torch.Tensor"),
]
CASES = GEMM_CASES + MM_CASES


@pytest.mark.parametrize(("label", "call", "exc", "text"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_and_out_untouched(dispatcher, label, call, exc, text):
    c = Call(dispatcher)
    with pytest.raises(exc) as info:
        call(c)
    assert text in str(info.value), str(info.value)
    assert torch.equal(c.out, torch.full((M, N), 7.0, dtype=BF16)), "out was written"


def test_bad_input_cases_cover_every_argument():
    """Each argument of gemm and mm_fp4 has at least one bad-input case whose error names it
    (``"<arg>: expected"`` or the argument alone), and no two cases share a label."""
    import inspect

    def named(cases, arg):
        return [lab for lab, _, _, text in cases if text == arg or text.startswith(f"{arg}:")
                or text.startswith(f"{arg} ")]  # fmt: skip

    for method, cases in ((Dispatcher.gemm, GEMM_CASES), (Dispatcher.mm_fp4, MM_CASES)):
        args = [p for p in inspect.signature(method).parameters if p != "self"]
        missing = [a for a in args if not named(cases, a)]
        assert not missing, f"{method.__name__}: no bad-input case names {missing}"
    labels = [c[0] for c in GEMM_CASES] + [f"mm {c[0]}" for c in MM_CASES]
    assert len(labels) == len(set(labels))


def test_bad_budget_and_device():
    with pytest.raises(ValueError, match="budget"):
        Dispatcher(device="cpu", budget=0)
    with pytest.raises(ValueError, match="device: expected one of"):
        Dispatcher(device="sm999")


# ---- W4A16: dense activations times an NVFP4 weight ----------------------------------------


def test_w4a16_gemm_matches_float64_of_the_unrounded_activation(dispatcher):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=g).to(torch.float16)
    qb = quantize_nvfp4(torch.randn(40, 96, generator=g))
    y = dispatcher.gemm(x, qb)
    assert y.dtype == torch.float16 and y.shape == (9, 40)  # out dtype follows x
    ref = x.double() @ dequantize(qb).double().T
    # the CPU reference may multiply in bf16 (its fastest tactic there): one bf16 rounding
    # of x (2**-9 relative) and of the output bound the error well under 5e-3
    assert float((y.double() - ref).norm() / ref.norm()) < 5e-3
    out = torch.full((9, 40), float("nan"), dtype=torch.bfloat16)
    assert dispatcher.gemm(x, qb, out_dtype=torch.bfloat16, out=out) is out
    assert torch.isfinite(out).all()
    # its own plan, and its own ranking: only backends that serve w4a16 compete
    assert dispatcher.cached_plan(9, 40, 96, "float16", "w4a16") is not None
    sl = dispatcher.candidates(9, 40, 96, operation="w4a16")
    assert sl.candidates and all(
        "w4a16" in dispatcher.registry.backends[c.backend].operations for c in sl.candidates
    )
    assert all(not c.tactic.swap_ab for c in sl.candidates)


@pytest.mark.parametrize(
    ("x", "exc", "text"),
    [
        (torch.randn(4, 96), TypeError, "bfloat16 or torch.float16"),
        (torch.randn(4, 64).half(), ValueError, "K must match"),
        (torch.randn(4, 2, 96).half(), ValueError, "2-D"),
        (torch.randn(96, 4).half().t(), ValueError, "unit stride"),
    ],
)
def test_w4a16_bad_activations_are_rejected(dispatcher, x, exc, text):
    qb = quantize_nvfp4(torch.randn(40, 96))
    with pytest.raises(exc, match=text):
        dispatcher.gemm(x, qb)


class _AlphaKernel:
    """A kernel recording the alpha it was handed (and its optional second factor)."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, operands, out) -> None:
        self.seen.append((operands.alpha, operands.alpha_b))


class _FactorKernel(_AlphaKernel):
    alpha_factors = True


@pytest.mark.parametrize("swap", [False, True])
def test_plan_hands_alpha_factors_only_to_kernels_that_take_them(swap: bool) -> None:
    from types import SimpleNamespace

    from fp4_dispatch.engine.plans import Plan

    cand = SimpleNamespace(tactic=SimpleNamespace(swap_ab=swap), backend="x")
    ga, gb = torch.tensor(3.0), torch.tensor(0.25)
    a, out = torch.zeros(2, 8, dtype=torch.uint8), torch.empty(2, 4)
    plain, factors = _AlphaKernel(), _FactorKernel()
    for kernel in (plain, factors):
        Plan((2, 4, 16, "bfloat16", "w4a4"), cand, kernel)(a, a, a, a, ga, out, gb)
    ((alpha, second),) = plain.seen
    assert second is None and alpha.shape == (1,) and float(alpha) == 0.75  # multiplied here
    ((alpha, second),) = factors.seen
    assert alpha is ga and second is gb  # handed as they came
    Plan((2, 4, 16, "bfloat16", "w4a4"), cand, plain)(a, a, a, a, ga, out)
    assert plain.seen[-1] == (ga, None)  # one factor: as before


class _DenseKernel:
    """A W4A16 kernel writing ``out = 1`` and recording the bias it was handed."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, operands, out) -> None:
        self.seen.append(operands.bias)
        out.fill_(1.0)


class _BiasKernel(_DenseKernel):
    bias_epilogue = True

    def __call__(self, operands, out) -> None:
        super().__call__(operands, out)
        out.add_(operands.bias)


def test_dense_plan_fuses_the_bias_only_into_kernels_with_an_epilogue() -> None:
    from types import SimpleNamespace

    from fp4_dispatch.engine.plans import DensePlan

    cand = SimpleNamespace(tactic=SimpleNamespace(swap_ab=False), backend="x")
    a, bias = torch.zeros(2, 16), torch.tensor([1.0, 2.0, 3.0])
    for kernel in (_DenseKernel(), _BiasKernel()):
        out = torch.empty(2, 3)
        DensePlan((2, 3, 16, "bfloat16", "w4a16"), cand, kernel)(a, a, a, a, out, bias)
        assert kernel.seen == [bias if isinstance(kernel, _BiasKernel) else None]
        assert torch.equal(out, torch.tensor([[2.0, 3.0, 4.0]] * 2))  # added exactly once
