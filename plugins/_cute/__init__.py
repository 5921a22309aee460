"""Shared code of the sm100, sm103 and sm107 plugins (NVIDIA CuTe-DSL NVFP4 GEMMs).

The plugin modules import without CuTe-DSL: the library is imported on the first
`supports` / `tactics` / `build` call. Absent extra -> the backend is *unsupported* with
the install hint; a broken install -> `supports` raises `CuteUnavailable` and the
dispatcher lists the backend as *failed* with the exact exception. Never absent.

Which devices a family serves is read from the library: a backend is available on a
device iff ``get_operators(..., target_sm=<its arch>)`` returns operators of its kind
(the SM100 design lists ``100f``/``110f`` and so also serves 103 and 107; the SM107
design serves 107). A family may step aside on some capabilities (``excluded``, with the
reason shown): the SM100 design's sm_103a build is its own family, so each kernel is in
exactly one family.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from importlib import metadata
from typing import ClassVar, Literal

from pydantic import model_validator

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.support.sources import SourceVersion

COMPILE_ONLY = (
    "CuTe-DSL Blackwell/Rubin kernels are compiled here for their target; "
    "they have not been run on hardware by this project"
)


def _ops_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-operators")
    except metadata.PackageNotFoundError:
        return "none"


class PersistentTactic(Tactic):
    """Knobs of NVIDIA's SM100 persistent block-scaled GEMM (PersistentDenseBlockScaledGemm).

    tile_m: MMA tiler M; 256 is a 2-CTA instruction (each CTA 128 rows), 128 a 1-CTA one.
    tile_n: MMA tiler N, the values the operator library generates (64/128/192).
    cluster_m x cluster_n: CTA cluster; the library generates cluster M 2 or 4 only.
    """

    tile_m: Literal[128, 256]
    tile_n: Literal[64, 128, 192]
    cluster_m: Literal[2, 4]
    cluster_n: Literal[1, 2, 4]

    @property
    def use_2cta(self) -> bool:
        return self.tile_m == 256

    @property
    def ctas_per_tile(self) -> int:
        """A 2-CTA MMA (tile M 256) spans a CTA pair: two SMs per output tile."""
        return 2 if self.use_2cta else 1

    @model_validator(mode="after")
    def _kernel_rules(self) -> PersistentTactic:
        # is_valid_mma_tiler_and_cluster_shape: a 2-CTA tile needs an even cluster M
        if self.tile_m == 256 and self.cluster_m % 2:
            raise ValueError(f"tile_m=256 (2-CTA) needs an even cluster_m, got {self.cluster_m}")
        return self

    def design_fields(self) -> dict:
        c = (self.cluster_m, self.cluster_n)
        return dict(kind="sm100", tile_m=self.tile_m, tile_n=self.tile_n, cluster_m=c[0],
                    cluster_n=c[1], fallback_m=c[0], fallback_n=c[1],
                    inst_m=256 if self.use_2cta else 128, b_reuse=False)  # fmt: skip


class CuteBackend(Backend):
    """A family of CuTe-DSL operators (one operator kind) compiled for the device's arch."""

    kind: ClassVar[Literal["sm100", "sm107"]]
    version = SourceVersion(
        f"1+cutlass-operators-{_ops_version()}", "fp4_dispatch.backends.cute", plugin=__name__
    )
    compile_only_note = COMPILE_ONLY
    #: `fp4-dispatch compile` builds these ahead of time (no GPU needed)
    compiles_ahead_of_time: ClassVar[bool] = True
    #: compute capabilities this family steps aside on, with the reason shown to users
    excluded: ClassVar[dict[int, str]] = {}
    #: if set, only these compute capabilities (else: every arch the library serves)
    only: ClassVar[frozenset[int] | None] = None

    def supports(self, device: DeviceInfo) -> Support:
        from fp4_dispatch.backends import cute as cb

        cc = device.cc
        if cc is None or cc < 100:
            return Support(False, f"needs a Blackwell/Rubin device (sm_100a+), got {device.name}")
        if cc in self.excluded:
            return Support(False, f"not served on sm_{cc}a: {self.excluded[cc]}")
        if self.only is not None and cc not in self.only:
            return Support(False, f"serves compute capability {sorted(self.only)}, not {cc}")
        ok, reason = cb.availability()  # raises CuteUnavailable on a broken install
        if not ok:
            return Support(False, reason)
        target = cb.target_of(cc)
        count = len(cb.designs(target, self.kind))
        if not count:
            return Support(False, f"nvidia-cutlass-operators has no {self.kind} NVFP4 "
                                  f"operator for {target}")  # fmt: skip
        where = "compile-only (simulated)" if device.is_simulated else "compiled for"
        return Support(True, f"{count} {self.kind} operators, {where} sm_{target}; {reason}")

    def _design_of(self, tactic: Tactic):  # -> fp4_dispatch.backends.cute.Design
        from fp4_dispatch.backends import cute as cb

        return cb.Design(**tactic.design_fields())

    def _tactic_of(self, design, swap: bool) -> Tactic:  # pragma: no cover - per family
        raise NotImplementedError

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Tactic]:
        from fp4_dispatch.backends import cute as cb

        dtype = cb.kernel_out_dtype(problem.out_dtype)
        swapped = problem.swapped()
        for design, entry in cb.designs(cb.target_of(device.cc), self.kind).items():
            if entry.can_implement(problem.m, problem.n, problem.k, dtype, "n"):
                yield _cached_tactic(self, design, False)
            if entry.can_implement(swapped.m, swapped.n, swapped.k, dtype, "m"):
                yield _cached_tactic(self, design, True)

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        """The kernel's own can_implement on the (swapped) problem; cheap, no enumeration."""
        from fp4_dispatch.backends import cute as cb

        checked = self.tactic_type.model_validate(tactic.model_dump())
        design = self._design_of(checked)
        target = cb.target_of(device.cc)
        entry = cb.designs(target, self.kind).get(design)
        if entry is None:
            return f"{checked.canonical_json()}: no such operator for {target}"
        p = problem.swapped() if checked.swap_ab else problem
        major = "m" if checked.swap_ab else "n"
        if not entry.can_implement(p.m, p.n, p.k, cb.kernel_out_dtype(p.out_dtype), major):
            return (f"{entry.name}: kernel can_implement rejects M={p.m} N={p.n} K={p.k} "
                    f"({'swapped, ' if checked.swap_ab else ''}{major}-major output)")  # fmt: skip
        return None

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        """Compile for the device's arch and SM count (cached in memory and on disk)."""
        from fp4_dispatch.backends import cute as cb

        checked = self.tactic_type.model_validate(tactic.model_dump())
        major = "m" if checked.swap_ab else "n"
        return cb.build_kernel(self._design_of(checked), problem.out_dtype, major, device)

    def build_cached(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel | None:
        """`build`, but only from the kernel cache (memory or disk): None instead of compiling."""
        from fp4_dispatch.backends import cute as cb

        checked = self.tactic_type.model_validate(tactic.model_dump())
        major = "m" if checked.swap_ab else "n"
        design = self._design_of(checked)
        return cb.build_kernel(design, problem.out_dtype, major, device, load_only=True)


@functools.lru_cache(maxsize=4096)
def _cached_tactic(backend: CuteBackend, design, swap: bool) -> Tactic:
    """Tactic objects are frozen: build each once (pydantic validation is ~5 us)."""
    return backend._tactic_of(design, swap)
