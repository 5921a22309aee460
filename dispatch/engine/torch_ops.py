"""PyTorch integration: custom ops that torch.compile traces and CUDA graphs capture.

Why: a serving stack compiles its model (``torch.compile(fullgraph=True)``) and replays
decode steps from CUDA graphs. The dispatcher's Python (ranking, pydantic models, plans,
kernel builds) must therefore sit behind an opaque op with a shape-only "fake"
implementation, and must do nothing inside a capture that a capture cannot record.

Layering: one direction per call. `fp4_dispatch.Dispatcher`'s public calls emit these
ops under torch.compile; the ops' implementations call the engine
(`fp4_dispatch.engine.runner.Runner.run_checked` / ``run_dense``) of the dispatcher
their int id names; the engine never calls back into this module (its capture state
lives in `fp4_dispatch.engine.capture`). The default dispatcher of a device is made by
the factory `fp4_dispatch.engine.dispatcher` registers on import.

Ops, namespace ``fp4_dispatch`` (``torch.ops.fp4_dispatch.*``):

- ``quantize(x, global_scale=None) -> (data, scale, global_scale)``: NVFP4 quantization
  of a 2-D activation, bit-identical to `quantize_nvfp4` (swizzled scales) and, like it,
  with no host synchronisation (the fused Triton kernel on CUDA), so it is capturable.
- ``gemm(a_data, a_scale, b_data, b_scale, alpha, out_dtype, dispatcher=-1) -> out``:
  ``out = alpha * dequant(a) @ dequant(b).T`` through a dispatcher.
- ``gemm_out(..., out, dispatcher=-1)``: the same, writing a caller's ``out``.
- ``gemm_w4a16(a, b_data, b_scale, alpha, out_dtype, dispatcher=-1, bias=None,
  b_prepared=None) -> out``: weight-only ``out = alpha * a @ dequant(b).T (+ bias)`` with
  dense bf16/fp16 activations ``a`` (``b_prepared``: `DenseOperands.b_prepared`).
- ``grouped_gemm(a, a_scale, b_data, b_scale, alpha, offsets, out_dtype, dispatcher=-1)
  -> out``: the grouped (mixture-of-experts) GEMM of `GroupedOperands` (``a_scale``
  None: dense ``a``, grouped W4A16); the offsets stay on the device (docs/grouped.md).

``dispatcher`` is an int: `dispatcher_id` of a registered dispatcher, or -1 for the
per-device default (`default_dispatcher`), -2 for the per-device default of the ``"fp8"``
precision policy (`default_dispatcher(device, "fp8")`). An int keeps the op schema plain and lets a
compiled graph hold the choice as a constant.

CUDA graphs. Outside a capture a GEMM runs its plan (`fp4_dispatch.engine.plans`; the
dispatcher may rank, build, compile and - under ``autotuning()`` - tune to make it) and
the plan becomes *warm*. Inside a capture (`stream_capturing`) nothing is ranked, built,
compiled, allocated or tuned: the warm plan of the exact (M, N, K, out dtype) launches,
and otherwise `CaptureNotWarmError` is raised before anything launches. So an *untuned*
bucket hit during capture runs the heuristic top-1 that the warm-up ran - never a tuning
pass - and a shape that was never run eagerly is an error that names the shape and the
fix: run the model once at that shape before capturing (what
``torch.compile(mode="reduce-overhead")`` and the usual side-stream warm-up do), or call
`warmup`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from fp4_dispatch.contracts.tactics import check_precision
from fp4_dispatch.engine import inductor
from fp4_dispatch.engine.capture import CaptureNotWarmError, not_warm, stream_capturing
from fp4_dispatch.engine.op_fast import FastCalls, w4a16_key
from fp4_dispatch.engine.plans import PlanKey
from fp4_dispatch.engine.runner import Runner, dispatcher_id, runner_of
from fp4_dispatch.format import checks, grouped
from fp4_dispatch.format.nvfp4 import (
    quantize_fields,
    quantize_nvfp4,
    swizzled_scale_shape,
)
from fp4_dispatch.support.progress import progress

if TYPE_CHECKING:
    from fp4_dispatch.policy.ranking import Candidate

log = logging.getLogger(__name__)

__all__ = [
    "CaptureNotWarmError",
    "Runner",
    "default_dispatcher",
    "dispatcher_id",
    "get_dispatcher",
    "is_warm",
    "not_warm",
    "quantize",
    "run",
    "run_grouped",
    "run_w4a16",
    "set_default_factory",
    "stream_capturing",
    "warmup",
]

#: the ``dispatcher`` argument meaning "the default dispatcher of the operands' device"
DEFAULT = -1
#: the same for the default dispatcher of the ``"fp8"`` precision policy
DEFAULT_FP8 = -2
#: precision policy -> its default-dispatcher argument
_DEFAULT_IDS = {"exact": DEFAULT, "fp8": DEFAULT_FP8}


# ---- which dispatcher ------------------------------------------------------------------

_lock = threading.Lock()
_defaults: dict[tuple[str, str], Runner] = {}
_factory: list[Callable[[str, str], Runner]] = []


def set_default_factory(factory: Callable[[str, str], Runner]) -> None:
    """Name what makes the default dispatcher of a device and precision policy
    (``factory("cuda:0", "exact")``).

    `fp4_dispatch.engine.dispatcher` registers `Dispatcher` here when it is imported:
    this module sits below `Dispatcher` (whose calls emit these ops) and above the engine
    (`Runner`, which the ops call), and imports only the engine.
    """
    _factory[:] = [factory]
    _checked.clear()
    _fast.clear()


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def default_dispatcher(device: torch.device | str = "cpu", precision: str = "exact") -> Runner:
    """The shared dispatcher of a torch device and precision policy (created on first
    use, then reused): ``"exact"`` (default) or ``"fp8"`` (`fp4_dispatch.Dispatcher`)."""
    key = (_device_key(device), check_precision(precision))
    with _lock:
        d = _defaults.get(key)
    if d is None:
        if not _factory:
            raise RuntimeError(
                "fp4_dispatch: no dispatcher factory registered; "
                "import fp4_dispatch.engine.dispatcher"
            )
        d = _factory[0](*key)
        with _lock:
            d = _defaults.setdefault(key, d)
    return d


def get_dispatcher(did: int, device: torch.device) -> Runner:
    """Resolve the op's ``dispatcher`` argument (see module docstring)."""
    if did in (DEFAULT, DEFAULT_FP8):
        return _resolve(None, device, "fp8" if did == DEFAULT_FP8 else "exact")
    d = runner_of(did)
    if d is None:
        raise RuntimeError(
            f"fp4_dispatch op: dispatcher #{did} no longer exists (it was garbage-collected "
            "while a graph or module still referred to it); keep a reference to it"
        )
    return d


