"""Family ``fi-grouped-w4a16``: FlashInfer's SM100 W4A16 grouped GEMM (CuTe-DSL).

The GEMM of FlashInfer's CuTe-DSL W4A16 MoE, without the rest of its MoE layer
(`fp4_dispatch.backends.flashinfer.grouped` says how it is driven and why that is
exact). Serves ``grouped_w4a16`` with bfloat16 activations and output (the kernel
decodes NVFP4 to bf16 and writes bf16); never ``grouped_w4a4`` and never fp16.

Orientation. The kernel puts the weight's output channels on the MMA's M side and the
routed token rows on N; tactics here speak the problem's orientation (rows = tokens):

* ``tile_m``: token rows per routed tile (FlashInfer's ``route_tile``; each tile belongs
  to one expert, so an expert with c rows occupies ceil(c / tile_m) tiles);
* ``tile_n``: output channels per CTA pair (the MMA M; 256 is a 2-CTA instruction);
* ``cluster_n``: CTAs of a cluster along the output channels (FlashInfer's cluster M).

Validity is the kernel's own ``can_implement`` over FlashInfer's tactic list, for the
padded row count `fp4_dispatch.backends.flashinfer.grouped.route_slots`. Scores: the
shared cost model. Compiled here for sm_100a / sm_103a / sm_107a; not run on hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator
from importlib import metadata
from typing import ClassVar, Literal

from pydantic import model_validator

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.policy.costmodel import (
    BW_SATURATION,
    LAUNCH_US,
    OVERLAP,
    _peak_tflops,
    _shared_us,
)
from fp4_dispatch.support.sources import SourceVersion

COMPILE_ONLY = (
    "FlashInfer's CuTe-DSL grouped W4A16 kernel is compiled here for its target; "
    "it has not been run on hardware by this project"
)
OPERATION = "grouped_w4a16"
#: GPU time assumed for one small device kernel (routing, copies) in a CUDA graph:
#: NOT fitted, to be measured on a Blackwell part
ROUTE_KERNEL_US = 2.0
#: the W4A16 call's kernels besides routing and the GEMM: scatter, gather, select, copy
W4A16_COPY_KERNELS = 4


def route_kernels() -> int:
    """Kernels of the routing (`fp4_dispatch.backends.flashinfer.grouped.route_kernels`:
    one with Triton, its torch ops without)."""
    from fp4_dispatch.backends.flashinfer import grouped as fg

    return fg.route_kernels()


def _fi_version() -> str:
    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return "none"


class FiGroupedW4A16Tactic(Tactic):
    """One FlashInfer W4A16 grouped-GEMM tactic, in the problem's orientation (see module).

    FlashInfer's rules, as types and a validator: a 2-CTA tile (tile_n 256) needs a
    cluster of 2 along the channels and a routed tile of at least 16 rows; a 192-row
    routed tile needs the 2-CTA tile (a 128 x 192 x 256 tile cannot hold the pipeline's
    two load and transform stages, per FlashInfer).
    """

    backend: Literal["fi-grouped-w4a16"] = "fi-grouped-w4a16"
    tile_m: Literal[8, 16, 32, 64, 128, 192]
    tile_n: Literal[128, 256]
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1, 2] = 1
    swap_ab: Literal[False] = False

    @property
    def ctas_per_tile(self) -> int:
        """A 2-CTA instruction (tile_n 256) spans a CTA pair: two SMs per output tile."""
        return 2 if self.tile_n == 256 else 1

    @model_validator(mode="after")
    def _kernel_rules(self) -> FiGroupedW4A16Tactic:
        if self.tile_n == 256 and self.cluster_n != 2:
            raise ValueError(f"tile_n=256 (2-CTA) needs cluster_n=2, got {self.cluster_n}")
        if self.tile_n == 256 and self.tile_m < 16:
            raise ValueError(f"tile_n=256 (2-CTA) needs tile_m >= 16, got {self.tile_m}")
        if self.tile_m == 192 and self.tile_n != 256:
            raise ValueError(f"tile_m=192 needs tile_n=256 (2-CTA), got {self.tile_n}")
        return self

    def to_fi(self) -> tuple:
        """FlashInfer's single-GEMM tactic tuple (raster along its M, as its tuner does)."""
        return ((self.tile_n, self.tile_m, 256), (self.cluster_n, 1), True)


