"""Nvfp4Linear: a drop-in for nn.Linear, checked against honest error bounds.

Error model. The module computes ``bf16(dq(q(x)) @ dq(q(W)).T) + b``. Against
``F.linear(dq(q(x)), dq(q(W)), b)`` the only differences are fp32 accumulation order and
the bf16 roundings of the product and of the bias add (each at most 2**-8 relative),
so the comparison is elementwise and tight. Against ``nn.Linear`` on the dequantized
weight the extra error is the activation's quantization; against the original layer
it is both quantizations. For those the bound is computed from the measured
quantization errors ``e_x = |x - dq(q(x))| / |x|`` (Frobenius, per operand): the
product's relative error is about ``sqrt(e_x**2 + e_w**2)`` for independent rounding
errors; the tests allow 1.5x that plus the output rounding, so they fail on a wrong
scale, layout or dtype (errors of order 1) but not on honest quantization noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp4_dispatch import Dispatcher, dequantize, quantize_nvfp4
from fp4_dispatch.engine import torch_ops
from fp4_dispatch.integrations.nn import Nvfp4Linear

ROUND16 = 2.0**-7  # two bf16 roundings (8 significant bits: half-ulp 2**-8 relative each)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def qerr(t: torch.Tensor) -> float:
    """Measured relative NVFP4 quantization error of one operand."""
    return rel(dequantize(quantize_nvfp4(t)), t.float())


@pytest.fixture
def layer():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.bias.mul_(4)
    return lin


def test_matches_linear_on_dequantized_operands_tightly(layer):
    mod = Nvfp4Linear.from_linear(layer, activations="nvfp4")
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (2, 7, 96) and y.dtype == torch.bfloat16
    x2 = x.reshape(-1, 256)
    xq = dequantize(quantize_nvfp4(x2)).double()
    prod = xq @ mod.dequantized_weight().double().T
    bias = layer.bias.detach().to(torch.bfloat16).double()
    bound = ROUND16 * (prod.abs() + bias.abs()) + 1e-6
    assert ((y.reshape(-1, 96).double() - (prod + bias)).abs() <= bound).all()


def test_error_vs_nn_linear_is_the_quantization_error(layer):
    mod = Nvfp4Linear.from_linear(layer, activations="nvfp4")
    x = torch.randn(33, 256)
    y = mod(x).float()  # float32 input -> bfloat16 output
    e_x, e_w = qerr(x), qerr(layer.weight.detach())
    assert 0.02 < e_x < 0.2 and 0.02 < e_w < 0.2  # the data really is being quantized
    bias = layer.bias.detach()
    # nn.Linear on the dequantized weight: only the activation's quantization differs
    on_dq_w = F.linear(x, mod.dequantized_weight(), bias)
    assert rel(y - bias, on_dq_w - bias) < 1.5 * e_x + ROUND16
    # the original layer: both quantizations
    orig = layer(x).detach()
    assert rel(y - bias, orig - bias) < 1.5 * (e_x**2 + e_w**2) ** 0.5 + ROUND16
    # and the quantized path is measurably different from no quantization (tests can fail)
    assert rel(y - bias, orig - bias) > 0.5 * e_x


@pytest.mark.parametrize(
    ("dtype", "out"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_output_dtype_rule(dtype, out):
    mod = Nvfp4Linear.from_linear(nn.Linear(64, 32).to(dtype))
    assert mod(torch.randn(3, 64, dtype=dtype)).dtype == out


def test_shapes_bias_none_and_empty_batch():
    mod = Nvfp4Linear.from_linear(nn.Linear(64, 40, bias=False))
    assert mod.bias is None
    assert mod(torch.randn(64)).shape == (40,)
    assert mod(torch.randn(2, 3, 5, 64)).shape == (2, 3, 5, 40)
    assert mod(torch.randn(0, 64)).shape == (0, 40)
    with pytest.raises(ValueError, match="last dimension 64"):
        mod(torch.randn(3, 32))


def test_constructor_and_from_linear_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        Nvfp4Linear(48, 16)
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        Nvfp4Linear.from_linear(nn.Conv1d(4, 4, 1))
    mod = Nvfp4Linear(64, 16)
    with pytest.raises(ValueError, match="shape"):
        mod.load_quantized(quantize_nvfp4(torch.randn(16, 32)))
    with pytest.raises(ValueError, match="finite value > 0"):
        mod.set_input_global_scale(0.0)


def test_state_dict_round_trip_with_static_input_scale(layer):
    src = Nvfp4Linear.from_linear(layer, input_global_scale=0.004, activations="nvfp4")
    sd = src.state_dict()
    assert set(sd) == {"weight_data", "weight_scale", "weight_global_scale",
                       "input_global_scale", "bias"}  # fmt: skip
    assert (
        sd["weight_scale"].dtype == torch.float8_e4m3fn and sd["weight_data"].dtype == torch.uint8
    )
    dst = Nvfp4Linear(256, 96, activations="nvfp4")
    dst.load_state_dict(sd)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    assert torch.equal(dst(x), src(x))
    # the static scale is the one used: same as quantizing x with it explicitly
    xq = dequantize(quantize_nvfp4(x, global_scale=0.004)).double()
    ref = xq @ src.dequantized_weight().double().T + layer.bias.detach().to(torch.bfloat16).double()
    assert rel(src(x), ref) < 4e-3
    assert "activation_scale=static" in repr(src)


def test_explicit_dispatcher_is_the_one_that_runs():
    d = Dispatcher(device="cpu")
    mod = Nvfp4Linear.from_linear(nn.Linear(64, 48), dispatcher=d, activations="nvfp4")
    mod(torch.randn(6, 64, dtype=torch.float16))
    assert torch_ops.is_warm(d, 6, 48, 64, torch.float16)
    assert (6, 48, 64, "float16", "w4a4") in d._plans


@pytest.mark.slow
def test_compiled_model_fullgraph_inductor_matches_eager():
    """The one inductor compile of the suite (~30 s on a small CPU): no graph break."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    d = Dispatcher(device="cpu")
    # an explicit dispatcher, then the default one of the input's device; W4A4: the
    # activation quantizer's op is in the graph too
    model[0] = Nvfp4Linear.from_linear(model[0], dispatcher=d, activations="nvfp4")
    model[2] = Nvfp4Linear.from_linear(model[2], activations="nvfp4")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    # ReLU, not GELU: inductor's GELU may round differently from eager's, moving an
    # activation of layer 2 to the next e2m1 code; with exact elementwise ops the compiled
    # model computes the very same thing
    assert torch.equal(compiled(x), eager)
    assert torch_ops.is_warm(d, 4, 64, 128, torch.bfloat16)  # layer 0 ran on `d`


