"""FlashInfer's SM100 W4A16 grouped GEMM (CuTe-DSL), used as a plain grouped GEMM.

FlashInfer 0.7.2.post1 ships the GEMM of its CuTe-DSL W4A16 MoE as a kernel class of its
own, ``Sm100W4A16GroupedGemmKernel`` (``flashinfer.fused_moe.cute_dsl.blackwell.
moe_w4a16_kernel``): NVFP4 weights ``[E, N, K/2]`` (per-expert 128x4 swizzled e4m3
scales), bf16 activations, decoded to bf16 inside the kernel (transform warps) and
multiplied on tcgen05 with fp32 accumulation, per-expert fp32 ``alpha`` in the epilogue.
Built with ``activation_type=None`` and ``use_fused_finalize=False`` it is a grouped GEMM
and nothing more: no router, no SwiGLU, no scatter. That is what this module drives; the
rest of FlashInfer's MoE layer (``moe_sort``, the fused finalize) is not used.

Its problem description is FlashInfer's routed-tile one, not torch's offsets:

* weights on the MMA's M side (output channels), routed rows (tokens) on N;
* rows are grouped in **tiles of ``route_tile`` rows, each tile owned by one expert**:
  tile ``j`` covers rows ``[j * route_tile, (j + 1) * route_tile)`` of a padded
  activation buffer, ``tile_expert[j]`` names its expert, rows at or past
  ``tile_limit[j]`` are ignored, and tiles at or past ``num_tiles[0]`` exit.

So an expert's rows must start on a tile boundary. `route` builds that layout from the
torch-style ``offsets`` (cumulative row ends) with a handful of device ops - no host
sync, fixed shapes for a given (tokens, experts, route_tile), so it records into a CUDA
graph - and `GroupedW4A16Kernel` copies ``a``'s rows into the padded buffer, launches,
and gathers the output rows back. Both copies move bits only: the result is exact.
Cost of the two copies: ``T x K x 2`` + ``T x N x 2`` bytes written and read again (at
decode tiny next to the ``E x N x K / 2`` weight bytes; at 4,096 x 8 rows and
N = K = 2048, about 0.5 GB of traffic, to be measured).

Compile: ``cute.compile(kernel.wrapper, ...)`` on typed null pointers with an explicit
``--gpu-arch=sm_XXXa``; sizes (N, rows, K) are runtime arguments, so one binary serves
every problem of a (tactic, E, K == K tile, N % cluster tile == 0) class. The maximum
number of co-resident clusters comes from `fp4_dispatch.backends.cute.max_clusters_for`;
the cubin's SM is read back and checked. Cached in memory and on disk (`compile_cached`:
the object file in the CuTe-DSL families' kernel cache folder, loaded back with the
same checks), so `fp4-dispatch`'s precompile workers' builds serve the measuring process.

Compiled here for sm_100a / sm_103a / sm_107a (FlashInfer offers its CuTe-DSL MoE on
compute capability 100, 103 and 107); not run on hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4_dispatch.backends import flashinfer as fb
from fp4_dispatch.support import safefs

if TYPE_CHECKING:
    import torch

    from fp4_dispatch.contracts.device import DeviceInfo

log = logging.getLogger(__name__)

KERNEL_MODULE = "flashinfer.fused_moe.cute_dsl.blackwell.moe_w4a16_kernel"
TUNER_MODULE = "flashinfer.fused_moe.cute_dsl.tuner"
#: FlashInfer's W4A16 K tile (``_W4A16_K_TILE``): 256 e2m1 values per stage
K_TILE = 256
#: compute capabilities FlashInfer offers its CuTe-DSL MoE on (``supported_compute_capability``)
CCS = frozenset({100, 103, 107})

#: FlashInfer's tactic tuple of one GEMM: ((tile_m, route_tile, K tile), (cluster_m,
#: cluster_n), raster_along_m), tile_m/cluster in the kernel's orientation (weights on M)
FiGemmTactic = tuple


@functools.cache
def availability() -> tuple[bool, str]:
    """(usable, reason): FlashInfer's (see `fp4_dispatch.backends.flashinfer.availability`),
    plus this kernel's module and tactic list (raises `FlashInferUnavailable` if moved)."""
    ok, reason = fb.availability()
    if not ok:
        return ok, reason
    try:
        kernel = importlib.import_module(KERNEL_MODULE)
        tuner = importlib.import_module(TUNER_MODULE)
        missing = [n for n in ("Sm100W4A16GroupedGemmKernel",) if not hasattr(kernel, n)]
        missing += [n for n in ("W4A16_MOE_TACTICS",) if not hasattr(tuner, n)]
        if missing:
            raise AttributeError(f"FlashInfer has no {', '.join(missing)}")
    except Exception as exc:  # its MoE kernel API is internal: failed, with the version
        raise fb.FlashInferUnavailable(fb._failure(exc)) from exc
    return True, reason


