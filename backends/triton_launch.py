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

Tracing. Inside `tracing` (torch.compile's functionalization of an op, driven by
`fp4_dispatch.engine.inductor`) a launch on traced operands is not run but stated as
``torch.library.wrap_triton(kernel)[grid](...)``: Inductor then compiles and launches the
kernel itself, with no custom op between the compiled graph and the launch.

Usage: ``bound = CachedLauncher(kernel).bind({"BM": 8, ...}, num_warps=4)`` once per
meta-parameter set, then ``bound(grid, runtime_args)`` per call (runtime parameters in
declaration order; `BoundLaunch` interleaves the constexprs by parameter name).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from fp4_dispatch.contracts.backend import NotTraceable
from fp4_dispatch.format.checks import all_aligned

log = logging.getLogger(__name__)

__all__ = [
    "BoundLaunch",
    "CachedLauncher",
    "all_aligned",
    "launch_aligned",
    "launch_hooks_active",
    "recording",
    "specialization_key",
    "tracing",
    "tracing_active",
]

_INT32_MAX = 2**31 - 1


def specialization_key(args: Sequence[object]) -> tuple[Hashable, ...]:
    """Key of the runtime arguments: equal keys can share one compiled binary.

    Tensors: (dtype, 16-byte aligned); ints: "== 1", "% 16 == 0" and "needs 64 bits";
    floats and None: their type only; host TMA descriptors (Gluon's ``TensorDescriptor``:
    a ``block_shape`` attribute): the base's dtype, the block, the shared layout and the
    integer key of every size and stride (what Triton's ``tensordesc`` type and its
    decomposed arguments depend on). One flat loop: this runs on every launch.
    """
    key: list[Hashable] = []
    for a in args:
        t = type(a)
        if t is int:  # inline (`_int_key`): this branch runs ~10 times a launch
            key.append((a == 1) + 2 * (a % 16 == 0) + 4 * (a > _INT32_MAX or a < -_INT32_MAX - 1))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is float:
            key.append("f")
        elif a is None:
            key.append(None)
        elif t is bool:
            key.append(("b", a))
        elif hasattr(a, "block_shape"):
            key.append((a.base.dtype, tuple(a.block_shape), a.layout, a.padding,
                        tuple(map(_int_key, (*a.shape, *a.strides)))))  # fmt: skip
        else:
            raise TypeError(f"args: unsupported kernel argument type {t.__name__}")
    return tuple(key)


def _int_key(a: int) -> int:
    """An integer's part of the key: "== 1", "% 16 == 0", "needs 64 bits"."""
    return (a == 1) + 2 * (a % 16 == 0) + 4 * (a > _INT32_MAX or a < -_INT32_MAX - 1)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def _passes_all_params() -> bool:
    """Whether this Triton's launcher takes every kernel parameter, constexprs included.

    Since Triton 3.3 ``JITFunction.run`` ends with ``kernel.run(..., *bound_args.values())``
    (all parameters); earlier versions passed only the non-constexpr ones. The direct
    path is used only where the convention is the one this module implements.
    """
    try:
        import triton  # noqa: PLC0415 - optional: Triton
    except ImportError:
        return False
    parts = triton.__version__.split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (3, 3)
    except (IndexError, ValueError):
        log.warning("unrecognised triton version %r: direct launches disabled", triton.__version__)
        return False


_cuda: bool | None = None


def _device_index() -> int:
    """The current CUDA device (a compiled binary is loaded per device); -1 without CUDA.

    ``torch._C._cuda_getDevice`` is what ``torch.cuda.current_device()`` returns after
    its lazy-init checks (~1 µs a call on the H200 host, for every launch); CUDA is
    initialised by then (a tensor argument lives there)."""
    global _cuda
    if _cuda is None:
        _cuda = torch.cuda.is_available()
        if _cuda:
            torch.cuda.init()
    return torch._C._cuda_getDevice() if _cuda else -1


def launch_aligned(
    bound: BoundLaunch,
    key: Hashable,
    grid: tuple[int, ...],
    args: Sequence[object],
    tensors: Sequence[torch.Tensor],
) -> None:
    """`BoundLaunch.launch_keyed` with ``key`` when every tensor of `tensors` (the
    pointer arguments) is 16-byte aligned (`all_aligned`), so ``key`` need not carry
    alignment; else the full specialization path (`BoundLaunch.__call__`). Traced
    operands (`tracing`) have no address: the launch is stated as it is."""
    if _tracing is not None:
        bound(grid, args)
    elif all_aligned(*tensors):
        bound.launch_keyed(key, grid, args)
    else:
        bound(grid, args)


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook would do anything: None, or (Triton >= 3.5) a
    ``HookChain`` with no calls, does nothing."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooks_active() -> bool:
    """Whether Triton has a launch hook that does something (a profiler such as proton):
    launches must then go through Triton's own runner, which calls it. Runs before every
    replayed launch: the hooks object is looked up once."""
    hooks = _runtime_knobs()
    if hooks is None:
        return False
    return _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook)


