"""Families ``fi-grouped-w4a4`` (cc 100, 103) and ``fi-grouped-w4a4-sm107`` (cc 107).

The second GEMM of FlashInfer's CuTe-DSL NVFP4 MoE (its Blackwell kernel in
"deterministic" mode; its Rubin kernel adding onto a zeroed output), used as a plain
grouped W4A4 GEMM (`fp4_dispatch.backends.flashinfer.grouped_w4a4` says how and why it
is exact). Serves ``grouped_w4a4`` with bfloat16 or float16 output where the kernel's
``can_implement`` accepts it, for N % 128 == 0 and K % 64 == 0.

Tactics in the problem's orientation (rows = tokens, as the kernel itself: A is the
activations): ``tile_m`` the MMA tile M, which is also the routed tile (each expert's
rows start on a multiple of it), ``tile_n`` output channels per tile; Blackwell: tile_m
256 is a 2-CTA instruction over a cluster pair; Rubin: ``inst_m`` the instruction M
(FlashInfer lists 128 only: a 256-row tile is two instructions in one CTA).
Compiled here for sm_100a / sm_103a / sm_107a; not run on hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator
from typing import ClassVar, Literal

from pydantic import model_validator

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.flashinfer.grouped import (
    ROUTE_KERNEL_US,
    _fi_version,
    estimate_routed,
    route_kernels,
)
from fp4_dispatch.support.sources import SourceVersion

COMPILE_ONLY = (
    "FlashInfer's CuTe-DSL grouped W4A4 kernel is compiled here for its target; "
    "it has not been run on hardware by this project"
)
OPERATION = "grouped_w4a4"
#: device ops of the scale repack, the row map and the router ones (on top of routing)
PREPARE_KERNELS = 10


class FiGroupedW4A4Tactic(Tactic):
    """One FlashInfer GEMM2 tactic (see module). FlashInfer's rule as a validator: the
    cluster M is the CTAs per tile (1, or 2 for the 2-CTA tile_m 256)."""

    backend: Literal["fi-grouped-w4a4"] = "fi-grouped-w4a4"
    tile_m: Literal[128, 256]
    tile_n: Literal[128, 256]
    cluster_m: Literal[1, 2] = 1
    cluster_n: Literal[1, 2] = 1
    swap_ab: Literal[False] = False

    @property
    def ctas_per_tile(self) -> int:
        """A 2-CTA instruction (tile_m 256) spans a CTA pair: two SMs per output tile."""
        return 2 if self.tile_m == 256 else 1

    @model_validator(mode="after")
    def _kernel_rules(self) -> FiGroupedW4A4Tactic:
        if self.cluster_m != self.tile_m // 128:
            raise ValueError(
                f"cluster_m must be tile_m / 128 = {self.tile_m // 128}, got {self.cluster_m}"
            )
        return self

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n), (self.cluster_m, self.cluster_n), False)


class FiGroupedW4A4Sm107Tactic(Tactic):
    """One FlashInfer Rubin GEMM2 tactic: MMA tile (tile_m x tile_n x 256), instruction
    (inst_m x tile_n x 128), cluster 1 x 1 (FlashInfer pins cluster N to 1 for this
    kernel, and cluster M x tile_m may not exceed the routed tile, which is tile_m)."""

    backend: Literal["fi-grouped-w4a4-sm107"] = "fi-grouped-w4a4-sm107"
    tile_m: Literal[128, 256]
    tile_n: Literal[128, 256]
    inst_m: Literal[128] = 128
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    swap_ab: Literal[False] = False

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n, 256), (self.inst_m, self.tile_n, 128), (1, 1), False)


def _unknown(fi: tuple) -> ValueError:
    return ValueError(
        f"fi-grouped-w4a4: unknown FlashInfer GEMM2 tactic {fi!r} (flashinfer-python "
        f"{_fi_version()}; fp4-dispatch was tested with 0.7.2.post1)"
    )


def tactic_of(fi: tuple) -> Tactic:
    """The typed tactic of a FlashInfer GEMM2 tactic of either kind (ValueError if unknown)."""
    if len(fi) == 4:
        (tm, tn, tk), (im, itn, ik), cluster, raster = fi
        if (tk, itn, ik, tuple(cluster), raster) != (256, tn, 128, (1, 1), False):
            raise _unknown(fi)
        return FiGroupedW4A4Sm107Tactic(tile_m=tm, tile_n=tn, inst_m=im)
    (tm, tn), (cm, cn), raster = fi
    if raster is not False:
        raise _unknown(fi)
    return FiGroupedW4A4Tactic(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn)


@functools.lru_cache(maxsize=256)
def _typed(fi: tuple) -> Tactic:
    return tactic_of(fi)


def _served(problem: Problem) -> str | None:
    """Why this family has nothing for `problem` (None when it may)."""
    from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4

    if problem.operation != OPERATION:
        return f"serves {OPERATION} only, not {problem.operation}"
    return g4.layout_rule(problem.n, problem.k)


class FiGroupedW4A4Backend(Backend):
    """FlashInfer's W4A4 grouped GEMM (GEMM2 of its MoE), Blackwell kernel."""

    name = "fi-grouped-w4a4"
    family = "fi-grouped-w4a4"
    tactic_type: ClassVar[type[Tactic]] = FiGroupedW4A4Tactic
    #: FlashInfer's kernel kind (`fp4_dispatch.backends.flashinfer.grouped_w4a4.CCS`)
    kind: ClassVar[str] = "sm100"
    operations = (OPERATION,)
    compile_only_note = COMPILE_ONLY
    compiles_ahead_of_time: ClassVar[bool] = True
    diversity_axes = ("tile_m", "tile_n")
    version = SourceVersion(
        f"1+flashinfer-{_fi_version()}",
        "fp4_dispatch.backends.flashinfer.grouped_w4a4",
        plugin=__name__,
    )

    def supports(self, device: DeviceInfo) -> Support:
        from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4

        cc = device.cc
        if cc is None or cc < 100:
            return Support(False, f"needs a Blackwell/Rubin device (sm_100a+), got {device.name}")
        ok, reason = g4.availability(self.kind)  # raises FlashInferUnavailable if broken
        if not ok:
            return Support(False, reason)
        if cc not in g4.CCS[self.kind]:
            return Support(False, f"FlashInfer's {self.kind} MoE GEMM serves compute "
                                  f"capability {sorted(g4.CCS[self.kind])}, not {cc}")  # fmt: skip
        where = "compile-only (simulated)" if device.is_simulated else "compiled for"
        return Support(True, f"{where} sm_{cc}a; grouped_w4a4; {reason}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Tactic]:
        from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4

        if _served(problem) is not None:
            return
        p = problem
        for fi in g4.valid_tactics(self.kind, p.m, p.n, p.k, p.groups, p.out_dtype):
            yield _typed(fi)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """`estimate_routed` with NVFP4 rows (0.5625 B a value) copied to the routed tiles
        and scales repacked (T x K x 0.5625 B written and read); no output copy. Unfitted."""
        checked = self.tactic_type.model_validate(tactic.model_dump())
        copies = 2.0 * problem.m * problem.k * (0.5 + 1.0 / 16)
        return estimate_routed(problem, device, checked, 0.5 + 1.0 / 16, copies,
                               route_kernels() + PREPARE_KERNELS)  # fmt: skip

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4

        checked = self.tactic_type.model_validate(tactic.model_dump())
        why = _served(problem)
        if why is not None:
            return f"{checked.canonical_json()}: {why}"
        p = problem
        if checked.to_fi() not in g4.valid_tactics(self.kind, p.m, p.n, p.k, p.groups,
                                                   p.out_dtype):  # fmt: skip
            return (f"{checked.canonical_json()}: FlashInfer's W4A4 kernel does not accept "
                    f"T={p.m} N={p.n} K={p.k} E={p.groups} ({p.out_dtype})")  # fmt: skip
        return None

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4

        checked = self.tactic_type.model_validate(tactic.model_dump())
        compiled = g4.compile_tactic(checked.to_fi(), problem.out_dtype, device)
        return g4.GroupedW4A4Kernel(compiled)

    def precompile_key(self, tactic: Tactic, problem: Problem) -> Hashable:
        """One binary per (tactic, out dtype): sizes and E are runtime arguments."""
        checked = self.tactic_type.model_validate(tactic.model_dump())
        return (checked, problem.out_dtype)


class FiGroupedW4A4Sm107Backend(FiGroupedW4A4Backend):
    """FlashInfer's W4A4 grouped GEMM (GEMM2 of its MoE), Rubin (SM107) kernel."""

    name = "fi-grouped-w4a4-sm107"
    family = "fi-grouped-w4a4-sm107"
    tactic_type = FiGroupedW4A4Sm107Tactic
    kind = "sm107"
    version = SourceVersion(
        f"1+flashinfer-{_fi_version()}",
        "fp4_dispatch.backends.flashinfer.grouped_w4a4",
        plugin=__name__,
    )

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """The Blackwell kind's estimate plus the memset of ``out`` (T x N x 2 B)."""
        memset = problem.m * problem.n * 2.0 / (device.mem_bw_gbps * 1e3)
        return super().estimate_us(problem, device, tactic) + memset + ROUTE_KERNEL_US
