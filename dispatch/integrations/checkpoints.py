"""`load_checkpoint`: load a ModelOpt NVFP4 or compressed-tensors checkpoint into a model.

Three passes, so that a bad checkpoint never leaves a half-loaded model:

1. **plan** (`_plan`): from the safetensors headers (dtypes and shapes, no weight data)
   and the few one-element scale tensors, match every checkpoint tensor to the model
   and check everything: format, names, shapes, dtypes, scale values. Any problem is
   one `CheckpointError` naming the tensor and the file; the model is untouched.
2. **stage** (`_stage`): read the data one file at a time, move each tensor to the
   target device, convert each quantized layer once to this project's layout
   (`fp4_dispatch.integrations.ckpt_formats`) and build its `Nvfp4Linear` - all beside the model.
   Host memory holds about one shard (the open file's pages and one tensor in flight).
3. **commit** (`_commit`): swap the new layers in and assign the plain tensors. Nothing
   here reads a file or can fail on the checkpoint's content.

docs/checkpoints.md has the formats, the conversions and why they are exact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike

import torch
from torch import nn

from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.format.nvfp4 import BLOCK_SIZE, Nvfp4Tensor, swizzle_scales
from fp4_dispatch.integrations.ckpt_formats import FORMATS, Format, LayerFormat, detect_format
from fp4_dispatch.integrations.ckpt_sources import CheckpointError, Source, TensorInfo, open_source
from fp4_dispatch.integrations.moe_ckpt import QMoE, build_moe, plan_moe, split_experts
from fp4_dispatch.integrations.nn import ACTIVATIONS, Activations, Nvfp4Linear

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "LoadReport", "load_checkpoint"]

_K_MULTIPLE = 2 * BLOCK_SIZE  # the GEMM's K rule
_OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class LoadReport:
    """What `load_checkpoint` loaded: the format, the layers now `Nvfp4Linear`, how many
    plain tensors (embeddings, norms, dense layers), tensors it left unused, and the
    MoE blocks now `fp4_dispatch.moe.Nvfp4MoE` (``moe``, the model's names)."""

    format: str
    quantized: list[str] = field(default_factory=list)
    tensors: int = 0
    unused: list[str] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        text = (
            f"{self.format}: {len(self.quantized)} NVFP4 linear layers, "
            f"{self.tensors} other tensors"
        )
        text += f", {len(self.moe)} NVFP4 MoE blocks" if self.moe else ""
        return text + (f", {len(self.unused)} unused" if self.unused else "")


@dataclass
class _QLayer:
    """One quantized linear of the checkpoint, matched to the model's module."""

    name: str
    n: int
    k: int
    roles: dict[str, str]  # "data" | "scale" | "bias" -> tensor name
    global_scale: torch.Tensor  # decode, float32 0-dim (CPU)
    input_scale: torch.Tensor | None  # decode, float32 0-dim (CPU), or None
    target: nn.Module
    bias_dtype: torch.dtype | None


@dataclass
class _Slot:
    """A model tensor (a parameter or persistent buffer, shared by every alias path)."""

    names: list[str]
    places: list[tuple[nn.Module, str]]
    old: torch.Tensor
    is_param: bool


@dataclass
class _Plan:
    fmt: LayerFormat
    layers: dict[str, _QLayer]
    plain: dict[str, _Slot]  # checkpoint tensor name -> the model tensor it fills
    unused: list[str]
    moe: dict[str, QMoE] = field(default_factory=dict)  # checkpoint block name -> plan


# ---- pass 1: plan and validate ------------------------------------------------------


def _err(name: str, info: TensorInfo | None, src: Source, what: str) -> CheckpointError:
    where = info.file if info is not None else src.label
    return CheckpointError(f"{name} in {where}: {what}")


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Every parameter and persistent buffer of `model` by each name it has (tied
    tensors share one `_Slot`)."""
    by_id: dict[int, _Slot] = {}
    names: dict[str, _Slot] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        entries = [(a, t, True) for a, t in mod._parameters.items()]
        entries += [
            (a, t, False)
            for a, t in mod._buffers.items()
            if a not in mod._non_persistent_buffers_set
        ]
        for attr, t, is_param in entries:
            if t is None:
                continue
            full = f"{mname}.{attr}" if mname else attr
            slot = by_id.setdefault(id(t), _Slot([], [], t, is_param))
            if full not in slot.names:
                slot.names.append(full)
            if (mod, attr) not in [(m, a) for m, a in slot.places]:
                slot.places.append((mod, attr))
            names[full] = slot
    return names


def _prefixes(infos: dict[str, TensorInfo], fmt: LayerFormat) -> set[str]:
    """Module names with any tensor of a quantized linear of `fmt` (a packed weight, an
    e4m3 block scale or a global scale): each must then have all of them."""
    found = set()
    for name, info in infos.items():
        prefix, _, suffix = name.rpartition(".")
        if (
            suffix == fmt.global_scale
            or (suffix == fmt.data and info.dtype == torch.uint8)
            or (suffix == fmt.scale and info.dtype == torch.float8_e4m3fn)
        ):
            found.add(prefix)
    return found


def _scalar(src: Source, infos: dict[str, TensorInfo], name: str, fmt: LayerFormat) -> torch.Tensor:
    """The decode value of a one-element float32 scale tensor, checked finite and > 0."""
    info = infos[name]
    if info.dtype != torch.float32 or math.prod(info.shape) != 1:
        raise _err(
            name,
            info,
            src,
            f"expected a float32 scale of one element, got "
            f"{info.dtype_name} of shape {list(info.shape)}",
        )
    value = src.read_small(name)
    decode = fmt.decode(value)
    v, d = float(value.reshape(())), float(decode)
    if not (math.isfinite(v) and v > 0 and math.isfinite(d) and d > 0):
        raise _err(name, info, src, f"expected a finite scale > 0, got {v}")
    return decode


def _check_layer_tensors(
    src: Source, infos: dict[str, TensorInfo], p: str, fmt: LayerFormat
) -> tuple[int, int]:
    """(N, K) of quantized layer `p` after checking its data and block-scale tensors."""
    data_n, scale_n = f"{p}.{fmt.data}", f"{p}.{fmt.scale}"
    for role in (fmt.data, fmt.scale, fmt.global_scale):
        if f"{p}.{role}" not in infos:
            anyone = next(
                infos[f"{p}.{r}"]
                for r in (fmt.data, fmt.scale, fmt.global_scale)
                if f"{p}.{r}" in infos
            )
            raise _err(
                f"{p}.{role}",
                anyone,
                src,
                f"missing: layer {p} has other {fmt.name} NVFP4 tensors but not this one",
            )
    d, s = infos[data_n], infos[scale_n]
    if d.dtype != torch.uint8 or len(d.shape) != 2:
        raise _err(
            data_n,
            d,
            src,
            f"expected uint8 [N, K/2] packed e2m1, got {d.dtype_name} of shape {list(d.shape)}",
        )
    n, k = d.shape[0], 2 * d.shape[1]
    if s.dtype != torch.float8_e4m3fn or s.shape != (n, k // BLOCK_SIZE):
        raise _err(
            scale_n,
            s,
            src,
            f"expected float8_e4m3fn [{n}, {k // BLOCK_SIZE}] (one "
            f"scale per 16 of K={k}), got {s.dtype_name} of shape {list(s.shape)}",
        )
    if k % _K_MULTIPLE:
        raise _err(
            data_n,
            d,
            src,
            f"K={k} is not a multiple of {_K_MULTIPLE}: the NVFP4 "
            "GEMMs of fp4-dispatch cannot run this layer",
        )
    return n, k


def _match_module(
    model_mods: dict[str, nn.Module],
    src: Source,
    info: TensorInfo,
    p: str,
    n: int,
    k: int,
    fmt: LayerFormat,
) -> nn.Module:
    mod = model_mods.get(p)
    data_n = f"{p}.{fmt.data}"
    if mod is None:
        raise _err(data_n, info, src, f"the model has no module {p!r}")
    if not isinstance(mod, (nn.Linear, Nvfp4Linear)):
        raise _err(
            data_n,
            info,
            src,
            f"model module {p!r} is a {type(mod).__name__}, expected nn.Linear or Nvfp4Linear",
        )
    if (mod.out_features, mod.in_features) != (n, k):
        raise _err(
            data_n,
            info,
            src,
            f"a [{n}, {k}] weight, but model module {p!r} is "
            f"[{mod.out_features}, {mod.in_features}]",
        )
    return mod


def _plan_layer(
    src: Source,
    infos: dict[str, TensorInfo],
    p: str,
    fmt: LayerFormat,
    model_mods: dict[str, nn.Module],
    strict: bool,
) -> _QLayer:
    n, k = _check_layer_tensors(src, infos, p, fmt)
    data_n = f"{p}.{fmt.data}"
    mod = _match_module(model_mods, src, infos[data_n], p, n, k, fmt)
    roles = {"data": data_n, "scale": f"{p}.{fmt.scale}"}
    bias_n = f"{p}.bias"
    has_bias = mod.bias is not None
    if bias_n in infos:
        b = infos[bias_n]
        if not has_bias:
            raise _err(bias_n, b, src, f"model module {p!r} has no bias")
        if b.shape != (n,) or b.dtype is None or not b.dtype.is_floating_point:
            raise _err(
                bias_n,
                b,
                src,
                f"expected a float [{n}] bias, got {b.dtype_name} of shape {list(b.shape)}",
            )
        roles["bias"] = bias_n
    elif has_bias and (strict or mod.bias.is_meta):
        raise _err(bias_n, None, src, f"missing: model module {p!r} has a bias")
    inp = f"{p}.{fmt.input_scale}"
    bias_dtype = mod.bias.dtype if has_bias else None
    if isinstance(mod, nn.Linear) and mod.weight.dtype in _OUT_DTYPES:
        bias_dtype = mod.weight.dtype  # as Nvfp4Linear.from_linear does
    return _QLayer(
        p,
        n,
        k,
        roles,
        _scalar(src, infos, f"{p}.{fmt.global_scale}", fmt),
        _scalar(src, infos, inp, fmt) if inp in infos else None,
        mod,
        bias_dtype,
    )


def _check_plain(name: str, info: TensorInfo, slot: _Slot, src: Source) -> None:
    old = slot.old
    if tuple(old.shape) != info.shape:
        raise _err(name, info, src, f"shape {list(info.shape)}, the model's is {list(old.shape)}")
    if old.is_floating_point() and not (
        info.dtype is not None and info.dtype.is_floating_point and info.dtype.itemsize > 1
    ):
        raise _err(
            name,
            info,
            src,
            f"dtype {info.dtype_name}, expected a float dtype for the model's {old.dtype} tensor",
        )


def _plan_moe(
    src: Source,
    infos: dict[str, TensorInfo],
    prefixes: set[str],
    fmt: LayerFormat,
    model_mods: dict[str, nn.Module],
) -> tuple[dict[str, QMoE], set[str]]:
    """The MoE blocks' plans (`fp4_dispatch.moe_ckpt`) and the prefixes left to linears."""
    blocks, rest = split_experts(prefixes)
    moe = {}
    for block, projs in sorted(blocks.items()):
        q = plan_moe(src, infos, block, projs, fmt, model_mods, _check_layer_tensors, _scalar)
        if q is None:  # no MoE block there: per-expert linears of the model, if anything
            rest |= set(projs.values())
        else:
            moe[block] = q
    return moe, rest


def _plan(model: nn.Module, src: Source, fmt: LayerFormat, strict: bool) -> _Plan:
    infos = src.infos()
    model_mods = dict(model.named_modules())
    moe, prefixes = _plan_moe(src, infos, _prefixes(infos, fmt), fmt, model_mods)
    layers = {p: _plan_layer(src, infos, p, fmt, model_mods, strict) for p in sorted(prefixes)}
    claimed = {t for q in layers.values() for t in q.roles.values()}
    claimed |= {f"{p}.{r}" for p in layers for r in (fmt.global_scale, fmt.input_scale)}
    claimed |= {t for q in moe.values() for t in (*q.roles.values(), *q.scalars)}
    replaced = tuple(q.target_name + "." for q in moe.values())
    slots = _slots(model)
    plain: dict[str, _Slot] = {}
    unused: list[str] = []
    for name, info in infos.items():
        if name in claimed:
            continue
        if name.rpartition(".")[2] in fmt.unused:
            unused.append(name)
            continue
        slot = slots.get(name)
        in_layer = name.rpartition(".")[0] in layers or name.startswith(replaced)
        if slot is None or in_layer:
            if strict:
                what = (
                    f"not a tensor of a {fmt.name} NVFP4 layer this loader knows (zero "
                    "points and other extras are not supported)"
                    if in_layer
                    else "the model has no parameter or buffer of this name"
                )
                raise _err(name, info, src, f"{what} (strict=True)")
            unused.append(name)
            continue
        _check_plain(name, info, slot, src)
        plain[name] = slot
    _check_missing(slots, plain, layers, src, strict, replaced)
    return _Plan(fmt, layers, plain, unused, moe)


def _check_missing(
    slots: dict[str, _Slot],
    plain: dict[str, _Slot],
    layers: dict[str, _QLayer],
    src: Source,
    strict: bool,
    replaced: tuple[str, ...] = (),
) -> None:
    """Every model tensor outside the loaded layers and MoE blocks (`replaced`: their
    name prefixes) must be filled (strict), and a meta-device one always: it has no
    value to keep."""
    filled = {id(s) for s in plain.values()}
    for name, slot in slots.items():
        if id(slot) in filled or name.rpartition(".")[0] in layers or name.startswith(replaced):
            continue
        if strict or slot.old.is_meta:
            why = "its weights are on the meta device" if slot.old.is_meta else "strict=True"
            raise _err(
                name, None, src, f"missing: the model has it and the checkpoint does not ({why})"
            )


# ---- pass 2: stage ------------------------------------------------------------------


def _build_layer(
    q: _QLayer,
    got: dict[str, torch.Tensor],
    device: torch.device,
    activations: Activations,
    dispatcher: Dispatcher | None,
) -> Nvfp4Linear:
    """The `Nvfp4Linear` of one quantized layer: scales swizzled once, on the device."""
    g = q.global_scale.to(device)
    scale = swizzle_scales(got["scale"])
    qw = Nvfp4Tensor._trusted(got["data"].contiguous(), scale, g, "swizzled", (q.n, q.k))
    layer = Nvfp4Linear.from_quantized(
        qw,
        got.get("bias"),
        dispatcher=dispatcher,
        activations=activations,
        input_global_scale=q.input_scale,
        bias_dtype=q.bias_dtype,
    )
    layer.train(q.target.training)
    return layer


def _stage(
    plan: _Plan,
    src: Source,
    device: torch.device,
    activations: Activations,
    dispatcher: Dispatcher | None,
) -> tuple[dict[str, nn.Module], dict[int, torch.Tensor]]:
    """Read every needed tensor, one file at a time, into new device tensors and new
    layers (`Nvfp4Linear`, `Nvfp4MoE`) beside the model."""
    groups = [*plan.layers.values(), *plan.moe.values()]
    role_of = {t: (q, r) for q in groups for r, t in q.roles.items()}
    pending: dict[str, dict[str, torch.Tensor]] = {q.name: {} for q in groups}
    built: dict[str, nn.Module] = {}
    staged: dict[int, torch.Tensor] = {}  # id(slot) -> new tensor
    with torch.no_grad():
        for file, items in src.read_files(set(role_of) | set(plan.plain)):
            logger.info("load_checkpoint: reading %s", file)
            for name, t in items:
                if name in role_of:
                    q, role = role_of[name]
                    pending[q.name][role] = t.to(device)
                    if len(pending[q.name]) == len(q.roles):
                        got = pending.pop(q.name)
                        build = build_moe if isinstance(q, QMoE) else _build_layer
                        built[q.name] = build(q, got, device, activations, dispatcher)
                    continue
                slot = plan.plain[name]
                if id(slot) not in staged:
                    dtype = slot.old.dtype if slot.old.is_floating_point() else t.dtype
                    new = t.to(device=device, dtype=dtype)
                    # safetensors maps the file: a CPU tensor read from it shares the
                    # file's pages, which a later save to the same path would pull away
                    staged[id(slot)] = new.clone() if new is t and src.maps_files else new
                del t
    if pending:  # read_files yields every planned tensor: only a changed file gets here
        name = next(iter(pending))
        raise CheckpointError(
            f"{name} in {src.label}: some of its tensors were not read "
            "(did a file change while loading?)"
        )
    return built, staged


# ---- pass 3: commit -----------------------------------------------------------------


def _commit(
    model: nn.Module, plan: _Plan, built: dict[str, nn.Module], staged: dict[int, torch.Tensor]
) -> None:
    targets = {**{p: q.target for p, q in plan.layers.items()},
               **{p: q.target for p, q in plan.moe.items()}}  # fmt: skip
    new_by_old = {id(targets[p]): layer for p, layer in built.items()}
    for mod in model.modules():
        for attr, child in list(mod._modules.items()):
            if child is not None and id(child) in new_by_old:
                mod._modules[attr] = new_by_old[id(child)]
    slots = {id(s): s for s in plan.plain.values()}
    for key, t in staged.items():
        slot = slots[key]
        value = nn.Parameter(t, requires_grad=slot.old.requires_grad) if slot.is_param else t
        for mod, attr in slot.places:
            (mod._parameters if slot.is_param else mod._buffers)[attr] = value


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def load_checkpoint(
    model: nn.Module,
    source: str | PathLike | Mapping[str, torch.Tensor],
    *,
    format: Format = "auto",
    strict: bool = True,
    device: torch.device | str | None = None,
    activations: Activations = "auto",
    dispatcher: Dispatcher | None = None,
) -> LoadReport:
    """Load an NVFP4 checkpoint into `model`, in place; returns a `LoadReport`.

    - ``source``: a directory (``config.json``, ``hf_quant_config.json`` where present,
      ``*.safetensors`` shards with their ``model.safetensors.index.json``) or a state
      dict. Reading a directory needs ``safetensors`` (the ``[hf]`` extra).
    - ``format``: ``"modelopt"`` (NVIDIA ModelOpt NVFP4), ``"compressed-tensors"``
      (``nvfp4-pack-quantized``) or ``"auto"`` (the config files, else the tensor names).
    - Every quantized linear of the checkpoint replaces the model's module of that name
      (an ``nn.Linear`` or `Nvfp4Linear` of the same shape, on any device, meta
      included) by an `Nvfp4Linear` with ``activations`` and ``dispatcher``; static
      activation scales (ModelOpt ``input_scale``, compressed-tensors
      ``input_global_scale``) become its ``input_global_scale`` (the W4A4 path's).
      Every other tensor fills the model's parameter or buffer of that name (cast to the
      model tensor's dtype, as ``load_state_dict`` does). KV-cache scales are not used.
    - ``strict`` (default True): every checkpoint tensor must have a place in the model
      and every model tensor a value in the checkpoint. A model tensor on the meta
      device must be filled whatever ``strict`` says.
    - ``device``: where the loaded tensors go (default: the model's device; CPU for a
      model wholly on the meta device).

    - MoE experts (``<block>.experts.<e>.gate_proj``/``up_proj``/``down_proj``, or
      Mixtral's ``w1``/``w3``/``w2``, with the router ``<block>.gate.weight``) load into
      one `fp4_dispatch.moe.Nvfp4MoE` that replaces the model's MoE block of that name
      (a transformers Mixtral or Qwen3-MoE block, or an `Nvfp4MoE`; Mixtral's
      ``block_sparse_moe`` is the model's ``mlp``), bytes as stored; the report lists
      them in ``moe``.

    Everything is checked before anything changes: a wrong shape or dtype, a missing
    scale, an unknown format or a module the model lacks raises `CheckpointError`
    naming the tensor and the file, and the model is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    src = open_source(source)
    fmt = detect_format(src, format)
    plan = _plan(model, src, fmt, strict)
    dev = torch.device(device) if device is not None else _device_of(model)
    built, staged = _stage(plan, src, dev, activations, dispatcher)
    _commit(model, plan, built, staged)
    moe = sorted(q.target_name for q in plan.moe.values())
    report = LoadReport(fmt.name, sorted(p for p in built if p in plan.layers), len(staged),
                        sorted(plan.unused), moe)  # fmt: skip
    logger.info("load_checkpoint %s: %s", src.label, report)
    return report
