"""Built-in plugin, family ``sm100``: NVIDIA's SM100 persistent NVFP4 GEMM (CuTe-DSL).

Kernel: ``PersistentDenseBlockScaledGemmOperator`` from ``nvidia-cutlass-operators``,
compiled ahead of time for the device's own arch (sm_100a on B200; sm_107a on the SM107
part, where it competes with family ``sm107``). It does not serve sm_103a: the sm_103a
build of this design is a family of its own, so no kernel is listed (and measured) twice.
Compiled here, not run on hardware.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.plugins._cute import CuteBackend, PersistentTactic


class Sm100Tactic(PersistentTactic):
    """SM100 persistent design compiled for sm_100a / sm_107a (see PersistentTactic)."""

    backend: Literal["cute-sm100"] = "cute-sm100"


#: B200: NVIDIA DGX B200 datasheet, per GPU dense (FP4 9 PF, FP8 4.5 PF, BF16 2.25 PF,
#: HBM3e 8 TB/s); 148 SMs from third-party sources.
PROFILE = DeviceProfile(
    "sm100",
    DeviceInfo(
        name="simulated B200 (sm100)",
        kind="simulated",
        compute_capability=(10, 0),
        sm_count=148,
        l2_bytes=126 * 2**20,
        mem_bw_gbps=8000.0,
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        fp4_tflops=9000.0,
        note="datasheet rates (DGX B200); not run on hardware",
    ),
)


class Sm100Backend(CuteBackend):
    name = "cute-sm100"
    device_profiles = (PROFILE,)
    family = "sm100"
    tactic_type = Sm100Tactic
    kind = "sm100"
    diversity_axes = ("swap_ab", "tile_m", "cluster_m")
    excluded: ClassVar[dict[int, str]] = {
        103: "the sm_103a build of this design is a family of its own (one family per kernel)"
    }

    def _tactic_of(self, design, swap: bool) -> Sm100Tactic:
        return Sm100Tactic(tile_m=design.tile_m, tile_n=design.tile_n, cluster_m=design.cluster_m,
                           cluster_n=design.cluster_n, swap_ab=swap)  # fmt: skip


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(Sm100Backend())