def _resolve(dispatcher: Runner | None, device: torch.device, precision: str = "exact") -> Runner:
    """`dispatcher`, or the default one of `device` and `precision` (never first created
    inside a capture)."""
    if dispatcher is not None:
        return dispatcher
    if stream_capturing() and (_device_key(device), precision) not in _defaults:
        raise CaptureNotWarmError(
            f"fp4_dispatch: the default dispatcher of {device} was first needed inside a "
            "CUDA graph capture; run the model once before capturing"
        )
    return default_dispatcher(device, precision)


def is_warm(
    d: Runner, m: int, n: int, k: int, out_dtype: torch.dtype, operation: str = "w4a4"
) -> bool:
    """Whether a GEMM of this exact problem may run inside a CUDA graph capture."""
    plan = d.cached_plan(m, n, k, checks.out_dtype_name(out_dtype), operation)
    return plan is not None and plan.warm


# ---- the ops -----------------------------------------------------------------------------


#: argument signatures (`_signature`) whose checks passed with nothing to convert ->
#: (dispatcher, output dtype name): a matching call skips the checks. Under torch.compile
#: every GEMM runs this module's Python; the checks cost ~10-20 µs a call, the signature
#: a few (benchmarks/RESULTS.md "Eager launch"). Emptied when it reaches `_CHECKED_MAX`
#: and when the default dispatcher's factory changes.
_checked: dict[tuple, tuple[Runner, str]] = {}
_CHECKED_MAX = 4096
#: the W4A16 op's kept fast calls (`fp4_dispatch.engine.op_fast`), emptied with `_checked`
_fast = FastCalls()


