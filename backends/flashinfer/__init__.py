"""FlashInfer's CuTe-DSL ``mm_fp4`` kernels, driven through FlashInfer's own runner.

FlashInfer (``flashinfer-python``, tested with 0.7.2.post1) is used as a library: its
runner enumerates and validates tactics, builds the kernel object of each family and
compiles it. Nothing of it is copied here. What this module adds:

* **Enumeration without a GPU.** ``_cute_dsl_gemm_fp4_runner(sm_major, sm_minor, ...)``
  returns a ``TunableRunner`` whose ``get_valid_tactics`` applies FlashInfer's rules
  (each kernel class's ``can_implement``, the narrow-tile rule for M <= 32, the split-K
  kernel's ``is_valid_tactic``, deep-K only for K % 512 == 0 ...) and then cuts the list
  with its own ranking (``_rank_mm_fp4_autotune_tactics``, flat top 32). We want the
  whole valid list, so during the call that ranking is replaced by the identity, and the
  device queries it makes (``get_device_sm_count``, ``torch.cuda.get_device_properties``
  for the prefetch rule) answer the `DeviceInfo`'s SM count. Operands are ``meta``
  tensors: only shapes, dtypes and contiguity are read, so M = 32768 costs no memory.
  Every patch is scoped (`_device_context`) and taken under one lock.
* **Ahead-of-time compile for a simulated device.** ``runner.forward(inputs, tactic)``
  picks the kernel class and its constructor arguments for the tactic (L2 policy, the
  deep-K instruction count, split-K slices ...) and calls
  ``_compile_block_scaled_gemm``. We wrap that function: the real one compiles (with
  a private in-memory cache - FlashInfer's is keyed by device index only, and handed
  an sm_107a compile the sm_100a kernel of an earlier one, caught by the cubin check -
  and its on-disk cache off, so nothing is loaded onto a GPU), then the wrapper stops
  the forward before its launch and hands the compiled function back. The maximum
  number of co-resident clusters the compile bakes in comes from
  `fp4_dispatch.backends.cute.max_clusters_for` (the driver on a real GPU,
  ``sm_count // cluster size`` on a simulated one); the target arch is an explicit
  ``--gpu-arch=sm_XXXa`` added to FlashInfer's compile options. The cubin inside the
  compiled object is read back (``dump_to_object`` + `fp4_dispatch.backends.cute.cubin_sm`) and
  must name the device's SM. Compiled kernels are memoized in memory only (no disk
  cache of our own for these: a later process recompiles, ~1-5 s each here).
* **Launch** (only on a Blackwell/Rubin GPU, never done here): the runner's own
  ``forward`` on real tensors, in FlashInfer's operand layout (see `FlashInferKernel`).

Compiled here for sm_100a / sm_103a / sm_107a; not run on hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import io
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fp4_dispatch.contracts.backend import GemmOperands
    from fp4_dispatch.contracts.device import DeviceInfo

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install '.[flashinfer]' in the fp4-dispatch checkout"
NOT_INSTALLED = f"flashinfer-python not installed: {INSTALL_HINT}"
#: the version the tactic specs and this module were written against
TESTED_VERSION = "0.7.2.post1"
#: module roots whose absence means "the extra is not installed"
_EXTRA_MODULES = ("flashinfer",)
#: FlashInfer internals used here (its runner API is internal: checked up front)
_REQUIRED = {
    "flashinfer.gemm.gemm_base": (
        "_cute_dsl_gemm_fp4_runner",
        "_rank_mm_fp4_autotune_tactics",
        "_compile_block_scaled_gemm",
        "get_device_sm_count",
        "get_device_index",
        "_MM_FP4_CUTE_DSL_MAX_TUNING_CONFIGS",
    ),
    "flashinfer.cute_dsl.utils": ("get_max_active_clusters",),
}

#: FlashInfer's tactic tuple: (mma_tiler_mn, cluster_shape_mn, swap_ab, use_prefetch,
#: kernel_type, extra) where `extra` is None / 8 (deep-K) for "sm100", the K-slice
#: count for "sm100sk", use_tma_store for "sm103", (inst_m, inst_n, inst_k, tiler_k,
#: prefetch_dist) for "sm107".
FiTactic = tuple

_lock = threading.RLock()


class FlashInferUnavailable(RuntimeError):
    """FlashInfer is installed but unusable here (import failed, or its API moved)."""


def version() -> str:
    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def availability() -> tuple[bool, str]:
    """(usable, reason). Absent -> (False, install hint); broken or moved API -> raises.

    Raises `FlashInferUnavailable` naming the exception and FlashInfer's version when
    the package is present but an import fails or a runner function this module calls
    is missing: the registry then lists the backends as *failed*, never absent.
    """
    mods: dict[str, Any] = {}
    try:
        for name in _REQUIRED:
            mods[name] = importlib.import_module(name)
        importlib.import_module("cutlass.cute")
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root in _EXTRA_MODULES:  # the package itself is absent
            log.info("FlashInfer backends unavailable: %s", NOT_INSTALLED)
            return False, NOT_INSTALLED
        raise FlashInferUnavailable(_failure(exc)) from exc
    except Exception as exc:  # a present but broken install: failed, with the message
        raise FlashInferUnavailable(_failure(exc)) from exc
    for name, attrs in _REQUIRED.items():
        missing = [a for a in attrs if not hasattr(mods[name], a)]
        if missing:
            exc = AttributeError(f"{name} has no {', '.join(missing)}")
            raise FlashInferUnavailable(_failure(exc))
    note = "" if version() == TESTED_VERSION else f" (tested with {TESTED_VERSION})"
    return True, f"flashinfer-python {version()}{note}"


def _failure(exc: BaseException) -> str:
    msg = (
        f"FlashInfer {version()} unusable: {type(exc).__name__}: {exc} "
        f"(fp4-dispatch was tested with flashinfer-python=={TESTED_VERSION}; {INSTALL_HINT})"
    )
    log.warning("%s", msg)
    return msg


# ---- device context -------------------------------------------------------------------


@contextlib.contextmanager
def _device_context(sm_count: int) -> Iterator[Any]:
    """FlashInfer's device queries answer `sm_count`; its top-32 cut is the identity.

    Yields the ``gemm_base`` module. Scoped: every patched name is restored on exit.
    """
    import torch

    gb = importlib.import_module("flashinfer.gemm.gemm_base")
    props = types.SimpleNamespace(multi_processor_count=sm_count)
    patches = [
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (gb, "get_device_sm_count", lambda device: sm_count),
        (gb, "get_device_index", lambda device: 0),
        (gb, "_rank_mm_fp4_autotune_tactics", lambda valid, *args: list(valid)),
    ]
    with _lock, _patched(patches):
        yield gb


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _torch_dtype(out_dtype: str) -> torch.dtype:
    from fp4_dispatch.format.checks import TORCH_DTYPES  # lazy: it imports torch

    return TORCH_DTYPES[out_dtype]


def meta_inputs(m: int, n: int, k: int, out_dtype: str) -> list:
    """The runner's ``inputs`` list on the meta device (shapes and layouts only).

    FlashInfer's mm_fp4 layout: ``a`` [M, K/2] row-major, ``b`` [K/2, N] column-major
    (the transpose of a row-major [N, K/2]), scalar ``alpha``, ``out`` [M, N].
    """
    import torch

    meta = torch.device("meta")
    a = torch.empty(m, k // 2, dtype=torch.uint8, device=meta)
    b = torch.empty(n, k // 2, dtype=torch.uint8, device=meta).t()
    sa = torch.empty(1, 1, dtype=torch.float8_e4m3fn, device=meta)
    sb = torch.empty(1, 1, dtype=torch.float8_e4m3fn, device=meta)
    alpha = torch.empty(1, dtype=torch.float32, device=meta)
    out = torch.empty(m, n, dtype=_torch_dtype(out_dtype), device=meta)
    return [a, b, sa, sb, alpha, None, out, None, None, None]


@functools.lru_cache(maxsize=64)
def _runner(cc: int, out_dtype: str) -> Any:
    """FlashInfer's CuTe-DSL FP4 runner for compute capability `cc` (NVFP4, no PDL)."""
    gb = importlib.import_module("flashinfer.gemm.gemm_base")
    return gb._cute_dsl_gemm_fp4_runner(cc // 10, cc % 10, False, _torch_dtype(out_dtype), True)


@functools.lru_cache(maxsize=4096)
def valid_tactics(m: int, n: int, k: int, out_dtype: str, cc: int, sm_count: int) -> tuple:
    """Every tactic FlashInfer's runner calls valid for this problem, in its order.

    FlashInfer's own enumeration and rules, without its top-32 cut (see module).
    """
    try:
        with _device_context(sm_count):
            runner = _runner(cc, out_dtype)
            found = runner.get_valid_tactics(meta_inputs(m, n, k, out_dtype), None)
    except Exception as exc:  # its runner API is internal: name the version that moved
        raise FlashInferUnavailable(_failure(exc)) from exc
    return tuple(found)


def flashinfer_shortlist(
    m: int, n: int, k: int, out_dtype: str, cc: int, sm_count: int
) -> list[FiTactic]:
    """FlashInfer's own shortlist: its ranking function over its valid tactics.

    Called as a library with the SM count supplied: ``_rank_mm_fp4_autotune_tactics``
    (one score per tactic, ties in enumeration order, flat top
    ``_MM_FP4_CUTE_DSL_MAX_TUNING_CONFIGS``).
    """
    gb = importlib.import_module("flashinfer.gemm.gemm_base")
    tactics = list(valid_tactics(m, n, k, out_dtype, cc, sm_count))
    return gb._rank_mm_fp4_autotune_tactics(
        tactics, m, n, k, sm_count, gb._MM_FP4_CUTE_DSL_MAX_TUNING_CONFIGS
    )


@functools.cache
def direct_store_epilogue_builds() -> bool:
    """Can the installed CuTe-DSL build FlashInfer's direct-store (non-TMA) epilogue?

    That epilogue (used by FlashInfer's SM103 kernel with ``use_tma_store=False``) makes
    a ``cute.nvgpu.CopyStgOp`` copy atom, which the public nvidia-cutlass-dsl 4.8.1 does
    not have: compiling such a tactic fails with AttributeError (measured here; FlashInfer
    notes its SM103 kernel needs an internal DSL build). Probed, not assumed by version.
    """
    import cutlass.cute as cute

    return hasattr(cute.nvgpu, "CopyStgOp")


# ---- compile --------------------------------------------------------------------------


class _Compiled(Exception):
    """Carries the compiled function out of ``runner.forward`` before its launch."""


@dataclasses.dataclass
class CompiledKernel:
    """One FlashInfer tactic compiled for one (arch, SM count)."""

    tactic: FiTactic
    function: Any  # CuTe-DSL JitCompiledFunction
    target: str
    sm_count: int
    cubin_sm: int
    max_active_clusters: int
    seconds: float
    source: str  # "compiled" or "memory"


_memory: dict[tuple, CompiledKernel] = {}


@contextlib.contextmanager
def _compile_context(device: DeviceInfo) -> Iterator[Callable[[], Any]]:
    """Device queries answered, clusters supplied, arch set; yields the capture getter."""
    import cutlass.cute as cute

    from fp4_dispatch.backends import cute as cb

    cb._preload_runtime()  # dump_to_object needs the DSL runtime (see fp4_dispatch.backends.cute)
    fcu = importlib.import_module("flashinfer.cute_dsl.utils")
    max_clusters = cb.max_clusters_for(device)
    arch = f"sm_{device.cc}a"
    compile_for_device = _arch_compile(cute.compile, arch)
    captured: dict[str, Any] = {}
    with _device_context(device.sm_count) as gb:
        real = gb._compile_block_scaled_gemm

        def capture(cache: dict, *args: Any, **kwargs: Any) -> Any:
            # A private cache: FlashInfer's own is keyed by device index, not arch or SM
            # count, so it would hand back another target's kernel (and must never hold
            # a simulated device's kernel for a later real launch). No disk cache either.
            kwargs["cache_module_name"] = None
            captured["result"] = real({}, *args, **kwargs)
            raise _Compiled

        patches = [
            (fcu, "get_max_active_clusters", max_clusters),
            (gb, "_compile_block_scaled_gemm", capture),
            (cute, "compile", compile_for_device),
        ]
        with cb._compile_lock, _patched(patches):
            yield lambda: captured.get("result")


def _arch_compile(compile_fn: Any, arch: str) -> Callable[..., Any]:
    """``cute.compile`` with ``--gpu-arch <arch>`` added to the options FlashInfer passes.

    FlashInfer's compile names no arch (the DSL then targets its ``envar.arch``, the
    machine's GPU or a default); the option makes the target explicit per compile.
    """

    def compile_for(*args: Any, **kwargs: Any) -> Any:
        opts = kwargs.get("options") or ""
        kwargs["options"] = f"{opts} --gpu-arch={arch}".strip()
        return compile_fn(*args, **kwargs)

    return compile_for


def compile_tactic(
    tactic: FiTactic, m: int, n: int, k: int, out_dtype: str, device: DeviceInfo
) -> CompiledKernel:
    """Compile `tactic` through FlashInfer's runner for `device`'s arch and SM count.

    (m, n, k) in FlashInfer's orientation (the runner swaps itself for swap_ab tactics).
    The cubin's SM is read back and checked. Memoized per (tactic, arch, SM count,
    out dtype, the L2 policy FlashInfer derives from M).
    """
    from fp4_dispatch.backends import cute as cb

    if device.cc is None:
        raise ValueError(f"device: {device.name} has no compute capability to compile for")
    target = cb.target_of(device.cc)
    gbm = importlib.import_module("flashinfer.gemm.gemm_base")
    policy = gbm.mm_fp4_l2_policy(m, tactic[0], tactic[2], tactic[4])
    key = (tactic, target, device.sm_count, out_dtype, policy)
    hit = _memory.get(key)
    if hit is not None:
        return dataclasses.replace(hit, source="memory", seconds=0.0)
    t0 = time.perf_counter()
    # the DSL prints progress ("[DSL INFO] ...") on stdout, which would corrupt a caller's
    # JSON output (`fp4-dispatch doctor --json`) and clutter stderr: it goes to the log
    with _compile_context(device) as result, dsl_chatter_to_log():
        runner = _runner(device.cc, out_dtype)
        try:
            runner.forward(meta_inputs(m, n, k, out_dtype), tactic=tactic)
        except _Compiled:
            log.debug("FlashInfer runner compiled %s", tactic)
        got = result()
    if got is None:
        raise RuntimeError(f"FlashInfer's runner did not compile tactic {tactic} (API change?)")
    function, mac = got
    sm = cb.cubin_sm(function.dump_to_object(f"fp4fi_{abs(hash(key)):x}"))
    cb._check_target(sm, target, f"flashinfer {tactic}")
    ck = CompiledKernel(tactic, function, target, device.sm_count, sm, int(mac),
                        time.perf_counter() - t0, "compiled")  # fmt: skip
    _memory[key] = ck
    log.info("flashinfer %s for %s, %d SMs: compiled in %.2f s", tactic, target,
             device.sm_count, ck.seconds)  # fmt: skip
    return ck


@contextlib.contextmanager
def dsl_chatter_to_log() -> Iterator[None]:
    """What the DSL prints on stdout while compiling, as DEBUG log lines (``-v -v`` shows
    them): neither a JSON stdout nor stderr gets ``[DSL INFO]`` lines."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                log.debug("DSL: %s", line)


# ---- launch (runs only on a Blackwell/Rubin GPU) ----------------------------------------


class FlashInferKernel:
    """``kernel(operands, out)`` through FlashInfer's runner (its own launch and alpha).

    The dispatcher hands a swap_ab tactic the exchanged operands and ``out.T``; the
    runner swaps by itself, so they are exchanged back here and the runner gets the
    problem in FlashInfer's orientation: ``a`` [M, K/2], ``b`` as [K/2, N] (a transposed
    row-major [N, K/2]), the 128x4-swizzled scales, ``alpha``, ``out`` [M, N].
    Not run here: no Blackwell/Rubin GPU was available.
    """

    def __init__(self, compiled: CompiledKernel, out_dtype: str, cc: int) -> None:
        self.compiled = compiled
        self.out_dtype = out_dtype
        self.cc = cc

    def __repr__(self) -> str:
        c = self.compiled
        return f"FlashInferKernel({c.tactic}, {c.target}, {c.sm_count} SMs, {c.source})"

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:
        swap = bool(self.compiled.tactic[2])
        ops = operands.swapped() if swap else operands
        dst = out.t() if swap else out
        if not dst.is_contiguous():
            raise ValueError(f"out: expected a row-major [M, N] result, got strides {out.stride()}")
        inputs = [ops.a_data, ops.b_data.t(), ops.a_scale, ops.b_scale, ops.alpha,
                  None, dst, None, None, None]  # fmt: skip
        _runner(self.cc, self.out_dtype).forward(inputs, tactic=self.compiled.tactic)
