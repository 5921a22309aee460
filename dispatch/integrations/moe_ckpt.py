"""MoE expert weights in NVFP4 checkpoints: matched to a model's MoE block, built as `Nvfp4MoE`.

Both formats store experts one linear at a time, under the names the Hugging Face
checkpoints use (``<block>.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` for
Qwen3-MoE, ``w1`` / ``w3`` / ``w2`` for Mixtral), each with its format's weight, block
scale, global scale and optional activation scale (`fp4_dispatch.ckpt_formats`); the
router is a plain ``<block>.gate.weight``. ModelOpt's exporter splits transformers 5's
fused experts back into these names, and so does compressed-tensors' (llm-compressor
calibrates experts as separate linears). Mixtral checkpoints name the block
``block_sparse_moe`` where transformers 5's model says ``mlp`` (`ALIASES`).

The planner here (`plan_moe`) claims every tensor of a block whose model module is an
MoE block (`fp4_dispatch.moe.Nvfp4MoE`, or a transformers block that
`fp4_dispatch.moe_convert.inspect_block` converts, on any device, meta included) and
checks it all: every expert present with all three projections, shapes, dtypes and
scales; `build_moe` then makes the layer from the tensors read, bytes as stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor
from fp4_dispatch.integrations.ckpt_formats import LayerFormat
from fp4_dispatch.integrations.ckpt_sources import CheckpointError, Source, TensorInfo
from fp4_dispatch.integrations.moe import Nvfp4MoE
from fp4_dispatch.integrations.moe_convert import inspect_block
from fp4_dispatch.integrations.nn import Activations

__all__ = ["ALIASES", "PROJECTIONS", "QMoE", "build_moe", "plan_moe", "split_experts"]

#: checkpoint projection names -> the layer's (gate, up, down)
PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_ORDER = ("gate", "up", "down")
#: (checkpoint block name component, model's) pairs tried when the model lacks the first
ALIASES = (("block_sparse_moe", "mlp"),)
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")

#: the checkers of `fp4_dispatch.checkpoints` a plan uses (passed in: that module is a
#: layer above this one): (N, K) of a quantized linear's tensors, and a decode scalar
CheckLayer = Callable[[Source, dict[str, TensorInfo], str, LayerFormat], tuple[int, int]]
Scalar = Callable[[Source, dict[str, TensorInfo], str, LayerFormat], torch.Tensor]


@dataclass
class QMoE:
    """One MoE block of the checkpoint, matched to the model's module."""

    name: str  # the block's name in the checkpoint
    target_name: str  # the model's module it replaces
    target: nn.Module
    experts: int
    hidden: int
    inter: int
    top_k: int
    norm_topk_prob: bool
    router_dtype: torch.dtype
    #: role -> tensor name: "router", and "<e>.<gate|up|down>.<data|scale>"
    roles: dict[str, str] = field(default_factory=dict)
    #: every scale tensor name it claims (read in the plan)
    scalars: list[str] = field(default_factory=list)
    global_scales: torch.Tensor | None = None  # float32 [3, E] decode (gate, up, down)
    input_scales: torch.Tensor | None = None  # float32 [3, E] decode, or None


def split_experts(prefixes: set[str]) -> tuple[dict[str, dict[tuple[int, str], str]], set[str]]:
    """The quantized-linear prefixes that name an expert projection, by block
    (``{block: {(expert, "gate"|"up"|"down"): prefix}}``), and the rest."""
    blocks: dict[str, dict[tuple[int, str], str]] = {}
    rest = set()
    for p in prefixes:
        m = _EXPERT.match(p)
        if m is None or m["proj"] not in PROJECTIONS:
            rest.add(p)
            continue
        blocks.setdefault(m["block"], {})[(int(m["e"]), PROJECTIONS[m["proj"]])] = p
    return blocks, rest


def _model_block(block: str, model_mods: dict[str, nn.Module]) -> tuple[str, nn.Module] | None:
    """The model's MoE module for checkpoint block `block` (directly or by `ALIASES`)."""
    names = [block] + [
        re.sub(rf"(^|\.){theirs}(\.|$)", rf"\g<1>{ours}\g<2>", block) for theirs, ours in ALIASES
    ]
    for name in dict.fromkeys(names):
        mod = model_mods.get(name)
        if isinstance(mod, Nvfp4MoE):
            return name, mod
        if mod is not None and inspect_block(mod) is not None:
            return name, mod
    return None


def _shape_of(
    mod: nn.Module, name: str, src: Source
) -> tuple[int, int, int, int, bool, torch.dtype]:
    """(E, H, I, top_k, norm_topk_prob, router dtype) of the model's MoE module."""
    if isinstance(mod, Nvfp4MoE):
        return (
            mod.num_experts,
            mod.hidden_size,
            mod.intermediate_size,
            mod.top_k,
            mod.norm_topk_prob,
            mod.gate.weight.dtype,
        )
    block = inspect_block(mod)
    if isinstance(block, str):
        raise CheckpointError(
            f"{name} in {src.label}: the model's MoE block cannot hold NVFP4 experts: {block}"
        )
    e, two_i, h = block.gate_up.shape
    return e, h, two_i // 2, block.top_k, block.norm_topk_prob, block.router_weight.dtype


def _err(name: str, info: TensorInfo | None, src: Source, what: str) -> CheckpointError:
    return CheckpointError(f"{name} in {info.file if info is not None else src.label}: {what}")


