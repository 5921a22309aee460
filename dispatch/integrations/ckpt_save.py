"""`save_checkpoint`: write a model with `Nvfp4Linear` layers as a ModelOpt NVFP4 checkpoint.

Why ModelOpt's layout: it is the NVFP4 format that vLLM, TensorRT-LLM and SGLang load,
and its global scale is a decode scale, as ours: a converted model is saved without any
rounding (codes and block scales as held, block scales back in the linear layout) and
`fp4_dispatch.load_checkpoint` reads it back bit for bit. Shards are written one at a
time (host memory about one shard), with ``model.safetensors.index.json``,
``hf_quant_config.json`` and, for a transformers model, ``config.json`` and
``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
from os import PathLike
from pathlib import Path

import torch
from torch import nn

from fp4_dispatch.integrations.moe import Nvfp4MoE
from fp4_dispatch.integrations.nn import Nvfp4Linear
from fp4_dispatch.version import __version__

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"


def _tensors(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(name, tensor) pairs in model order, ModelOpt names for `Nvfp4Linear` layers, each
    tied tensor once; and the names of the ``nn.Linear`` layers left dense."""
    out: list[tuple[str, torch.Tensor]] = []
    dense: list[str] = []
    seen: set[int] = set()
    quantized = {n for n, m in model.named_modules() if isinstance(m, (Nvfp4Linear, Nvfp4MoE))}
    for name, mod in model.named_modules():
        if isinstance(mod, Nvfp4MoE):
            out += _expert_tensors(name, mod)
            dense.append(f"{name}.gate")  # the router: dense, as ModelOpt lists it
            continue
        if isinstance(mod, Nvfp4Linear):
            q = mod.quantized_weight()
            out += [(f"{name}.weight", q.natural_data()),
                    (f"{name}.weight_scale", q.linear_scale()),
                    (f"{name}.weight_scale_2", q.global_scale)]  # fmt: skip
            if mod.input_global_scale is not None:
                out.append((f"{name}.input_scale", mod.input_global_scale))
            if mod.bias is not None:
                out.append((f"{name}.bias", mod.bias))
        elif isinstance(mod, nn.Linear):
            dense.append(name)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.rpartition(".")[0] in quantized or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out, dense


def _expert_tensors(name: str, mod: Nvfp4MoE) -> list[tuple[str, torch.Tensor]]:
    """An `Nvfp4MoE`'s experts under the per-expert ModelOpt names
    (``<name>.experts.<e>.gate_proj``/``up_proj``/``down_proj``, what vLLM and
    `fp4_dispatch.load_checkpoint` read), bytes as held; the router goes with the
    state dict (``<name>.gate.weight``)."""
    out: list[tuple[str, torch.Tensor]] = []
    scales = mod.input_scales
    for x in range(mod.num_experts):
        for j, (proj, which) in enumerate((("gate_proj", "gate"), ("up_proj", "up"),
                                           ("down_proj", "down"))):  # fmt: skip
            q = mod.expert_weight(which, x)
            p = f"{name}.experts.{x}.{proj}"
            out += [(f"{p}.weight", q.natural_data().contiguous()),
                    (f"{p}.weight_scale", q.linear_scale().contiguous()),
                    (f"{p}.weight_scale_2", q.global_scale.reshape(()))]  # fmt: skip
            if scales is not None:
                out.append((f"{p}.input_scale", scales[j, x].reshape(())))
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU, contiguous, and a copy when it is part of a larger storage (an
    expert's slice of a stacked buffer): safetensors refuses tensors sharing memory."""
    t = t.detach().to("cpu").contiguous()
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _write_shards(path: Path, tensors: list[tuple[str, torch.Tensor]], limit: int) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 - optional: the [hf] extra

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    by_name = dict(tensors)
    weight_map = {}
    total = 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: _own(by_name[n]) for n in names}
        total += sum(t.numel() * t.element_size() for t in part.values())
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del part
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))


def save_checkpoint(
    model: nn.Module, path: str | PathLike, *, max_shard_bytes: int = 5 * 10**9
) -> Path:
    """Write `model` to the directory `path` (created) as a ModelOpt NVFP4 checkpoint.

    Every `Nvfp4MoE` becomes its experts as ModelOpt writes them, one linear each
    (``<block>.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``) and its dense router
    ``<block>.gate.weight`` (listed in ``exclude_modules``).
    Every `Nvfp4Linear` becomes ``weight`` (uint8 packed e2m1), ``weight_scale`` (e4m3,
    linear ``[N, K/16]``), ``weight_scale_2`` (the decode global scale), ``input_scale``
    when the layer has a static activation scale, and ``bias``; every other tensor is
    saved as it is (tied tensors once); the ``nn.Linear`` layers left dense are listed in
    ``exclude_modules``. Shards hold at most ``max_shard_bytes`` (a larger tensor gets a
    shard of its own). Returns the directory.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected a positive int, got {max_shard_bytes!r}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors, dense = _tensors(model)
    _write_shards(root, tensors, max_shard_bytes)
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": dense}  # fmt: skip
    hf_quant = {"producer": {"name": "fp4-dispatch", "version": __version__}, "quantization": quant}
    (root / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        data = config.to_dict()
        data["quantization_config"] = {"quant_method": "modelopt", **quant}
        (root / "config.json").write_text(json.dumps(data, indent=2, default=str))
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "to_json_file"):
        gen.to_json_file(str(root / "generation_config.json"))
    logger.info("save_checkpoint %s: %d tensors", root, len(tensors))
    return root