@pytest.mark.parametrize(
    ("cast", "bias_dtype"),
    [
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.float(), torch.float32),
        (lambda m: nn.Sequential(m).to(torch.float16)[0], torch.float16),
        (lambda m: m.to("cpu", torch.float16), torch.float16),
    ],
)
def test_dtype_casts_touch_only_the_bias(layer, cast, bias_dtype):
    mod = Nvfp4Linear.from_linear(layer)
    before = {n: b.clone() for n, b in mod.named_buffers()}
    x = torch.randn(3, 256, dtype=torch.float16)
    y_before = mod(x)
    cast_mod = cast(mod)
    for name, buf in cast_mod.named_buffers():
        assert buf.dtype == before[name].dtype, name  # the format is not a dtype to cast
        assert torch.equal(
            buf.reshape(-1).view(torch.uint8), before[name].reshape(-1).view(torch.uint8)
        )
    assert cast_mod.bias.dtype == bias_dtype
    y = cast_mod(x)  # used to fail: "expected dtype torch.float8_e4m3fn, got ..."
    assert y.dtype == torch.float16
    assert rel(y, y_before) < 2e-3  # only the bias's rounding may differ


def test_backward_raises_a_clear_error(layer):
    mod = Nvfp4Linear.from_linear(layer)
    x = torch.randn(4, 256, requires_grad=True)
    y = mod(x)
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
    assert x.grad is None
    with torch.no_grad():
        assert not mod(x).requires_grad  # the usual inference call is untouched