_knobs: list = []


def _runtime_knobs() -> Any:
    """``triton.knobs.runtime`` (where launch hooks live), or None (no Triton, or one
    without knobs); looked up once."""
    if not _knobs:
        try:
            import triton  # noqa: PLC0415 - optional: Triton
        except ImportError:
            _knobs.append(None)
        else:
            _knobs.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    return _knobs[0]


# ---- recording the launches of one call (fp4_dispatch.backends.driver_launch) -----------

#: (thread id, list) while `recording` is active on that thread, else None: read on every
#: launch, so a module global rather than a thread-local (one load and a compare)
_noted: tuple[int, list] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Note every launch this thread makes through a `BoundLaunch` inside the block: one
    ``(compiled kernel or None, grid, arguments, liveness)`` entry each, the arguments
    with tensors replaced by their addresses and ``liveness`` weak references to the
    tensors (nothing is kept alive by the note). Not re-entrant."""
    global _noted
    if _noted is not None:
        raise RuntimeError("triton_launch.recording() is already active")
    notes: list = []
    _noted = (threading.get_ident(), notes)
    try:
        yield notes
    finally:
        _noted = None


def _note(bound: BoundLaunch, grid: tuple[int, ...], args: Sequence[object],
          compiled: Any = None) -> None:  # fmt: skip
    """Add one launch to the active recording (`recording`) if this thread has one.
    ``compiled``: the kernel that launched, where the caller knows it (a keyed launch:
    its runner may serve arguments whose `specialization_key` differs from the call that
    compiled it, in values Triton does not specialize on, e.g. a ``do_not_specialize``
    flag); else looked up by the arguments' key."""
    noted = _noted
    if noted is None or noted[0] != threading.get_ident():
        return
    full = bound._all_args(args)
    if compiled is None:
        compiled = bound._compiled.get((specialization_key(args), _device_index()))
    frozen = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in full)
    alive = [weakref.ref(a) if isinstance(a, torch.Tensor) else None for a in full]
    noted[1].append((compiled, tuple(grid), frozen, alive))


# ---- stating launches for torch.compile (fp4_dispatch.engine.inductor) ----------------

#: (thread id, ``wrap_triton``) while `tracing` is active on that thread, else None
_tracing: tuple[int, Any] | None = None

#: launch options a traced launch may drop: ``launch_pdl`` only overlaps a kernel with
#: the one before it, and the grid-dependency instructions it pairs with are no-ops in a
#: kernel launched without it (`fp4_dispatch.backends.pdl`), so the result is the same
_DROPPABLE_OPTIONS = frozenset({"launch_pdl"})
#: launch options Inductor takes with a user kernel (its ``triton.Config`` fields)
_INDUCTOR_OPTIONS = frozenset({"num_stages"})


@contextlib.contextmanager
def tracing(wrap: Any = None) -> Iterator[None]:
    """State every launch this thread makes through a `BoundLaunch` inside the block as
    ``wrap(kernel)[grid](**arguments, num_warps=..., num_stages=...)`` instead of running
    it (``wrap``: default ``torch.library.wrap_triton``). Scratch buffers asked for inside
    are made in the traced graph (`fp4_dispatch.backends.workspace`). A launch that cannot
    be stated raises `NotTraceable`. Not re-entrant."""
    global _tracing
    if _tracing is not None:
        raise RuntimeError("triton_launch.tracing() is already active")
    if wrap is None:
        from torch.library import wrap_triton  # noqa: PLC0415 - torch >= 2.6

        wrap = wrap_triton
    _tracing = (threading.get_ident(), wrap)
    try:
        yield
    finally:
        _tracing = None


def tracing_active() -> bool:
    """Whether this thread is inside `tracing`."""
    state = _tracing
    return state is not None and state[0] == threading.get_ident()


def _is_traced(t: torch.Tensor) -> bool:
    """Whether `t` is an operand of the traced graph (functional or fake), not a real
    device buffer a kernel kept (whose address a compiled graph cannot own)."""
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415 - compile only
    from torch._subclasses.functional_tensor import FunctionalTensor  # noqa: PLC0415

    return isinstance(t, (FunctionalTensor, FakeTensor))