def _meta(t: torch.Tensor | None) -> tuple | None:
    """What the checks read of an operand: shape, dtype, strides and device."""
    return None if t is None else (t.shape, t.dtype, t.stride(), t.device)


def _signature(did: int, *operands: torch.Tensor | None) -> tuple:
    """The key of `_checked`: the dispatcher id, every operand's `_meta`, and the
    addresses of the weight-side operands (b_data, b_scale, bias, b_prepared: the checks
    relate them to each other, so another weight is checked anew)."""
    weight_side = (operands[2], operands[3], operands[6], operands[7])
    fixed = tuple(None if t is None else t.data_ptr() for t in weight_side)
    return (did, fixed, *[_meta(t) for t in operands])


def _op_impl(
    did: int,
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    b_prepared: torch.Tensor | None = None,
) -> tuple[Runner, str] | None:
    """Every GEMM op's body: check the plain-tensor operands (the ops are public), then
    run; operands whose signature was checked before run straight away (`_checked`).
    Returns (dispatcher, output dtype name) when the call ran unchecked operands as
    given (a signature checked before), else None."""
    operands = (a, a_scale, b_data, b_scale, alpha, out, bias, b_prepared)
    sig = _signature(did, *operands)
    hit = _checked.get(sig)
    if hit is not None:
        d, dtype = hit
        if a_scale is None:
            d.run_dense(a, b_data, b_scale, alpha, out, dtype, bias, b_prepared)
        else:
            d.run_checked(a, a_scale, b_data, b_scale, alpha, out, dtype)
        return hit
    d, dtype, checked = _check_and_run(did, operands)
    if all(_meta(c) == _meta(t) for c, t in zip(checked, operands, strict=True)):
        if len(_checked) >= _CHECKED_MAX:
            _checked.clear()
        _checked[sig] = (d, dtype)
    return None


def _check_and_run(did: int, operands: tuple) -> tuple[Runner, str, tuple]:
    """Check `_op_impl`'s operands, then run: ``a_scale`` None: W4A16 (``a`` dense
    bf16/fp16 ``[M, K]``, optional ``bias`` and ``b_prepared`` as in `DenseOperands`),
    else W4A4 (``a`` the packed ``[M, K/2]`` activation with its swizzled scales).
    Returns the dispatcher, the output dtype name and the operands as checked (views of
    the inputs)."""
    a, a_scale, b_data, b_scale, alpha, out, bias, b_prepared = operands
    dense = a_scale is None
    a_name = "a" if dense else "a_data"
    if dense:
        a = checks.dense_activation("a", a)
        k_a = a.shape[1]
    else:
        a = checks.fp4_data("a_data", a)
        k_a = a.shape[1] * 2
    b_data = checks.fp4_data("b_data", b_data)
    m, n = a.shape[0], b_data.shape[0]
    k = checks.k_dims(k_a, b_data.shape[1] * 2, (a_name, "b_data"))
    dtype = checks.out_dtype_name(out.dtype)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
    if dense and not b_data.is_contiguous():
        raise ValueError("b_data: expected a contiguous [N, K/2] tensor")
    if not dense and not (a.is_contiguous() and b_data.is_contiguous()):
        raise ValueError("a_data and b_data: expected contiguous [rows, K/2] tensors")
    d = get_dispatcher(did, a.device)
    device = d.check_device(a_name, a)
    if dense:
        checks.same_device(device, b_data=b_data, b_scale=b_scale, out=out)
        sb = checks.swizzled_scale("b_scale", b_scale, n, k)
        if bias is not None:
            bias = checks.bias_vector("bias", bias, n, device)
        if b_prepared is not None:
            b_prepared = checks.prepared_bytes("b_prepared", b_prepared, b_data, device)
        alpha = checks.alpha_tensor(alpha, device)
        d.run_dense(a, b_data, sb, alpha, out, dtype, bias, b_prepared)
        return d, dtype, (a, None, b_data, sb, alpha, out, bias, b_prepared)
    checks.same_device(device, a_scale=a_scale, b_data=b_data, b_scale=b_scale, out=out)
    sa = checks.swizzled_scale("a_scale", a_scale, m, k)
    sb = checks.swizzled_scale("b_scale", b_scale, n, k)
    alpha = checks.alpha_tensor(alpha, device)
    d.run_checked(a, sa, b_data, sb, alpha, out, dtype)
    return d, dtype, (a, sa, b_data, sb, alpha, out, None, None)


