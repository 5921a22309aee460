"""fp4-dispatch: pick and run the fastest NVFP4 GEMM for the NVIDIA GPU it is on."""

from __future__ import annotations

from .backend import Backend, GemmOperands, Kernel, Support
from .device import DeviceInfo
from .hookspecs import hookimpl
from .nvfp4 import Nvfp4Tensor, dequantize, quantize_nvfp4, reference_gemm
from .registry import LoadError, PluginLoadError
from .tactics import Problem, Tactic
from .version import __version__


def __getattr__(name: str):
    """Load the dispatcher (and with it the ranking) only when it is first used."""
    if name in ("Dispatcher", "BackendStatus"):
        from . import dispatcher

        return getattr(dispatcher, name)
    if name == "Nvfp4Linear":
        from .nn import Nvfp4Linear

        return Nvfp4Linear
    raise AttributeError(f"module 'fp4_dispatch' has no attribute {name!r}")


__all__ = [
    "Backend",
    "BackendStatus",
    "DeviceInfo",
    "Dispatcher",
    "GemmOperands",
    "Kernel",
    "LoadError",
    "Nvfp4Linear",
    "Nvfp4Tensor",
    "PluginLoadError",
    "Problem",
    "Support",
    "Tactic",
    "__version__",
    "dequantize",
    "hookimpl",
    "quantize_nvfp4",
    "reference_gemm",
]
