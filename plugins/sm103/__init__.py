"""Built-in plugin, family ``sm103`` (B300): the SM100 persistent design compiled for sm_103a.

Decision, stated plainly: ``nvidia-cutlass-operators`` 0.3.0 has no native SM103 operator
(none uses the SM103 MMA, ``SM103MmaMXF4NVF4Op`` with instruction K 96). What runs on an
SM103 part is the SM100 design compiled for ``sm_103a``; the library lists it as
supporting the whole ``100f`` family. This family is that offering, and it serves cc 103
only; family ``sm100`` steps aside on cc 103 so each kernel is ranked and measured once.
No SM103-specific constraint is added (FlashInfer's "output contiguous dim % 16" belongs
to its native SM103 kernel, not to this one): validity is the kernel's own
``can_implement``. When a native SM103 operator ships, it belongs here.
Compiled here, not run on hardware.
"""

from __future__ import annotations

from typing import Literal

from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.plugins._cute import CuteBackend, PersistentTactic


class Sm103Tactic(PersistentTactic):
    """SM100 persistent design compiled for sm_103a (see PersistentTactic)."""

    backend: Literal["cute-sm103"] = "cute-sm103"


#: B300: dense FP4 15 PF from NVIDIA's Blackwell Ultra announcement; 160 SMs from
#: third-party sources; the other rates assumed equal to the B200's.
PROFILE = DeviceProfile(
    "sm103",
    DeviceInfo(
        name="simulated B300 (sm103)",
        kind="simulated",
        compute_capability=(10, 3),
        sm_count=160,
        l2_bytes=126 * 2**20,
        mem_bw_gbps=8000.0,
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        fp4_tflops=15000.0,
        note="FP4 rate from NVIDIA's Blackwell Ultra figures, others assumed = B200",
    ),
)


class Sm103Backend(CuteBackend):
    name = "cute-sm103"
    device_profiles = (PROFILE,)
    family = "sm103"
    tactic_type = Sm103Tactic
    kind = "sm100"
    only = frozenset({103})
    diversity_axes = ("swap_ab", "tile_m", "cluster_m")

    def _tactic_of(self, design, swap: bool) -> Sm103Tactic:
        return Sm103Tactic(tile_m=design.tile_m, tile_n=design.tile_n, cluster_m=design.cluster_m,
                           cluster_n=design.cluster_n, swap_ab=swap)  # fmt: skip


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(Sm103Backend())
