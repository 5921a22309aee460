"""NVIDIA's CuTe-DSL NVFP4 GEMMs (``nvidia-cutlass-operators``) for SM100, SM103 and SM107.

Three jobs, all on top of the library's own API (nothing of it is copied here):

* **Discovery.** ``get_operators(GemmArguments(...), target_sm=...)`` lists the block-scaled
  GEMM operators for a target: 36 ``PersistentDenseBlockScaledGemmOperator`` (the SM100
  design, also compiled for 103a and 107a) and, on 107a, 138
  ``Sm107DenseBlockScaledGemmOperator``. The list is discovered once per (target, kernel
  output dtype, output major) and cached (~5-15 ms each after the ~1.5 s import).
* **Validity.** A design is valid for a problem iff its kernel's own static
  ``can_implement`` accepts it (alignment of every contiguous dimension, dtype/layout
  combination, tile/cluster rules and, for SM107, "the problem is at least one preferred
  cluster tile"). That call costs ~3 us, so it is used directly: the rules are the
  kernel's, not a transcription. ``Operator.supports`` is not used for the problem rules
  because the SM107 operator does not check the cluster-tile rule (its kernel does).
* **Compile + cache + launch.** ``Operator.compile`` asks the CUDA driver for the maximum
  number of co-resident clusters (baked into the binary). We supply it: from the driver
  for a real GPU, ``sm_count // cluster_size`` for a simulated one (an upper bound: a real
  part's GPC layout can allow fewer). Compiled artifacts are cached in memory and on disk,
  keyed by (operator, arch, SM count, the cluster counts baked in, library versions). The
  on-disk entry is the object file ``JitCompiledFunction.dump_to_object`` writes (host
  launcher + the cubin); ``cute.runtime.load_module`` loads it back. That round trip
  needs the non-TVM-FFI calling convention, so compiles run with
  ``GlobalOptions().use_tvm_ffi`` off (scoped): a launch costs a little more host time
  than through TVM-FFI, which CUDA graphs hide. The target is *checked*: the cubin
  embedded in the object is parsed and its ELF ``e_flags`` must name the device's SM
  (bits 8-15 on Blackwell-era cubins).

Global scale: the operators have no alpha epilogue, so alpha is applied by us, after the
kernel, in fp32, in one elementwise pass:

* bfloat16 output: the kernel writes bf16 straight into ``out`` (compiled for ``out``'s
  major order), then ``out.mul_(alpha)`` (fp32 math, one rounding). Cost: one read + one
  write of the output (4 B per element). Rounding: ``bf16(bf16(acc) * alpha)``, i.e. one
  extra rounding step against applying alpha to the fp32 accumulator; exact when alpha is
  a power of two.
* float16 output: the unscaled product overflows fp16 (block scales reach 448, so one
  product reaches 2688^2), so the kernel writes fp32 into a temporary and
  ``torch.mul(tmp, alpha, out=out)`` rounds once. Cost: +6 B per output element and an
  M x N fp32 temporary.

Blackwell kernels are compiled here, never run: no Blackwell or Rubin GPU was available.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fp4_dispatch.support import safefs

if TYPE_CHECKING:
    import torch

    from fp4_dispatch.contracts.backend import GemmOperands
    from fp4_dispatch.contracts.device import DeviceInfo

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install '.[cute]' in the fp4-dispatch checkout"
NOT_INSTALLED = f"nvidia-cutlass-dsl[cu13] not installed: {INSTALL_HINT}"
#: modules whose absence means "the extra is not installed" (anything else is a failure)
_EXTRA_MODULES = ("cutlass", "nvidia_cutlass_dsl", "tvm_ffi", "cuda")
#: environment variable naming the on-disk kernel cache directory
CACHE_ENV = "FP4_DISPATCH_KERNEL_CACHE"

Kind = Literal["sm100", "sm107"]
Major = Literal["n", "m"]  # the output's contiguous dimension, in the kernel's orientation
EM_CUDA = 190


class CuteUnavailable(RuntimeError):
    """The CuTe-DSL extra is installed but importing it failed (not the same as absent)."""


# ---- availability -------------------------------------------------------------------


@functools.cache
def availability() -> tuple[bool, str]:
    """(usable, reason). Absent extra -> (False, install hint); broken import -> raises.

    Raises `CuteUnavailable` with the exact exception when the packages are present but
    an import inside them fails: the registry shows that backend as *failed*, never absent.
    """
    try:
        ops = importlib.import_module("cutlass.operators")
        importlib.import_module("cutlass.cute")
        importlib.import_module("cutlass.utils")
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root in _EXTRA_MODULES:
            log.info("CuTe-DSL backends unavailable: %s (%s)", NOT_INSTALLED, exc)
            return False, f"{NOT_INSTALLED} ({exc})" if root != "cutlass" else NOT_INSTALLED
        raise CuteUnavailable(_import_failure(exc)) from exc
    except Exception as exc:  # a present but broken install: a failure with its message
        raise CuteUnavailable(_import_failure(exc)) from exc
    return True, (
        f"nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}, "
        f"nvidia-cutlass-operators {getattr(ops, '__version__', '?')}"
    )


def _import_failure(exc: BaseException) -> str:
    msg = f"importing CuTe-DSL failed: {type(exc).__name__}: {exc} (reinstall: {INSTALL_HINT})"
    log.warning("%s", msg)
    return msg


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def library_versions() -> tuple[str, str]:
    return _version("nvidia-cutlass-dsl"), _version("nvidia-cutlass-operators")


# ---- discovery ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Design:
    """One operator's design, in the kernel's own terms (read from the operator's impl).

    ``tile_m`` is the MMA tiler's M: rows per CTA pair for a 2-CTA instruction
    (``inst_m == 256``), twice the instruction M with B reuse (SM107).
    """

    kind: Kind
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    fallback_m: int
    fallback_n: int
    inst_m: int
    b_reuse: bool


@dataclasses.dataclass(frozen=True)
class OperatorEntry:
    design: Design
    name: str
    operator: Any  # cutlass.operators.Operator
    #: the kernel's static can_implement(mnkl, ...) -> bool, with the design bound
    can_implement: Callable[[int, int, int, str, Major], bool]


def kernel_out_dtype(out_dtype: str) -> str:
    """The dtype the kernel writes: bf16 directly; fp32 for fp16 output (overflow)."""
    return "bfloat16" if out_dtype == "bfloat16" else "float32"


def _torch_dtype(name: str) -> torch.dtype:
    """An output dtype (`fp4_dispatch.format.checks.TORCH_DTYPES`) or "float32" (the fp16 path)."""
    import torch

    from fp4_dispatch.format.checks import TORCH_DTYPES

    return torch.float32 if name == "float32" else TORCH_DTYPES[name]


def _probe_args(out_dtype: str, major: Major, m: int = 256, n: int = 256, k: int = 256) -> Any:
    """Small CPU GemmArguments in our operand format (only dtypes and majors matter)."""
    import torch
    from cutlass import operators as ops

    fp4 = torch.float4_e2m1fn_x2
    a = torch.empty(m, k // 2, dtype=fp4)
    b = torch.empty(n, k // 2, dtype=fp4).t()
    sa = torch.empty(padded_scale_numel(m, k), dtype=torch.float8_e4m3fn)
    sb = torch.empty(padded_scale_numel(n, k), dtype=torch.float8_e4m3fn)
    dt = _torch_dtype(out_dtype)
    out = torch.empty(m, n, dtype=dt) if major == "n" else torch.empty(n, m, dtype=dt).t()
    mode, swz = ops.ScaleMode.Blockwise1x16, ops.ScaleSwizzleMode.Swizzle32x4x4
    return ops.GemmArguments(
        ops.ScaledOperand(a, sa, mode, swz),
        ops.ScaledOperand(b, sb, mode, swz),
        out,
        accumulator_type=torch.float32,
    )


def padded_scale_numel(rows: int, k: int) -> int:
    """Elements of a 128x4-swizzled scale tensor
    (`fp4_dispatch.format.nvfp4.swizzled_scale_shape`)."""
    from fp4_dispatch.format.nvfp4 import swizzled_scale_shape  # lazy: it imports torch

    padded_rows, padded_cols = swizzled_scale_shape(rows, k)
    return padded_rows * padded_cols


def _entry(op: Any) -> OperatorEntry:
    import cutlass

    impl = op.impl
    cls = type(op).__name__
    fp4, sf = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN
    c_types = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}
    if cls == "PersistentDenseBlockScaledGemmOperator":
        tile = tuple(op.metadata.design.tile_shape[:2])
        cluster = tuple(impl.cluster_shape_mn)
        design = Design(
            "sm100", tile[0], tile[1], *cluster, *cluster,
            inst_m=256 if impl.use_2cta_instrs else 128, b_reuse=False,
        )  # fmt: skip
        kernel = type(impl)

        def check(m: int, n: int, k: int, c: str, major: Major) -> bool:
            return bool(kernel.can_implement(
                (m, n, k, 1), fp4, fp4, sf, c_types[c], "k", "k", major, 16, tile, cluster
            ))  # fmt: skip

    elif cls == "Sm107DenseBlockScaledGemmOperator":
        tiler, inst = tuple(impl.mma_tiler), tuple(impl.mma_inst_shape)
        pref, fall = tuple(impl.preferred_cluster_shape_mn), tuple(impl.fallback_cluster_shape_mn)
        design = Design(
            "sm107", tiler[0], tiler[1], *pref, *fall,
            inst_m=inst[0], b_reuse=bool(impl.enable_breuse),
        )  # fmt: skip
        kernel = type(impl)

        def check(m: int, n: int, k: int, c: str, major: Major) -> bool:
            return bool(kernel.can_implement(
                (m, n, k, 1), fp4, fp4, sf, c_types[c], "k", "k", major, 16,
                tiler, inst, pref, fall,
            ))  # fmt: skip

    else:
        raise TypeError(f"unexpected operator class {cls} for NVFP4")
    return OperatorEntry(design, op.metadata.operator_name, op, check)


@functools.cache
def discover(target: str, kernel_dtype: str = "bfloat16", major: Major = "n") -> tuple:
    """Every NVFP4 operator for `target` (e.g. ``"107a"``), as `OperatorEntry`, cached."""
    from cutlass import operators as ops

    t0 = time.perf_counter()
    found = ops.get_operators(_probe_args(kernel_dtype, major), target_sm=target)
    entries = tuple(sorted((_entry(op) for op in found), key=lambda e: e.name))
    log.info(
        "discovered %d CuTe-DSL operators for %s (%s, %s-major out) in %.1f ms",
        len(entries), target, kernel_dtype, major, (time.perf_counter() - t0) * 1e3,
    )  # fmt: skip
    return entries


@functools.cache
def designs(target: str, kind: Kind) -> dict[Design, OperatorEntry]:
    """Design -> operator (bf16, row-major output) of one kind for `target`."""
    return {e.design: e for e in discover(target) if e.design.kind == kind}


def operator_for(design: Design, target: str, out_dtype: str, major: Major) -> OperatorEntry:
    """The operator implementing `design` for this output dtype and major order."""
    for e in discover(target, kernel_out_dtype(out_dtype), major):
        if e.design == design:
            return e
    raise LookupError(f"no {design.kind} operator for {design} on {target} ({out_dtype}, {major})")


def target_of(cc: int) -> str:
    return f"{cc}a"


# ---- compile, cache, check ----------------------------------------------------------


@dataclasses.dataclass
class CompiledKernel:
    """A compiled operator for one (arch, SM count), with what is known about it."""

    entry: OperatorEntry
    artifact: Any  # cutlass.operators.CompiledArtifact
    target: str
    sm_count: int
    cubin_sm: int
    seconds: float
    source: Literal["compiled", "disk", "memory"]
    path: str | None


_memory: dict[str, CompiledKernel] = {}
_compile_lock = threading.Lock()


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("fp4-dispatch")) / "cute-kernels"


def cubin_sm(obj: bytes) -> int:
    """SM number of the first CUDA ELF (cubin) embedded in an object file.

    Blackwell-era cubins (ELF ABI version 8) keep the SM in bits 8-15 of ``e_flags``
    (sm_100 -> 0x64); older ones in bits 0-7.
    """
    start = obj.find(b"\x7fELF", 1)
    while start != -1:
        machine = struct.unpack_from("<H", obj, start + 18)[0]
        if machine == EM_CUDA:
            flags = struct.unpack_from("<I", obj, start + 48)[0]
            abi_version = obj[start + 8]
            return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
        start = obj.find(b"\x7fELF", start + 1)
    raise ValueError("no CUDA cubin (ELF e_machine 190) found in the compiled object")


@functools.cache
def _preload_runtime() -> tuple[str, ...]:
    """Load the DSL's runtime library globally before dumping objects.

    ``dump_to_object`` resolves the host launcher's CUDA runtime symbols in-process.
    They are only present once ``libcute_dsl_runtime.so`` is loaded, which the DSL does
    itself only when it JIT-loads a kernel for the machine's own default arch: on a CPU
    machine, compiling for sm_103a/sm_107a first fails with "Symbols not found:
    _cudaLaunchKernelEx ..." (measured). The library names its runtime libraries.
    """
    import ctypes

    from cutlass.runtime import find_runtime_libraries

    paths = tuple(find_runtime_libraries(enable_tvm_ffi=False))
    for path in paths:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    return paths


@contextlib.contextmanager
def _compile_context(max_clusters: Callable[[int], int]) -> Iterator[None]:
    """Supply the max active clusters the operator asks the driver for; TVM-FFI off."""
    import cutlass.utils as cu
    from cutlass.operators import GlobalOptions

    class SuppliedHardwareInfo:
        """Stands in for cutlass.utils.HardwareInfo during one compile."""

        def __init__(self, device_id: int = 0) -> None:
            self.device_id = device_id

        def get_max_active_clusters(self, cluster_size: int, stream: object = None) -> int:
            return max_clusters(cluster_size)

    _preload_runtime()
    original, options = cu.HardwareInfo, GlobalOptions()
    tvm = options.use_tvm_ffi
    with _compile_lock:
        cu.HardwareInfo, options.use_tvm_ffi = SuppliedHardwareInfo, False
        try:
            yield
        finally:
            cu.HardwareInfo, options.use_tvm_ffi = original, tvm


def max_clusters_for(device: DeviceInfo) -> Callable[[int], int]:
    """Real GPU: ask the driver (per cluster size); simulated: ``sm_count // size``."""
    if device.kind == "cuda":
        import cutlass.utils as cu

        index = int(device.torch_device.partition(":")[2] or 0)
        hw = cu.HardwareInfo(index)
        return functools.cache(hw.get_max_active_clusters)
    return lambda size: max(1, device.sm_count // size)


def compile_operator(
    entry: OperatorEntry,
    target: str,
    sm_count: int,
    max_clusters: Callable[[int], int],
    load_only: bool = False,
) -> CompiledKernel | None:
    """Compile (or load) `entry` for `target` and `sm_count`; memory, then disk, then compile.

    ``load_only``: return None instead of compiling (``fp4-dispatch compile`` loads what
    the cache has in its own process, and spawns compile workers only for the rest).
    """
    dsl, opv = library_versions()
    d = entry.design
    sizes = sorted({d.cluster_m * d.cluster_n, d.fallback_m * d.fallback_n})
    clusters = [[size, max_clusters(size)] for size in sizes]  # baked into the binary
    key = (entry.name, target, sm_count, clusters, dsl, opv)
    hit = _memory.get(json.dumps(key))
    if hit is not None:
        return dataclasses.replace(hit, source="memory", seconds=0.0)
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    prefix = f"fp4k_{digest}"
    directory = cache_dir()
    obj_path, meta_path = directory / f"{prefix}.o", directory / f"{prefix}.json"
    t0 = time.perf_counter()
    loaded = _load(entry, target, key, prefix, obj_path, meta_path)
    if loaded is not None:
        artifact, sm = loaded
        ck = CompiledKernel(entry, artifact, target, sm_count, sm, time.perf_counter() - t0,
                            "disk", str(obj_path))  # fmt: skip
    elif load_only:
        return None
    else:
        with _compile_context(max_clusters):
            artifact = entry.operator.compile(_probe_args(*_kernel_out(entry)), target_sm=target)
        obj = artifact.compiled_obj.dump_to_object(prefix)
        sm = cubin_sm(obj)
        _check_target(sm, target, entry.name)
        path = _store(obj, obj_path, meta_path, key, sm)
        ck = CompiledKernel(entry, artifact, target, sm_count, sm, time.perf_counter() - t0,
                            "compiled", path)  # fmt: skip
    _memory[json.dumps(key)] = ck
    return ck


def _kernel_out(entry: OperatorEntry) -> tuple[str, Major]:
    """Output dtype and major order the operator was discovered with (from its metadata)."""
    out = entry.operator.metadata.operands.out
    dtype = "float32" if out.dtype.width == 32 else "bfloat16"
    return dtype, ("n" if tuple(out.stride)[-1] == 1 else "m")


def _check_target(sm: int, target: str, name: str) -> None:
    want = int(target.rstrip("af"))
    if sm != want:
        raise RuntimeError(f"{name}: compiled for {target} but its cubin says sm_{sm}")


def _store(obj: bytes, obj_path: Path, meta_path: Path, key: tuple, sm: int) -> str | None:
    """Write the object file and its metadata atomically; a failure is logged (one warning
    per folder and process, e.g. a read-only cache), not fatal.

    Only regular files are replaced (`fp4_dispatch.support.safefs`): a symlink, FIFO or device
    planted under an entry's name is left alone and the kernel is simply not stored.
    """
    try:
        obj_path.parent.mkdir(parents=True, exist_ok=True)
        safefs.warn_world_writable(obj_path.parent, "kernel cache")
        for path, data in ((obj_path, obj), (meta_path, None)):
            safefs.check_regular(path, "kernel cache entry")
            if data is None:
                meta = {"key": list(key), "cubin_sm": sm, "created": time.time()}
                data = json.dumps(meta, indent=1).encode()
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        _warn_store_once(obj_path.parent, exc)
        return None
    return str(obj_path)


_store_warned: set[str] = set()


def _warn_store_once(folder: Path, exc: OSError) -> None:
    """A read-only kernel cache says so once per folder, not once per kernel (was 32x)."""
    if str(folder) in _store_warned:
        log.debug("could not store compiled kernel in %s: %s", folder, exc)
        return
    _store_warned.add(str(folder))
    log.warning("could not store compiled kernels in %s: %s (kernels are compiled in memory "
                "each run; set %s to a writable folder)", folder, exc, CACHE_ENV)  # fmt: skip


def _load(
    entry: OperatorEntry, target: str, key: tuple, prefix: str, obj_path: Path, meta_path: Path
) -> tuple[Any, int] | None:
    """The cached artifact if its metadata matches `key` and it loads; None otherwise."""
    if not (os.path.lexists(obj_path) and os.path.lexists(meta_path)):
        return None
    try:
        # loading an object file runs its code: only this user's regular files, never a
        # link or device planted in a shared folder
        for path in (obj_path, meta_path):
            st = safefs.check_regular(path, "kernel cache entry")
            if st is not None and st.st_uid not in (0, os.geteuid()):
                raise PermissionError(f"{path} is owned by another user (uid {st.st_uid})")
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != list(key):
            log.warning("kernel cache %s holds another key; recompiling", meta_path)
            return None
        sm = cubin_sm(obj_path.read_bytes())
        _check_target(sm, target, entry.name)
        import cutlass.cute as cute
        from cutlass.operators import CompiledArtifact
        from cutlass.operators.arch import TargetSm

        fn = getattr(cute.runtime.load_module(str(obj_path), enable_tvm_ffi=False), prefix)
    except Exception as exc:  # a stale or corrupt cache entry is recompiled, loudly
        log.warning("kernel cache entry %s unusable (%s: %s); recompiling",
                    obj_path, type(exc).__name__, exc)  # fmt: skip
        return None
    return CompiledArtifact(fn, entry.operator, TargetSm(target)), sm


# ---- launch (runs only on a Blackwell/Rubin GPU) ------------------------------------


def major_of(t: torch.Tensor) -> Major | None:
    """'n' for a row-major [M, N] view, 'm' for a column-major one, None otherwise."""
    if t.stride(1) == 1 and t.stride(0) >= t.shape[1]:
        return "n"
    if t.stride(0) == 1 and t.stride(1) >= t.shape[0]:
        return "m"
    return None


class CuteKernel:
    """``kernel(operands, out)``: run the compiled operator, then apply alpha (see module)."""

    def __init__(self, compiled: CompiledKernel, out_dtype: str, major: Major) -> None:
        self.compiled = compiled
        self.out_dtype = out_dtype
        self.kernel_dtype = kernel_out_dtype(out_dtype)
        self.major = major

    def __repr__(self) -> str:
        c = self.compiled
        return f"CuteKernel({c.entry.name}, {c.target}, {c.sm_count} SMs, {c.source})"

    def check(self, operands: GemmOperands) -> None:
        """The kernel's own rules for this call, and padded scales (never hand it less)."""
        m, n, k = operands.m, operands.n, operands.k
        if not self.compiled.entry.can_implement(m, n, k, self.kernel_dtype, self.major):
            raise ValueError(f"{self.compiled.entry.name} cannot implement M={m} N={n} K={k}")
        for name, rows, scale in (("a", m, operands.a_scale), ("b", n, operands.b_scale)):
            want = padded_scale_numel(rows, k)
            if scale.numel() != want:
                raise ValueError(
                    f"{name}_scale: expected {want} elements (128x4 swizzled, padded), "
                    f"got {scale.numel()} (shape {tuple(scale.shape)})"
                )

    def __call__(self, operands: GemmOperands, out: torch.Tensor) -> None:
        import torch

        self.check(operands)
        direct = out.dtype == _torch_dtype(self.kernel_dtype) and major_of(out) == self.major
        if direct:
            dst = out
        else:  # a temporary in the compiled layout; the scale pass writes `out`
            rows, cols = out.shape
            shape = (rows, cols) if self.major == "n" else (cols, rows)
            dst = torch.empty(shape, dtype=_torch_dtype(self.kernel_dtype), device=out.device)
            dst = dst if self.major == "n" else dst.t()
        self.launch(operands, dst)
        if direct:
            out.mul_(operands.alpha)
        else:
            torch.mul(dst, operands.alpha, out=out)

    def launch(self, operands: GemmOperands, dst: torch.Tensor) -> None:
        """The operator's own run() on the current torch stream (no alpha)."""
        import torch
        from cuda.bindings import driver
        from cutlass import operators as ops

        fp4 = torch.float4_e2m1fn_x2
        mode, swz = ops.ScaleMode.Blockwise1x16, ops.ScaleSwizzleMode.Swizzle32x4x4
        args = ops.GemmArguments(
            ops.ScaledOperand(operands.a_data.view(fp4), operands.a_scale.reshape(-1), mode, swz),
            ops.ScaledOperand(
                operands.b_data.view(fp4).t(), operands.b_scale.reshape(-1), mode, swz
            ),
            dst,
            accumulator_type=torch.float32,
        )
        stream = driver.CUstream(torch.cuda.current_stream(dst.device).cuda_stream)
        self.compiled.entry.operator.run(args, self.compiled.artifact, stream=stream)


def build_kernel(
    design: Design, out_dtype: str, major: Major, device: DeviceInfo, load_only: bool = False
) -> CuteKernel | None:
    """Compile `design` for `device` (its arch and SM count) and wrap it as a Kernel.

    ``load_only``: None when the kernel is in neither the memory nor the disk cache.
    """
    if device.cc is None:
        raise ValueError(f"{device.name}: no compute capability to compile for")
    target = target_of(device.cc)
    entry = operator_for(design, target, out_dtype, major)
    compiled = compile_operator(
        entry, target, device.sm_count, max_clusters_for(device), load_only=load_only
    )
    if compiled is None:
        return None
    log.info("%s for %s, %d SMs: %s in %.2f s", entry.name, target, device.sm_count,
             compiled.source, compiled.seconds)  # fmt: skip
    return CuteKernel(compiled, out_dtype, major)
