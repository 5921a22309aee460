"""Under torch.compile, Inductor launches a warm W4A16 plan's Triton kernels itself.

Why: in torch.compile's default mode a custom op runs its Python implementation on every
call - the op's C++-to-Python dispatch plus the kept call's Python, ~37 µs a linear on an
H100 host against ~5 µs for the compiled bf16 ``mm`` it replaces (benchmarks/RESULTS.md,
"Whole model" run 4: compiled decode 0.69x bf16). A kernel Inductor launches from its
generated code pays neither.

How: ``fp4_dispatch::gemm_w4a16`` carries a rule for functionalization
(``FunctionalTensorMode``, the step where torch.compile's AOTAutograd decomposes ops; the
hook ``torch.library.triton_op`` uses for its ops). The rule

1. makes the plan of the call's exact (M, N, K, out dtype) warm on real operands of that
   shape, outside the tracing modes (`_warm`: plans, builds, checks a plugin's first run,
   and tunes inside ``Dispatcher.autotuning()``, as an eager call would);
2. states the plan's call on the traced operands through its kernel's ``trace``
   (`fp4_dispatch.contracts.backend.NotTraceable`): each launch becomes a
   ``wrap_triton`` node that Inductor compiles from the kernel's source and launches;
   split-K scratch is allocated in the graph.

A compiled graph keeps the kernel chosen when it was compiled, as a CUDA graph does;
re-tuning later changes what eager calls run, not the compiled graph (recompile it).

The op stays opaque - its Python implementation per call, as before - when the rule
cannot state the call: a symbolic size (dynamic shapes), a capture in progress, a
non-CUDA device, a plan whose kernel has no ``trace`` or raises `NotTraceable`,
``torch.export`` (which keeps custom ops), or the switch off (`enabled`: opt-in with
``FP4_DISPATCH_INDUCTOR=1``, read per compile). Each outcome is logged once per plan key.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from fp4_dispatch.contracts.backend import NotTraceable
from fp4_dispatch.engine.capture import stream_capturing
from fp4_dispatch.engine.plans import Plan, PlanKey
from fp4_dispatch.engine.runner import Runner
from fp4_dispatch.format import checks
from fp4_dispatch.format.nvfp4 import quantize_nvfp4

log = logging.getLogger(__name__)

__all__ = ["enabled", "register_dense_rule"]

#: (plan key or reason, outcome) already logged
_logged: set[tuple[Any, str]] = set()
_log_lock = threading.Lock()


def enabled() -> bool:
    """Whether compiled graphs may launch the kernels themselves: ``FP4_DISPATCH_INDUCTOR=1``
    (opt-in). Why off by default: a kernel Inductor cannot compile fails the whole
    ``torch.compile`` (after this rule ran, so nothing here can fall back), and the path
    has not yet run to completion on a GPU (benchmarks/RESULTS.md, "Eager launch" run 9)."""
    return os.environ.get("FP4_DISPATCH_INDUCTOR", "0") == "1"


def register_dense_rule(
    lib: torch.library.Library, op_name: str, resolve: Callable[[int, torch.device], Runner]
) -> None:
    """Give `op_name` (the ``gemm_w4a16`` schema) its functionalization rule (module
    docstring); ``resolve(dispatcher id, device)`` finds the op's dispatcher."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode  # noqa: PLC0415

    def rule(mode: Any, op: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        a, b, sb, alpha, out_dtype, did, bias, prepared = _dense_arguments(args, kwargs)
        plan = _traceable_plan(a, b, out_dtype, did, resolve)
        if plan is not None:
            with mode:
                out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
                try:
                    plan.trace((a, b, sb, alpha, out, bias, prepared))
                except NotTraceable as exc:
                    _log_once(plan.key, f"kept as a custom op: {exc}")
                else:
                    _log_once(plan.key, f"launched by Inductor ({plan.candidate.backend})")
                    return out
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(op_name, FunctionalTensorMode, rule, lib=lib)


def _dense_arguments(args: tuple, kwargs: dict) -> tuple:
    """The ``gemm_w4a16`` arguments in schema order, defaults filled in."""
    names = ("dispatcher", "bias", "b_prepared")
    defaults = (-1, None, None)
    rest = [
        args[5 + i] if len(args) > 5 + i else kwargs.get(name, default)
        for i, (name, default) in enumerate(zip(names, defaults, strict=True))
    ]
    return (*args[:5], int(rest[0]), rest[1], rest[2])


def _traceable_plan(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    did: int,
    resolve: Callable[[int, torch.device], Runner],
) -> Plan | None:
    """The warm plan whose call the rule states, or None (the op stays opaque)."""
    why = _why_opaque(a, b)
    if why is not None:
        _log_once(why, f"kept as a custom op: {why}")
        return None
    d = resolve(did, a.device)
    key: PlanKey = d.dense_plan_key(a, b, checks.out_dtype_name(out_dtype))
    plan = d.cached_plan(*key)
    if plan is None or not plan.warm:
        _warm(d, key, a.dtype, out_dtype)
        plan = d.cached_plan(*key)
    if plan is None or not plan.warm:
        _log_once(key, "kept as a custom op: the plan did not become warm")
        return None
    return plan


def _why_opaque(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why a call is not stated for Inductor (module docstring), or None."""
    if not enabled():
        return "FP4_DISPATCH_INDUCTOR is not 1"
    if not torch._functorch.config.decompose_custom_triton_ops:
        return "torch.export keeps custom ops"
    if a.device.type != "cuda":
        return f"device {a.device.type}"
    sizes = (a.shape[0], a.shape[1], b.shape[0])
    if not all(type(v) is int for v in sizes):
        return "a symbolic size (dynamic shapes)"
    if 0 in sizes:
        return "an empty operand"
    if stream_capturing():
        return "compiled inside a CUDA graph capture"
    return None


def _warm(d: Runner, key: PlanKey, a_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Run the problem of `key` once on real operands (random activations, a quantized
    random weight), outside every tracing mode, so its plan is made and warm."""
    from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415

    with _disable_current_modes(), torch.no_grad():
        device = torch.device(d.device.torch_device)
        m, n, k, dtype = key[:4]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=gen).to(device, a_dtype)
        qb = quantize_nvfp4(torch.randn(n, k, generator=gen).to(device))
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        alpha = qb.global_scale.reshape(1)
        d.run_dense(x, qb.data, qb.scale, alpha, out, dtype)


def _log_once(key: Any, outcome: str) -> None:
    with _log_lock:
        if (key, outcome) in _logged:
            return
        _logged.add((key, outcome))
    log.info("torch.compile, %s: %s", key, outcome)
