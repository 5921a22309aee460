"""Plans: what one exact GEMM shape runs, decided once and launched with no further work.

Why: a decode step calls the same few shapes thousands of times, and every microsecond of
Python per call is a microsecond the GPU waits (a bf16 ``nn.Linear`` costs ~22 µs of host
time on the H200 host; a Triton launch alone ~10-15 µs). So the dispatcher resolves an
exact (M, N, K, out dtype) once - tuned winner or heuristic pick, built kernel, swap
orientation - into a `Plan`, and a call is then a dict lookup plus `Plan.__call__`.

A plan is also the unit of the CUDA-graph rule: inside a capture only a plan that has
already run eagerly (``warm``) may launch (see `fp4_dispatch.engine.torch_ops`). Re-tuning makes
new plan objects, so a captured shape whose pick changed is detectable: its new plan is
not warm yet.

Replays. A warm plan whose kernel can record its launches (a kernel attribute
``record``, e.g. `fp4_dispatch.backends.driver_launch.record_launches` for the Triton
kernels) keeps one *replay* per set of fixed operands (the weight, its scales, the
bias...; `Plan.replay_key`): the launches of one recorded call, each with its argument
buffer, relaunched with only the per-call tensors' addresses patched (`Plan.run`). The
per-call layout (strides, dtypes, 16-byte alignment) is part of the key, so a call that
would have compiled or launched differently never replays. A call that cannot be
recorded (see that module) keeps the ordinary path, remembered per key.
`Dispatcher(replay=False)` (default: ``FP4_DISPATCH_REPLAY``, on unless ``0``) makes
plans without them.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from fp4_dispatch.contracts.backend import (
    DenseOperands,
    GemmOperands,
    GroupedOperands,
    Kernel,
    NotTraceable,
)
from fp4_dispatch.contracts.tactics import DENSE_OPERATIONS

if TYPE_CHECKING:
    from fp4_dispatch.policy.ranking import Candidate

#: (M, N, K, out dtype, operation), plus the expert count E for a grouped operation: the
#: exact problem a plan serves
PlanKey = tuple[int, int, int, str, str] | tuple[int, int, int, str, str, int]


class Plan:
    """The built kernel of one candidate for one exact shape, with the swap applied once.

    ``plan(a, sa, b, sb, alpha, out, alpha_b=None)`` takes W4A4 operands in the caller's
    orientation (already checked by the public entry points) and writes ``out``; with
    ``alpha_b`` the scale is ``alpha * alpha_b``, handed to kernels that multiply it
    themselves (``alpha_factors``) and multiplied here for the others (`GemmOperands`).
    `DensePlan` is the W4A16 variant. Iterating a plan gives ``(candidate, kernel)``.
    """

    __slots__ = ("candidate", "factors", "kernel", "key", "record", "replays", "swap", "warm")

    #: argument positions of the per-call tensors (patched on replay): a, sa, alpha, out;
    #: the rest (b, sb, alpha_b) are fixed operands and key the replay
    PER_CALL: tuple[int, ...] = (0, 1, 4, 5)
    FIXED: tuple[int, ...] = (2, 3, 6)
    #: the per-call tensor whose strides the kernels read (out; ``a`` is contiguous)
    STRIDED: tuple[int, ...] = (5,)

    def __init__(
        self, key: PlanKey, candidate: Candidate, kernel: Kernel, replay: bool = True
    ) -> None:
        self.key = key
        self.candidate = candidate
        self.kernel = kernel
        self.swap = bool(candidate.tactic.swap_ab)
        #: whether the kernel takes alpha as two factors (`GemmOperands.alpha_b`)
        self.factors = getattr(type(kernel), "alpha_factors", False) is True
        #: True once it ran outside a capture: only then may a CUDA graph record it
        self.warm = False
        #: the kernel's launch recorder (module docstring), or None: no replays
        self.record = getattr(kernel, "record", None) if replay else None
        #: replay key -> replay (a callable), or None where the call cannot be replayed
        self.replays: dict[Hashable, Any] = {}

    def __call__(
        self,
        a: torch.Tensor,
        sa: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        alpha_b: torch.Tensor | None = None,
    ) -> None:
        if alpha_b is not None and not self.factors:
            alpha, alpha_b = (alpha * alpha_b).reshape(1), None
        if self.swap:
            self.kernel(GemmOperands(b, sb, a, sa, alpha, alpha_b), out.t())
        else:
            self.kernel(GemmOperands(a, sa, b, sb, alpha, alpha_b), out)

    def __iter__(self):
        return iter((self.candidate, self.kernel))

    def trace(self, args: tuple) -> None:
        """State this plan's call on traced operands (as `__call__` takes them) as launches
        torch.compile compiles itself (`fp4_dispatch.engine.inductor`): the ordinary call
        inside the kernel's ``trace`` context. `NotTraceable` where the kernel has none or
        cannot state the call."""
        tracer = getattr(self.kernel, "trace", None)
        if tracer is None:
            raise NotTraceable(f"{self.candidate.backend}: its kernel states no launches")
        with tracer():
            self(*args)

    def replay_key(self, args: tuple) -> Hashable | None:
        """What a replay of `args` depends on beyond the plan's key: the fixed operands'
        addresses and dtypes, the strided per-call tensors' strides, the per-call dtypes;
        None when a per-call address is not 16-byte aligned (never replayed)."""
        align = 0
        key: list[Hashable] = []
        for i in self.PER_CALL:
            t = args[i]
            align |= t.data_ptr()
            key.append(t.dtype)
        if align & 15:
            return None
        for i in self.STRIDED:
            key.append(args[i].stride())
        for i in self.FIXED:
            t = args[i]
            key.append(None if t is None else (t.data_ptr(), t.dtype))
        return tuple(key)

    def run(self, args: tuple) -> None:
        """Run a warm plan on checked `args`: its replay for these fixed operands, recorded
        on the first such call (that call launches normally while it is recorded), else
        the ordinary call."""
        record = self.record
        if record is None or not self.warm:
            self(*args)
            return
        key = self.replay_key(args)
        if key is None:  # an unaligned per-call address: never replayed
            self(*args)
            return
        replay = self.replays.get(key, _UNSEEN)
        per_call = [args[i] for i in self.PER_CALL]
        if replay is _UNSEEN:
            fixed = [args[i] for i in self.FIXED if args[i] is not None]
            with record(repr(self), per_call, fixed) as rec:
                self(*args)
            self.replays[key] = rec.replay
        elif replay is None or not replay(per_call):
            self(*args)

    def __repr__(self) -> str:
        m, n, k, dtype, op = self.key[:5]
        state = "warm" if self.warm else "cold"
        e = f" E={self.key[5]}" if len(self.key) > 5 else ""
        return f"Plan({op} M={m} N={n} K={k}{e} {dtype}: {self.candidate.backend} {state})"


class DensePlan(Plan):
    """A dense plan (W4A16, or W4A8 under ``precision="fp8"``: the same call):
    ``plan(a, b, sb, alpha, out, bias=None, b_prepared=None)`` with
    dense ``a`` (never swapped); ``bias`` goes to kernels with a bias epilogue
    (``bias_epilogue``) and is added after the kernel for the others; ``b_prepared`` is
    handed on as it is (`DenseOperands`)."""

    __slots__ = ("fused_bias",)

    PER_CALL = (0, 4)  # a, out
    FIXED = (1, 2, 3, 5, 6)  # b, sb, alpha, bias, b_prepared
    STRIDED = (0, 4)

    def __init__(
        self, key: PlanKey, candidate: Candidate, kernel: Kernel, replay: bool = True
    ) -> None:
        super().__init__(key, candidate, kernel, replay)
        self.fused_bias = getattr(type(kernel), "bias_epilogue", False) is True

    def __call__(  # type: ignore[override]
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        b_prepared: torch.Tensor | None = None,
    ) -> None:
        if bias is None or self.fused_bias:
            self.kernel(DenseOperands(a, b, sb, alpha, bias=bias, b_prepared=b_prepared), out)
        else:
            self.kernel(DenseOperands(a, b, sb, alpha, b_prepared=b_prepared), out)
            out.add_(bias)


class GroupedPlan(Plan):
    """A grouped W4A16 plan: ``plan(a, b, sb, alpha, offsets, out)`` (`GroupedOperands`:
    ``a`` dense ``[T, K]``, the expert stack, per-expert alpha, device offsets). The
    routing (offsets) and alpha change per call and are patched on replay; the expert
    stack keys it."""

    __slots__ = ()

    PER_CALL = (0, 3, 4, 5)  # a, alpha, offsets, out
    FIXED = (1, 2)  # b, sb
    STRIDED = (0, 5)

    def __call__(  # type: ignore[override]
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self.kernel(GroupedOperands(a, b, sb, alpha, offsets), out)


class GroupedW4A4Plan(Plan):
    """A grouped W4A4 plan: ``plan(a, sa, b, sb, alpha, offsets, out)`` with the NVFP4
    activation's data and swizzled scales (per call) and the expert stack (fixed)."""

    __slots__ = ()

    PER_CALL = (0, 1, 4, 5, 6)  # a, sa, alpha, offsets, out
    FIXED = (2, 3)  # b, sb
    STRIDED = (6,)

    def __call__(  # type: ignore[override]
        self,
        a: torch.Tensor,
        sa: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self.kernel(GroupedOperands(a, b, sb, alpha, offsets, a_scale=sa), out)


def replays_default() -> bool:
    """Whether plans replay their launches unless told (``FP4_DISPATCH_REPLAY``, on
    unless ``0``)."""
    return os.environ.get("FP4_DISPATCH_REPLAY", "1") != "0"


#: a replay key never seen (distinct from None: "seen, cannot be replayed")
_UNSEEN = object()


def plan_for(key: PlanKey, candidate: Candidate, kernel: Kernel, replay: bool = True) -> Plan:
    """The plan class of the key's operation (``replay``: whether it may replay)."""
    cls = _PLAN_CLASSES.get(key[4], DensePlan if key[4] in DENSE_OPERATIONS else Plan)
    return cls(key, candidate, kernel, replay)


_PLAN_CLASSES: dict[str, type[Plan]] = {
    "grouped_w4a16": GroupedPlan,
    "grouped_w4a4": GroupedW4A4Plan,
}
