"""Eager launches at driver speed: replay a plan's Triton kernels through ``cuLaunchKernelEx``.

Why: an eager decode GEMM is host-bound. On the H200 host (one device call, 2026-12-03,
``.scratch`` probe recorded in benchmarks/RESULTS.md "Eager launch"): Triton's own C
launcher, called directly, costs 6.8 µs a launch; ``cuLaunchKernelEx`` through
cuda-python with a kept launch configuration and a kept argument buffer 4.1 µs; and the
Python between a user's call and that launch (argument checks, operand objects, the
specialization key, Triton's launcher wrapper) 20-40 µs more. A serving loop calls the
same layer with the same weight thousands of times, so that work can be done once.

How. A *replay* is recorded from one ordinary call of a plan (`record_launches`): every
`fp4_dispatch.backends.triton_launch.BoundLaunch` launch the call makes is noted with
its arguments; each becomes a `DriverLaunch` - the compiled kernel's ``CUfunction``
(loaded by Triton for this device), its launch configuration (grid, block, shared
memory, and the PDL, cooperative and cluster attributes Triton's launcher would set)
and one packed argument buffer. Later calls with the same fixed operands patch only the
pointers of the per-call tensors (activations, output, and what lies inside them) and
launch. A replay is made only when it is safe to make:

- the kernel's parameters are known (`DriverLaunch.describe`: no TMA descriptor
  arguments, no global or profile scratch, a Triton whose compiled kernel carries a
  signature) and agree, parameter by parameter, with what the driver reads off the
  loaded function (``cuFuncGetParamInfo``: count and sizes);
- the call ran nothing but those launches: no torch operation other than views ran
  during it (a ``TorchDispatchMode`` watches), so no cuBLAS call or ``add_`` is skipped;
- every pointer it passed lies in a per-call tensor (patched), a fixed operand (the
  replay is keyed by their addresses) or a tensor still alive after the call (the
  kernel's kept scratch, never freed while the kernel lives,
  `fp4_dispatch.backends.workspace`): a per-call temporary would dangle, so its launch
  is refused.

Anything else - an older Triton, a TMA kernel, a launch hook set by a profiler, no
cuda-python - leaves the ordinary path in place, with one log line per reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4_dispatch.backends import triton_launch

log = logging.getLogger(__name__)

__all__ = ["DriverLaunch", "Recording", "Replay", "record_launches"]

try:  # optional: cuda-python's driver bindings (a dependency, absent on odd installs)
    from cuda.bindings import driver as _cu
except ImportError as exc:  # recorded: every replay is refused with this reason
    _cu = None
    _CU_MISSING = f"cuda-python's driver bindings are not importable ({exc})"
else:
    _CU_MISSING = ""

#: one 8-byte slot per kernel parameter: struct format of each Triton scalar type
#: (Triton's launcher passes fp32 as a 4-byte float, ints at their width)
_SCALAR_FORMAT = {
    "i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i",
    "u32": "I", "i64": "q", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip
_SLOT = 8

#: torch operations that only make views: a recorded call may run these (no kernel)
_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "reshape", "_reshape_alias",
    "slice", "select", "as_strided", "alias", "expand", "unsqueeze", "squeeze", "detach",
    "narrow", "view_as", "unflatten", "flatten", "split", "split_with_sizes", "unbind",
    "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})  # fmt: skip

_logged: set[str] = set()


def _once(what: str, why: str) -> None:
    """One INFO line per distinct reason a replay was not made (the ordinary path runs)."""
    line = f"{what}: launched through Triton ({why})"
    if line not in _logged:
        _logged.add(line)
        log.info("%s", line)


@dataclass
class DriverLaunch:
    """One compiled Triton kernel with its launch configuration and a kept argument buffer.

    ``launch(stream)`` launches it with the buffer as it stands; `set_pointer` patches a
    pointer slot. Built by `describe` from a compiled kernel and one call's arguments.
    """

    name: str
    function: Any  # CUfunction
    config: Any  # CUlaunchConfig, kept (its attributes too)
    buffer: ctypes.Array
    params: ctypes.Array  # void*[]: the address of each slot
    #: parameter index (among all of the kernel's parameters) -> its slot's byte offset
    pointer_slots: dict[int, int]
    stream: int = -1
    _keep: list = field(default_factory=list, repr=False)  # attribute objects

    @property
    def params_address(self) -> int:
        return ctypes.addressof(self.params)

    def set_pointer(self, offset: int, address: int) -> None:
        """Write a device address into the slot at byte ``offset``."""
        struct.pack_into("Q", self.buffer, offset, address)

    def launch(self, stream: int) -> None:
        """Launch on ``stream`` (a raw ``CUstream`` value); raises on a driver error."""
        if stream != self.stream:
            self.config.hStream = stream
            self.stream = stream
        (err,) = _cu.cuLaunchKernelEx(self.config, self.function, self.params_address, 0)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx({self.name}) failed: {err!r}")

    @classmethod
    def describe(cls, compiled: Any, grid: Sequence[int], args: Sequence[object]
                 ) -> DriverLaunch | str:  # fmt: skip
        """A `DriverLaunch` of `compiled` for `grid` with `args` (every kernel parameter
        in declaration order, constexprs included, as `BoundLaunch` passes them), or the
        reason it cannot be described."""
        if _cu is None:
            return _CU_MISSING
        src, meta = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
        signature = getattr(src, "signature", None)
        handle = getattr(compiled, "function", None)
        if not isinstance(signature, dict) or meta is None or not handle:
            return "this Triton's compiled kernel has no signature or loaded function"
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            return "the kernel needs Triton's global or profile scratch"
        types = list(signature.values())
        if len(types) != len(args):
            return f"{len(args)} arguments for {len(types)} parameters"
        fmts: list[str] = []
        values: list[object] = []
        pointers: dict[int, int] = {}
        for i, (ty, arg) in enumerate(zip(types, args, strict=True)):
            if ty == "constexpr":
                continue
            if not isinstance(ty, str) or ty.startswith("tensordesc") or ty == "nvTmaDesc":
                return f"parameter {i} is a {ty} (TMA descriptors are built per call)"
            if ty.startswith("*"):
                pointers[i] = _SLOT * len(fmts)
                fmts.append("Q")
                values.append(_address(arg))
            elif ty in _SCALAR_FORMAT:
                fmts.append(_SCALAR_FORMAT[ty])
                values.append(arg)
            else:
                return f"parameter {i} has type {ty}"
        fmts += ["Q", "Q"]  # Triton's global and profile scratch pointers (none here)
        values += [0, 0]
        function = _cu.CUfunction(handle)
        why = _check_params(function, fmts)
        if why:
            return why
        buffer = (ctypes.c_char * (_SLOT * len(fmts)))()
        for j, (fmt, value) in enumerate(zip(fmts, values, strict=True)):
            struct.pack_into(fmt, buffer, _SLOT * j, value)
        base = ctypes.addressof(buffer)
        params = (ctypes.c_void_p * len(fmts))(*[base + _SLOT * j for j in range(len(fmts))])
        config, keep = _config(meta, grid)
        return cls(getattr(meta, "name", "kernel"), function, config, buffer, params, pointers,
                   _keep=keep)  # fmt: skip


def _address(arg: object) -> int:
    """A pointer argument's device address (a tensor's ``data_ptr()``, or an int)."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else int(arg)  # type: ignore[arg-type]


