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

Where the dispatcher's plan cannot be stated (its kernel has no ``trace``: the Gluon ``mma``
kernel, the sm90 pick at one token) and no CUDA graph will replay the compiled step
(``torch._inductor.config.triton.cudagraphs`` off: the default mode), the rule states a
*side plan* instead: the best-ranked candidate whose kernel can be stated, if its call is
estimated shorter than the pick's through the op, host time counted (`_side_plan`:
decode, where the host bounds the step; never a GPU-bound prefill). It is kept beside the
dispatcher's plans, never replaces them (eager calls and CUDA graphs keep the pick), and
runs once on real operands first, through the first-use check where its plugin needs one.

A compiled graph keeps the kernel chosen when it was compiled, as a CUDA graph does;
re-tuning later changes what eager calls run, not the compiled graph (recompile it).

The op stays opaque - its Python implementation per call, as before - when the rule
cannot state the call: a symbolic size (dynamic shapes), a capture in progress, a
non-CUDA device, a plan whose kernel has no ``trace`` or raises `NotTraceable`,
``torch.export`` (which keeps custom ops), or the switch off (`enabled`:
``FP4_DISPATCH_INDUCTOR=0``, read per compile). Each outcome is logged once per plan key.

Inductor's FX-graph and AOTAutograd caches key a compiled graph by the graph, not by this
module's choices: a graph compiled with the switch on is reused with it off (and the
reverse) until those caches are cleared; both compute the same function.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fp4_dispatch.contracts.backend import NotTraceable
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.engine.capture import stream_capturing
from fp4_dispatch.engine.plans import Plan, PlanKey, plan_for
from fp4_dispatch.engine.runner import Runner
from fp4_dispatch.format import checks
from fp4_dispatch.format.nvfp4 import quantize_nvfp4
from fp4_dispatch.loading.guard import PluginFault

log = logging.getLogger(__name__)

__all__ = ["enabled", "register_dense_rule"]

#: (plan key or reason, outcome) already logged
_logged: set[tuple[Any, str]] = set()
_log_lock = threading.Lock()

#: Host time, µs, of one W4A16 call in a default-mode compiled step: through the opaque
#: op (its C++-to-Python dispatch and the kept call's Python, ~37 µs a linear) and as a
#: launch Inductor makes itself (~5 µs, as the compiled bf16 ``mm``) (benchmarks/RESULTS.md,
#: "Eager launch" run 4 and "Whole model" run 4, H100 hosts). A call costs about the
#: larger of its host and GPU times (the host runs ahead of a slower GPU): `_side_plan`
#: compares candidates so.
OPAQUE_OP_HOST_US = 37.0
STATED_HOST_US = 5.0

#: dispatcher -> {plan key: its side plan, or None where no candidate qualified}
_side_plans: weakref.WeakKeyDictionary[Runner, dict[PlanKey, Plan | None]] = (
    weakref.WeakKeyDictionary()
)


def enabled() -> bool:
    """Whether compiled graphs may launch the kernels themselves: unless
    ``FP4_DISPATCH_INDUCTOR=0``. On by default since it ran through on GPUs and took 22%
    off a compiled 8B decode step at batch 1 (benchmarks/RESULTS.md, "Eager launch" run
    11); the switch is the way out should Inductor fail to compile a kernel (that fails
    the whole ``torch.compile``, past any fallback here)."""
    return os.environ.get("FP4_DISPATCH_INDUCTOR", "1") != "0"


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
    if _states_launches(plan) or _graphs_replay():
        return plan
    side = _side_plan(d, key, a.dtype, out_dtype)
    if side is None:
        return plan
    _log_once(
        key, f"{plan.candidate.backend} states no launches; side plan {side.candidate.backend}"
    )
    return side


def _states_launches(plan: Plan) -> bool:
    return getattr(plan.kernel, "trace", None) is not None


def _graphs_replay() -> bool:
    """Whether the step being compiled will replay as a CUDA graph (``mode=
    "reduce-overhead"`` sets this option for the compile), where an op costs no host time."""
    from torch._inductor import config  # noqa: PLC0415

    return bool(config.triton.cudagraphs)


def _side_plan(
    d: Runner, key: PlanKey, a_dtype: torch.dtype, out_dtype: torch.dtype
) -> Plan | None:
    """The warm side plan of `key` (module docstring), made once per dispatcher and key:
    the best-ranked candidate that states its launches and runs right, if its estimated
    call (`STATED_HOST_US`) is shorter than the pick's through the op
    (`OPAQUE_OP_HOST_US`); else None."""
    kept = _side_plans.setdefault(d, {})
    if key in kept:
        return kept[key]
    m, n, k, dtype, op = key[:5]
    problem = Problem(m=m, n=n, k=k, out_dtype=dtype, operation=op)
    ranked = d.candidates(m, n, k, dtype, "w4a16").candidates
    opaque_us = max(ranked[0].est_us, OPAQUE_OP_HOST_US)  # the pick, through the op
    found = None
    for cand in ranked:
        if max(cand.est_us, STATED_HOST_US) >= opaque_us:
            break
        backend = d.registry.backends.get(cand.backend)
        if not getattr(backend, "states_launches", False):
            continue  # not built: a build may compile
        if (cand.backend, cand.tactic) in d.guard.broken:
            continue
        try:
            kernel = d.kernel_for(cand, problem)
        except PluginFault:  # recorded by the guard (the pair is marked broken)
            continue
        plan = plan_for(key, cand, kernel, replay=False)
        if _states_launches(plan) and _runs_right(d, plan, a_dtype, out_dtype):
            found = plan
            break
    kept[key] = found
    return found


def _runs_right(d: Runner, plan: Plan, a_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Run `plan` once on real operands; a plugin's kernel is also checked against the
    reference (`fp4_dispatch.engine.firstuse`). A failure is recorded by the guard."""
    cand = plan.candidate
    with _real():
        args = _operands(d, plan.key, a_dtype, out_dtype)
        try:
            plan(*args)
            wrong = d.first_use.check(plan, args) if d.first_use.needed(plan) else None
        except Exception as exc:  # a plugin's kernel: recorded, not taken
            d.guard.fault(cand.backend, "kernel()", exc, cand.tactic)
            return False
    if wrong is not None:
        d.guard.fault(cand.backend, "kernel() result", wrong, cand.tactic)
        return False
    plan.warm = True
    return True


def _why_opaque(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why a call is not stated for Inductor (module docstring), or None."""
    if not enabled():
        return "FP4_DISPATCH_INDUCTOR=0"
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
    """Run the problem of `key` once through the dispatcher, so its plan is made and warm."""
    with _real():
        a, b, sb, alpha, out, _, _ = _operands(d, key, a_dtype, out_dtype)
        d.run_dense(a, b, sb, alpha, out, key[3])


@contextmanager
def _real() -> Iterator[None]:
    """Outside every tracing mode, without autograd: where real operands can run."""
    from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415

    with _disable_current_modes(), torch.no_grad():
        yield


def _operands(d: Runner, key: PlanKey, a_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple:
    """Real operands of `key`'s problem as a dense plan takes them: random activations, a
    quantized random weight, no bias, no prepared copy."""
    device = torch.device(d.device.torch_device)
    m, n, k = key[:3]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, a_dtype)
    qb = quantize_nvfp4(torch.randn(n, k, generator=gen).to(device))
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    return (x, qb.data, qb.scale, qb.global_scale.reshape(1), out, None, None)


def _log_once(key: Any, outcome: str) -> None:
    with _log_lock:
        if (key, outcome) in _logged:
            return
        _logged.add((key, outcome))
    log.info("torch.compile, %s: %s", key, outcome)
