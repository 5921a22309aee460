"""New uninitialized tensors for the eager fast paths, at the caching allocator's own cost.

Why: ``torch.empty`` of a CUDA tensor goes through the dispatcher and costs 1.9-3.0 µs of
host time a call on an H100 host, the function Inductor's generated code allocates with
(``torch._C._dynamo.guards._empty_strided_cuda``) 1.0-1.1 µs; a kept one-row quantize
spent 11.7 of its 18.2 µs making its outputs (benchmarks/RESULTS.md, "Eager launch" run
13). The fast paths (a kept quantize, a layer's fast call, ``gemm``'s kept call) allocate
through `empty` instead.

That function allocates on the *current* CUDA device (from the current stream's pool, as
``torch.empty`` does), so it is taken only when the wanted device is the current one;
under ``torch.inference_mode()`` it gives an inference tensor as ``torch.empty`` does. Where
torch lacks it (a CPU build, a future rename) ``torch.empty_strided`` serves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: (shape, stride, dtype) -> a new uninitialized tensor on the current CUDA device
Allocator = Callable[[tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor]


def _lookup_direct() -> tuple[Allocator | None, Callable[[], int] | None]:
    """Inductor's CUDA allocator and the current-device query, or None for each absent."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, "_empty_strided_cuda", None), getattr(torch._C, "_cuda_getDevice", None)


_DIRECT, _CURRENT = _lookup_direct()


def direct_allocator(device: torch.device) -> Allocator | None:
    """Inductor's allocator when `device` is the current CUDA device, else None (another
    device, a CPU tensor, a torch without it)."""
    if _DIRECT is None or _CURRENT is None or device.type != "cuda":
        return None
    return _DIRECT if device.index is None or device.index == _CURRENT() else None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of `shape` (what ``torch.empty(shape)`` has)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def empty(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:  # fmt: skip
    """A new uninitialized tensor of `shape`, `stride` and `dtype` on `device`: through
    `direct_allocator` where it serves, else ``torch.empty_strided``."""
    new = direct_allocator(device)
    if new is not None:
        return new(shape, stride, dtype)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)
