"""Low-overhead launches of Triton kernels: compile once per specialization, then call
the compiled kernel directly.

Why: ``kernel[grid](*args)`` re-binds every argument, recomputes the specialization key
and looks the kernel up in Triton's cache on every call - 10-15 µs of host time on the
H200 host, more than the GPU time of a decode-sized quantize (~1-2 µs). A serving hot
path calls the same shape thousands of times, so `CachedLauncher` does that work once
per *specialization* and afterwards hands the arguments straight to the compiled
kernel's launcher (``CompiledKernel[grid](*all_args)``, the call Triton's own
``JITFunction.run`` ends with).

A specialization is everything Triton's compiled binary depends on: the constexpr
values, the launch options (``num_warps``...), every tensor's dtype and 16-byte
alignment, and every integer's "== 1" and "divisible by 16" properties plus whether it
needs 64 bits. `specialization_key` computes exactly those, so a cached binary is never
reused for arguments it was not compiled for (a misaligned slice would otherwise hit a
kernel compiled with aligned vector loads).

Fallback. Under ``TRITON_INTERPRET=1`` there is no compiled kernel; on a Triton whose
``JITFunction.run`` does not return one, or whose compiled kernel cannot be indexed by
a grid, the launcher logs once and keeps using the ordinary ``kernel[grid](...)`` path
(correct, just slower). The fast path only ever runs with arguments whose
specialization key matches the one that compiled the kernel.

The kernel's parameters must be passed *all* positionally in declaration order by the
caller's ``args`` (runtime values) and ``constexprs`` (by name); `CachedLauncher`
interleaves them by the kernel's parameter names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["CachedLauncher", "specialization_key"]

_INT32_MAX = 2**31 - 1


def _arg_key(value: object) -> Hashable:
    """The properties of one runtime argument that Triton specializes a binary on."""
    if isinstance(value, torch.Tensor):
        return ("t", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value == 1, value % 16 == 0, not -_INT32_MAX - 1 <= value <= _INT32_MAX)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return ("n",)
    raise TypeError(f"args: unsupported kernel argument type {type(value).__name__}")


def specialization_key(args: Sequence[object]) -> tuple[Hashable, ...]:
    """Key of the runtime arguments: equal keys can share one compiled binary."""
    return tuple(_arg_key(a) for a in args)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


class CachedLauncher:
    """Launch one ``@triton.jit`` kernel, compiling once per specialization.

    ``launcher(grid, args, constexprs, num_warps=4)``: ``args`` are the kernel's
    runtime parameters in declaration order, ``constexprs`` the constexpr parameters by
    name. The first call of a specialization goes through ``kernel[grid]`` (which
    compiles); later calls launch the compiled binary directly.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", None) or getattr(
            getattr(kernel, "fn", None), "__name__", "kernel"
        )
        self._compiled: dict[Hashable, Any] = {}
        self._runners: dict[tuple[Hashable, tuple[int, ...]], Any] = {}
        self._fast = not _interpreting()
        self._order: list[str] | None = None

    def _param_order(self) -> list[str]:
        if self._order is None:
            self._order = list(self.kernel.arg_names)
        return self._order

    def _all_args(self, args: Sequence[object], constexprs: dict[str, object]) -> list[object]:
        """Runtime and constexpr arguments interleaved in the kernel's parameter order."""
        it = iter(args)
        out = []
        for name in self._param_order():
            out.append(constexprs[name] if name in constexprs else next(it))
        return out

    def _disable_fast(self, why: str) -> None:
        log.warning(
            "%s: direct launch unavailable (%s); using kernel[grid] launches", self.name, why
        )
        self._fast = False

    def __call__(
        self,
        grid: tuple[int, ...],
        args: Sequence[object],
        constexprs: dict[str, object],
        num_warps: int = 4,
    ) -> None:
        if not self._fast:
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        key = (
            specialization_key(args),
            tuple(sorted(constexprs.items())),
            num_warps,
            torch.cuda.current_device() if torch.cuda.is_available() else -1,
        )
        runner = self._runners.get((key, grid))
        if runner is not None:
            self._run_direct(runner, grid, args, constexprs, num_warps)
            return
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            if compiled is None or not hasattr(compiled, "__getitem__"):
                self._disable_fast(f"kernel[grid] returned {type(compiled).__name__}")
                return
            self._compiled[key] = compiled
            try:
                self._runners[(key, grid)] = compiled[grid]
            except Exception as exc:  # an unexpected Triton API: keep the safe path
                self._disable_fast(f"{type(exc).__name__}: {exc}")
            return  # this call already launched through kernel[grid]
        try:
            runner = compiled[grid]
        except Exception as exc:  # an unexpected Triton API: keep the safe path
            self._disable_fast(f"{type(exc).__name__}: {exc}")
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        self._runners[(key, grid)] = runner
        self._run_direct(runner, grid, args, constexprs, num_warps)

    def _run_direct(
        self,
        runner: Any,
        grid: tuple[int, ...],
        args: Sequence[object],
        constexprs: dict[str, object],
        num_warps: int,
    ) -> None:
        """Call the compiled launcher; an argument-convention mismatch (TypeError, raised
        while packing arguments, before anything launches) switches to the safe path."""
        try:
            runner(*self._all_args(args, constexprs))
        except TypeError as exc:
            self._disable_fast(f"TypeError: {exc}")
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