def _direct_runner(compiled: Any, grid3: tuple[int, int, int], device: int, standard: Any) -> Any:
    """A launcher of `compiled` on `grid3` that calls its CUDA launcher directly, or None.

    Why: Triton's ``compiled[grid]`` runner asks the driver for the current device and
    stream and builds launch metadata on every call (~4 µs of the ~15 µs a launch costs
    on the H200 host, the removed bench_launch_overhead.py). Here the device is fixed (a runner is
    cached per device) and the stream comes from ``torch._C._cuda_getCurrentRawStream``
    (0.1 µs, vs 4.7 µs for ``torch.cuda.current_stream().cuda_stream``), and empty
    launch-hook chains are not called. Launch hooks (profilers such as proton add them)
    need the metadata: while one is set, calls go through Triton's own runner,
    ``standard`` (``compiled[grid3]``, which also loaded the binary). None when this
    Triton's compiled kernel lacks the pieces (``run``, ``function``, ``packed_metadata``,
    ``triton.knobs``).
    """
    try:
        import triton  # noqa: PLC0415 - optional: Triton
    except ImportError:
        return None
    hooks = getattr(getattr(triton, "knobs", None), "runtime", None)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    meta = getattr(compiled, "packed_metadata", None)
    if hooks is None or raw_stream is None or run is None or function is None or meta is None:
        return None
    g0, g1, g2 = grid3

    def runner(*args: object) -> None:
        if _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook):
            standard(*args)
            return
        run(g0, g1, g2, raw_stream(device), function, meta, None, None, None, *args)

    return runner


