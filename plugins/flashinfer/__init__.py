"""Plugin ``flashinfer``: FlashInfer's CuTe-DSL ``mm_fp4`` kernels, one family per kernel.

Installed by the extra ``flashinfer`` (``flashinfer-python==0.7.2.post1``; ``pip install
'.[flashinfer]'`` in the checkout).
Five families, one backend each, one typed tactic per FlashInfer kernel family:

=================  ==========================================  =================
family / backend   FlashInfer kernel (``kernel_type`` slot)     devices (cc)
=================  ==========================================  =================
fi-sm100           SM100 persistent, K tile 256 (``"sm100"``)   100, 103, 107
fi-sm100-deepk     the same kernel, K tile 512 (``"sm100"``, 8)  100, 103, 107
fi-sm100-splitk    SM100 low-M cluster split-K (``"sm100sk"``)  100, 103, 107
fi-sm103           SM103 3xFP4 persistent (``"sm103"``)         107 only
fi-sm107           SM107 persistent (``"sm107"``)               107
=================  ==========================================  =================

FlashInfer's runner offers its SM103 kernel only on cc 107 in this version (a TODO in
its source keeps it off on sm_103 until the public DSL has its MMA op), so fi-sm103 says
so on an SM103 device. Validity is FlashInfer's: a tactic is valid iff the runner's
``get_valid_tactics`` lists it for the problem (`fp4_dispatch.backends.flashinfer`).
The pydantic specs only make every knob a narrow type, so an impossible knob is a
ValidationError before FlashInfer is asked. Scores: the shared cost model
(`fp4_dispatch.policy.ranking`), which reads the generic optional fields ``tile_k`` (deep-K)
and ``split_k`` (split-K) these tactics declare.

Compiled here for sm_100a / sm_103a / sm_107a on a CPU; not run on hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from importlib import metadata
from typing import ClassVar, Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.flashinfer.grouped import FiGroupedW4A16Backend
from fp4_dispatch.plugins.flashinfer.grouped_w4a4 import (
    FiGroupedW4A4Backend,
    FiGroupedW4A4Sm107Backend,
)
from fp4_dispatch.support.sources import SourceVersion

COMPILE_ONLY = (
    "FlashInfer's CuTe-DSL kernels are compiled here for their target; "
    "they have not been run on hardware by this project"
)
Cluster = Literal[1, 2, 4]


def _fi_version() -> str:
    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return "none"


#: FlashInfer's K instructions per stage of the deep-K variant (K tile 512 for FP4)
DEEP_K_INST = 8


class FiSm100Tactic(Tactic):
    """SM100 persistent kernel (K tile 256). tile_m 256 = 2-CTA MMA; tile_n 8-256."""

    backend: Literal["fi-sm100"] = "fi-sm100"
    tile_m: Literal[128, 256]
    tile_n: Literal[8, 16, 32, 64, 128, 192, 256]
    cluster_m: Cluster = 1
    cluster_n: Cluster = 1
    use_prefetch: bool = False

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n), (self.cluster_m, self.cluster_n), self.swap_ab,
                self.use_prefetch, "sm100", None)  # fmt: skip


class FiSm100DeepKTactic(Tactic):
    """SM100 persistent kernel with 8 MMA K instructions per stage: K tile 512.

    FlashInfer offers it for narrow N tiles (<= 32) and K % 512 == 0 only.
    """

    backend: Literal["fi-sm100-deepk"] = "fi-sm100-deepk"
    tile_m: Literal[128, 256]
    tile_n: Literal[8, 16, 32]
    tile_k: Literal[512] = 512
    cluster_m: Cluster = 1
    cluster_n: Cluster = 1
    use_prefetch: bool = False

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n), (self.cluster_m, self.cluster_n), self.swap_ab,
                self.use_prefetch, "sm100", DEEP_K_INST)  # fmt: skip


class FiSm100SplitKTactic(Tactic):
    """SM100 low-M cluster split-K: ``split_k`` CTAs of a (1, 1, split_k) cluster share
    one tile's K range and reduce in the cluster. Swapped only (tokens on N), M <= 32.
    """

    backend: Literal["fi-sm100-splitk"] = "fi-sm100-splitk"
    tile_m: Literal[128]
    tile_n: Literal[8, 16, 32]
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    swap_ab: Literal[True] = True
    split_k: Literal[2, 4]

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n), (1, 1), True, False, "sm100sk", self.split_k)


class FiSm103Tactic(Tactic):
    """SM103 3xFP4 persistent kernel; ``use_tma_store`` picks the TMA-store epilogue."""

    backend: Literal["fi-sm103"] = "fi-sm103"
    tile_m: Literal[128, 256]
    tile_n: Literal[128, 256]
    cluster_m: Cluster = 1
    cluster_n: Cluster = 1
    use_tma_store: bool

    def to_fi(self) -> tuple:
        return ((self.tile_m, self.tile_n), (self.cluster_m, self.cluster_n), self.swap_ab,
                False, "sm103", self.use_tma_store)  # fmt: skip


class FiSm107Tactic(Tactic):
    """SM107 persistent kernel. inst_m: MMA instruction M (256 = 2-CTA); instruction
    N = tile_n, instruction K 128 and K tile 256 (fixed for FP4 by FlashInfer);
    prefetch_dist: 0 off, 2 shallow, None = FlashInfer's "auto" (pipeline depth).
    """

    backend: Literal["fi-sm107"] = "fi-sm107"
    tile_m: Literal[128, 256]
    tile_n: Literal[64, 128, 192, 256]
    inst_m: Literal[128, 256]
    cluster_m: Cluster = 1
    cluster_n: Cluster = 1
    prefetch_dist: Literal[0, 2] | None

    def to_fi(self) -> tuple:
        inst = (self.inst_m, self.tile_n, 128, 256, self.prefetch_dist)
        return ((self.tile_m, self.tile_n), (self.cluster_m, self.cluster_n), self.swap_ab,
                False, "sm107", inst)  # fmt: skip


def tactic_of(fi: tuple) -> Tactic:
    """The typed tactic of a FlashInfer tactic tuple (ValueError for unknown kinds)."""
    (tm, tn), (cm, cn), swap, prefetch, kind, extra = fi
    geo = dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn)
    if kind == "sm100" and extra is None:
        return FiSm100Tactic(**geo, swap_ab=swap, use_prefetch=prefetch)
    if kind == "sm100" and extra == DEEP_K_INST:
        return FiSm100DeepKTactic(**geo, swap_ab=swap, use_prefetch=prefetch)
    if kind == "sm100sk" and not prefetch and swap and (cm, cn) == (1, 1):
        return FiSm100SplitKTactic(tile_m=tm, tile_n=tn, split_k=extra)
    if kind == "sm103" and not prefetch:
        return FiSm103Tactic(**geo, swap_ab=swap, use_tma_store=extra)
    if kind == "sm107" and not prefetch and tuple(extra[1:4]) == (tn, 128, 256):
        return FiSm107Tactic(**geo, swap_ab=swap, inst_m=extra[0], prefetch_dist=extra[4])
    raise ValueError(
        f"fi: unknown FlashInfer mm_fp4 tactic {fi!r} (flashinfer-python {_fi_version()}; "
        "fp4-dispatch was tested with 0.7.2.post1)"
    )


@functools.lru_cache(maxsize=1 << 14)
def _typed(fi: tuple) -> Tactic:
    """Tactic objects are frozen: build each once (pydantic validation is ~5 us)."""
    return tactic_of(fi)


class FlashInferBackend(Backend):
    """One FlashInfer kernel family, enumerated, validated and compiled by FlashInfer."""

    #: FlashInfer's kernel_type and a predicate on the extra slot of its tactic tuple
    kernel_type: ClassVar[str]
    #: compute capabilities this family's kernel is offered on by FlashInfer's runner
    ccs: ClassVar[frozenset[int]] = frozenset({100, 103, 107})
    compile_only_note = COMPILE_ONLY
    compiles_ahead_of_time: ClassVar[bool] = True

    version = SourceVersion(
        f"1+flashinfer-{_fi_version()}", "fp4_dispatch.backends.flashinfer", plugin=__name__
    )

    def _mine(self, fi: tuple) -> bool:
        return fi[4] == self.kernel_type

    def unbuildable(self, fi: tuple) -> str | None:
        """Why the installed DSL cannot build this FlashInfer tactic (None: it can)."""
        return None

    def supports(self, device: DeviceInfo) -> Support:
        from fp4_dispatch.backends import flashinfer as fb

        cc = device.cc
        if cc is None or cc < 100:
            return Support(False, f"needs a Blackwell/Rubin device (sm_100a+), got {device.name}")
        ok, reason = fb.availability()  # raises FlashInferUnavailable on a broken install
        if not ok:
            return Support(False, reason)
        if cc not in self.ccs:
            return Support(False, f"FlashInfer {fb.version()} offers this kernel on compute "
                                  f"capability {sorted(self.ccs)}, not {cc}")  # fmt: skip
        where = "compile-only (simulated)" if device.is_simulated else "compiled for"
        return Support(True, f"{where} sm_{cc}a; {reason}")

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Tactic]:
        from fp4_dispatch.backends import flashinfer as fb

        p = problem
        for fi in fb.valid_tactics(p.m, p.n, p.k, p.out_dtype, device.cc, device.sm_count):
            if self._mine(fi) and self.unbuildable(fi) is None:
                yield _typed(fi)

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        """FlashInfer's rules: the tactic must be in its runner's valid list."""
        from fp4_dispatch.backends import flashinfer as fb

        checked = self.tactic_type.model_validate(tactic.model_dump())
        p = problem
        valid = fb.valid_tactics(p.m, p.n, p.k, p.out_dtype, device.cc, device.sm_count)
        if checked.to_fi() not in valid:
            return (f"{checked.canonical_json()}: FlashInfer's runner does not list it for "
                    f"M={p.m} N={p.n} K={p.k} on sm_{device.cc}a")  # fmt: skip
        return self.unbuildable(checked.to_fi())

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        """Compile through FlashInfer's runner for the device's arch and SM count.

        `problem` comes in the kernel's orientation (swapped for swap_ab); FlashInfer's
        runner swaps by itself, so it gets the caller's orientation back.
        """
        from fp4_dispatch.backends import flashinfer as fb

        checked = self.tactic_type.model_validate(tactic.model_dump())
        p = problem.swapped() if checked.swap_ab else problem
        compiled = fb.compile_tactic(checked.to_fi(), p.m, p.n, p.k, p.out_dtype, device)
        return fb.FlashInferKernel(compiled, p.out_dtype, device.cc)


class FiSm100Backend(FlashInferBackend):
    name = "fi-sm100"
    family = "fi-sm100"
    tactic_type = FiSm100Tactic
    kernel_type = "sm100"
    diversity_axes = ("swap_ab", "tile_n", "use_prefetch")

    def _mine(self, fi: tuple) -> bool:
        return fi[4] == "sm100" and fi[5] is None


class FiSm100DeepKBackend(FlashInferBackend):
    name = "fi-sm100-deepk"
    family = "fi-sm100-deepk"
    tactic_type = FiSm100DeepKTactic
    kernel_type = "sm100"
    diversity_axes = ("swap_ab", "tile_n")

    def _mine(self, fi: tuple) -> bool:
        return fi[4] == "sm100" and fi[5] == DEEP_K_INST


class FiSm100SplitKBackend(FlashInferBackend):
    name = "fi-sm100-splitk"
    family = "fi-sm100-splitk"
    tactic_type = FiSm100SplitKTactic
    kernel_type = "sm100sk"
    diversity_axes = ("split_k", "tile_n")


class FiSm103Backend(FlashInferBackend):
    name = "fi-sm103"
    family = "fi-sm103"
    tactic_type = FiSm103Tactic
    kernel_type = "sm103"
    ccs = frozenset({107})
    diversity_axes = ("swap_ab", "use_tma_store", "tile_m")

    def unbuildable(self, fi: tuple) -> str | None:
        """``use_tma_store=False`` needs a DSL op the public CuTe-DSL lacks (probed)."""
        from fp4_dispatch.backends import flashinfer as fb

        if fi[5] is False and not fb.direct_store_epilogue_builds():
            return (
                "use_tma_store=False: FlashInfer's direct-store epilogue needs "
                "cute.nvgpu.CopyStgOp, absent from the installed nvidia-cutlass-dsl"
            )
        return None

    def supports(self, device: DeviceInfo) -> Support:
        from fp4_dispatch.backends import flashinfer as fb

        s = super().supports(device)
        if s.ok and not fb.direct_store_epilogue_builds():
            return Support(True, f"{s.reason}; use_tma_store=False tactics not offered "
                                 "(the installed CuTe-DSL lacks cute.nvgpu.CopyStgOp)")  # fmt: skip
        return s


class FiSm107Backend(FlashInferBackend):
    name = "fi-sm107"
    family = "fi-sm107"
    tactic_type = FiSm107Tactic
    kernel_type = "sm107"
    ccs = frozenset({107})
    diversity_axes = ("swap_ab", "inst_m", "prefetch_dist")


BACKENDS = (FiSm100Backend, FiSm100DeepKBackend, FiSm100SplitKBackend, FiSm103Backend,
            FiSm107Backend)  # fmt: skip


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    for cls in BACKENDS:
        register(cls())
    register(FiGroupedW4A16Backend())  # grouped_w4a16 (plugins/flashinfer/grouped.py)
    register(FiGroupedW4A4Backend())  # grouped_w4a4 (plugins/flashinfer/grouped_w4a4.py)
    register(FiGroupedW4A4Sm107Backend())
