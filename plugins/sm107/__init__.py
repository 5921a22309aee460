"""Built-in plugin, family ``sm107`` (Rubin-class SM107 part): NVIDIA's SM107 NVFP4 GEMM.

Kernel: ``Sm107DenseBlockScaledGemmOperator`` (CuTe-DSL, ``nvidia-cutlass-operators``),
compiled for sm_107a: persistent, mixed preferred/fallback clusters, optional 2-CTA MMA
and B-operand reuse. On cc 107 it competes with family ``sm100`` (the SM100 design
compiled for sm_107a) — the case where one family used to be starved at the cut.
Its kernel refuses problems smaller than one preferred cluster tile (``can_implement``:
M >= tile_m / CTAs-per-MMA x cluster_m and N >= tile_n x cluster_n, in the kernel's
orientation), so for min(M, N) < 64 this family offers no tactic and family sm100 serves
alone. Compiled here, not run on hardware.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.contracts.tactics import Tactic
from fp4_dispatch.plugins._cute import CuteBackend

#: fallback clusters the operator library generates
FALLBACKS = ((1, 1), (1, 2), (2, 1))


class Sm107Tactic(Tactic):
    """Knobs of the SM107 block-scaled GEMM (rules from its kernel; see the validator).

    inst_m: MMA instruction M; 256 = 2-CTA instruction (a CTA pair), 128 = one CTA.
    b_reuse: fire the instruction twice along M keeping B in place: tile_m = 2 x inst_m.
    tile_m: MMA tiler M (rows per CTA pair when 2-CTA): inst_m x (2 if b_reuse else 1).
    tile_n: MMA tiler N (= instruction N).
    cluster_m x cluster_n: preferred cluster; fallback_cluster_*: the cluster used where
    the preferred one does not fit (must divide it, and differ from it).
    """

    backend: Literal["cute-sm107"] = "cute-sm107"
    tile_m: Literal[128, 256, 512]
    tile_n: Literal[64, 128, 256]
    inst_m: Literal[128, 256]
    b_reuse: bool
    cluster_m: Literal[1, 2, 4]
    cluster_n: Literal[1, 2, 4]
    fallback_cluster_m: Literal[1, 2]
    fallback_cluster_n: Literal[1, 2]

    @property
    def use_2cta(self) -> bool:
        return self.inst_m == 256

    @property
    def ctas_per_tile(self) -> int:
        """A 2-CTA instruction (inst M 256) spans a CTA pair: two SMs per output tile."""
        return 2 if self.use_2cta else 1

    @model_validator(mode="after")
    def _kernel_rules(self) -> Sm107Tactic:
        want = self.inst_m * (2 if self.b_reuse else 1)
        if self.tile_m != want:
            raise ValueError(
                f"tile_m must be inst_m x {2 if self.b_reuse else 1} (b_reuse={self.b_reuse}) "
                f"= {want}, got {self.tile_m}"
            )
        pref = (self.cluster_m, self.cluster_n)
        fall = (self.fallback_cluster_m, self.fallback_cluster_n)
        if fall not in FALLBACKS:
            raise ValueError(f"fallback cluster must be one of {FALLBACKS}, got {fall}")
        if fall == pref:
            raise ValueError(f"fallback cluster must differ from the preferred one, got {fall}")
        if pref[0] % fall[0] or pref[1] % fall[1]:
            raise ValueError(f"fallback cluster {fall} must divide the preferred cluster {pref}")
        if self.use_2cta and (pref[0] % 2 or fall[0] % 2):
            raise ValueError(
                f"inst_m=256 (2-CTA) needs even cluster M, preferred and fallback; got "
                f"{pref[0]} and {fall[0]}"
            )
        return self

    def design_fields(self) -> dict:
        return dict(kind="sm107", tile_m=self.tile_m, tile_n=self.tile_n,
                    cluster_m=self.cluster_m, cluster_n=self.cluster_n,
                    fallback_m=self.fallback_cluster_m, fallback_n=self.fallback_cluster_n,
                    inst_m=self.inst_m, b_reuse=self.b_reuse)  # fmt: skip


#: The SM107 (Rubin-class) part of the FlashInfer measurements: 212 SMs measured there.
#: Its rates are NOT published: assumed equal to the B300's per SM, scaled to 212 SMs.
PROFILE = DeviceProfile(
    "sm107",
    DeviceInfo(
        name="simulated SM107 part (sm107)",
        kind="simulated",
        compute_capability=(10, 7),
        sm_count=212,
        l2_bytes=126 * 2**20,
        mem_bw_gbps=8000.0,
        bf16_tflops=2250.0 * 212 / 160,
        fp8_tflops=4500.0 * 212 / 160,
        fp4_tflops=15000.0 * 212 / 160,
        note="SM count from FlashInfer measurements; rates assumed (B300 per SM)",
    ),
)


class Sm107Backend(CuteBackend):
    name = "cute-sm107"
    device_profiles = (PROFILE,)
    family = "sm107"
    tactic_type = Sm107Tactic
    kind = "sm107"
    diversity_axes = ("swap_ab", "inst_m", "b_reuse")

    def _tactic_of(self, design, swap: bool) -> Sm107Tactic:
        return Sm107Tactic(
            tile_m=design.tile_m, tile_n=design.tile_n, inst_m=design.inst_m,
            b_reuse=design.b_reuse, cluster_m=design.cluster_m, cluster_n=design.cluster_n,
            fallback_cluster_m=design.fallback_m, fallback_cluster_n=design.fallback_n,
            swap_ab=swap,
        )  # fmt: skip


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(Sm107Backend())
