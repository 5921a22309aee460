"""Devices: what dispatch knows about the part it ranks for (value types, no hardware table).

A real GPU is read through cuda-python (`detect`); detection never raises: no driver,
no GPU or a broken binding yields the CPU device with the reason in `DeviceInfo.note`.
Peak rates and simulated parts (``--device sm107``) come from the families, as
`DeviceProfile`s (see `fp4_dispatch.loading.profiles`): adding a family adds its parts.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
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
        sm_count = check_sm_count(sm_count)
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


@dataclass(frozen=True)
class DeviceProfile:
    """A part a family knows: ``--device <alias>`` simulates it, and a real GPU of its
    compute capability takes its peak rates (scaled per SM). Families contribute these as
    `fp4_dispatch.Backend.device_profiles`; the core holds no hardware table.

    ``device`` is a simulated `DeviceInfo` (kind "simulated"); cite the source of every
    figure in its ``note``.
    """

    alias: str
    device: DeviceInfo

    def __post_init__(self) -> None:
        if not self.alias or self.alias != self.alias.lower() or not self.alias.isidentifier():
            raise ValueError(
                f"alias: expected a lower-case identifier like 'sm100', got {self.alias!r}"
            )
        if self.device.kind != "simulated" or self.device.compute_capability is None:
            raise ValueError(
                f"device: expected a simulated DeviceInfo with a compute capability, got "
                f"kind={self.device.kind!r} compute_capability={self.device.compute_capability}"
            )


CPU = DeviceInfo(name="cpu", kind="cpu", note="no CUDA device")


def check_sm_count(sm_count: object) -> int:
    """A user's SM count: a positive int (not a bool or float); ValueError otherwise.

    Why: 0 divided the rates (ZeroDivisionError deep in the cost model) and a negative
    count produced negative rates that ranked every tactic as free.
    """
    if type(sm_count) is not int or sm_count < 1:
        raise ValueError(f"sm_count: expected a positive int, got {sm_count!r}")
    return sm_count


def _check(result: tuple) -> object:
    """Unwrap a cuda-python ``(err, value...)`` tuple, raising on a CUDA error."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _read_cuda_device(index: int) -> DeviceInfo:
    from cuda.bindings import driver as drv  # noqa: PLC0415 - optional: no driver, no import

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
        note="peak rates not known yet (filled from the family profile of its capability)",
    )


@functools.cache
def detect(index: int = 0) -> DeviceInfo:
    """The real CUDA device `index`, or the CPU device (with the reason) if there is none."""
    try:
        return _read_cuda_device(index)
    except Exception as exc:  # any failure means "no usable CUDA device": report, never raise
        log.debug("CUDA device detection failed: %r", exc)
        return CPU.model_copy(update={"note": no_device_note(exc)})


def no_device_note(exc: BaseException) -> str:
    """One short line for a CPU-only machine: "no CUDA driver" when the driver library is
    missing (its loader's several-sentence text stays in the debug log), else the error's
    first line."""
    name = type(exc).__name__
    if isinstance(exc, ImportError) or "NotFound" in name or "libcuda" in str(exc):
        return "no CUDA driver (CPU only)"
    first = (str(exc).strip().splitlines() or [""])[0]
    first = first if len(first) <= 120 else first[:117] + "..."
    return f"no CUDA device: {name}: {first}" if first else f"no CUDA device: {name}"
