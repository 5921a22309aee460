"""`from_pretrained`: a transformers model from an NVFP4 checkpoint directory, ready to run.

Needs the ``[hf]`` extra (transformers, safetensors). The model is built from
``config.json`` with its parameters on the meta device (no memory, no random
initialisation), then `fp4_dispatch.load_checkpoint` swaps the quantized linears for
`Nvfp4Linear` and loads every tensor straight onto the device, one shard at a time.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from os import PathLike
from pathlib import Path

import torch
from torch import nn

from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.integrations.checkpoints import CheckpointError, load_checkpoint
from fp4_dispatch.integrations.ckpt_formats import Format
from fp4_dispatch.integrations.nn import Activations

logger = logging.getLogger(__name__)

__all__ = ["from_pretrained"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (its storage freed at
    once; ``torch.empty`` never touched it); buffers stay real, so buffers that are
    computed at construction and not saved (rotary ``inv_freq``) keep their values. An
    already-meta parameter is registered as it is, so tied weights stay one object."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _dtype_of(config: object, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
        return dtype
    # transformers >= 4.56 names it dtype (reading torch_dtype there warns)
    got = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(got, str):
        got = getattr(torch, got, None)
    return got if isinstance(got, torch.dtype) else torch.bfloat16


def from_pretrained(
    path: str | PathLike,
    *,
    device: torch.device | str | None = None,
    activations: Activations = "auto",
    dtype: torch.dtype | None = None,
    format: Format = "auto",
    dispatcher: Dispatcher | None = None,
    strict: bool = True,
) -> nn.Module:
    """A transformers causal LM from the NVFP4 checkpoint directory `path` (ModelOpt NVFP4
    or compressed-tensors ``nvfp4-pack-quantized``), in eval mode on ``device``.

    - ``device``: default the current CUDA GPU when there is one, else the CPU.
    - ``activations``, ``dispatcher``: of the `Nvfp4Linear` layers (see there).
    - ``dtype``: of the unquantized parameters (embeddings, norms, ``lm_head``); default
      the config's ``dtype`` / ``torch_dtype``, else bfloat16.
    - ``format``, ``strict``: as in `fp4_dispatch.load_checkpoint`.

    ``generate()`` works on the result (its ``generation_config.json`` is read when the
    directory has one). Nothing is downloaded: `path` is a local directory.
    """
    try:
        import transformers  # noqa: PLC0415 - optional: the [hf] extra
    except ImportError as exc:
        raise ImportError(
            "from_pretrained needs transformers and safetensors: pip install 'fp4-dispatch[hf]'"
        ) from exc
    root = Path(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"config.json in {root}: not there (expected a model directory)")
    dev = (
        torch.device(device)
        if device is not None
        else (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    )
    config = transformers.AutoConfig.from_pretrained(str(root))
    bare = copy.deepcopy(config)
    if hasattr(bare, "quantization_config"):
        del bare.quantization_config  # this project does the quantized layers itself
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(bare, dtype=_dtype_of(config, dtype))
    report = load_checkpoint(
        model,
        root,
        format=format,
        strict=strict,
        device=dev,
        activations=activations,
        dispatcher=dispatcher,
    )
    model.to(dev)  # the buffers made at construction (on the CPU)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{left[0]} in {root}: still on the meta device after loading")
    if (root / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(root))
    logger.info("from_pretrained %s: %s", root, report)
    return model.eval()
