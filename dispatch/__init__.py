"""fp4-dispatch: pick and run the fastest NVFP4 GEMM for the NVIDIA GPU it is on.

Every public name is imported on first use (PEP 562 ``__getattr__``), so that
``import fp4_dispatch`` and the ``fp4-dispatch --help`` / ``--version`` console script
do not pay for importing torch (about 1 s on a small CPU, several seconds on a loaded
one). ``from fp4_dispatch import quantize_nvfp4`` imports exactly what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fp4_dispatch import _aliases
from fp4_dispatch.version import __version__

_aliases.install()

#: public name -> the submodule that defines it
_LAZY = {
    "Backend": "contracts.backend",
    "DenseOperands": "contracts.backend",
    "GemmOperands": "contracts.backend",
    "GroupedOperands": "contracts.backend",
    "Kernel": "contracts.backend",
    "Support": "contracts.backend",
    "DeviceInfo": "contracts.device",
    "DeviceProfile": "contracts.device",
    "hookimpl": "contracts.hookspecs",
    "Nvfp4Tensor": "format.nvfp4",
    "dequantize": "format.nvfp4",
    "quantize_nvfp4": "format.nvfp4",
    "reference_gemm": "format.nvfp4",
    "e2m1_to_float": "format.nvfp4",
    "unpack_e2m1": "format.nvfp4",
    "unswizzle_scales": "format.nvfp4",
    "Nvfp4Experts": "format.grouped",
    "quantize_experts": "format.grouped",
    "LoadError": "loading.registry",
    "PluginLoadError": "loading.registry",
    "Problem": "contracts.tactics",
    "Tactic": "contracts.tactics",
    "Dispatcher": "engine.dispatcher",
    "BackendStatus": "engine.dispatcher",
    "Nvfp4Linear": "integrations.nn",
    "Nvfp4MoE": "integrations.moe",
    "ConversionReport": "integrations.convert",
    "quantize_model": "integrations.convert",
    "CheckpointError": "integrations.checkpoints",
    "LoadReport": "integrations.checkpoints",
    "load_checkpoint": "integrations.checkpoints",
    "save_checkpoint": "integrations.ckpt_save",
    "from_pretrained": "integrations.hf",
}

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time the names are lazy
    from fp4_dispatch.contracts.backend import (
        Backend,
        DenseOperands,
        GemmOperands,
        GroupedOperands,
        Kernel,
        Support,
    )
    from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile
    from fp4_dispatch.contracts.hookspecs import hookimpl
    from fp4_dispatch.contracts.tactics import Problem, Tactic
    from fp4_dispatch.engine.dispatcher import BackendStatus, Dispatcher
    from fp4_dispatch.format.grouped import Nvfp4Experts, quantize_experts
    from fp4_dispatch.format.nvfp4 import (
        Nvfp4Tensor,
        dequantize,
        e2m1_to_float,
        quantize_nvfp4,
        reference_gemm,
        unpack_e2m1,
        unswizzle_scales,
    )
    from fp4_dispatch.integrations.checkpoints import CheckpointError, LoadReport, load_checkpoint
    from fp4_dispatch.integrations.ckpt_save import save_checkpoint
    from fp4_dispatch.integrations.convert import ConversionReport, quantize_model
    from fp4_dispatch.integrations.hf import from_pretrained
    from fp4_dispatch.integrations.moe import Nvfp4MoE
    from fp4_dispatch.integrations.nn import Nvfp4Linear
    from fp4_dispatch.loading.registry import LoadError, PluginLoadError


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
    "Nvfp4MoE",
    "Nvfp4Tensor",
    "PluginLoadError",
    "Problem",
    "Support",
    "Tactic",
    "__version__",
    "dequantize",
    "e2m1_to_float",
    "from_pretrained",
    "hookimpl",
    "load_checkpoint",
    "quantize_experts",
    "quantize_model",
    "quantize_nvfp4",
    "reference_gemm",
    "save_checkpoint",
    "unpack_e2m1",
    "unswizzle_scales",
]