@functools.cache
def flashinfer_tactics() -> tuple[FiGemmTactic, ...]:
    """Every single-GEMM tactic FlashInfer's W4A16 MoE tuner enumerates (both GEMMs of
    its pairs), in its order, without duplicates."""
    tuner = importlib.import_module(TUNER_MODULE)
    seen: dict[FiGemmTactic, None] = {}
    for pair in tuner.W4A16_MOE_TACTICS:
        for tactic in pair:
            (tm, rt, tk), (cm, cn), raster = tactic
            seen[((int(tm), int(rt), int(tk)), (int(cm), int(cn)), bool(raster))] = None
    return tuple(seen)


def route_slots(tokens: int, experts: int, route_tile: int) -> int:
    """Rows of the padded activation buffer: an upper bound on ``sum_e ceil(c_e / rt) * rt``
    over any split of `tokens` rows among `experts` (at most min(E, T) are non-empty, and
    each wastes at most ``rt - 1`` rows). Host facts only: the counts live on the device."""
    if tokens < 0 or experts < 1 or route_tile < 1:
        raise ValueError(f"tokens, experts, route_tile: expected >= 0, >= 1, >= 1, got "
                         f"{tokens}, {experts}, {route_tile}")  # fmt: skip
    used = min(experts, tokens)
    tiles = (tokens + used * (route_tile - 1)) // route_tile
    return max(1, tiles) * route_tile


def can_implement(fi: FiGemmTactic, n: int, k: int, slots: int, experts: int) -> bool:
    """The kernel's own static ``can_implement`` (alignment, tile and cluster rules) for
    N output channels, K, `slots` routed rows and `experts` groups."""
    import cutlass

    kernel = importlib.import_module(KERNEL_MODULE).Sm100W4A16GroupedGemmKernel
    tiler, cluster, _ = fi
    return bool(kernel.can_implement(
        mnkl=(n, slots, k, experts), a_dtype=cutlass.Float4E2M1FN, b_dtype=cutlass.BFloat16,
        c_dtype=cutlass.BFloat16, a_major="k", b_major="k", c_major="m", mma_tiler=tiler,
        cluster_shape_mn=cluster, use_2cta_instrs=tiler[0] == 256,
    ))  # fmt: skip


@functools.lru_cache(maxsize=4096)
def valid_tactics(tokens: int, n: int, k: int, experts: int) -> tuple[FiGemmTactic, ...]:
    """FlashInfer's tactics its kernel accepts for this grouped problem (bf16 in and out)."""
    found = []
    for fi in flashinfer_tactics():
        if can_implement(fi, n, k, route_slots(tokens, experts, fi[0][1]), experts):
            found.append(fi)
    return tuple(found)


# ---- routing: torch offsets -> FlashInfer's routed tiles (device ops, no sync) ----------


@dataclasses.dataclass(frozen=True)
class Routing:
    """FlashInfer's routed-tile description of one grouped problem (all on the device).

    ``dest``: int64 ``[T]``, row ``r`` of ``a`` goes to row ``dest[r]`` of the padded
    buffer; ``valid``: bool ``[T]``, False for rows at or past ``offsets[E-1]`` (they
    belong to no expert, land past their neighbours' tiles, and are never written back);
    ``tile_expert``/``tile_limit``: int32 ``[slots / route_tile]``; ``num_tiles``: int32
    ``[1]``, the tiles in use.
    """

    dest: torch.Tensor
    valid: torch.Tensor
    tile_expert: torch.Tensor
    tile_limit: torch.Tensor
    num_tiles: torch.Tensor
    slots: int