def _check_params(function: Any, fmts: list[str]) -> str:
    """The empty string when the loaded function takes exactly these parameters (count
    and sizes, as ``cuFuncGetParamInfo`` reads them off the cubin), else why not."""
    for j, fmt in enumerate(fmts):
        err, _offset, size = _cu.cuFuncGetParamInfo(function, j)
        if err:
            return f"cuFuncGetParamInfo({j}) failed: {err!r} (expected {len(fmts)} parameters)"
        if size != struct.calcsize(fmt):
            return f"parameter slot {j}: the cubin says {size} bytes, the signature {fmt!r}"
    err, _offset, _size = _cu.cuFuncGetParamInfo(function, len(fmts))
    if not err:
        return f"the cubin has more than {len(fmts)} parameters"
    return ""


def _config(meta: Any, grid: Sequence[int]) -> tuple[Any, list]:
    """The ``CUlaunchConfig`` Triton's launcher would build for `meta` and `grid`."""
    g = (*grid, 1, 1)[:3]
    ctas = int(getattr(meta, "num_ctas", 1) or 1)
    cfg = _cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g[0] * ctas, g[1], g[2]
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 32 * meta.num_warps, 1, 1
    cfg.sharedMemBytes = int(meta.shared)
    ids = _cu.CUlaunchAttributeID
    attrs = []
    if getattr(meta, "launch_pdl", False):
        a = _cu.CUlaunchAttribute()
        a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        attrs.append(a)
    if getattr(meta, "launch_cooperative_grid", False):
        a = _cu.CUlaunchAttribute()
        a.id = ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        a.value.cooperative = 1
        attrs.append(a)
    if ctas != 1:
        a = _cu.CUlaunchAttribute()
        a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = ctas, 1, 1
        s = _cu.CUlaunchAttribute()
        s.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
        s.value.clusterSchedulingPolicyPreference = (
            _cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_SPREAD
        )
        attrs += [a, s]
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg, attrs


