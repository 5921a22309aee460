"""`Nvfp4Linear`: a drop-in for ``nn.Linear`` with an NVFP4 weight, run by the dispatcher.

Why a module: serving stacks swap ``nn.Linear`` layers for quantized ones and then
``torch.compile`` and CUDA-graph the model. This module keeps the quantized weight in
buffers (so ``state_dict``/``load_state_dict``/``.to()`` work), quantizes activations on
the fly with the sync-free ``fp4_dispatch::quantize`` op and multiplies with the
``fp4_dispatch::gemm`` op (`fp4_dispatch.engine.torch_ops`; eagerly the same code runs without
the ops' dispatch overhead), so a compiled model has no graph break here and a warmed-up
forward can be captured in a CUDA graph (see `fp4_dispatch.engine.torch_ops`).

Numerics: ``y = dequant(quant(x)) @ dequant(W).T + b`` with fp32 accumulation, rounded
to the output dtype. Relative to ``nn.Linear`` on the dequantized weight, the only
extra error is the activation's NVFP4 quantization (about 8% RMS per element for
Gaussian data, averaging down over K in the product).

Output dtype: the input's dtype when it is bfloat16 or float16; for other inputs the
bias's dtype when that is 16-bit, else bfloat16 (the kernels write 16-bit outputs only).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from fp4_dispatch.contracts.tactics import check_precision
from fp4_dispatch.engine import torch_ops
from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.format import checks
from fp4_dispatch.format.nvfp4 import (
    BLOCK_SIZE,
    SM90_GROUP,
    Nvfp4Tensor,
    dequantize,
    kept_quantize,
    quantize_nvfp4,
    sm90_prepare_data,
    swizzled_scale_shape,
)
from fp4_dispatch.support import alloc

__all__ = ["Nvfp4Linear"]

_OUT_DTYPES = tuple(checks.OUT_DTYPES)  # bfloat16, float16 (their one home)
Activations = Literal["auto", "nvfp4", "bf16"]
ACTIVATIONS: tuple[str, ...] = ("auto", "nvfp4", "bf16")
#: buffers whose dtype IS the format: a module-wide dtype cast must never touch them
_QUANTIZED_BUFFERS = ("weight_data", "weight_scale", "weight_global_scale", "input_global_scale")


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change), or None for a tensor
    made under ``torch.inference_mode``, which keeps none."""
    return None if t.is_inference() else t._version