def test_weight_only_activations_keep_the_input_unrounded(layer):
    """activations="bf16": W4A16 - only the weight is quantized."""
    mod = Nvfp4Linear.from_linear(layer, activations="bf16")
    assert mod.operation() == "w4a16" and "activations=bf16" in repr(mod)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y = mod(x)
    ref = (
        x.double() @ mod.dequantized_weight().double().T
        + layer.bias.detach().to(torch.bfloat16).double()
    )
    assert rel(y, ref) < 2 * ROUND16  # no activation quantization error at all
    w4a4 = Nvfp4Linear.from_linear(layer, activations="nvfp4")(x)
    assert rel(w4a4, ref) > 10 * rel(y, ref)  # the W4A4 path does round x (tests can fail)


def test_prepared_weight_copy_reaches_the_kernel_and_follows_the_weight(layer, monkeypatch):
    """prepare_weight: where W4A16 runs on Hopper the layer hands the GEMM the weight bytes
    in the sm90-prepared order too, made once and remade when weight_data changes; off
    Hopper, or with prepare_weight=False, nothing is made. Here the CPU stands in for a
    Hopper device (`_prepares_on` patched); the portable kernel ignores the copy."""
    from fp4_dispatch.format.nvfp4 import sm90_prepare_data

    seen = []
    real = torch_ops.run_w4a16

    def spy(*args):
        seen.append(args[8] if len(args) > 8 else None)
        return real(*args)

    monkeypatch.setattr(torch_ops, "run_w4a16", spy)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    plain = Nvfp4Linear.from_linear(layer, activations="bf16", prepare_weight=False)
    want = plain(x)
    assert seen == [None]  # CPU, and no copy asked for
    mod = Nvfp4Linear.from_linear(layer, activations="bf16")
    mod(x)
    assert seen[-1] is None  # not a Hopper device: no copy
    monkeypatch.setattr(Nvfp4Linear, "_prepares_on", lambda self, device: True)
    y = mod(x)
    first = seen[-1]
    assert torch.equal(first, sm90_prepare_data(mod.weight_data))
    assert torch.equal(y, want)  # same values, whichever bytes the kernel reads
    mod(x)
    assert seen[-1] is first  # kept between calls
    other = quantize_nvfp4(torch.randn(96, 256))
    mod.load_quantized(other)  # an in-place load: the copy is made again
    mod(x)
    assert seen[-1] is not first and torch.equal(seen[-1], sm90_prepare_data(other.data))
    assert "weight_data_prepared" not in mod.state_dict() and len(mod.state_dict()) == 4
    mod.load_state_dict(plain.state_dict())  # in place too: back to the first weight
    mod(x)
    assert torch.equal(seen[-1], first)
    with torch.inference_mode():  # buffers made here keep no version counter
        frozen = Nvfp4Linear.from_linear(layer, activations="bf16")
        assert torch.equal(frozen(x), want)
        frozen.load_quantized(other)
        frozen(x)
    assert torch.equal(seen[-1], sm90_prepare_data(other.data))
    with pytest.raises(TypeError, match="prepare_weight"):
        Nvfp4Linear(64, 16, prepare_weight="yes")


def test_auto_activations_follow_the_device():
    """ "auto" is W4A4 only where FP4 tensor cores are (CUDA, compute capability >= 10):
    on the CPU it is W4A16, exact weight-only (docs/checkpoints.md, "Activations")."""
    mod = Nvfp4Linear(64, 16)
    assert mod.activations == "auto" and mod.operation("cpu") == "w4a16"
    assert "activations=auto (cpu: w4a16)" in repr(mod)
    mod(torch.randn(3, 64, dtype=torch.bfloat16))  # runs the W4A16 plan of the CPU
    assert (3, 16, 64, "bfloat16", "w4a16") in torch_ops.default_dispatcher("cpu")._plans
    with pytest.raises(ValueError, match="activations"):
        Nvfp4Linear(64, 16, activations="fp8")


@pytest.mark.parametrize("activations", ["nvfp4", "bf16"])
def test_a_non_finite_input_poisons_only_its_own_row(layer, activations):
    """As with a bf16 nn.Linear: NaN/inf in row 2 makes row 2 NaN, the others stay exact."""
    mod = Nvfp4Linear.from_linear(layer, activations=activations)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    clean = mod(x)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 17] = bad
        out = mod(y)
        assert not torch.isfinite(out[2]).any()
        rows = [0, 1, 3, 4]  # W4A4: the dynamic scale is taken over finite values only
        assert torch.equal(out[rows], clean[rows])