# ---- replays --------------------------------------------------------------------------------


@dataclass
class Replay:
    """A plan's launches for fixed operands: ``replay(tensors)`` patches the per-call
    tensors' addresses (each launch's slots that pointed into them at recording, with
    the same byte offsets) and launches every kernel in order on the current stream of
    ``device``. Returns False, launching nothing, while a Triton launch hook is set (the
    caller then runs the ordinary path, which calls the hook)."""

    launches: list[DriverLaunch]
    #: per launch: (slot offset, index of the per-call tensor, byte offset inside it)
    patches: list[list[tuple[int, int, int]]]
    device: int

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        if triton_launch.launch_hooks_active():
            return False
        stream = _raw_stream(self.device)
        ptrs = [t.data_ptr() for t in tensors]
        for launch, patches in zip(self.launches, self.patches, strict=True):
            buf = launch.buffer
            for slot, which, delta in patches:
                struct.pack_into("Q", buf, slot, ptrs[which] + delta)
            launch.launch(stream)
        return True


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _NonViewOps(TorchDispatchMode):
    """Notes every torch operation that is not a view (any such op runs a kernel or
    allocates: a recorded replay would skip it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _VIEW_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@dataclass
class Recording:
    """What `record_launches` saw; ``replay`` is the result (None: see ``why``)."""

    per_call: Sequence[torch.Tensor]
    fixed: Sequence[torch.Tensor]
    #: `triton_launch.recording`'s notes: (compiled, grid, arguments, liveness) per launch
    launches: list[tuple[Any, tuple[int, ...], tuple, list]] = field(default_factory=list)
    replay: Replay | None = None
    why: str = ""


@contextlib.contextmanager
def record_launches(
    name: str, per_call: Sequence[torch.Tensor], fixed: Sequence[torch.Tensor]
) -> Iterator[Recording]:
    """Record the Triton launches of the call made inside the block and build its
    `Replay` on exit (``recording.replay``, or None and ``recording.why``).

    ``per_call``: the tensors that change from call to call (patched on replay);
    ``fixed``: the operands a replay is keyed by (its caller's business), which may
    hold pointers the kernels read. See the module docstring for what is refused.
    """
    rec = Recording(per_call, fixed)
    if _cu is None or _raw_stream is None:
        rec.why = _CU_MISSING or "this torch has no raw-stream accessor"
        yield rec
        return
    mode = _NonViewOps()
    with triton_launch.recording() as noted, mode:
        yield rec
    rec.launches = noted
    if mode.seen:
        rec.why = f"the call also ran torch operations {sorted(set(mode.seen))}"
    elif not noted:
        rec.why = "the call made no Triton launch"
    else:
        rec.replay, rec.why = _build(rec)
    if rec.replay is None:
        _once(name, rec.why)


def _build(rec: Recording) -> tuple[Replay | None, str]:
    ranges = [_span(t) for t in rec.per_call]
    fixed = [(t.data_ptr(), t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())
             for t in rec.fixed]  # fmt: skip
    launches: list[DriverLaunch] = []
    patches: list[list[tuple[int, int, int]]] = []
    for compiled, grid, args, alive in rec.launches:
        if compiled is None:
            return None, "a launch went through Triton's uncached path"
        launch = DriverLaunch.describe(compiled, grid, args)
        if isinstance(launch, str):
            return None, launch
        mine: list[tuple[int, int, int]] = []
        for index, slot in launch.pointer_slots.items():
            address = _address(args[index])
            hit = _inside(address, ranges)
            if hit is not None:
                mine.append((slot, hit, address - ranges[hit][0]))
            elif _inside(address, fixed) is None and not _alive(alive[index]):
                return None, f"argument {index} of {launch.name} is a temporary of the call"
        launches.append(launch)
        patches.append(mine)
    return Replay(launches, patches, rec.per_call[0].get_device()), ""


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(start, bytes) of the memory a per-call tensor's elements cover - the tensor's own
    extent, not its storage's: two per-call tensors cut from one block are told apart,
    and a replay given separate blocks patches each pointer from its own tensor."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), extent * t.element_size()


def _inside(address: int, ranges: list[tuple[int, int]]) -> int | None:
    """Index of the (start, bytes) range holding `address`, or None."""
    for i, (start, nbytes) in enumerate(ranges):
        if start <= address < start + max(nbytes, 1):
            return i
    return None


def _alive(ref: weakref.ref | None) -> bool:
    """Whether a recorded tensor argument still exists after the call (a kept buffer)."""
    return ref is not None and ref() is not None
