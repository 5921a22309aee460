"""Kept fast calls: what a compiled `Nvfp4Linear` or a `Dispatcher.gemm` loop pays a GEMM.

The W4A16 custom op keeps them per `w4a16_key`, `Dispatcher.gemm` per `public_gemm_key`.

Why: under ``torch.compile`` (default mode) every NVFP4 GEMM of a model is a call of the
op ``fp4_dispatch::gemm_w4a16`` from Inductor's generated Python, and each call ran the
op's whole path: an operand signature of eight tensors, the plan look-up, the replay's
key, then the replay. Measured on an H100 host (benchmarks/RESULTS.md, "Eager launch
(issue 33)", run 4): the op called directly took 28 µs a call where the eager layer's
kept call (`fp4_dispatch.integrations.nn`) took 15.6 µs for the same plan, and a
two-layer 8B-shaped Llama compiled in default mode stepped at 0.76x bf16's speed.

What: an `OpFastCall` is kept per `w4a16_key` once a call of that key was checked and
ran through a warm plan with a recorded replay (`Runner.replay_of`). A later call with
the same key is one tuple build, one dictionary look-up and the replay's launches. It
holds while the dispatcher's plans are unchanged (``plan_epoch``), no ``autotuning``
block is active, no CUDA-graph capture is under way (a capture takes the engine's
captured path) and the activation's address is 16-byte aligned (what the replay
assumes); otherwise the call takes the ordinary path. The key holds every fact the
replay was recorded under: the activation's shape, strides, dtype and device, the
output dtype, and the weight-side operands' addresses, shapes and dtypes (a replay
launches with the recorded weight addresses; an operand that changed in place at the
same address is read anew by the kernel, as by the plan).

`Dispatcher.gemm` keeps the same kind of call per `public_gemm_key` (the activation's
layout, the weight's fields by address, the output dtype): its checks, layout
conversions, plan look-up and replay key cost ~15 µs a call over the layer's kept call
on an H100 host (benchmarks/RESULTS.md "Eager launch" run 8: 29.9 against 15.0 µs at
16x4096x4096, the same plan).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from fp4_dispatch.engine.capture import stream_capturing
from fp4_dispatch.engine.plans import PlanKey
from fp4_dispatch.engine.runner import Runner
from fp4_dispatch.format.checks import all_aligned
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor

#: kept fast calls at most; emptied when reached (a model has a few hundred GEMM shapes)
MAX_KEPT = 4096


def w4a16_key(
    did: int,
    a: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    b_prepared: torch.Tensor | None,
) -> Hashable:
    """What an `OpFastCall` of the W4A16 op depends on (module docstring)."""
    return (
        did, a.shape, a.stride(), a.dtype, a.get_device(), out_dtype,
        b_data.data_ptr(), b_data.shape, b_data.dtype,
        b_scale.data_ptr(), b_scale.shape, b_scale.dtype,
        alpha.data_ptr(), alpha.dtype,
        None if bias is None else (bias.data_ptr(), bias.shape, bias.dtype),
        None if b_prepared is None else (b_prepared.data_ptr(), b_prepared.shape),
    )  # fmt: skip


class OpFastCall:
    """The replay of one warm plan for one key: ``fast(per_call)`` launches it and returns
    True, or returns False having launched nothing (module docstring: when)."""

    __slots__ = ("dispatcher", "epoch", "replay")

    def __init__(self, dispatcher: Runner, replay: Callable[[list], bool]) -> None:
        self.dispatcher, self.epoch, self.replay = dispatcher, dispatcher.plan_epoch, replay

    def __call__(self, per_call: list[torch.Tensor]) -> bool:
        """``per_call``: the plan's per-call tensors in `Plan.PER_CALL` order."""
        d = self.dispatcher
        if d.plan_epoch != self.epoch or d._autotune_depth or not all_aligned(*per_call):
            return False
        if stream_capturing():
            return False
        return self.replay(per_call)


def public_gemm_key(qa: object, qb: Nvfp4Tensor, out_dtype: torch.dtype | None
                    ) -> Hashable | None:  # fmt: skip
    """What a kept `Dispatcher.gemm` call (no ``out``) depends on, or None for a call that
    is not kept (``qa`` neither a plain tensor nor an `Nvfp4Tensor`, or an operand not in
    swizzled scales and natural bytes: those are converted per call). Holds every fact
    the call's checks and the replay read: the activation's shape, strides, dtype and
    device (W4A4: its data's and scales'), the weight's fields by address and shape, and
    ``out_dtype``."""
    if type(qb) is not Nvfp4Tensor or qb.layout != "swizzled" or qb.data_layout != "natural":
        return None
    b, sb = qb.data, qb.scale
    weight = (b.data_ptr(), b.shape, sb.data_ptr(), sb.shape, qb.global_scale.data_ptr(),
              b.get_device())  # fmt: skip
    if type(qa) is torch.Tensor:
        return (qa.shape, qa.stride(), qa.dtype, qa.get_device(), out_dtype, weight)
    if type(qa) is not Nvfp4Tensor or qa.layout != "swizzled" or qa.data_layout != "natural":
        return None
    a, sa = qa.data, qa.scale
    return (a.shape, a.stride(), sa.shape, sa.stride(), a.get_device(), out_dtype, weight)


class FastCalls:
    """Kept `OpFastCall`s by key: ``get(key)``; ``keep(key, d, plan_key, args, per_call)``
    after an ordinary call that ran checked ``args``.

    A key whose warm plan has no replay (a CPU plan, ``replay=False``, a kernel the
    driver path cannot describe) is remembered with the dispatcher's ``plan_epoch``, so
    its later calls do not ask the plan again until the plans change; only when the
    answer cannot change otherwise (no ``autotuning`` block, an aligned activation:
    `OpFastCall`'s other reasons to decline)."""

    def __init__(self) -> None:
        self._calls: dict[Hashable, OpFastCall] = {}
        #: key -> the ``plan_epoch`` at which its plan had no replay
        self._none: dict[Hashable, int] = {}
        #: keys offered once (`seen_before`)
        self._seen: set[Hashable] = set()

    def seen_before(self, key: Hashable) -> bool:
        """Whether `key` was offered before (and note it). For a caller whose first call
        of a key may also be its plan's first: a plan records its replay on its second
        call, so asking after the first would find none and remember that."""
        if key in self._seen:
            return True
        if len(self._seen) >= MAX_KEPT:
            self._seen.clear()
        self._seen.add(key)
        return False

    def get(self, key: Hashable) -> OpFastCall | None:
        return self._calls.get(key)

    def keep(self, key: Hashable, d: Runner, plan_key: PlanKey, args: tuple,
             per_call: list[torch.Tensor]) -> None:  # fmt: skip
        """Keep the replay the warm plan of `plan_key` recorded for `args` (checked
        operands, as `Runner._run` takes them; ``per_call``: their per-call tensors), if
        any."""
        if self._none.get(key) == d.plan_epoch:
            return
        replay = d.replay_of(plan_key, args)
        if len(self._calls) + len(self._none) >= MAX_KEPT:
            self.clear()
        if replay is not None:
            self._calls[key] = OpFastCall(d, replay)
        elif not d._autotune_depth and all_aligned(*per_call):
            self._none[key] = d.plan_epoch

    def clear(self) -> None:
        self._calls.clear()
        self._none.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._calls)
