"""FlashInfer's SM100 block-scaled contiguous grouped GEMM (CuTe-DSL) as a plain grouped W4A4.

FlashInfer 0.7.2.post1's CuTe-DSL NVFP4 MoE computes its second GEMM with
``Sm100BlockScaledContiguousGroupedGemmFinalizeFusionKernel`` (``flashinfer.fused_moe.
cute_dsl.blackwell``): NVFP4 x NVFP4 (16-element e4m3 block scales, tcgen05 block-scaled
MMA), rows in routed tiles (`fp4_dispatch.backends.flashinfer.grouped.route`), and an
epilogue that sends each computed row ``p`` to output row ``expanded[p]`` scaled by
``alpha[e] * router_weight``. Built with ``use_fused_finalize=False`` (its
"deterministic" mode) the router weight is 1.0 and each row is *written*, not added:
``out[expanded[p]] = round(alpha[e] * acc)``. With ``top_k = 1`` and
``expanded[dest[r]] = r`` that is exactly a grouped GEMM writing ``out`` in place: no
output gather, no memset. Only the operands are re-laid out on the device (no sync):

* A's e2m1 rows go to their padded rows (`route`, tile = the kernel's MMA tile M);
* A's block scales, one tensor swizzled 128x4 over all T rows in our format, are moved
  element by element to the same swizzle over the padded rows (an expert's first row is
  then on a 128-row atom boundary, which the kernel's scale TMA needs);
* ``expanded`` is -1 on padding rows (never written: the epilogue stops at each tile's
  row limit) and ``r`` on row ``dest[r]``; the router weights are a ``[T, 1]`` float32
  tensor of ones (read, then replaced by 1.0 in this mode).

Layout rule of this kernel (its wrapper builds the scale layouts with floor division):
N % 128 == 0 and K % 64 == 0, so that its scale strides equal our padded ones; other
shapes get no tactic. Kernel kinds (one family each):

* ``"sm100"`` (cc 100, 103): the Blackwell kernel above, deterministic mode;
* ``"sm107"`` (cc 107): FlashInfer's Rubin sibling, ``Sm107BlockScaledContiguousGrouped
  GemmFinalizeFusionKernel``, which has no deterministic mode: it always adds each row
  into ``out[token]`` with a bulk reduce-add. With ``top_k = 1`` every output row gets
  exactly one addition, so ``out`` is zeroed first and ``0 + round(alpha * acc)`` is the
  rounded value itself: still exact, at the cost of one memset of ``out``.

Compiled here for sm_100a / sm_103a / sm_107a; not run on hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import time
from typing import TYPE_CHECKING, Any

from fp4_dispatch.backends import flashinfer as fb
from fp4_dispatch.backends.flashinfer import grouped as fg

if TYPE_CHECKING:
    import torch

    from fp4_dispatch.contracts.device import DeviceInfo

log = logging.getLogger(__name__)

KERNEL_MODULE = (
    "flashinfer.fused_moe.cute_dsl.blackwell.blockscaled_contiguous_grouped_gemm_finalize_fusion"
)
RUBIN_MODULE = (
    "flashinfer.fused_moe.cute_dsl.rubin.blockscaled_contiguous_grouped_gemm_finalize_fusion"
)
KERNEL_CLASS = "Sm100BlockScaledContiguousGroupedGemmFinalizeFusionKernel"
RUBIN_CLASS = "Sm107BlockScaledContiguousGroupedGemmFinalizeFusionKernel"
TUNER_MODULE = "flashinfer.fused_moe.cute_dsl.tuner"
#: compute capabilities of each kernel kind (FlashInfer's MoE picks the same way)
CCS = {"sm100": frozenset({100, 103}), "sm107": frozenset({107})}
SF_VEC = 16
#: out dtype name -> the kernel's (cutlass type attribute, torch dtype attribute)
OUT_TYPES = {"bfloat16": "BFloat16", "float16": "Float16"}

#: FlashInfer's GEMM2 tactic. "sm100": ((tile M, tile N), (cluster M, cluster N), raster);
#: "sm107": ((tile M, N, K), (instruction M, N, K), (cluster M, N), raster)
FiTactic = tuple
_KINDS = {
    "sm100": (KERNEL_MODULE, KERNEL_CLASS, "get_blackwell_gemm2_valid_tactics"),
    "sm107": (RUBIN_MODULE, RUBIN_CLASS, "get_rubin_gemm2_valid_tactics"),
}


def kind_of(cc: int | None) -> str | None:
    """The kernel kind serving compute capability `cc` (None: neither)."""
    return next((kind for kind, ccs in CCS.items() if cc in ccs), None)


def _kernel_class(kind: str) -> Any:
    module, cls, _ = _KINDS[kind]
    return getattr(importlib.import_module(module), cls)


@functools.cache
def availability(kind: str = "sm100") -> tuple[bool, str]:
    """FlashInfer's availability plus this kind's kernel class and tactic list."""
    ok, reason = fb.availability()
    if not ok:
        return ok, reason
    module, cls, lister = _KINDS[kind]
    try:
        kernel = importlib.import_module(module)
        tuner = importlib.import_module(TUNER_MODULE)
        missing = [n for n in (cls,) if not hasattr(kernel, n)]
        missing += [n for n in (lister, "VALID_TILE_SIZES") if not hasattr(tuner, n)]
        if missing:
            raise AttributeError(f"FlashInfer has no {', '.join(missing)}")
    except Exception as exc:  # an internal API: failed, naming the version
        raise fb.FlashInferUnavailable(fb._failure(exc)) from exc
    return True, reason


def _plain(value: Any) -> Any:
    """Nested tuples of Python ints and bools (FlashInfer's lists may hold other ints)."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value if isinstance(value, bool) else int(value)


@functools.cache
def flashinfer_tactics(kind: str = "sm100") -> tuple[FiTactic, ...]:
    """FlashInfer's GEMM2 tactics of this kernel kind over its tile sizes, in its order."""
    tuner = importlib.import_module(TUNER_MODULE)
    lister = getattr(tuner, _KINDS[kind][2])
    found: dict[FiTactic, None] = {}
    for size in tuner.VALID_TILE_SIZES:
        for tactic in lister(size):
            found[_plain(tactic)] = None
    return tuple(found)


def tile_size(fi: FiTactic) -> int:
    """The routed tile (rows per tile, one expert each): the MMA tile M of either kind."""
    return fi[0][0]


def layout_rule(n: int, k: int) -> str | None:
    """Why this kernel's scale layout differs from ours for (N, K) (None: equal)."""
    if n % 128 or k % 64:
        return (f"N % 128 == 0 and K % 64 == 0 needed (the kernel's scale layout has no "
                f"padding), got N={n} K={k}")  # fmt: skip
    return None


def can_implement(
    kind: str, fi: FiTactic, n: int, k: int, slots: int, experts: int, out: str
) -> bool:
    """The kernel's own ``can_implement`` for `slots` routed rows, plus `layout_rule`."""
    import cutlass

    if out not in OUT_TYPES or layout_rule(n, k) is not None:
        return False
    kernel = _kernel_class(kind)
    fp4, sf, c = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, getattr(cutlass, OUT_TYPES[out])
    if kind == "sm107":
        tiler, inst, cluster, _ = fi
        return bool(kernel.can_implement(
            a_dtype=fp4, b_dtype=fp4, sf_dtype=sf, sf_vec_size=SF_VEC, c_dtype=c,
            mma_inst_shape=inst, mma_tiler=tiler, cluster_shape_mn=cluster, m=slots, n=n,
            k=k, l=experts, a_major="k", b_major="k", c_major="n",
        ))  # fmt: skip
    tiler, cluster, _ = fi
    return bool(kernel.can_implement(
        fp4, fp4, sf, SF_VEC, c, cutlass.Float32, tiler, cluster, slots, n, k, experts,
        a_major="k", b_major="k", out_major="n",
    ))  # fmt: skip


@functools.lru_cache(maxsize=4096)
def valid_tactics(
    kind: str, tokens: int, n: int, k: int, experts: int, out: str
) -> tuple[FiTactic, ...]:
    """FlashInfer's tactics of this kind its kernel accepts for this grouped W4A4 problem."""
    return tuple(
        fi for fi in flashinfer_tactics(kind)
        if can_implement(kind, fi, n, k, fg.route_slots(tokens, experts, tile_size(fi)),
                         experts, out)
    )  # fmt: skip


# ---- A's block scales: one swizzle over T rows -> the same swizzle over padded rows -----


def swizzled_index(rows: torch.Tensor, cols: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """Element index of (row, block column) in a 128x4-swizzled scale tensor whose rows
    hold `k_blocks` (a multiple of 4) block scales: 512-element atoms of 128 rows x 4
    columns, rows r%32 x 16 + (r//32)%4 x 4 + c%4 within an atom, atoms K-major.
    (`fp4_dispatch.format.nvfp4`'s swizzled order.)"""
    atom = (rows // 128) * (k_blocks // 4) + cols // 4
    return atom * 512 + (rows % 32) * 16 + ((rows // 32) % 4) * 4 + cols % 4


def repack_scales(a_scale: torch.Tensor, dest: torch.Tensor, k: int, slots: int) -> torch.Tensor:
    """A's scales in the swizzled order over `slots` padded rows (row r -> dest[r])."""
    import torch

    tokens, k_blocks = dest.shape[0], k // SF_VEC
    dev = dest.device
    cols = torch.arange(k_blocks, device=dev, dtype=torch.int64)
    rows = torch.arange(tokens, device=dev, dtype=torch.int64)
    src = swizzled_index(rows[:, None], cols[None, :], k_blocks).reshape(-1)
    dst = swizzled_index(dest[:, None], cols[None, :], k_blocks).reshape(-1)
    flat = a_scale.reshape(-1).view(torch.uint8)
    out = torch.empty(slots * k_blocks, dtype=torch.uint8, device=dev)
    out.index_copy_(0, dst, flat.index_select(0, src))
    return out.view(torch.float8_e4m3fn)


# ---- compile --------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledKernel:
    """One tactic compiled for one (arch, SM count, out dtype)."""

    tactic: FiTactic
    function: Any
    out_dtype: str
    kind: str
    target: str
    sm_count: int
    cubin_sm: int
    max_active_clusters: int
    seconds: float
    source: str  # "compiled", "disk" or "memory"
    path: str | None = None


_memory: dict[tuple, CompiledKernel] = {}


def _pointers(out_dtype: str, addresses: dict[str, int] | None = None) -> list[Any]:
    """The wrappers' eleven typed pointers, in their order (null ones for a compile); the
    Blackwell wrapper takes a twelfth, the per-row A scale, passed as None."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    a = addresses or {}
    fp4, sf, i32 = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, cutlass.Int32
    spec = (("a", fp4, 32), ("b", fp4, 32), ("a_sf", sf, 16), ("b_sf", sf, 16),
            ("out", getattr(cutlass, OUT_TYPES[out_dtype]), 32), ("alpha", cutlass.Float32, 4),
            ("tile_expert", i32, 4), ("tile_limit", i32, 4), ("expanded", i32, 4),
            ("num_tiles", i32, 4), ("router", cutlass.Float32, 16))  # fmt: skip
    return [make_ptr(t, a.get(name, 0), cute.AddressSpace.gmem, assumed_align=al)
            for name, t, al in spec]  # fmt: skip


def _make_kernel(kind: str, fi: FiTactic) -> Any:
    if kind == "sm107":
        tiler, inst, cluster, raster = fi
        return _kernel_class(kind)(
            sf_vec_size=SF_VEC, mma_inst_shape=inst, mma_tiler=tiler, cluster_shape_mn=cluster,
            raster_along_m=raster, topK=1,
        )  # fmt: skip
    tiler, cluster, raster = fi
    return _kernel_class(kind)(
        sf_vec_size=SF_VEC, mma_tiler_mn=tiler, cluster_shape_mn=cluster,
        raster_along_m=raster, enable_pdl=False, use_a_per_token_scale=False,
        use_fused_finalize=False,
    )  # fmt: skip


def _cluster(kind: str, fi: FiTactic) -> tuple[int, int]:
    return fi[2] if kind == "sm107" else fi[1]


def compile_tactic(fi: FiTactic, out_dtype: str, device: DeviceInfo) -> CompiledKernel:
    """Compile `fi` for `device` (the kind its compute capability takes; Blackwell:
    deterministic mode, no PDL); the cubin's SM is checked. Sizes are runtime arguments:
    one binary per (tactic, out dtype, arch, SM count)."""
    import cutlass
    import cutlass.cute as cute

    from fp4_dispatch.backends import cute as cb

    kind = kind_of(device.cc)
    if kind is None:
        raise ValueError(f"device: {device.name} is not served by FlashInfer's MoE GEMMs")
    target = cb.target_of(device.cc)
    key = (fi, out_dtype, target, device.sm_count)
    hit = _memory.get(key)
    if hit is not None:
        return dataclasses.replace(hit, source="memory", seconds=0.0)
    cluster = _cluster(kind, fi)
    mac = int(cb.max_clusters_for(device)(cluster[0] * cluster[1]))
    extra = [None] if kind == "sm100" else []  # the Blackwell wrapper's per-row A scale
    rubin = {"c_stride_row": cutlass.Int64(0)} if kind == "sm107" else {}
    t0 = time.perf_counter()

    def build() -> Any:
        kernel = _make_kernel(kind, fi)
        cb._preload_runtime()
        with cb._compile_lock, fb.dsl_chatter_to_log():
            return cute.compile(
                kernel.wrapper, *_pointers(out_dtype), *extra, tile_size(fi), 128, 256, 1, 1,
                1, tile_size=tile_size(fi), scaling_vector_size=SF_VEC,
                max_active_clusters=mac, stream=cute.runtime.make_fake_stream(),
                options=f"--gpu-arch=sm_{device.cc}a", **rubin,
            )  # fmt: skip

    name = f"flashinfer grouped W4A4 ({kind}) {fi}"
    function, sm, source, path = fg.compile_cached((*key, kind, mac), target, name, build)
    ck = CompiledKernel(fi, function, out_dtype, kind, target, device.sm_count, sm, mac,
                        time.perf_counter() - t0, source, path)  # fmt: skip
    _memory[key] = ck
    log.info("%s for %s, %d SMs: %s in %.2f s", name, target, device.sm_count, source,
             ck.seconds)  # fmt: skip
    return ck


# ---- launch (runs only on a Blackwell/Rubin GPU) ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The kernel's operands built from `GroupedOperands` (all on the device)."""

    routing: fg.Routing
    a: torch.Tensor  # uint8 [slots, K/2]
    a_scale: torch.Tensor  # e4m3 [slots * K/16], swizzled over the padded rows
    expanded: torch.Tensor  # int32 [slots]: -1 or the source row
    router: torch.Tensor  # float32 [T, 1] of ones


def prepare(operands: Any, route_tile: int) -> Prepared:
    """Routed tiles, A's rows and scales moved to them, and the row map (device ops)."""
    import torch

    a, offsets = operands.a, operands.offsets
    tokens, half_k = a.shape
    routing = fg.route(offsets, tokens, route_tile)
    padded = torch.empty(routing.slots, half_k, dtype=torch.uint8, device=a.device)
    padded.index_copy_(0, routing.dest, a)
    scales = repack_scales(operands.a_scale, routing.dest, half_k * 2, routing.slots)
    expanded = torch.full((routing.slots,), -1, dtype=torch.int32, device=a.device)
    rows = torch.arange(tokens, device=a.device, dtype=torch.int32)
    expanded.index_copy_(0, routing.dest, rows)
    router = torch.ones(tokens, 1, dtype=torch.float32, device=a.device)
    return Prepared(routing, padded, scales, expanded, router)


class GroupedW4A4Kernel:
    """``kernel(operands, out)`` for a grouped W4A4 problem: `prepare`, then FlashInfer's
    kernel writes ``out``'s rows in place (alpha per expert in its epilogue; the Rubin
    kind adds them onto a zeroed ``out``). Not run here: no Blackwell/Rubin GPU."""

    def __init__(self, compiled: CompiledKernel) -> None:
        self.compiled = compiled
        self.route_tile = tile_size(compiled.tactic)

    def __repr__(self) -> str:
        c = self.compiled
        return f"GroupedW4A4Kernel({c.tactic}, {c.target}, {c.sm_count} SMs, {c.source})"

    def __call__(self, operands: Any, out: torch.Tensor) -> None:
        if operands.a_scale is None:
            raise ValueError("a_scale: expected A's block scales (grouped_w4a4), got None")
        prepared = prepare(operands, self.route_tile)
        # the kernel writes rows of N at a stride of N: another layout goes through a copy
        # of `out` (so rows of no expert keep their values either way)
        dst = out if out.is_contiguous() else out.contiguous()
        if self.compiled.kind == "sm107":  # it adds each row once: onto zero is exact
            dst.masked_fill_(prepared.routing.valid[:, None], 0)  # rows of no expert: kept
        self.launch(operands, prepared, dst)
        if dst is not out:
            out.copy_(dst)

    def launch(self, operands: Any, p: Prepared, out: torch.Tensor) -> None:
        """FlashInfer's compiled kernel on the current torch stream."""
        import cutlass
        import torch
        from cuda.bindings import driver

        r = p.routing
        addresses = {
            "a": p.a.data_ptr(), "b": operands.b_data.data_ptr(),
            "a_sf": p.a_scale.data_ptr(), "b_sf": operands.b_scale.data_ptr(),
            "out": out.data_ptr(), "alpha": operands.alpha.data_ptr(),
            "tile_expert": r.tile_expert.data_ptr(), "tile_limit": r.tile_limit.data_ptr(),
            "expanded": p.expanded.data_ptr(), "num_tiles": r.num_tiles.data_ptr(),
            "router": p.router.data_ptr(),
        }  # fmt: skip
        experts, n = operands.b_data.shape[0], operands.b_data.shape[1]
        stream = driver.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
        rubin = self.compiled.kind == "sm107"
        extra = [] if rubin else [None]
        kw = {"c_stride_row": cutlass.Int64(0)} if rubin else {}
        self.compiled.function(
            *_pointers(self.compiled.out_dtype, addresses), *extra, r.slots, n,
            p.a.shape[1] * 2, experts, out.shape[0], 1, stream=stream, **kw,
        )  # fmt: skip