class BoundLaunch:
    """One kernel with fixed constexprs and options: ``bound(grid, args)`` launches it.

    Precomputes what does not change between calls (the constexpr part of the cache key
    and where the runtime arguments go among the parameters), so a warm call costs the
    specialization key of the runtime arguments, two dict look-ups and the launch.
    """

    def __init__(
        self,
        owner: CachedLauncher,
        constexprs: dict[str, object],
        num_warps: int,
        options: dict[str, object] | None = None,
    ):
        self.owner = owner
        self.constexprs = dict(constexprs)
        self.num_warps = num_warps
        #: other launch options (e.g. ``maxnreg``), passed wherever ``num_warps`` is
        self.options = dict(options or {})
        self._static = (tuple(sorted(constexprs.items())), num_warps)
        names = list(owner.kernel.arg_names)
        self._template = [constexprs.get(n) for n in names]
        self._slots = [i for i, n in enumerate(names) if n not in constexprs]
        self._compiled: dict[Hashable, Any] = {}
        self._runners: dict[tuple[Hashable, tuple[int, ...]], Any] = {}
        #: caller key -> (runner, its compiled kernel) (`launch_keyed`)
        self._keyed: dict[Hashable, tuple[Any, Any]] = {}
        #: the constexpr values when every constexpr follows every runtime parameter
        #: (then all parameters are ``(*runtime, *tail)``: no per-call list building)
        trailing = self._slots == list(range(len(self._slots)))
        self._tail = tuple(self._template[len(self._slots) :]) if trailing else None
        #: the compiled kernel of the latest compiling call (its ``asm``: PTX, cubin)
        self.last_compiled: Any = None

    def _slow(self, grid: tuple[int, ...], args: Sequence[object]) -> Any:
        compiled = self.owner.kernel[grid](*args, **self.constexprs, num_warps=self.num_warps,
                                           **self.options)  # fmt: skip
        self.last_compiled = compiled
        return compiled

    def _all_args(self, args: Sequence[object]) -> list[object]:
        full = list(self._template)
        for slot, value in zip(self._slots, args, strict=True):
            full[slot] = value
        return full

    def warmup(self, grid: tuple[int, ...], args: Sequence[object]) -> Any:
        """Compile the specialization of `args` without launching (Triton's ``warmup``).

        `args` as for a call; a tensor may be given as its ``torch.dtype`` (Triton's
        placeholder, taken as 16-byte aligned like every fresh allocation). The binary
        lands in Triton's on-disk cache, so a later first call - in any process - loads
        it instead of compiling. Returns Triton's compiled kernel.
        """
        return self.owner.kernel.warmup(*args, grid=grid, **self.constexprs,
                                        num_warps=self.num_warps, **self.options)  # fmt: skip

    def __call__(self, grid: tuple[int, ...], args: Sequence[object]) -> None:
        if _tracing is not None and tracing_active():
            self.trace(grid, args)
            return
        self._call(grid, args)
        if _noted is not None:
            _note(self, grid, args)

    def trace(self, grid: tuple[int, ...], args: Sequence[object]) -> None:
        """State this launch for torch.compile (`tracing`): every parameter by name, the
        constexprs included, and the launch options Inductor takes; `NotTraceable` for a
        real tensor argument or an option it cannot express (nothing is stated then)."""
        names = list(self.owner.kernel.arg_names)
        arguments = dict(zip(names, self._all_args(args), strict=True))
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor) and not _is_traced(value):
                raise NotTraceable(
                    f"{self.owner.name}: argument {name!r} is a device buffer the kernel "
                    "keeps, not an operand of the traced graph"
                )
        launch: dict[str, object] = {"num_warps": self.num_warps}
        extra = {k: v for k, v in self.constexprs.items() if k not in arguments}
        for name, value in {**extra, **self.options}.items():
            if name in _INDUCTOR_OPTIONS:
                launch[name] = value
            elif name not in _DROPPABLE_OPTIONS:
                raise NotTraceable(f"{self.owner.name}: launch option {name}={value!r} "
                                   "has no torch.compile equivalent")  # fmt: skip
        _tracing[1](self.owner.kernel)[tuple(grid)](**arguments, **launch)

    def _call(self, grid: tuple[int, ...], args: Sequence[object]) -> None:
        if not self.owner.fast:
            self._slow(grid, args)
            return
        key = (specialization_key(args), _device_index())
        runner = self._runners.get((key, grid))
        if runner is None:
            compiled = self._compiled.get(key)
            if compiled is None:  # compile (and launch) through Triton's own path
                compiled = self._slow(grid, args)
                if compiled is None or not hasattr(compiled, "__getitem__"):
                    self.owner.disable_fast(f"kernel[grid] returned {type(compiled).__name__}")
                else:
                    self._compiled[key] = compiled
                return
            try:  # the compiled kernel's runner indexes grid[0..2]: pad to three dims
                grid3 = (*grid, 1, 1)[:3]
                runner = compiled[grid3]
                runner = _direct_runner(compiled, grid3, key[1], runner) or runner
                self._runners[(key, grid)] = runner
            except Exception as exc:  # an unexpected Triton API: keep the safe path
                self.owner.disable_fast(f"{type(exc).__name__}: {exc}")
                self._slow(grid, args)
                return
        self._launch(runner, grid, args)

    def _launch(self, runner: Any, grid: tuple[int, ...], args: Sequence[object]) -> bool:
        """Run the compiled kernel's runner; False (and the safe path) if that failed."""
        try:
            if self._tail is None:
                runner(*self._all_args(args))
            else:
                runner(*args, *self._tail)
        except (TypeError, ValueError, IndexError, SystemError) as exc:
            # argument packing failed (before anything launched): another convention
            self.owner.disable_fast(f"{type(exc).__name__}: {exc}")
            self._slow(grid, args)
            return False
        return True

    def launch_keyed(self, key: Hashable, grid: tuple[int, ...], args: Sequence[object]) -> None:
        """`__call__` for callers that know their specialization: ``key`` must differ
        whenever `specialization_key` of ``args`` could differ between calls with that
        grid (e.g. the dtype, alignment and strides of the tensors a user passes, for a
        plan whose other arguments are fixed; `all_aligned` helps). The current device
        is added here. A known key skips the specialization key and both cache look-ups:
        one dict get and the launch.
        """
        if _tracing is not None and tracing_active():
            self.trace(grid, args)
            return
        keyed = (key, grid, _device_index())  # a runner is bound to one device
        hit = self._keyed.get(keyed)
        if hit is not None:
            if not self._launch(hit[0], grid, args):
                self._keyed.clear()
            if _noted is not None:
                _note(self, grid, args, hit[1])
            return
        self(grid, args)
        if self.owner.fast:  # remember the runner the ordinary path chose, if any
            spec = (specialization_key(args), keyed[2])
            full = self._runners.get((spec, grid))
            if full is not None:
                self._keyed[keyed] = (full, self._compiled.get(spec))


class CachedLauncher:
    """Launch one ``@triton.jit`` kernel, compiling once per specialization.

    ``launcher.bind(constexprs, num_warps)`` gives a `BoundLaunch` (keep it, e.g. in a
    per-shape plan); ``bound(grid, args)`` takes the runtime parameters in declaration
    order. The first call of a specialization goes through ``kernel[grid]`` (which
    compiles); later calls launch the compiled binary directly.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)
        self.name = getattr(fn, "__name__", "kernel")
        self.fast = not _interpreting() and _passes_all_params()
        self._bound: dict[tuple, BoundLaunch] = {}

    def disable_fast(self, why: str) -> None:
        if self.fast:
            log.warning("%s: direct launch unavailable (%s); using kernel[grid]", self.name, why)
        self.fast = False

    def bind(
        self, constexprs: dict[str, object], num_warps: int = 4, **options: object
    ) -> BoundLaunch:
        """The `BoundLaunch` of these constexprs and launch options (made once)."""
        key = (tuple(sorted(constexprs.items())), num_warps, tuple(sorted(options.items())))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = BoundLaunch(self, constexprs, num_warps, options)
        return bound
