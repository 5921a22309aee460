"""Device profiles from the families: simulated parts, and the peak rates of real ones.

Why here and not in `fp4_dispatch.contracts.device`: the parts a project knows are hardware facts,
and hardware facts live with the family that targets them (each backend's
``device_profiles``). This module merges what the installed backends declare and turns a
user's device argument into a `DeviceInfo`:

- ``None``/``"auto"``: the detected GPU (or the CPU), with peak rates from the profile of
  the same compute capability (else the nearest lower one of its major version, else the
  nearest lower one), scaled by SM count;
- ``"cpu"``, ``"cuda"``, ``"cuda:N"``;
- an alias a family declares (``"sm90"``, ``"sm100"``, ...): that simulated part.

The first backend (in registry order) to declare an alias wins; a later duplicate is
logged and ignored.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from fp4_dispatch.contracts.backend import Backend
from fp4_dispatch.contracts.device import CPU, DeviceInfo, DeviceProfile, check_sm_count, detect
from fp4_dispatch.loading.registry import load

log = logging.getLogger(__name__)


def _installed() -> tuple[Backend, ...]:
    return _installed_cached()


@functools.cache
def _installed_cached() -> tuple[Backend, ...]:
    return tuple(load(strict=False).backends.values())


def profiles(backends: Iterable[Backend] | None = None) -> dict[str, DeviceProfile]:
    """Alias -> profile, from `backends` (default: every installed backend)."""
    found: dict[str, DeviceProfile] = {}
    for b in _installed() if backends is None else backends:
        for p in getattr(b, "device_profiles", ()):
            if not isinstance(p, DeviceProfile):
                log.warning("backend %s: device_profiles holds a %s, not a DeviceProfile",
                            b.name, type(p).__name__)  # fmt: skip
                continue
            if p.alias in found:
                log.debug("device alias %r of %s ignored (already declared)", p.alias, b.name)
                continue
            found[p.alias] = p
    return found


def _sm_count(sm_count: object) -> int | None:
    """None (keep the part's), or `fp4_dispatch.contracts.device.check_sm_count`'s positive int."""
    return None if sm_count is None else check_sm_count(sm_count)


def simulated(
    name: str, sm_count: int | None = None, backends: Iterable[Backend] | None = None
) -> DeviceInfo:
    """The simulated part a family declares under `name` (``sm90``, ``sm100``, ...)."""
    known = profiles(backends)
    key = name.lower().replace("_", "")
    if key not in known:
        raise ValueError(
            f"device: expected one of {sorted(known)}, 'cpu', 'cuda' or 'cuda:N', got {name!r}"
        )
    dev = known[key].device
    sm_count = _sm_count(sm_count)
    return dev if sm_count is None else dev.with_sm_count(sm_count)


def _nearest(cc: int, known: dict[str, DeviceProfile]) -> DeviceInfo | None:
    """The profile of capability `cc`, else the nearest lower of its major, else lower."""
    by_cc = {p.device.cc: p.device for p in known.values()}
    if cc in by_cc:
        return by_cc[cc]
    lower = [c for c in by_cc if c is not None and c < cc]
    same_major = [c for c in lower if c // 10 == cc // 10]
    pick = max(same_major or lower, default=None)
    return None if pick is None else by_cc[pick]


def rated(dev: DeviceInfo, backends: Iterable[Backend] | None = None) -> DeviceInfo:
    """A real GPU with peak rates from the nearest family profile, scaled per SM."""
    if dev.kind != "cuda" or dev.cc is None:
        return dev
    ref = _nearest(dev.cc, profiles(backends))
    if ref is None:
        return dev.model_copy(update={"note": "no family profile for this capability: "
                                              "placeholder peak rates"})  # fmt: skip
    scaled = ref.with_sm_count(dev.sm_count)
    return dev.model_copy(
        update={
            "bf16_tflops": scaled.bf16_tflops,
            "fp8_tflops": scaled.fp8_tflops,
            "fp4_tflops": scaled.fp4_tflops if dev.cc >= 100 else None,
            "note": f"peak rates of {ref.name} scaled to {dev.sm_count} SMs",
        }
    )


def resolve(
    device: str | DeviceInfo | None = None,
    sm_count: int | None = None,
    backends: Iterable[Backend] | None = None,
) -> DeviceInfo:
    """Turn a user's device argument into a `DeviceInfo` (module docstring)."""
    sm_count = _sm_count(sm_count)
    backends = None if backends is None else tuple(backends)
    if isinstance(device, DeviceInfo):
        dev = device
    elif device is None or device == "auto":
        dev = rated(detect(), backends)
    elif device == "cpu":
        dev = CPU
    elif isinstance(device, str) and device.startswith("cuda"):
        index_text = device.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ValueError(
                f"device: expected 'cuda' or 'cuda:N' (N a device index), got {device!r}"
            )
        dev = detect(int(index_text))
        if dev.kind != "cuda":
            raise RuntimeError(f"device {device!r} requested, but {dev.note}")
        dev = rated(dev, backends)
    elif isinstance(device, str):
        return simulated(device, sm_count, backends)
    else:
        raise TypeError(
            f"device: expected a str, a DeviceInfo or None, got {type(device).__name__}"
        )
    return dev if sm_count is None else dev.with_sm_count(sm_count)