#: the ops' library. Why `torch.library.Library` and not ``torch.library.custom_op``: the
#: latter wraps every call of the implementation in Python layers (an alias check of the
#: outputs, a Dynamo-disabling wrapper) that cost about as much again as the C++
#: dispatch itself - measured on this project's 2-core CPU host, a no-op op of this
#: signature: 16.2-16.6 µs a call through ``custom_op``, 8.9-9.3 µs defined here
#: (docs/launch.md). Under torch.compile every GEMM is such a call.
_LIB = torch.library.Library("fp4_dispatch", "DEF")


def _define(schema: str) -> Callable[[Callable], Callable]:
    """Define the op of `schema` in namespace ``fp4_dispatch`` with the decorated function
    as its implementation for every device (CompositeExplicitAutograd: no autograd
    formula; the callers that can be differentiated refuse a gradient themselves) and
    tag it pt2-compliant, as ``custom_op`` does."""

    def register(impl: Callable) -> Callable:
        name = schema.split("(", 1)[0]
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, impl, "CompositeExplicitAutograd")
        impl.op_name = f"fp4_dispatch::{name}"  # type: ignore[attr-defined]
        return impl

    return register


def _fake(impl: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated function as the fake (shape-only) implementation of the op
    `impl` was defined for (`_define`)."""

    def register(fake: Callable) -> Callable:
        torch.library.register_fake(impl.op_name, fake, lib=_LIB)  # type: ignore[attr-defined]
        return fake

    return register


@_define(
    "gemm(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, Tensor alpha, "
    "ScalarType out_dtype, SymInt dispatcher=-1) -> Tensor"
)
def _gemm_op(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    dispatcher: int = DEFAULT,
) -> torch.Tensor:
    out = torch.empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype, device=a_data.device)
    _op_impl(dispatcher, a_data, a_scale, b_data, b_scale, alpha, out)
    return out


@_fake(_gemm_op)
def _gemm_fake(a_data, a_scale, b_data, b_scale, alpha, out_dtype, dispatcher=DEFAULT):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


@_define(
    "gemm_out(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, Tensor alpha, "
    "Tensor(a5!) out, SymInt dispatcher=-1) -> ()"
)
def _gemm_out_op(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor,
    dispatcher: int = DEFAULT,
) -> None:
    _op_impl(dispatcher, a_data, a_scale, b_data, b_scale, alpha, out)


@_fake(_gemm_out_op)
def _gemm_out_fake(a_data, a_scale, b_data, b_scale, alpha, out, dispatcher=DEFAULT):
    return None


@_define(
    "gemm_w4a16(Tensor a, Tensor b_data, Tensor b_scale, Tensor alpha, ScalarType out_dtype, "
    "SymInt dispatcher=-1, Tensor? bias=None, Tensor? b_prepared=None) -> Tensor"
)
def _gemm_w4a16_op(
    a: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    dispatcher: int = DEFAULT,
    bias: torch.Tensor | None = None,
    b_prepared: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty((a.shape[0], b_data.shape[0]), dtype=out_dtype, device=a.device)
    key = w4a16_key(dispatcher, a, b_data, b_scale, alpha, out_dtype, bias, b_prepared)
    fast = _fast.get(key)
    if fast is not None and fast([a, out]):
        return out
    hit = _op_impl(dispatcher, a, None, b_data, b_scale, alpha, out, bias, b_prepared)
    if hit is not None and out.numel():  # checked before and run as given: keep its replay
        d, dtype = hit
        _fast.keep(key, d, d.dense_plan_key(a, b_data, dtype),
                   (a, b_data, b_scale, alpha, out, bias, b_prepared), [a, out])  # fmt: skip
    return out


@_fake(_gemm_w4a16_op)
def _gemm_w4a16_fake(a, b_data, b_scale, alpha, out_dtype, dispatcher=DEFAULT, bias=None,
                     b_prepared=None):  # fmt: skip
    return a.new_empty((a.shape[0], b_data.shape[0]), dtype=out_dtype)


# under torch.compile Inductor launches the plan's kernels itself where it can
inductor.register_dense_rule(_LIB, _gemm_w4a16_op.op_name, get_dispatcher)


def _grouped_impl(
    did: int,
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The grouped op's body: check the plain-tensor operands (the op is public; no value
    is read, so no host sync), then run through the dispatcher's plan. A signature seen
    before skips the checks (`_checked`, tagged "grouped")."""
    operands = (a, a_scale, b_data, b_scale, alpha, offsets, out)
    sig = ("grouped", did, b_data.data_ptr(), b_scale.data_ptr(), *[_meta(t) for t in operands])
    hit = _checked.get(sig)
    if hit is not None:
        d, dtype = hit
        d.run_grouped(a, a_scale, b_data, b_scale, alpha, offsets, out, dtype)
        return
    if a_scale is None:
        a = checks.dense_activation("a", a)
        k = checks.gemm_k(a.shape[1], "a")
    else:
        a = checks.fp4_data("a", a)
        k = checks.gemm_k(a.shape[1] * 2, "a")
        a_scale = checks.swizzled_scale("a_scale", a_scale, a.shape[0], k)
    e, n = grouped.check_stack(b_data, b_scale, alpha, k)
    grouped.check_offsets(offsets, e)
    dtype = checks.out_dtype_name(out.dtype)
    if tuple(out.shape) != (a.shape[0], n):
        raise ValueError(f"out: expected shape {(a.shape[0], n)}, got {tuple(out.shape)}")
    d = get_dispatcher(did, a.device)
    device = d.check_device("a", a)
    checks.same_device(device, b_data=b_data, b_scale=b_scale, alpha=alpha, offsets=offsets,
                       out=out)  # fmt: skip
    d.run_grouped(a, a_scale, b_data, b_scale, alpha, offsets, out, dtype)
    if len(_checked) >= _CHECKED_MAX:
        _checked.clear()
    _checked[sig] = (d, dtype)


@_define(
    "grouped_gemm(Tensor a, Tensor? a_scale, Tensor b_data, Tensor b_scale, Tensor alpha, "
    "Tensor offsets, ScalarType out_dtype, SymInt dispatcher=-1) -> Tensor"
)
def _grouped_gemm_op(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    dispatcher: int = DEFAULT,
) -> torch.Tensor:
    out = torch.empty((a.shape[0], b_data.shape[1]), dtype=out_dtype, device=a.device)
    _grouped_impl(dispatcher, a, a_scale, b_data, b_scale, alpha, offsets, out)
    return out


@_fake(_grouped_gemm_op)
def _grouped_gemm_fake(a, a_scale, b_data, b_scale, alpha, offsets, out_dtype,
                       dispatcher=DEFAULT):  # fmt: skip
    return a.new_empty((a.shape[0], b_data.shape[1]), dtype=out_dtype)


def _quantize_eager(
    x: torch.Tensor, global_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_nvfp4`'s path (the fused kernel on CUDA) minus its opt-in checks."""
    g = None
    if global_scale is not None:
        g = global_scale.detach().reshape(()).to(device=x.device, dtype=torch.float32)
    # quantize_fields never returns an alias of g (an op's output may not alias its input)
    return quantize_fields(x, g, "swizzled")


def _check_quantize_input(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor [R, K], got shape {tuple(x.shape)}")
    if x.shape[1] % 32:
        raise ValueError(f"x: K must be a multiple of 32 for the GEMM, got K={x.shape[1]}")


@_define("quantize(Tensor x, Tensor? global_scale=None) -> (Tensor, Tensor, Tensor)")
def _quantize_op(
    x: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_quantize_input(x)
    return _quantize_eager(x, global_scale)


@_fake(_quantize_op)
def _quantize_fake(x, global_scale=None):
    _check_quantize_input(x)
    r, k = x.shape
    rows, cols = swizzled_scale_shape(r, k)
    return (
        x.new_empty((r, k // 2), dtype=torch.uint8),
        x.new_empty((rows, cols), dtype=torch.float8_e4m3fn),
        x.new_empty((), dtype=torch.float32),
    )


# ---- the public functions ----------------------------------------------------------------


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D activation ``[M, K]`` (``K % 32 == 0``) without host syncs.

    Returns ``(data uint8 [M, K/2], scale e4m3 swizzled, global_scale float32 [])`` -
    the fields of the `Nvfp4Tensor` `quantize_nvfp4` would give, bit for bit.
    ``global_scale`` (a float32 tensor, decode multiplier) fixes the per-tensor scale,
    e.g. a calibrated static one; None computes ``amax / (6 * 448)`` on the device.
    NaN/inf inputs are not checked here (that would synchronise): their 16-element
    block gets the NaN scale 0x7F and codes 0, other rows are unaffected. Under
    torch.compile this is the ``fp4_dispatch::quantize`` op; eagerly the same code runs
    without the op's dispatch overhead.
    """
    if torch.compiler.is_compiling():
        return torch.ops.fp4_dispatch.quantize(x, global_scale)
    _check_quantize_input(x)
    return _quantize_eager(x, global_scale)


def run(
    dispatcher: Runner | None,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    alpha_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * dequant(a) @ dequant(b).T`` on already checked operands.

    Operands as in `GemmOperands` (swizzled scales, ``alpha`` one float32 element, and
    optionally its second factor ``alpha_b``, multiplied in by the kernel when it can);
    ``dispatcher`` None means the default dispatcher of the operands' device. Under
    torch.compile this becomes the ``fp4_dispatch::gemm`` (or ``gemm_out``) op, so the
    graph holds one opaque call and no dispatcher Python; eagerly it runs the plan
    directly (a custom op's dispatch costs tens of microseconds of host time, more than
    a decode GEMM). Both paths obey the CUDA-graph rules of this module.
    """
    if torch.compiler.is_compiling():
        did = DEFAULT if dispatcher is None else dispatcher.op_id
        if alpha_b is not None:  # the op takes the product (one small fused kernel)
            alpha = (alpha * alpha_b).reshape(1)
        if out is None:
            return torch.ops.fp4_dispatch.gemm(
                a_data, a_scale, b_data, b_scale, alpha, out_dtype, did
            )
        torch.ops.fp4_dispatch.gemm_out(a_data, a_scale, b_data, b_scale, alpha, out, did)
        return out
    d = _resolve(dispatcher, a_data.device)
    dtype = checks.out_dtype_name(out_dtype)
    if out is None:
        out = torch.empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype, device=a_data.device)
    d.run_checked(a_data, a_scale, b_data, b_scale, alpha, out, dtype, alpha_b)
    return out


def run_w4a16(
    dispatcher: Runner | None,
    a: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    b_prepared: torch.Tensor | None = None,
    precision: str = "exact",
) -> torch.Tensor:
    """W4A16 ``alpha * a @ dequant(b).T (+ bias)`` (dense ``a``) on checked operands.

    ``dispatcher`` None: the default dispatcher of ``a``'s device for ``precision``
    (``"fp8"``: it may run the call as W4A8); a given dispatcher uses its own policy.

    Under torch.compile this is the ``fp4_dispatch::gemm_w4a16`` op; eagerly the plan
    runs directly (same CUDA-graph rules as `run`). Both hand ``bias`` and ``b_prepared``
    (the weight bytes in the sm90-prepared order) to the kernel (`DenseOperands`), so a
    compiled model computes the eager bits: the bias in the kernel's epilogue where it
    has one, in fp32 before the one rounding. A caller's ``out`` is written through a
    copy under torch.compile (the op returns a new tensor).
    """
    if torch.compiler.is_compiling():
        did = _DEFAULT_IDS[precision] if dispatcher is None else dispatcher.op_id
        y = torch.ops.fp4_dispatch.gemm_w4a16(a, b_data, b_scale, alpha, out_dtype, did, bias,
                                              b_prepared)  # fmt: skip
        return y if out is None else out.copy_(y)
    d = _resolve(dispatcher, a.device, precision)
    dtype = checks.out_dtype_name(out_dtype)
    if out is None:
        out = torch.empty((a.shape[0], b_data.shape[0]), dtype=out_dtype, device=a.device)
    d.run_dense(a, b_data, b_scale, alpha, out, dtype, bias, b_prepared)
    return out


def run_grouped(
    dispatcher: Runner | None,
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grouped GEMM on checked `GroupedOperands` fields (``a_scale`` None: dense
    ``a``). Under torch.compile the ``fp4_dispatch::grouped_gemm`` op (a caller's ``out``
    is written through a copy); eagerly the plan runs directly. Same CUDA-graph rules as
    `run`; nothing reads ``offsets`` on the host."""
    if torch.compiler.is_compiling():
        did = DEFAULT if dispatcher is None else dispatcher.op_id
        y = torch.ops.fp4_dispatch.grouped_gemm(a, a_scale, b_data, b_scale, alpha, offsets,
                                                out_dtype, did)  # fmt: skip
        return y if out is None else out.copy_(y)
    d = _resolve(dispatcher, a.device)
    dtype = checks.out_dtype_name(out_dtype)
    if out is None:
        out = torch.empty((a.shape[0], b_data.shape[1]), dtype=out_dtype, device=a.device)
    d.run_grouped(a, a_scale, b_data, b_scale, alpha, offsets, out, dtype)
    return out


def warmup(
    dispatcher: Runner,
    shapes: Iterable[tuple[int, int, int]],
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    show_progress: bool | None = None,
) -> dict[PlanKey, Candidate]:
    """Run one GEMM per exact (M, N, K) eagerly so those shapes may be graph-captured.

    This plans (and, inside ``Dispatcher.autotuning()``, tunes), builds, JIT-compiles and
    allocates workspaces outside any capture. Returns the candidate each shape will run.
    Must not be called while capturing.
    """
    if stream_capturing():
        raise RuntimeError("warmup() must run before the CUDA graph capture, not inside it")
    device = torch.device(dispatcher.device.torch_device)
    dtype = checks.out_dtype_name(out_dtype)
    shapes = [tuple(int(v) for v in s) for s in shapes]
    gen = torch.Generator().manual_seed(0)
    done: dict[PlanKey, Candidate] = {}
    for m, n, k in progress(
        shapes, desc="fp4_dispatch warm-up", unit="shape", enable=show_progress
    ):
        qa = quantize_nvfp4(torch.randn(m, k, generator=gen).to(device))
        qb = quantize_nvfp4(torch.randn(n, k, generator=gen).to(device))
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        dispatcher.run_checked(qa.data, qa.scale, qb.data, qb.scale, qa.global_scale, out,
                               dtype, qb.global_scale)  # fmt: skip
        plan = dispatcher.cached_plan(m, n, k, dtype)
        if plan is not None:
            done[(m, n, k, dtype)] = plan.candidate
            log.debug("warm: M=%d N=%d K=%d -> %s %s", m, n, k, plan.candidate.backend,
                      plan.candidate.tactic.canonical_json())  # fmt: skip
    return done