def route(offsets: torch.Tensor, tokens: int, route_tile: int) -> Routing:
    """Lay `tokens` rows grouped by `offsets` (int32 ``[E]`` cumulative row ends, empty
    experts allowed) out in tiles of `route_tile` rows.

    Expert ``e``'s rows go to ``[pad_start[e], pad_start[e] + count[e])`` where
    ``pad_start`` is the exclusive cumulative sum of ``ceil(count / rt) * rt``. Ends are
    clamped to [0, T] on the device, so ends past T (a caller's error the host cannot
    see without a sync) never make a tile cover rows that do not exist. Shapes depend on
    (T, E, rt) only, values on the device: no host synchronisation. On a GPU with Triton
    this is one kernel (`fp4_dispatch.backends.flashinfer.route_triton`); otherwise ~24
    small torch ops.
    """
    import torch

    experts = offsets.shape[0]
    slots = route_slots(tokens, experts, route_tile)
    dev = offsets.device
    fused = _fused_route() if offsets.is_cuda else None
    if fused is not None and experts <= fused.MAX_EXPERTS:
        out = (torch.empty(tokens, dtype=torch.int64, device=dev),
               torch.empty(tokens, dtype=torch.bool, device=dev),
               torch.empty(slots // route_tile, dtype=torch.int32, device=dev),
               torch.empty(slots // route_tile, dtype=torch.int32, device=dev),
               torch.empty(1, dtype=torch.int32, device=dev))  # fmt: skip
        fused.route_into(offsets, tokens, route_tile, slots, out)
        return Routing(*out, slots)
    ends = offsets.to(torch.int64).clamp_(0, tokens)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + route_tile - 1) // route_tile
    tile_end = torch.cumsum(tiles, 0)
    pad_start = (tile_end - tiles) * route_tile
    rows = torch.arange(tokens, device=dev, dtype=torch.int64)
    group = torch.searchsorted(ends, rows, right=True)
    valid = group < experts
    group.clamp_(max=experts - 1)
    dest = rows + (pad_start - (ends - counts))[group]
    slot_tiles = torch.arange(slots // route_tile, device=dev, dtype=torch.int64)
    owner = torch.searchsorted(tile_end, slot_tiles, right=True).clamp_(max=experts - 1)
    limit = (pad_start + counts)[owner]
    return Routing(dest, valid, owner.to(torch.int32), limit.to(torch.int32),
                   tile_end[-1:].to(torch.int32), slots)  # fmt: skip


@functools.cache
def _fused_route() -> Any:
    """The one-launch routing module, or None without Triton (routing stays in torch)."""
    try:
        return importlib.import_module("fp4_dispatch.backends.flashinfer.route_triton")
    except ImportError as exc:
        log.info("grouped routing in torch ops (no Triton: %s)", exc)
        return None


def route_kernels() -> int:
    """Device kernels `route` launches on a GPU: 1 with Triton, else its torch ops (~24)."""
    return 1 if _fused_route() is not None else 24


# ---- compile --------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledKernel:
    """One tactic compiled for one (arch, SM count, E, K class, N alignment class)."""

    tactic: FiGemmTactic
    function: Any  # CuTe-DSL JitCompiledFunction
    experts: int
    target: str
    sm_count: int
    cubin_sm: int
    max_active_clusters: int
    seconds: float
    source: str  # "compiled", "disk" or "memory"
    path: str | None = None


_memory: dict[tuple, CompiledKernel] = {}


def compile_cached(
    key: tuple, target: str, name: str, build: Callable[[], Any]
) -> tuple[Any, int, str, str | None]:
    """(function, cubin SM, source, path) of a grouped kernel: from the on-disk kernel
    cache (`fp4_dispatch.backends.cute.cache_dir`) if an entry of this exact key and
    library versions loads and its cubin names `target`, else ``build()`` (a compile),
    checked and stored. Entries are the object file ``dump_to_object`` writes and a JSON
    of the key; only this user's regular files are ever loaded (loading runs code)."""
    from fp4_dispatch.backends import cute as cb

    text = json.dumps([repr(key), fb.version(), *cb.library_versions()])
    prefix = f"fp4fig_{hashlib.sha256(text.encode()).hexdigest()[:24]}"
    folder = cb.cache_dir()
    obj_path, meta_path = folder / f"{prefix}.o", folder / f"{prefix}.json"
    loaded = _load(prefix, obj_path, meta_path, text, target, name)
    if loaded is not None:
        return (*loaded, "disk", str(obj_path))
    function = build()
    obj = function.dump_to_object(prefix)
    sm = cb.cubin_sm(obj)
    cb._check_target(sm, target, name)
    return function, sm, "compiled", cb._store(obj, obj_path, meta_path, (text,), sm)


def _load(
    prefix: str, obj_path: Path, meta_path: Path, text: str, target: str, name: str
) -> tuple[Any, int] | None:
    """The cached function and its cubin SM, or None (absent, another key, or unusable:
    a stale or corrupt entry is recompiled, with a warning)."""
    from fp4_dispatch.backends import cute as cb

    if not (os.path.lexists(obj_path) and os.path.lexists(meta_path)):
        return None
    try:
        for path in (obj_path, meta_path):
            st = safefs.check_regular(path, "kernel cache entry")
            if st is not None and st.st_uid not in (0, os.geteuid()):
                raise PermissionError(f"{path} is owned by another user (uid {st.st_uid})")
        if json.loads(meta_path.read_text()).get("key") != [text]:
            log.warning("kernel cache %s holds another key; recompiling", meta_path)
            return None
        sm = cb.cubin_sm(obj_path.read_bytes())
        cb._check_target(sm, target, name)
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=False)
        return getattr(module, prefix), sm
    except Exception as exc:
        log.warning("kernel cache entry %s unusable (%s: %s); recompiling",
                    obj_path, type(exc).__name__, exc)  # fmt: skip
        return None


def compile_key(fi: FiGemmTactic, n: int, k: int, experts: int) -> tuple:
    """What the binary depends on besides the target: the tactic, E (the kernel's
    ``group_count``), whether K is one K tile (FlashInfer then transforms 128-value
    fragments, else 32) and whether N fills whole cluster tiles (``m_cluster_aligned``)."""
    (tile_m, _, tile_k), (cluster_m, _), _ = fi
    cta_tile_m = tile_m // (2 if tile_m == 256 else 1)
    fragment = 128 if k == tile_k else 32
    aligned = n > 0 and n % (cta_tile_m * cluster_m) == 0
    return (fi, experts, fragment, aligned)


def _make_kernel(fi: FiGemmTactic, experts: int, fragment: int, aligned: bool) -> Any:
    kernel_cls = importlib.import_module(KERNEL_MODULE).Sm100W4A16GroupedGemmKernel
    enums = importlib.import_module("flashinfer.tllm_enums")
    import cutlass

    tiler, cluster, raster = fi
    return kernel_cls(
        acc_dtype=cutlass.Float32, use_2cta_instrs=tiler[0] == 256, mma_tiler_mnk=tiler,
        cluster_shape_mn=cluster, group_count=experts, activation_type=None,
        swiglu_alpha=enums.DEFAULT_SWIGLU_ALPHA, swiglu_beta=enums.DEFAULT_SWIGLU_BETA,
        swiglu_limit=enums.DEFAULT_SWIGLU_LIMIT, situ_beta=None, situ_linear_beta=None,
        use_fused_finalize=False, enable_pdl=False, use_clc_scheduler=False,
        raster_along_m=raster, transform_fragment_size=fragment, m_cluster_aligned=aligned,
    )  # fmt: skip


def _pointers(addresses: dict[str, int] | None = None) -> list[Any]:
    """The wrapper's eight typed global-memory pointers (null ones for a compile)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    a = addresses or {}
    spec = (("weight", cutlass.Float4E2M1FN, 32), ("weight_sf", cutlass.Float8E4M3FN, 16),
            ("activation", cutlass.BFloat16, 32), ("tile_expert", cutlass.Int32, 16),
            ("tile_limit", cutlass.Int32, 16), ("num_tiles", cutlass.Int32, 16),
            ("alpha", cutlass.Float32, 16), ("output", cutlass.BFloat16, 32))  # fmt: skip
    return [make_ptr(t, a.get(name, 0), cute.AddressSpace.gmem, assumed_align=al)
            for name, t, al in spec]  # fmt: skip


def compile_tactic(
    fi: FiGemmTactic, n: int, k: int, experts: int, device: DeviceInfo
) -> CompiledKernel:
    """Compile `fi` for `device`'s arch and SM count; the cubin's SM is checked."""
    import cutlass.cute as cute

    from fp4_dispatch.backends import cute as cb

    if device.cc is None:
        raise ValueError(f"device: {device.name} has no compute capability to compile for")
    target = cb.target_of(device.cc)
    base = compile_key(fi, n, k, experts)
    key = (*base, target, device.sm_count)
    hit = _memory.get(key)
    if hit is not None:
        return dataclasses.replace(hit, source="memory", seconds=0.0)
    cluster = fi[1][0] * fi[1][1]
    mac = int(cb.max_clusters_for(device)(cluster))
    t0 = time.perf_counter()

    def build() -> Any:
        kernel = _make_kernel(fi, experts, base[2], base[3])
        cb._preload_runtime()  # dump_to_object needs the DSL runtime (see backends.cute)
        with cb._compile_lock, fb.dsl_chatter_to_log():
            return cute.compile(
                kernel.wrapper, *_pointers(), None, None, n, fi[0][1], k, 0, 0,
                max_active_clusters=mac, stream=cute.runtime.make_fake_stream(),
                options=f"--gpu-arch=sm_{device.cc}a",
            )  # fmt: skip

    name = f"flashinfer grouped W4A16 {fi}"
    function, sm, source, path = compile_cached((*key, mac), target, name, build)
    ck = CompiledKernel(fi, function, experts, target, device.sm_count, sm, mac,
                        time.perf_counter() - t0, source, path)  # fmt: skip
    _memory[key] = ck
    log.info("%s for %s, %d SMs, E=%d: %s in %.2f s", name, target, device.sm_count,
             experts, source, ck.seconds)  # fmt: skip
    return ck


# ---- launch (runs only on a Blackwell/Rubin GPU) ----------------------------------------


class GroupedW4A16Kernel:
    """``kernel(operands, out)`` for a grouped W4A16 problem (bf16 ``a`` and ``out``).

    Scatter ``a``'s rows into the routed-tile buffer (`route`), launch FlashInfer's
    kernel (its alpha per expert), gather the rows back into ``out`` (rows of no expert
    left as they were). Not run here: no
    Blackwell/Rubin GPU was available.
    """

    def __init__(self, compiled: CompiledKernel) -> None:
        self.compiled = compiled
        self.route_tile = compiled.tactic[0][1]

    def __repr__(self) -> str:
        c = self.compiled
        return (f"GroupedW4A16Kernel({c.tactic}, E={c.experts}, {c.target}, "
                f"{c.sm_count} SMs, {c.source})")  # fmt: skip

    def __call__(self, operands: Any, out: torch.Tensor) -> None:
        import torch

        a, offsets = operands.a, operands.offsets
        tokens, k = a.shape
        experts, n = operands.b_data.shape[0], operands.b_data.shape[1]
        if experts != self.compiled.experts:
            raise ValueError(f"b_data: compiled for {self.compiled.experts} experts, got {experts}")
        for name, t in (("a", a), ("out", out)):  # any strides: only copies touch them
            if t.dtype != torch.bfloat16:
                raise ValueError(f"{name}: expected bfloat16 (the kernel decodes to bf16 and "
                                 f"writes bf16), got {t.dtype}")  # fmt: skip
        routing = route(offsets, tokens, self.route_tile)
        padded = torch.empty(routing.slots, k, dtype=torch.bfloat16, device=a.device)
        padded.index_copy_(0, routing.dest, a)
        result = torch.empty(routing.slots, n, dtype=torch.bfloat16, device=a.device)
        self.launch(operands, routing, padded, result)
        # rows of no expert keep what `out` held (GroupedOperands): a select, no host sync
        gathered = result.index_select(0, routing.dest)
        out.copy_(torch.where(routing.valid[:, None], gathered, out))

    def launch(self, operands: Any, routing: Routing, padded: Any, result: Any) -> None:
        """FlashInfer's compiled kernel on the current torch stream."""
        import torch
        from cuda.bindings import driver

        addresses = {
            "weight": operands.b_data.data_ptr(), "weight_sf": operands.b_scale.data_ptr(),
            "activation": padded.data_ptr(), "tile_expert": routing.tile_expert.data_ptr(),
            "tile_limit": routing.tile_limit.data_ptr(),
            "num_tiles": routing.num_tiles.data_ptr(), "alpha": operands.alpha.data_ptr(),
            "output": result.data_ptr(),
        }  # fmt: skip
        n, k = operands.b_data.shape[1], padded.shape[1]
        stream = driver.CUstream(torch.cuda.current_stream(padded.device).cuda_stream)
        self.compiled.function(*_pointers(addresses), None, None, n, routing.slots, k, 0,
                               stream=stream)  # fmt: skip