def plan_moe(
    src: Source,
    infos: dict[str, TensorInfo],
    block: str,
    projs: dict[tuple[int, str], str],
    fmt: LayerFormat,
    model_mods: dict[str, nn.Module],
    check_layer: CheckLayer,
    scalar: Scalar,
) -> QMoE | None:
    """The plan of checkpoint block `block` (its expert prefixes `projs`), or None when
    the model has no MoE block there (then they are ordinary linears, if anything)."""
    hit = _model_block(block, model_mods)
    if hit is None:
        return None
    target_name, mod = hit
    e, h, i, top_k, norm, router_dtype = _shape_of(mod, target_name, src)
    q = QMoE(block, target_name, mod, e, h, i, top_k, norm, router_dtype)
    any_info = infos[f"{next(iter(projs.values()))}.{fmt.data}"]
    extra = sorted(x for x, _ in projs if x >= e)
    if extra:
        p = projs[next(k for k in projs if k[0] == extra[0])]
        raise _err(
            f"{p}.{fmt.data}",
            infos[f"{p}.{fmt.data}"],
            src,
            f"expert {extra[0]}, but model module {target_name!r} has {e} experts",
        )
    want = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    g = torch.empty(3, e, dtype=torch.float32)
    inputs: list[torch.Tensor | None] = []
    for x in range(e):
        for j, proj in enumerate(_ORDER):
            p = projs.get((x, proj))
            if p is None:
                raise _err(
                    f"{block}.experts.{x}.{_raw_name(projs, proj)}.{fmt.data}",
                    any_info,
                    src,
                    f"missing: block {block} has NVFP4 experts but not expert {x}'s {proj} "
                    "projection",
                )
            n, k = check_layer(src, infos, p, fmt)
            if (n, k) != want[proj]:
                raise _err(
                    f"{p}.{fmt.data}",
                    infos[f"{p}.{fmt.data}"],
                    src,
                    f"a [{n}, {k}] weight, but model module {target_name!r} has "
                    f"{proj} weights of [{want[proj][0]}, {want[proj][1]}]",
                )
            if f"{p}.bias" in infos:
                raise _err(f"{p}.bias", infos[f"{p}.bias"], src, "expert biases are not supported")
            q.roles[f"{x}.{proj}.data"] = f"{p}.{fmt.data}"
            q.roles[f"{x}.{proj}.scale"] = f"{p}.{fmt.scale}"
            q.scalars.append(f"{p}.{fmt.global_scale}")
            g[j, x] = scalar(src, infos, f"{p}.{fmt.global_scale}", fmt)
            inp = f"{p}.{fmt.input_scale}"
            inputs.append(scalar(src, infos, inp, fmt) if inp in infos else None)
            if inp in infos:
                q.scalars.append(inp)
    q.global_scales = g
    q.input_scales = _input_scales(inputs, e, block, any_info, src, fmt)
    q.roles["router"] = _router(src, infos, block, q)
    return q


def _raw_name(projs: dict[tuple[int, str], str], proj: str) -> str:
    """The checkpoint's name of projection `proj` (``gate_proj`` or Mixtral's ``w1``...),
    as its other experts spell it."""
    hub = any(p.rpartition(".")[2] in ("w1", "w2", "w3") for p in projs.values())
    return next(raw for raw, ours in PROJECTIONS.items() if ours == proj and hub == (raw[0] == "w"))


def _input_scales(
    inputs: list[torch.Tensor | None],
    e: int,
    block: str,
    info: TensorInfo,
    src: Source,
    fmt: LayerFormat,
) -> torch.Tensor | None:
    """[3, E] from the per-projection activation scales: all or none."""
    have = [t is not None for t in inputs]
    if not any(have):
        return None
    if not all(have):
        raise _err(
            f"{block}.experts",
            info,
            src,
            f"some expert projections have {fmt.input_scale} and some do not",
        )
    return torch.stack(inputs).reshape(e, 3).T.contiguous()


def _router(src: Source, infos: dict[str, TensorInfo], block: str, q: QMoE) -> str:
    name = f"{block}.gate.weight"
    info = infos.get(name)
    if info is None:
        raise _err(name, None, src, f"missing: the router of MoE block {block}")
    if (
        info.shape != (q.experts, q.hidden)
        or info.dtype is None
        or not (info.dtype.is_floating_point and info.dtype.itemsize > 1)
    ):
        raise _err(
            name,
            info,
            src,
            f"expected a float [{q.experts}, {q.hidden}] router weight, got "
            f"{info.dtype_name} of shape {list(info.shape)}",
        )
    return name


def build_moe(
    q: QMoE,
    got: dict[str, torch.Tensor],
    device: torch.device,
    activations: Activations,
    dispatcher: Dispatcher | None,
) -> Nvfp4MoE:
    """The `Nvfp4MoE` of one planned block from its tensors (`q.roles` -> tensor)."""
    mod = q.target
    layer = Nvfp4MoE(
        q.hidden,
        q.inter,
        q.experts,
        q.top_k,
        norm_topk_prob=q.norm_topk_prob,
        dispatcher=dispatcher,
        activations=activations,
        device=device,
        dtype=q.router_dtype,
    )
    g = q.global_scales.to(device)
    with torch.no_grad():
        layer.gate.weight.copy_(got["router"])
        for x in range(q.experts):
            parts = {}
            for j, proj in enumerate(_ORDER):
                n, k = (q.hidden, q.inter) if proj == "down" else (q.inter, q.hidden)
                parts[proj] = Nvfp4Tensor._trusted(
                    got[f"{x}.{proj}.data"].contiguous(),
                    got[f"{x}.{proj}.scale"].contiguous(),
                    g[j, x],
                    "linear",
                    (n, k),
                )
            layer.load_expert(x, **parts)
    if q.input_scales is not None:
        layer.set_input_scales(q.input_scales)
    layer.train(mod.training)
    return layer
