"""fp4-dispatch: pick and run the fastest NVFP4 GEMM for the NVIDIA GPU it is on.

Every public name is imported on first use (PEP 562 ``__getattr__``), so that
``import fp4_dispatch`` and the ``fp4-dispatch --help`` / ``--version`` console script
do not pay for importing torch (about 1 s on a small CPU, several seconds on a loaded
one). ``from fp4_dispatch import quantize_nvfp4`` imports exactly what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

#: public name -> the submodule that defines it
_LAZY = {
    "Backend": "backend",
    "DenseOperands": "backend",
    "GemmOperands": "backend",
    "GroupedOperands": "backend",
    "Kernel": "backend",
    "Support": "backend",
    "DeviceInfo": "device",
    "DeviceProfile": "device",
    "hookimpl": "hookspecs",
    "Nvfp4Tensor": "nvfp4",
    "dequantize": "nvfp4",
    "quantize_nvfp4": "nvfp4",
    "reference_gemm": "nvfp4",
    "Nvfp4Experts": "grouped",
    "quantize_experts": "grouped",
    "LoadError": "registry",
    "PluginLoadError": "registry",
    "Problem": "tactics",
    "Tactic": "tactics",
    "Dispatcher": "dispatcher",
    "BackendStatus": "dispatcher",
    "Nvfp4Linear": "nn",
    "ConversionReport": "convert",
    "quantize_model": "convert",
    "CheckpointError": "checkpoints",
    "LoadReport": "checkpoints",
    "load_checkpoint": "checkpoints",
    "save_checkpoint": "ckpt_save",
    "from_pretrained": "hf",
}

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time the names are lazy
    from .backend import Backend, DenseOperands, GemmOperands, GroupedOperands, Kernel, Support
    from .checkpoints import CheckpointError, LoadReport, load_checkpoint
    from .ckpt_save import save_checkpoint
    from .convert import ConversionReport, quantize_model
    from .device import DeviceInfo, DeviceProfile
    from .dispatcher import BackendStatus, Dispatcher
    from .grouped import Nvfp4Experts, quantize_experts
    from .hf import from_pretrained
    from .hookspecs import hookimpl
    from .nn import Nvfp4Linear
    from .nvfp4 import Nvfp4Tensor, dequantize, quantize_nvfp4, reference_gemm
    from .registry import LoadError, PluginLoadError
    from .tactics import Problem, Tactic


def __getattr__(name: str) -> Any:
    """Import the submodule that defines `name` on first use, then cache the attribute."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4_dispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Backend",
    "BackendStatus",
    "CheckpointError",
    "ConversionReport",
    "DenseOperands",
    "DeviceInfo",
    "DeviceProfile",
    "Dispatcher",
    "GemmOperands",
    "GroupedOperands",
    "Kernel",
    "LoadError",
    "LoadReport",
    "Nvfp4Experts",
    "Nvfp4Linear",
    "Nvfp4Tensor",
    "PluginLoadError",
    "Problem",
    "Support",
    "Tactic",
    "__version__",
    "dequantize",
    "from_pretrained",
    "hookimpl",
    "load_checkpoint",
    "quantize_experts",
    "quantize_model",
    "quantize_nvfp4",
    "reference_gemm",
    "save_checkpoint",
]
