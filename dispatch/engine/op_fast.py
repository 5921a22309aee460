"""Fast calls of the W4A16 custom op: what a compiled `Nvfp4Linear` pays per GEMM.

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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from fp4_dispatch.engine.capture import stream_capturing
from fp4_dispatch.engine.runner import Runner

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
    """The replay of one warm plan for one `w4a16_key`: ``fast(a, out)`` launches it and
    returns True, or returns False having launched nothing (module docstring: when)."""

    __slots__ = ("dispatcher", "epoch", "replay")

    def __init__(self, dispatcher: Runner, replay: Callable[[list], bool]) -> None:
        self.dispatcher, self.epoch, self.replay = dispatcher, dispatcher.plan_epoch, replay

    def __call__(self, a: torch.Tensor, out: torch.Tensor) -> bool:
        d = self.dispatcher
        if d.plan_epoch != self.epoch or d._autotune_depth or a.data_ptr() & 15:
            return False
        if stream_capturing():
            return False
        return self.replay([a, out])


class FastCalls:
    """Kept `OpFastCall`s by key: ``get(key)``; ``keep(key, d, m, n, k, dtype, args)``
    after an ordinary call that ran checked ``args`` (`Runner.run_dense` order).

    A key whose warm plan has no replay (a CPU plan, ``replay=False``, a kernel the
    driver path cannot describe) is remembered with the dispatcher's ``plan_epoch``, so
    its later calls do not ask the plan again until the plans change; only when the
    answer cannot change otherwise (no ``autotuning`` block, an aligned activation:
    `OpFastCall`'s other reasons to decline)."""

    def __init__(self) -> None:
        self._calls: dict[Hashable, OpFastCall] = {}
        #: key -> the ``plan_epoch`` at which its plan had no replay
        self._none: dict[Hashable, int] = {}

    def get(self, key: Hashable) -> OpFastCall | None:
        return self._calls.get(key)

    def keep(self, key: Hashable, d: Runner, m: int, n: int, k: int, dtype: str,
             args: tuple) -> None:  # fmt: skip
        """Keep the replay the warm plan of (m, n, k, dtype) recorded for `args`, if any."""
        if self._none.get(key) == d.plan_epoch:
            return
        replay = d.replay_of((m, n, k, dtype, d.dense_operation), args)
        if len(self._calls) + len(self._none) >= MAX_KEPT:
            self.clear()
        if replay is not None:
            self._calls[key] = OpFastCall(d, replay)
        elif not (d._autotune_depth or args[0].data_ptr() & 15):
            self._none[key] = d.plan_epoch

    def clear(self) -> None:
        self._calls.clear()
        self._none.clear()

    def __len__(self) -> int:
        return len(self._calls)
