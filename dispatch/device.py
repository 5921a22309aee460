"""Devices: real GPUs read through cuda-python, CPU, and simulated Blackwell/Hopper parts.

Detection never raises: no driver, no GPU or a broken binding yields the CPU device
with the reason in `DeviceInfo.note`. Simulated devices let anyone inspect dispatch
for hardware they do not have (`--device sm107`).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

log = logging.getLogger(__name__)

DeviceKind = Literal["cuda", "cpu", "simulated"]


class DeviceInfo(BaseModel):
    """What dispatch needs to know about a device. Rates feed the shared cost model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: DeviceKind
    compute_capability: tuple[int, int] | None = None
    sm_count: PositiveInt = 1
    l2_bytes: PositiveInt = 1
    mem_bw_gbps: PositiveFloat = 1.0
    bf16_tflops: PositiveFloat = 0.01
    fp8_tflops: PositiveFloat = 0.01
    #: dense NVFP4 tensor-core rate; None where the chip has no FP4 MMA (Hopper)
    fp4_tflops: PositiveFloat | None = None
    torch_device: str = "cpu"
    note: str = ""

    @property
    def cc(self) -> int | None:
        """Compute capability as one number (9.0 -> 90, 10.3 -> 103), None on CPU."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def arch(self) -> str | None:
        """Architecture-specific compile target, e.g. ``sm_100a``; None on CPU."""
        return None if self.cc is None else f"sm_{self.cc}a"

    @property
    def is_simulated(self) -> bool:
        return self.kind == "simulated"

    def with_sm_count(self, sm_count: int) -> DeviceInfo:
        """Same part with another SM count; per-SM rates stay, totals scale."""
        f = sm_count / self.sm_count
        fp4 = None if self.fp4_tflops is None else self.fp4_tflops * f
        return self.model_copy(
            update={
                "sm_count": sm_count,
                "bf16_tflops": self.bf16_tflops * f,
                "fp8_tflops": self.fp8_tflops * f,
                "fp4_tflops": fp4,
                "name": f"{self.name} ({sm_count} SMs)",
            }
        )


# Sources: H200 figures measured on an H200 by this project (2026-11-30: copy 4.25 TB/s, bf16 691 TFLOP/s, fp8 1263 TFLOP/s; 132 SMs; L2 from
# torch.cuda.get_device_properties). B200: NVIDIA DGX B200 datasheet (per GPU dense:
# FP4 9 PF, FP8 4.5 PF, BF16 2.25 PF, HBM3e 8 TB/s); 148 SMs (third-party sources). B300: NVIDIA Blackwell Ultra announcement (dense FP4 15 PF), 160 SMs
# (third-party); other B300 rates assumed equal to B200. SM107 part: 212 SMs from the
# FlashInfer measurements; its rates are NOT published — assumed equal to
# B300 per SM, scaled by SM count, and marked as such in `note`.
SIMULATED: dict[str, DeviceInfo] = {
    "sm90": DeviceInfo(
        name="simulated H200 (sm90)",
        kind="simulated",
        compute_capability=(9, 0),
        sm_count=132,
        l2_bytes=50 * 2**20,
        mem_bw_gbps=4250.0,
        bf16_tflops=691.0,
        fp8_tflops=1263.0,
        note="rates measured on an H200 by this project",
    ),
    "sm100": DeviceInfo(
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
    "sm103": DeviceInfo(
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
    "sm107": DeviceInfo(
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
}

CPU = DeviceInfo(name="cpu", kind="cpu", note="no CUDA device")


def simulated(name: str, sm_count: int | None = None) -> DeviceInfo:
    """A simulated device by family name (``sm90``, ``sm100``, ``sm103``, ``sm107``)."""
    key = name.lower().replace("_", "")
    if key not in SIMULATED:
        raise ValueError(
            f"device: expected one of {sorted(SIMULATED)}, 'cpu', 'cuda' or 'cuda:N', got {name!r}"
        )
    dev = SIMULATED[key]
    return dev if sm_count is None else dev.with_sm_count(sm_count)


def _rates_for(cc: int, sm_count: int) -> dict[str, float | None]:
    """Peak rates of a real part: the nearest simulated family, scaled per SM."""
    family = {90: "sm90", 100: "sm100", 103: "sm103", 107: "sm107"}.get(cc)
    if family is None:
        family = "sm90" if cc < 100 else "sm100"
    ref = SIMULATED[family].with_sm_count(sm_count)
    return {
        "bf16_tflops": ref.bf16_tflops,
        "fp8_tflops": ref.fp8_tflops,
        "fp4_tflops": ref.fp4_tflops if cc >= 100 else None,
    }


def _check(result: tuple) -> object:
    """Unwrap a cuda-python ``(err, value...)`` tuple, raising on a CUDA error."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _read_cuda_device(index: int) -> DeviceInfo:
    from cuda.bindings import driver as drv

    _check(drv.cuInit(0))
    count = _check(drv.cuDeviceGetCount())
    if index >= count:
        raise RuntimeError(f"cuda:{index} requested but {count} CUDA device(s) present")
    dev = _check(drv.cuDeviceGet(index))
    name = _check(drv.cuDeviceGetName(64, dev)).split(b"\0", 1)[0].decode()
    attr = drv.CUdevice_attribute

    def get(a: object) -> int:
        return int(_check(drv.cuDeviceGetAttribute(a, dev)))

    major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    sms = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    l2 = get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
    mem_khz = get(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
    bus_bits = get(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
    # DDR: two transfers per clock. Datasheet-like peak; the copy rate is ~85-90% of it.
    bw = 2.0 * mem_khz * 1e3 * bus_bits / 8 / 1e9 if mem_khz and bus_bits else 1000.0
    return DeviceInfo(
        name=name,
        kind="cuda",
        compute_capability=(major, minor),
        sm_count=sms,
        l2_bytes=max(l2, 1),
        mem_bw_gbps=bw,
        torch_device=f"cuda:{index}",
        **_rates_for(major * 10 + minor, sms),
    )


@functools.cache
def detect(index: int = 0) -> DeviceInfo:
    """The real CUDA device `index`, or the CPU device (with the reason) if there is none."""
    try:
        return _read_cuda_device(index)
    except Exception as exc:  # any failure means "no usable CUDA device": report, never raise
        log.debug("CUDA device detection failed: %r", exc)
        return CPU.model_copy(update={"note": f"no CUDA device: {type(exc).__name__}: {exc}"})


def resolve(device: str | DeviceInfo | None = None, sm_count: int | None = None) -> DeviceInfo:
    """Turn a user's device argument into a `DeviceInfo`.

    None or ``"auto"`` detects; ``"cpu"``; ``"cuda"``/``"cuda:N"``; a simulated name.
    """
    if isinstance(device, DeviceInfo):
        dev = device
    elif device is None or device == "auto":
        dev = detect()
    elif device == "cpu":
        dev = CPU
    elif device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        dev = detect(index)
        if dev.kind != "cuda":
            raise RuntimeError(f"device {device!r} requested, but {dev.note}")
    else:
        return simulated(device, sm_count)
    return dev if sm_count is None else dev.with_sm_count(sm_count)