def tactic_of(fi: tuple) -> FiGroupedW4A16Tactic:
    """The typed tactic of a FlashInfer W4A16 GEMM tactic (ValueError for unknown ones)."""
    (tile, route_tile, tile_k), (cm, cn), raster = fi
    if tile_k != 256 or cn != 1 or raster is not True:
        raise ValueError(
            f"fi-grouped-w4a16: unknown FlashInfer W4A16 tactic {fi!r} (flashinfer-python "
            f"{_fi_version()}; fp4-dispatch was tested with 0.7.2.post1)"
        )
    return FiGroupedW4A16Tactic(tile_m=route_tile, tile_n=tile, cluster_n=cm)


@functools.lru_cache(maxsize=256)
def _typed(fi: tuple) -> FiGroupedW4A16Tactic:
    """Tactic objects are frozen: build each once (pydantic validation is ~5 us)."""
    return tactic_of(fi)


def _served(problem: Problem) -> str | None:
    """Why this family has nothing for `problem` (None when it may)."""
    if problem.operation != OPERATION:
        return f"serves {OPERATION} only, not {problem.operation}"
    if problem.out_dtype != "bfloat16":
        return f"writes bfloat16 only (bf16 activations), not {problem.out_dtype}"
    if not getattr(problem, "groups", None):
        return "a grouped problem needs its expert count (groups)"
    return None


