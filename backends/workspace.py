"""Device scratch buffers a kernel keeps for its whole life, made outside CUDA-graph pools.

Why: a split-K kernel needs fp32 partial tiles and per-tile counters. Allocating them per
call costs an allocation and a memset launch on the hot path; keeping them on the kernel
broke torch.compile's CUDA-graph trees once, because the first (warm-up) call runs with
every allocation *of the current thread* routed into the graph's private memory pool,
and a buffer from that pool that outlives the graph is rejected. So the buffers are made
on a short-lived helper thread (outside any pool routing), zeroed once, synchronised once,
and then reused by every call. The kernels that use them reset their counters themselves,
so no call needs a memset.

Buffers are never freed or replaced while the owner lives: a CUDA graph that recorded a
launch keeps pointing at them. A kernel object that owns scratch must therefore not run on
two streams at once (like cuBLAS workspaces).

Under torch.compile (`fp4_dispatch.backends.triton_launch.tracing`) the buffers are
instead operations of the traced graph: a compiled graph cannot own a kept buffer, and
nothing made while tracing is kept. One pair serves every launch the graph states
(`_traced_pair`): its counters are zeroed once per call of the graph and each kernel
leaves them zero, as with the kept pairs, so a linear in a compiled step costs no
zero-fill launch and no scratch allocation of its own. Inductor runs the kernels on the
one pair in place, in graph order (it re-inplaces a functionalized Triton call whose
mutated input has no later reader).
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fp4_dispatch.backends import triton_launch

log = logging.getLogger(__name__)


class Scratch:
    """``scratch.get(device, floats, counters)`` -> (fp32 buffer, zeroed int32 counters).

    One pair per distinct (device, floats, counters), made on first use outside any
    CUDA-graph memory pool (module docstring) and kept for the owner's lifetime.
    """

    def __init__(self) -> None:
        #: (device type, device index, floats, counters) -> pair (no ``str(device)``: this
        #: look-up runs on every split-K call)
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(
        self, device: torch.device, floats: int, counters: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if triton_launch.tracing_active():
            return _traced_pair(device, floats, counters)
        key = (device.type, device.index, floats, counters)
        pair = self._buffers.get(key)
        if pair is None:
            with self._lock:
                pair = self._buffers.get(key)
                if pair is None:
                    pair = self._buffers[key] = _make_outside_pools(device, floats, counters)
        return pair

    def __len__(self) -> int:
        return len(self._buffers)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (buffer, counters) pair made so far (tests check the counters reset)."""
        return list(self._buffers.values())


_ONES: dict[tuple[bool, int], torch.Tensor] = {}


def one_like(t: torch.Tensor) -> torch.Tensor:
    """A float32 ``[1]`` tensor holding 1.0 on `t`'s device, made once per device outside
    CUDA-graph pools (like `Scratch`) and kept for the process: the neutral second
    factor of a kernel that takes alpha as two (`fp4_dispatch.contracts.backend.GemmOperands`).
    Looked up by ``(t.is_cuda, t.get_device())``, not ``t.device`` (a hot-path call)."""
    if triton_launch.tracing_active():
        return _traced_one(t.device)
    key = (t.is_cuda, t.get_device())
    o = _ONES.get(key)
    if o is None:
        device = t.device
        ws, _ = _make_outside_pools(device, 1, 1)
        o = _ONES[key] = ws.fill_(1.0)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # once, off the hot path
    return o


#: counters a traced graph's pair holds at least (16 KiB): a graph's split-K launches
#: rarely need more, so one zero-fill serves the graph (`_traced_pair`)
TRACED_COUNTERS_MIN = 4096

#: the traced graphs' scratch: functionalization mode (one per graph being traced) ->
#: {(device type, device index): (partials, counters); (type, index, "one"): ``[1.0]``}
_graph_scratch: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _graph_pool() -> dict[tuple, Any] | None:
    """The scratch of the graph being traced (keyed by its functionalization mode, active
    while torch.compile states a launch: `fp4_dispatch.engine.inductor`), or None outside
    functionalization."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL)
    return None if mode is None else _graph_scratch.setdefault(mode, {})


def _traced_pair(
    device: torch.device, floats: int, counters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters) for a launch being stated: the graph's shared pair, remade
    larger where this launch needs more (module docstring); a new pair per call outside
    functionalization."""
    pool = _graph_pool()
    if pool is None:
        return _pair(device, floats, counters)
    key = (device.type, device.index)
    ws, cnt = pool.get(key, (None, None))
    if ws is None or ws.numel() < floats:
        ws = torch.empty(floats, dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < counters:
        cnt = torch.zeros(max(counters, TRACED_COUNTERS_MIN), dtype=torch.int32, device=device)
    pool[key] = (ws, cnt)
    return ws, cnt


def _traced_one(device: torch.device) -> torch.Tensor:
    """`one_like` for a launch being stated: one ``[1.0]`` per graph and device."""
    pool = _graph_pool()
    if pool is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    key = (device.type, device.index, "one")
    one = pool.get(key)
    if one is None:
        one = pool[key] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def _pair(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A new (float32 partials, zeroed int32 counters) pair: kept by `Scratch` (`_make`),
    or operations of the graph being traced (module docstring)."""
    ws = torch.empty(floats, dtype=torch.float32, device=device)
    return ws, torch.zeros(counters, dtype=torch.int32, device=device)


def _make(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws, cnt = _pair(device, floats, counters)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # once per buffer, off the hot path
    return ws, cnt


def _make_outside_pools(
    device: torch.device, floats: int, counters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kernel scratch (split-K partials, expanded activations) requested inside a "
            "CUDA graph capture: run this GEMM shape "
            "once eagerly before capturing"
        )
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4-scratch") as pool:
        pair = pool.submit(_make, device, floats, counters).result()
    log.debug("scratch on %s: %d floats, %d counters", device, floats, counters)
    return pair
