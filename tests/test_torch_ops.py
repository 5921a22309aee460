"""The torch integration: custom ops, torch.compile without graph breaks, CUDA-graph rules.

CUDA-graph capture is simulated on the CPU by making ``torch.cuda.is_initialized`` and
``torch.cuda.is_current_stream_capturing`` answer True; the real capture runs in
``python -m benchmarks serving --cases graphs`` on a GPU. One torch.compile here (aot_eager backend,
a few seconds); the inductor compile lives in test_nn.py.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from fp4_dispatch import Dispatcher, Nvfp4Tensor, quantize_nvfp4, reference_gemm
from fp4_dispatch.engine import capture, torch_ops
from fp4_dispatch.engine.plans import Plan
from fp4_dispatch.engine.torch_ops import CaptureNotWarmError
from fp4_dispatch.support.progress import ENV as PROGRESS_ENV
from fp4_dispatch.support.progress import enabled, progress

OPCHECK_UTILS = ("test_faketensor", "test_aot_dispatch_dynamic")  # test_schema: no fp8 allclose


@pytest.fixture(scope="module")
def dispatcher():
    return Dispatcher(device="cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def alpha_of(qa, qb) -> torch.Tensor:
    return (qa.global_scale * qb.global_scale).reshape(1)


# ---- quantize ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 128), (130, 96)])
def test_quantize_is_bit_identical_to_quantize_nvfp4(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 5).to(dtype)
    x[0, :16] = 0  # an all-zero block: scale 0, codes 0
    q = quantize_nvfp4(x)
    for data, scale, gs in (torch_ops.quantize(x), torch.ops.fp4_dispatch.quantize(x)):
        assert torch.equal(data, q.data)
        assert torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
        assert torch.equal(gs, q.global_scale) and gs.shape == ()


def test_quantize_static_scale_and_all_zero_input():
    x = torch.randn(8, 64)
    s = torch.tensor(0.003)
    data, scale, gs = torch_ops.quantize(x, s)
    q = quantize_nvfp4(x, global_scale=s)
    assert torch.equal(data, q.data) and torch.equal(
        scale.view(torch.uint8), q.scale.view(torch.uint8)
    )
    assert float(gs) == pytest.approx(0.003) and gs.data_ptr() != s.data_ptr()
    data, scale, gs = torch_ops.quantize(torch.zeros(4, 32))
    assert float(gs) == 1.0 and not data.any() and not scale.view(torch.uint8).any()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        torch_ops.quantize(torch.randn(4, 48))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        torch_ops.quantize(torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        torch_ops.quantize(torch.zeros(64))


def test_ops_pass_opcheck(dispatcher, operands):
    """Schema, fake (meta) implementations and aot dispatch with dynamic shapes."""
    qa, qb = operands(8, 64, 128)
    did = torch_ops.dispatcher_id(dispatcher)
    a = (qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb))
    out = torch.empty(8, 64, dtype=torch.float16)
    cases = [
        (torch.ops.fp4_dispatch.gemm.default, (*a, torch.bfloat16, did)),
        (torch.ops.fp4_dispatch.gemm.default, (*a, torch.float16, torch_ops.DEFAULT)),
        (torch.ops.fp4_dispatch.gemm_out.default, (*a, out, did)),
        (torch.ops.fp4_dispatch.quantize.default, (torch.randn(8, 128), None)),
        (
            torch.ops.fp4_dispatch.quantize.default,
            (torch.randn(8, 64).bfloat16(), torch.tensor(0.1)),
        ),
        (
            torch.ops.fp4_dispatch.gemm_w4a16.default,
            (
                torch.randn(8, 128).bfloat16(),
                qb.data,
                qb.scale,
                qb.global_scale.reshape(1),
                torch.bfloat16,
                did,
            ),
        ),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


# ---- the gemm ops --------------------------------------------------------------------------


def test_gemm_op_matches_reference_and_dispatcher(dispatcher, operands):
    qa, qb = operands(37, 96, 128)
    ref = reference_gemm(qa, qb)
    did = torch_ops.dispatcher_id(dispatcher)
    y = torch.ops.fp4_dispatch.gemm(
        qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb), torch.float16, did
    )
    assert y.dtype == torch.float16 and rel_err(y, ref) < 5e-3
    assert torch.equal(
        dispatcher.gemm(qa, qb),
        torch_ops.run(dispatcher, qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb)),
    )
    out = torch.full((37, 96), float("nan"), dtype=torch.bfloat16)
    assert dispatcher.gemm(qa.with_layout("linear"), qb, out=out) is out
    assert rel_err(out, ref) < 5e-3
    y = torch_ops.run(None, qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb))
    assert rel_err(y, ref) < 5e-3  # the default dispatcher of the CPU


def test_dispatcher_ids_are_stable_distinct_and_weak(operands):
    d1, d2 = Dispatcher(device="cpu"), Dispatcher(device="cpu")
    i1 = torch_ops.dispatcher_id(d1)
    assert i1 == torch_ops.dispatcher_id(d1) != torch_ops.dispatcher_id(d2)
    assert torch_ops.get_dispatcher(i1, torch.device("cpu")) is d1
    assert torch_ops.default_dispatcher("cpu") is torch_ops.default_dispatcher(torch.device("cpu"))
    del d1
    gc.collect()
    qa, qb = operands(4, 32, 64)
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.fp4_dispatch.gemm(
            qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb), torch.bfloat16, i1
        )


def test_gemm_op_checks_its_operands(dispatcher, operands):
    qa, qb = operands(8, 32, 64)
    did = torch_ops.dispatcher_id(dispatcher)
    op = torch.ops.fp4_dispatch.gemm
    with pytest.raises(ValueError, match="K must match"):
        _, qc = operands(8, 32, 128)
        op(qa.data, qa.scale, qc.data, qc.scale, alpha_of(qa, qb), torch.bfloat16, did)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        op(qa.data, qa.scale.float(), qb.data, qb.scale, alpha_of(qa, qb), torch.bfloat16, did)
    with pytest.raises(TypeError, match="out_dtype"):
        op(qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb), torch.float32, did)
    sim = Dispatcher(device="sm100")
    with pytest.raises(RuntimeError, match="simulated"):
        sim.gemm(qa, qb)
    empty = torch_ops.run(dispatcher, qa.data[:0], qa.scale, qb.data, qb.scale, alpha_of(qa, qb))
    assert empty.shape == (0, 32)


def test_a_checked_signature_skips_the_checks_and_anything_else_is_checked(
    dispatcher, operands, monkeypatch
):
    """The ops' Python runs on every call under torch.compile: operands whose signature
    (metadata, and the weight's addresses) passed the checks run without them - same
    result - while a call that differs in anything checked is checked again."""
    from fp4_dispatch.format import checks

    qa, qb = operands(8, 32, 64)
    did = torch_ops.dispatcher_id(dispatcher)
    op = torch.ops.fp4_dispatch.gemm
    torch_ops._checked.clear()
    first = op(qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb), torch.bfloat16, did)
    assert len(torch_ops._checked) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("checked again")

    monkeypatch.setattr(checks, "fp4_data", refuse)
    again = op(qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb), torch.bfloat16, did)
    assert torch.equal(again, first)
    _, qc = operands(8, 32, 64)  # another weight (another address): checked
    with pytest.raises(AssertionError, match="checked again"):
        op(qa.data, qa.scale, qc.data, qc.scale, alpha_of(qa, qc), torch.bfloat16, did)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # same addresses, other dtype
        op(qa.data, qa.scale.view(torch.uint8), qb.data, qb.scale, alpha_of(qa, qb),
           torch.bfloat16, did)  # fmt: skip


# ---- torch.compile -------------------------------------------------------------------------


def _op_targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_torch_ops_gemm_traces_in_one_graph(operands):
    """dynamo traces the checks and Nvfp4Tensor access; the GEMM stays one opaque op."""
    d = Dispatcher(device="cpu")
    qa, qb = operands(8, 64, 128)
    explained = torch._dynamo.explain(lambda a, b: d.gemm(a, b))(qa, qb)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert "fp4_dispatch.gemm" in _op_targets(explained.graphs[0])
    assert set(d._plans) == {(8, 64, 128, "bfloat16", "w4a4")}  # explain ran it: the op planned it


@pytest.mark.slow
def test_module_calling_dispatcher_gemm_compiles_fullgraph(operands):
    """The issue's requirement: ``Dispatcher.gemm`` inside a compiled module, no graph break.

    Fresh dispatcher (nothing memoized), dynamic M, backend aot_eager (dynamo + fake
    tensors + functionalization; the inductor compile is in test_nn.py).
    """
    d = Dispatcher(device="cpu")
    _, qb = operands(1, 64, 128)

    class Head(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            data, scale, gs = torch_ops.quantize(x)  # quantize_nvfp4 syncs (NaN check)
            qa = Nvfp4Tensor(data, scale, gs, "swizzled", (x.shape[0], x.shape[1]))
            return d.gemm(qa, qb).float().relu()

    compiled = torch.compile(Head(), fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (3, 17):
        x = torch.randn(m, 128)
        got = compiled(x)
        assert got.shape == (m, 64)
        assert rel_err(got, reference_gemm(quantize_nvfp4(x), qb).relu()) < 5e-3
    assert set(d._plans) == {(3, 64, 128, "bfloat16", "w4a4"), (17, 64, 128, "bfloat16", "w4a4")}


# ---- CUDA-graph capture rules (simulated) ---------------------------------------------------


@pytest.fixture
def capturing(monkeypatch):
    """``capturing(True)`` makes the ops believe a CUDA graph capture is in progress."""

    def set_capturing(on: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: on)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)
        monkeypatch.setattr(capture, "_capturing", lambda: on)  # what the engine calls

    yield set_capturing
    set_capturing(False)


def _forbid_planning(monkeypatch, d: Dispatcher) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("ranked, built or ran through Dispatcher.run inside a capture")

    for name in ("select", "kernel_for", "run", "run_candidate"):
        monkeypatch.setattr(d, name, forbidden)


def test_capture_of_a_shape_never_run_raises_and_launches_nothing(operands, capturing, monkeypatch):
    d = Dispatcher(device="cpu")
    qa, qb = operands(5, 48, 64)
    out = torch.full((5, 48), float("nan"), dtype=torch.bfloat16)
    _forbid_planning(monkeypatch, d)
    capturing(True)
    with pytest.raises(CaptureNotWarmError, match=r"M=5 N=48 K=64 .*without ever having run") as e:
        d.gemm(qa, qb, out=out)
    assert "warmup" in str(e.value)
    assert out.isnan().all()
    assert not d._plans and not torch_ops.is_warm(d, 5, 48, 64, torch.bfloat16)


def test_capture_replays_the_warm_plan_only_for_the_exact_shape(operands, capturing, monkeypatch):
    d = Dispatcher(device="cpu")
    qa, qb = operands(8, 48, 64)
    eager = d.gemm(qa, qb)
    assert torch_ops.is_warm(d, 8, 48, 64, torch.bfloat16)
    planned = d._plans[(8, 48, 64, "bfloat16", "w4a4")]
    assert planned.candidate == d.select(8, 48, 64)  # untuned bucket: the heuristic top-1
    _forbid_planning(monkeypatch, d)
    capturing(True)
    out = torch.full((8, 48), float("nan"), dtype=torch.bfloat16)
    d.gemm(qa, qb, out=out)
    assert torch.equal(out, eager)
    qa5, _ = operands(5, 48, 64)
    with pytest.raises(CaptureNotWarmError, match="M=5 N=48 K=64"):  # same bucket, other M
        d.gemm(qa5, qb)
    with pytest.raises(CaptureNotWarmError, match="float16"):  # other output dtype
        d.gemm(qa, qb, out_dtype=torch.float16)


def test_capture_after_the_plan_changed_raises(operands, capturing):
    d = Dispatcher(device="cpu")
    qa, qb = operands(8, 48, 64)
    d.gemm(qa, qb)
    key = (8, 48, 64, "bfloat16", "w4a4")
    cand, kernel = d._plans[key]
    d._plans[key] = Plan(key, cand, kernel)  # e.g. re-tuned: a new plan object, never run
    capturing(True)
    with pytest.raises(CaptureNotWarmError, match="plan changed"):
        d.gemm(qa, qb)


def test_capture_never_creates_the_default_dispatcher(operands, capturing, monkeypatch):
    monkeypatch.setattr(torch_ops, "_defaults", {})
    qa, qb = operands(4, 32, 64)
    capturing(True)
    with pytest.raises(CaptureNotWarmError, match="default dispatcher"):
        torch_ops.run(None, qa.data, qa.scale, qb.data, qb.scale, alpha_of(qa, qb))
    assert torch_ops._defaults == {}


def test_warmup_makes_shapes_capturable(capturing, monkeypatch, capsys):
    monkeypatch.setenv(PROGRESS_ENV, "0")
    d = Dispatcher(device="cpu")
    shapes = [(1, 64, 128), (3, 64, 128), (16, 32, 64)]
    picked = torch_ops.warmup(d, shapes)
    assert set(picked) == {(*s, "bfloat16") for s in shapes}
    assert all(c.backend in {b.name for b in d.available} for c in picked.values())
    assert all(torch_ops.is_warm(d, *s, torch.bfloat16) for s in shapes)
    assert not torch_ops.is_warm(d, 2, 64, 128, torch.bfloat16)
    assert capsys.readouterr() == ("", "")  # library code prints nothing
    capturing(True)
    with pytest.raises(RuntimeError, match="before the CUDA graph capture"):
        torch_ops.warmup(d, shapes)


# ---- progress bars -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "explicit", "expect"),
    [("0", None, False), ("off", None, False), ("1", None, True), ("", None, None),
     ("0", True, True), ("1", False, False), ("bogus", None, None)],
)  # fmt: skip
def test_progress_switch(monkeypatch, env, explicit, expect):
    monkeypatch.setenv(PROGRESS_ENV, env)
    assert enabled(explicit) is expect
    bar = progress(range(3), enable=explicit)
    off = not sys.stderr.isatty() if expect is None else not expect  # tqdm's rule for None
    assert bar.disable is off
    assert list(bar) == [0, 1, 2]


# ---- the eager hot path ----------------------------------------------------------------


def test_linear_eager_path_takes_strided_inputs_and_follows_a_changed_mode(dispatcher):
    """`Nvfp4Linear`'s eager forward (no reshape for 2-D inputs, cached activation mode)
    computes what the general path does: a transposed 2-D input gives the contiguous
    input's output, and setting ``activations`` after a forward switches the operation."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    gen = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    layer = Nvfp4Linear.from_linear(lin, dispatcher=dispatcher, activations="bf16")
    x = torch.randn(64, 3, generator=gen).to(torch.bfloat16).t()  # strides (1, 3)
    assert x.stride(1) != 1
    with torch.no_grad():
        dense = layer(x)
        assert torch.equal(dense, layer(x.contiguous()))
        layer.activations = "nvfp4"
        quantized = layer(x)
        ref = Nvfp4Linear.from_linear(lin, dispatcher=dispatcher, activations="nvfp4")
    assert torch.equal(quantized, ref(x.contiguous()))
    assert not torch.equal(quantized, dense)  # the activation is rounded now


def test_linear_alpha_view_follows_its_buffer(dispatcher):
    """The cached W4A16 alpha view sees an in-place load and a replaced buffer."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    layer = Nvfp4Linear.from_linear(torch.nn.Linear(64, 32), dispatcher=dispatcher,
                                    activations="bf16")  # fmt: skip
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y1 = layer(x)
        layer.weight_global_scale.mul_(2.0)  # in place: the view sees it
        y2 = layer(x)
        layer.weight_global_scale = layer.weight_global_scale / 4.0  # a new buffer object
        y3 = layer(x)
    bias = layer.bias.to(y1.dtype)
    torch.testing.assert_close(y2 - bias, 2 * (y1 - bias), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(y3 - bias, 0.5 * (y1 - bias), rtol=2e-2, atol=1e-2)


def test_w4a16_op_hands_bias_and_prepared_bytes_to_the_plan(monkeypatch):
    """Under torch.compile the W4A16 layer's bias and the op's ``b_prepared`` reach the
    plan as eagerly (a bias-epilogue kernel then rounds once in both modes), and the op
    checks them: a compiled layer computes the eager bits."""
    from fp4_dispatch.format.nvfp4 import sm90_prepare_data
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    d = Dispatcher(device="cpu")
    seen = []
    real = d.run_dense

    def spy(a, b, sb, alpha, out, dtype, bias=None, b_prepared=None):
        seen.append((bias, b_prepared))
        real(a, b, sb, alpha, out, dtype, bias, b_prepared)

    monkeypatch.setattr(d, "run_dense", spy)
    layer = Nvfp4Linear.from_linear(torch.nn.Linear(128, 40, dtype=torch.bfloat16),
                                    dispatcher=d, activations="bf16")  # fmt: skip
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, eager)
    assert len(seen) == 2 and all(bias is not None for bias, _ in seen)
    qb = layer.quantized_weight()
    prepared = sm90_prepare_data(qb.data)
    alpha = qb.global_scale.reshape(1)
    y = torch.ops.fp4_dispatch.gemm_w4a16(x, qb.data, qb.scale, alpha, torch.bfloat16,
                                          d.op_id, layer.bias, prepared)  # fmt: skip
    assert seen[-1][1] is prepared and torch.equal(y, eager)
    with pytest.raises(ValueError, match="bias: expected a float tensor of shape"):
        torch.ops.fp4_dispatch.gemm_w4a16(x, qb.data, qb.scale, alpha, torch.bfloat16,
                                          d.op_id, layer.bias[:7], None)  # fmt: skip
    with pytest.raises(ValueError, match="b_prepared: expected uint8"):
        torch.ops.fp4_dispatch.gemm_w4a16(x, qb.data, qb.scale, alpha, torch.bfloat16,
                                          d.op_id, None, prepared[:, :8])  # fmt: skip