class FiGroupedW4A16Backend(Backend):
    """FlashInfer's W4A16 grouped GEMM: enumerated by FlashInfer, validated by its kernel."""

    name = "fi-grouped-w4a16"
    family = "fi-grouped-w4a16"
    tactic_type = FiGroupedW4A16Tactic
    operations = (OPERATION,)
    compile_only_note = COMPILE_ONLY
    compiles_ahead_of_time: ClassVar[bool] = True
    diversity_axes = ("tile_m", "tile_n")
    version = SourceVersion(
        f"1+flashinfer-{_fi_version()}",
        "fp4_dispatch.backends.flashinfer.grouped",
        plugin=__name__,
    )

    def supports(self, device: DeviceInfo) -> Support:
        from fp4_dispatch.backends.flashinfer import grouped as fg

        cc = device.cc
        if cc is None or cc < 100:
            return Support(False, f"needs a Blackwell/Rubin device (sm_100a+), got {device.name}")
        ok, reason = fg.availability()  # raises FlashInferUnavailable on a broken install
        if not ok:
            return Support(False, reason)
        if cc not in fg.CCS:
            return Support(False, f"FlashInfer offers its CuTe-DSL MoE GEMMs on compute "
                                  f"capability {sorted(fg.CCS)}, not {cc}")  # fmt: skip
        where = "compile-only (simulated)" if device.is_simulated else "compiled for"
        return Support(True, f"{where} sm_{cc}a; grouped_w4a16, bfloat16; {reason}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Tactic]:
        from fp4_dispatch.backends.flashinfer import grouped as fg

        if _served(problem) is not None:
            return
        p = problem
        for fi in fg.valid_tactics(p.m, p.n, p.k, p.groups):
            yield _typed(fi)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """The shared model's pieces on the kernel's real work (unfitted; see `estimate`)."""
        return estimate(problem, device, self.tactic_type.model_validate(tactic.model_dump()))

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        """FlashInfer's list and its kernel's ``can_implement`` for this problem."""
        from fp4_dispatch.backends.flashinfer import grouped as fg

        checked = self.tactic_type.model_validate(tactic.model_dump())
        why = _served(problem)
        if why is not None:
            return f"{checked.canonical_json()}: {why}"
        p = problem
        if checked.to_fi() not in fg.valid_tactics(p.m, p.n, p.k, p.groups):
            return (f"{checked.canonical_json()}: FlashInfer's W4A16 kernel does not accept "
                    f"T={p.m} N={p.n} K={p.k} E={p.groups}")  # fmt: skip
        return None

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        """Compile for the device's arch and SM count (memoized in this process)."""
        from fp4_dispatch.backends.flashinfer import grouped as fg

        checked = self.tactic_type.model_validate(tactic.model_dump())
        p = problem
        compiled = fg.compile_tactic(checked.to_fi(), p.n, p.k, p.groups, device)
        return fg.GroupedW4A16Kernel(compiled)

    def precompile_key(self, tactic: Tactic, problem: Problem) -> Hashable:
        """The binary does not depend on the token count (a runtime size): one compile
        per (tactic, E, K class, N alignment class)."""
        from fp4_dispatch.backends.flashinfer import grouped as fg

        checked = self.tactic_type.model_validate(tactic.model_dump())
        return fg.compile_key(checked.to_fi(), problem.n, problem.k, problem.groups)


def estimate(problem: Problem, device: DeviceInfo, tactic: FiGroupedW4A16Tactic) -> float:
    """`estimate_routed` for this family: bf16 rows (2 B a value) copied in (T x K x 2 B
    read and written), the bf16 result rows gathered (T x N x 2 B read and written) and
    selected into ``out`` (rows of no expert keep theirs: three passes of T x N x 2 B
    read, one written, plus the copy back)."""
    copies = problem.m * (2.0 * problem.k + 7.0 * problem.n) * 2.0
    kernels = route_kernels() + W4A16_COPY_KERNELS
    return estimate_routed(problem, device, tactic, 2.0, copies, kernels)


def estimate_routed(
    problem: Problem, device: DeviceInfo, tactic: Tactic, a_bytes: float, copy_bytes: float,
    route_kernels: int,
) -> float:  # fmt: skip
    """Estimated microseconds of a routed-tile grouped kernel under the balanced routing
    of docs/grouped.md. Not fitted.

    Rows: `Problem.touched_groups` experts get ceil(T / touched) rows each, padded to
    whole routed tiles: P = touched x ceil(ceil(T / touched) / tile_m) x tile_m rows
    (at decode, 8 rows on 8 experts with tile_m 16 is 128 rows of MMA work). Compute:
    the shared formula's wave model on a P x N x K problem (its memory term switched
    off). Memory: the touched experts' weights (0.5625 B per value), the P padded rows
    of A (`a_bytes` a value) read and bf16 results written, 8 B per expert, at the
    bandwidth the active CTAs reach (as the shared model). Plus `route_kernels` small
    kernels of `ROUTE_KERNEL_US` each and `copy_bytes` of re-layout at full bandwidth.
    """
    touched = problem.touched_groups
    per_expert = -(-problem.m // touched)
    rows = touched * -(-per_expert // tactic.tile_m) * tactic.tile_m
    cpt = tactic.ctas_per_tile
    compute = _shared_us(rows, problem.n, problem.k, device.sm_count, _peak_tflops(device),
                         float("inf"), tactic.tile_m, tactic.tile_n, tactic.cluster_m,
                         tactic.cluster_n, False, cpt) - LAUNCH_US  # fmt: skip
    fp4 = 0.5 + 1.0 / 16
    weights = touched * problem.n * problem.k * fp4
    rows_bytes = rows * (problem.k * a_bytes + problem.n * 2.0)
    traffic = weights + rows_bytes + 8.0 * (problem.groups or 1)
    ctas = -(-rows // tactic.tile_m) * -(-problem.n // tactic.tile_n) * cpt
    bw_frac = min(1.0, min(ctas, device.sm_count) / (BW_SATURATION * device.sm_count))
    memory = traffic / (device.mem_bw_gbps * 1e3 * bw_frac)
    copies = copy_bytes / (device.mem_bw_gbps * 1e3)
    kernel = max(compute, memory) + OVERLAP * min(compute, memory) + LAUNCH_US
    return kernel + copies + route_kernels * ROUTE_KERNEL_US