class _NoGradient(torch.autograd.Function):
    """Identity forward; a backward that says why there is no gradient (inference only)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, *requesting: torch.Tensor) -> torch.Tensor:
        # `requesting`: the tensors a gradient was asked for (the input, the bias), so
        # that autograd routes their backward here
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise RuntimeError(
            "Nvfp4Linear is inference-only: no gradient flows through its quantized GEMM "
            "(the input is rounded to NVFP4). Run it under torch.no_grad() or "
            "torch.inference_mode(), or keep the layer as nn.Linear for training."
        )


class Nvfp4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in NVFP4 and ``x`` quantized per call.

    - ``in_features`` must be a multiple of 32 (the GEMM's K rule).
    - ``dispatcher``: the `Dispatcher` to run on; None uses the default dispatcher of
      the input's device (`fp4_dispatch.engine.torch_ops.default_dispatcher`).
    - ``activations``: ``"nvfp4"`` quantizes activations per call (W4A4, FP4 tensor
      cores); ``"bf16"`` keeps them dense (W4A16, weight-only: no activation rounding,
      activations cast to the output dtype); ``"auto"`` (default) is W4A4 on CUDA GPUs
      with FP4 tensor cores (compute capability >= 10) and W4A16 elsewhere (Hopper, the
      CPU: no FP4 tensor cores, so W4A16 is as fast and more accurate). ``repr`` shows
      the choice.
    - ``precision``: the precision policy of the dense (``"bf16"``/resolved ``"auto"``)
      forward. ``"exact"``: W4A16, activations never rounded. ``"fp8"``: the dispatcher
      may also run it as W4A8 (activations and weights rounded to FP8 E4M3 per token and
      per output channel for Hopper's FP8 tensor cores, ~3% relative error; README,
      "Accuracy"), per M bucket whichever ranks or tunes faster, so a layer typically
      runs W4A16 at decode and W4A8 at prefill (`computed_operation`). None (default):
      the given dispatcher's policy, else ``"exact"``; a dispatcher of another policy is
      an error. Without a dispatcher the default one of the device and policy is used
      (`fp4_dispatch.engine.torch_ops.default_dispatcher`). The weight stays NVFP4 either way.
      NVFP4 activations (W4A4) are unaffected.
    - Buffers: ``weight_data`` uint8 ``[out, in/2]``, ``weight_scale`` e4m3 in the
      swizzled 128x4 layout, ``weight_global_scale`` float32 ``[]``, and optionally
      ``input_global_scale`` (a calibrated static activation scale; when absent the
      activation's scale is ``amax / (6 * 448)`` per call, computed on the device).
    - ``bias``: a parameter in ``dtype`` (default bfloat16), or None.
    - ``prepare_weight`` (default True): W4A16 on Hopper (compute capability 9.x, and
      ``in_features % 64 == 0``) also keeps the weight bytes in the ``"sm90-prepared"``
      order (`fp4_dispatch.format.nvfp4.sm90_prepare_data`), which its kernels dequantize in
      fewer instructions (4-10% faster decode on the H200, benchmarks/RESULTS.md). The copy
      costs another ``out * in / 2`` bytes of device memory (half the NVFP4 weight's
      footprint again); it is made at the first eager forward on such a device (outside
      a CUDA-graph capture) and remade when ``weight_data`` changes. Not in the
      ``state_dict``: checkpoints hold the natural bytes only. False: no copy.

    Inference only: asking for a gradient through it raises (at ``backward``).

    Dtype casts (``.to(torch.bfloat16)``, ``.half()``, ``model.to(dtype)``) change only
    the bias: the quantized buffers keep their format dtypes, as in torchao's and
    bitsandbytes' quantized modules. ``.to(device)`` moves everything.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dispatcher: Dispatcher | None = None,
        activations: Activations = "auto",
        prepare_weight: bool = True,
        precision: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
        self.precision = precision_of(precision, dispatcher)
        #: what a dense forward passes `torch_ops.run_w4a16` about the policy: nothing
        #: under "exact" (the call is the one made before the policy existed)
        self._policy_kwargs = {} if self.precision == "exact" else {"precision": self.precision}
        if not isinstance(prepare_weight, bool):
            raise TypeError(f"prepare_weight: expected a bool, got {type(prepare_weight).__name__}")
        self.activations = activations
        self.prepare_weight = prepare_weight
        #: device type -> True when activations stay dense there (resolved "auto")
        self._dense_on: dict[str, bool] = {}
        if in_features <= 0 or in_features % (2 * BLOCK_SIZE):
            raise ValueError(
                f"in_features: expected a positive multiple of {2 * BLOCK_SIZE}, got {in_features}"
            )
        if out_features <= 0:
            raise ValueError(f"out_features: expected a positive int, got {out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.dispatcher = dispatcher
        self.register_buffer(
            "weight_data",
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device),
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(
                swizzled_scale_shape(out_features, in_features),
                dtype=torch.float8_e4m3fn,
                device=device,
            ),
        )
        self.register_buffer(
            "weight_global_scale", torch.ones((), dtype=torch.float32, device=device)
        )
        self.register_buffer("input_global_scale", None)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype or torch.bfloat16, device=device),
                requires_grad=False,
            )
        else:
            self.register_parameter("bias", None)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        dispatcher: Dispatcher | None = None,
        *,
        weight_global_scale: float | torch.Tensor | None = None,
        input_global_scale: float | torch.Tensor | None = None,
        activations: Activations = "auto",
        prepare_weight: bool = True,
        precision: str | None = None,
    ) -> Nvfp4Linear:
        """Quantize ``linear``'s weight (on its device) into a new `Nvfp4Linear`.

        ``weight_global_scale`` defaults to ``amax(|W|) / (6 * 448)``;
        ``input_global_scale`` (decode multiplier of activations) defaults to dynamic;
        ``activations``, ``prepare_weight`` and ``precision`` as in the constructor.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        bias_dtype = w.dtype if w.dtype in _OUT_DTYPES else torch.bfloat16
        mod = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            dispatcher=dispatcher,
            activations=activations,
            prepare_weight=prepare_weight,
            precision=precision,
            device=w.device,
            dtype=bias_dtype,
        )
        mod.load_quantized(quantize_nvfp4(w, weight_global_scale))
        if linear.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        if input_global_scale is not None:
            mod.set_input_global_scale(input_global_scale)
        return mod

    @classmethod
    def from_quantized(
        cls,
        qw: Nvfp4Tensor,
        bias: torch.Tensor | None = None,
        *,
        dispatcher: Dispatcher | None = None,
        input_global_scale: float | torch.Tensor | None = None,
        activations: Activations = "auto",
        prepare_weight: bool = True,
        bias_dtype: torch.dtype | None = None,
        precision: str | None = None,
    ) -> Nvfp4Linear:
        """A new `Nvfp4Linear` on ``qw``'s device holding an already quantized weight
        (``[out, in]``, either scale layout): how a converted model or a loaded NVFP4
        checkpoint becomes a layer without a dense copy of the weight ever existing.

        ``bias`` (``[out]``) is copied in ``bias_dtype`` (default: its own dtype when
        16-bit, else bfloat16); ``input_global_scale``, ``activations``,
        ``prepare_weight`` and ``precision`` as in `from_linear` and the constructor.
        """
        if not isinstance(qw, Nvfp4Tensor):
            raise TypeError(f"qw: expected an Nvfp4Tensor, got {type(qw).__name__}")
        if bias is not None and tuple(bias.shape) != (qw.rows,):
            raise ValueError(f"bias: expected shape ({qw.rows},), got {tuple(bias.shape)}")
        if bias_dtype is None and bias is not None:
            bias_dtype = bias.dtype if bias.dtype in _OUT_DTYPES else torch.bfloat16
        mod = cls(qw.k, qw.rows, bias=bias is not None, dispatcher=dispatcher,
                  activations=activations, prepare_weight=prepare_weight,
                  precision=precision, device=qw.device, dtype=bias_dtype)  # fmt: skip
        mod.load_quantized(qw)
        if bias is not None:
            mod.bias.data.copy_(bias.detach())
        if input_global_scale is not None:
            mod.set_input_global_scale(input_global_scale)
        return mod

    def load_quantized(self, qw: Nvfp4Tensor) -> None:
        """Take an already quantized ``[out, in]`` weight (either scale layout)."""
        if not isinstance(qw, Nvfp4Tensor):
            raise TypeError(f"qw: expected an Nvfp4Tensor, got {type(qw).__name__}")
        if qw.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"qw: expected shape {(self.out_features, self.in_features)}, got {qw.shape}"
            )
        qw = qw.with_layout("swizzled").to(self.weight_data.device)
        self.__dict__.pop("_prepared_cache", None)  # the prepared copy is of the old bytes
        self.__dict__.pop("_fast", None)
        with torch.no_grad():
            self.weight_data.copy_(qw.data)
            self.weight_scale.copy_(qw.scale)
            self.weight_global_scale.copy_(qw.global_scale)

    def set_input_global_scale(self, scale: float | torch.Tensor | None) -> None:
        """Fix the activation's global (decode) scale, or None for per-call dynamic."""
        if scale is None:
            self.input_global_scale = None
            return
        t = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())
        if not bool(torch.isfinite(t)) or float(t) <= 0:
            raise ValueError(f"input_global_scale: expected a finite value > 0, got {float(t)}")
        self.input_global_scale = t.to(self.weight_data.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Accept a calibrated ``input_global_scale`` even when this module has none yet."""
        self.__dict__.pop("_prepared_cache", None)  # the prepared copy is of the old bytes
        self.__dict__.pop("_fast", None)
        key = prefix + "input_global_scale"
        if key in state_dict and self.input_global_scale is None:
            self.input_global_scale = torch.ones((), device=self.weight_data.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        """Let a dtype cast reach the bias only; device moves still move the buffers."""
        kept = {n: self._buffers[n] for n in _QUANTIZED_BUFFERS if self._buffers.get(n) is not None}
        self.__dict__.pop("_prepared_cache", None)  # remade on the next forward where it runs
        self.__dict__.pop("_fast", None)
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:  # cast by fn: undo the cast, keep the device move
                self._buffers[name] = old.to(device=new.device)
        return self

    # ---- views ------------------------------------------------------------------------

    def quantized_weight(self) -> Nvfp4Tensor:
        """The weight as an `Nvfp4Tensor` (views of the buffers, swizzled scales)."""
        return Nvfp4Tensor(
            self.weight_data,
            self.weight_scale,
            self.weight_global_scale,
            "swizzled",
            (self.out_features, self.in_features),
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the GEMM actually multiplies by, as float32 ``[out, in]``."""
        return dequantize(self.quantized_weight())

    def extra_repr(self) -> str:
        scale = "dynamic" if self.input_global_scale is None else "static"
        acts = self.activations
        if acts == "auto" and self._dense_on:
            acts += " (" + ", ".join(
                f"{dev}: {'w4a16' if dense else 'w4a4'}" for dev, dense in self._dense_on.items()
            ) + ")"  # fmt: skip
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activations={acts}, activation_scale={scale}, "
            f"precision={self.precision}"
        )

    def operation(self, device: torch.device | str | None = None) -> str:
        """``"w4a16"`` or ``"w4a4"``: what a forward on `device` runs. "auto" resolves to
        W4A4 only on a CUDA GPU with FP4 tensor cores (compute capability >= 10) and to
        W4A16 everywhere else: Hopper and the CPU have no FP4 tensor cores, so there
        rounding the activations buys no speed and costs accuracy (logits cosine against
        the dequantized twin of a small Llama on the CPU: 0.987 W4A4, 0.99997 W4A16;
        docs/checkpoints.md, "Activations")."""
        if self.activations != "auto":
            return "w4a16" if self.activations == "bf16" else "w4a4"
        dev = torch.device(device if device is not None else self.weight_data.device)
        key = str(dev)
        dense = self._dense_on.get(key)
        if dense is None:
            dense = dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 10
            self._dense_on[key] = dense
        return "w4a16" if dense else "w4a4"

    def computed_operation(
        self, m: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> str:
        """What a forward of `m` tokens on `device` computes: ``"w4a4"``, ``"w4a16"`` or,
        under ``precision="fp8"``, ``"w4a8"`` where the dispatcher's pick for that M (the
        bucket's tuned winner, else the heuristic pick) is a W4A8 candidate. ``dtype``:
        the output dtype (default bfloat16)."""
        op = self.operation(device)
        if op != "w4a16":
            return op
        dev = torch.device(device if device is not None else self.weight_data.device)
        d = self.dispatcher or torch_ops.default_dispatcher(dev, self.precision)
        dtype = checks.out_dtype_name(torch.bfloat16 if dtype is None else dtype)
        return d.select(m, self.out_features, self.in_features, dtype, "w4a16").operation

    # ---- forward ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self._forward_eager(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: expected last dimension {self.in_features}, got shape {tuple(x.shape)}"
            )
        out_dtype = self._out_dtype(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.operation(x.device) == "w4a16":
            # the bias into the GEMM, as eagerly (same bits); natural weight bytes only:
            # the kept prepared copy is eager state (`_prepared_weight`)
            alpha = self.weight_global_scale.reshape(1)
            y = torch_ops.run_w4a16(self.dispatcher, x2.to(out_dtype), self.weight_data,
                                    self.weight_scale, alpha, out_dtype, None,
                                    self._bias_in(self.bias, out_dtype),
                                    **self._policy_kwargs)  # fmt: skip
        else:
            a, sa, ga = torch_ops.quantize(x2, self.input_global_scale)
            alpha = (ga * self.weight_global_scale).reshape(1)
            y = torch_ops.run(
                self.dispatcher, a, sa, self.weight_data, self.weight_scale, alpha, out_dtype
            )
            if self.bias is not None:
                b = self.bias
                y = y.add_(b) if b.dtype == out_dtype else y + b.to(out_dtype)
        if torch.is_grad_enabled() and (x.requires_grad or self._bias_wants_grad()):
            wanting = [t for t in (x, self.bias) if t is not None and t.requires_grad]
            y = _NoGradient.apply(y, *wanting)
        return y.reshape(*lead, self.out_features)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` outside torch.compile: the same computation with the per-call Python
        cut to what a decode step needs (measured on the host: module attribute look-ups,
        reshapes and views are ~1 µs each, a custom op's dispatch tens of µs) - buffers
        read from the module's dicts, no reshape of a 2-D input, the W4A16 alpha view
        made once per weight-scale buffer, the activation mode cached per device. A call
        that matches the layer's kept fast call (`_FastCall`) is one comparison, the
        output's allocation and the plan's replayed launches."""
        fast = self.__dict__.get("_fast")
        if fast is not None:
            y = fast(x, self._buffers, self._parameters["bias"])
            if y is not None:
                return y
        k = self.in_features
        shape = x.shape
        if shape[-1] != k:
            raise ValueError(f"x: expected last dimension {k}, got shape {tuple(shape)}")
        d = self.dispatcher
        if d is not None:
            d.check_device("x", x)
        out_dtype = x.dtype if x.dtype in _OUT_DTYPES else self._out_dtype(x)
        x2 = x if len(shape) == 2 else x.reshape(-1, k)
        bufs = self._buffers
        bias = self._parameters["bias"]
        if self._dense(x.device):
            if x2.dtype != out_dtype:
                x2 = x2.to(out_dtype)
            if x2.stride(1) != 1:  # the W4A16 kernels need unit stride along K
                x2 = x2.contiguous()
            # the bias goes into the GEMM's epilogue (or is added right after it)
            w = bufs["weight_data"]
            args = (x2, w, bufs["weight_scale"], self._weight_alpha(bufs), None,
                    self._bias_in(bias, out_dtype), self._prepared_weight(w))  # fmt: skip
            y = torch_ops.run_w4a16(d, x2, *args[1:4], out_dtype, *args[4:],
                                    **self._policy_kwargs)  # fmt: skip
            if x.device.type == "cuda" and not x.requires_grad:
                self._keep_fast(x, y, args, d)
        else:
            a, sa, ga = torch_ops.quantize(x2, bufs["input_global_scale"])
            # alpha as two factors (no product kernel when the GEMM kernel multiplies them)
            y = torch_ops.run(d, a, sa, bufs["weight_data"], bufs["weight_scale"], ga,
                              out_dtype, None, bufs["weight_global_scale"])  # fmt: skip
            if bias is not None:
                y = y.add_(bias) if bias.dtype == out_dtype else y + bias.to(out_dtype)
            if x.device.type == "cuda" and not x.requires_grad:
                self._keep_fast_w4a4(x, x2, (a, sa, ga), y, d)
        if torch.is_grad_enabled() and (x.requires_grad or self._bias_wants_grad()):
            wanting = [t for t in (x, bias) if t is not None and t.requires_grad]
            y = _NoGradient.apply(y, *wanting)
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)

    def _keep_fast(self, x: torch.Tensor, y: torch.Tensor, args: tuple, d: Dispatcher | None
                   ) -> None:  # fmt: skip
        """Keep a `_FastCall` for calls shaped like `x` once the plan of this W4A16 call
        has a replay for this layer's weight (`Dispatcher.replay_of`)."""
        bias = self._parameters["bias"]
        if bias is not None and (bias.requires_grad or args[5] is not bias):
            return  # a per-call cast of the bias, or autograd: keep the ordinary path
        d = d if d is not None else torch_ops.default_dispatcher(x.device, self.precision)
        x2, w, sb, alpha, _, bias_arg, prepared = args
        key = d.dense_plan_key(x2, w, checks.out_dtype_name(y.dtype))
        y2 = y if y.dim() == 2 else y.view(x2.shape[0], self.out_features)
        replay = d.replay_of(key, (x2, w, sb, alpha, y2, bias_arg, prepared))
        if replay is not None:
            self.__dict__["_fast"] = _FastCall(x, y, replay, d, self._buffers, bias, prepared)

    def _keep_fast_w4a4(self, x: torch.Tensor, x2: torch.Tensor, quantized: tuple,
                        y: torch.Tensor, d: Dispatcher | None) -> None:  # fmt: skip
        """Keep a `_FastCallW4A4` for calls shaped like `x` once both launches of this W4A4
        call have replays: the activation quantize (`kept_quantize`) and the GEMM plan's
        (`Dispatcher.replay_of`)."""
        bias = self._parameters["bias"]
        if bias is not None and (bias.requires_grad or bias.dtype != y.dtype):
            return  # a per-call cast of the bias, or autograd: keep the ordinary path
        if x2.data_ptr() & 15:  # the replays are recorded for aligned inputs only
            return
        bufs = self._buffers
        igs = bufs["input_global_scale"]
        g = None if igs is None else igs.detach().reshape(())
        if g is not None and (g.dtype != torch.float32 or g.device != x.device):
            return  # the ordinary path copies it per call
        quantize = kept_quantize(x2, g)
        if quantize is None:
            return
        d = d if d is not None else torch_ops.default_dispatcher(x.device)
        a, sa, ga = quantized
        w, sb, wgs = bufs["weight_data"], bufs["weight_scale"], bufs["weight_global_scale"]
        key = d.w4a4_plan_key(a, w, checks.out_dtype_name(y.dtype))
        y2 = y if y.dim() == 2 else y.view(x2.shape[0], self.out_features)
        replay = d.replay_of(key, (a, sa, w, sb, ga, y2, wgs))
        if replay is not None:
            self.__dict__["_fast"] = _FastCallW4A4(x, y, replay, d, bufs, bias, quantize, igs)

    @staticmethod
    def _bias_in(bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
        """The bias as the W4A16 GEMM adds it: in the output dtype (cast per call only
        when it differs, as the unfused ``y + bias.to(out_dtype)`` did)."""
        if bias is None or bias.dtype == out_dtype:
            return bias
        return bias.to(out_dtype)

    def _weight_alpha(self, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``weight_global_scale`` as a one-element view (W4A16 alpha), remade only when
        the buffer object changes (``.to(device)``, assignment); a view, so in-place
        loads (``load_state_dict``, `load_quantized`) are seen."""
        wgs = bufs["weight_global_scale"]
        cached = self.__dict__.get("_alpha_cache")
        if cached is None or cached[0] is not wgs:
            cached = self.__dict__["_alpha_cache"] = (wgs, wgs.reshape(1))
        return cached[1]

    def _prepared_weight(self, w: torch.Tensor) -> torch.Tensor | None:
        """``w`` (the ``weight_data`` buffer) in the sm90-prepared byte order where a
        W4A16 forward on its device reads it (``prepare_weight``), else None. Made once and
        kept with the identity and version counter of ``w``: a new buffer or an in-place
        change makes it again. `load_quantized` and ``load_state_dict`` drop it outright
        (a buffer made under ``torch.inference_mode`` has no version counter)."""
        cached = self.__dict__.get("_prepared_cache")
        if cached is not None and cached[0]() is w and cached[1] == _version(w):
            return cached[2]
        if not (self.prepare_weight and self._prepares_on(w.device)):
            return None
        if torch_ops.stream_capturing():  # never allocate a kept tensor inside a capture
            return None
        prepared = sm90_prepare_data(w)
        self.__dict__["_prepared_cache"] = (weakref.ref(w), _version(w), prepared)
        return prepared

    def _prepares_on(self, device: torch.device) -> bool:
        """Whether W4A16 on `device` reads prepared bytes: a Hopper GPU (compute
        capability 9.x, whose sm90 W4A16 kernels take them) and ``in_features % 64 == 0``
        (the layout's rule); cached per device."""
        cache = self.__dict__.setdefault("_prepares_by_device", {})
        hit = cache.get(device)
        if hit is None:
            hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            hit = cache[device] = hopper and self.in_features % (2 * SM90_GROUP) == 0
        return hit

    def _dense(self, device: torch.device) -> bool:
        """Whether a forward on `device` keeps activations dense (W4A16); the resolution
        of "auto" is cached per device object."""
        acts = self.activations
        if acts != "auto":
            return acts == "bf16"
        cache = self.__dict__.setdefault("_dense_by_device", {})
        dense = cache.get(device)
        if dense is None:
            dense = cache[device] = self.operation(device) == "w4a16"
        return dense

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The input's dtype when 16-bit; else the bias's when 16-bit; else bfloat16."""
        if x.dtype in _OUT_DTYPES:
            return x.dtype
        if self.bias is not None and self.bias.dtype in _OUT_DTYPES:
            return self.bias.dtype
        return torch.bfloat16

    def _bias_wants_grad(self) -> bool:
        return self.bias is not None and self.bias.requires_grad


def precision_of(precision: str | None, dispatcher: Dispatcher | None) -> str:
    """The layer's precision policy: `precision`, else the dispatcher's, else "exact";
    a ValueError when both are given and differ (the dispatcher decides what runs)."""
    theirs = getattr(dispatcher, "precision", None) if dispatcher is not None else None
    if precision is None:
        return theirs or "exact"
    check_precision(precision)
    if theirs is not None and theirs != precision:
        raise ValueError(
            f"precision: expected the dispatcher's policy {theirs!r} (or None), got "
            f"{precision!r}; pass Dispatcher(precision={precision!r}) or leave dispatcher=None"
        )
    return precision


class _FastCall:
    """An eager W4A16 call of one layer at one input signature, kept by the layer: the
    plan's replay (`fp4_dispatch.engine.plans`) for this layer's weight, run with nothing but a
    comparison of the input's signature, the output's allocation and the launches.

    A call takes it only when everything the replay was recorded with still holds: the
    input's shape, dtype, strides and device; no gradient asked for; the same weight,
    scale, global-scale and bias objects (and the weight's version counter, which the
    prepared copy follows); the dispatcher's plans unchanged (`Dispatcher.plan_epoch`)
    and no `Dispatcher.autotuning` block active. Anything else returns None and the
    layer runs its ordinary path (which may keep a new fast call)."""

    __slots__ = ("bias", "device", "dispatcher", "dtype", "epoch", "index", "out_dtype",
                 "out_shape", "out_stride", "prepared", "replay", "shape", "stride",
                 "version", "weights")  # fmt: skip

    def __init__(self, x: torch.Tensor, y: torch.Tensor, replay, d: Dispatcher,
                 bufs: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 prepared: torch.Tensor | None) -> None:  # fmt: skip
        self.shape, self.dtype, self.stride = x.shape, x.dtype, x.stride()
        self.index, self.device = x.get_device(), x.device
        self.out_shape, self.out_dtype = (*x.shape[:-1], y.shape[-1]), y.dtype
        self.out_stride = alloc.contiguous_strides(self.out_shape)
        self.replay, self.dispatcher, self.epoch = replay, d, d.plan_epoch
        w = bufs["weight_data"]
        self.weights = (w, bufs["weight_scale"], bufs["weight_global_scale"])
        self.version = _version(w)
        self.bias, self.prepared = bias, prepared

    def holds(self, x: torch.Tensor, bufs: dict[str, torch.Tensor],
              bias: torch.Tensor | None) -> bool:  # fmt: skip
        """Whether a call with `x` may take this fast call (the class docstring's list)."""
        w, sb, g = self.weights
        d = self.dispatcher
        return not (x.shape != self.shape or x.dtype is not self.dtype
                    or x.stride() != self.stride or x.requires_grad
                    or x.get_device() != self.index or bias is not self.bias
                    or bufs["weight_data"] is not w or bufs["weight_scale"] is not sb
                    or bufs["weight_global_scale"] is not g or _version(w) != self.version
                    or d.plan_epoch != self.epoch or d._autotune_depth
                    or x.data_ptr() & 15)  # fmt: skip

    def __call__(self, x: torch.Tensor, bufs: dict[str, torch.Tensor],
                 bias: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        if not self.holds(x, bufs, bias):
            return None
        y = alloc.empty(self.out_shape, self.out_stride, self.out_dtype, self.device)
        return y if self.replay((x, y)) else None


class _FastCallW4A4(_FastCall):
    """An eager W4A4 call of one layer at one input signature: the activation quantize's
    replay and the GEMM plan's replay launched back to back, with the bias (if any)
    added after them as the ordinary path does. Taken under `_FastCall`'s conditions and
    only while the layer's ``input_global_scale`` buffer is the object it was kept with
    (a static scale is read by the kernel through its address; None: dynamic)."""

    __slots__ = ("input_scale", "quantize")

    def __init__(self, x: torch.Tensor, y: torch.Tensor, replay, d: Dispatcher,
                 bufs: dict[str, torch.Tensor], bias: torch.Tensor | None, quantize,
                 input_scale: torch.Tensor | None) -> None:  # fmt: skip
        super().__init__(x, y, replay, d, bufs, bias, None)
        self.quantize, self.input_scale = quantize, input_scale

    def __call__(self, x: torch.Tensor, bufs: dict[str, torch.Tensor],
                 bias: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        if bufs["input_global_scale"] is not self.input_scale or not self.holds(x, bufs, bias):
            return None
        quantized = self.quantize(x)  # reads x's address only: any rank of the same rows
        if quantized is None:
            return None
        a, sa, ga = quantized
        y = alloc.empty(self.out_shape, self.out_stride, self.out_dtype, self.device)
        if not self.replay((a, sa, ga, y)):
            return None
        return y if bias is None else y.add_(bias)
