"""`quantize_model`: convert every eligible ``nn.Linear`` of a model to `Nvfp4Linear` in place.

Why one call: users run models, not GEMMs; a hand-written swap loop gets the details
wrong (the layer that must stay dense, the K rule, memory). The conversion goes layer
by layer and frees as it goes, so the peak is the model plus one layer's new NVFP4
buffers and a bounded quantization scratch (`_CHUNK_BYTES`), never a second copy of the
model. Each weight is quantized exactly as `fp4_dispatch.quantize_nvfp4` would quantize
it whole (same global scale ``amax / (6 * 448)`` over the finite values, same bytes):
rows are independent once the global scale is fixed, so chunking rows changes nothing.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.format.nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3_MAX,
    Nvfp4Tensor,
    quantize_fields,
    swizzle_scales,
)
from fp4_dispatch.integrations.moe_convert import inspect_block, to_nvfp4_moe
from fp4_dispatch.integrations.nn import ACTIVATIONS, Activations, Nvfp4Linear, precision_of

logger = logging.getLogger(__name__)

__all__ = ["ConversionReport", "MetaWeightsError", "quantize_model"]

#: float32 bytes of one quantization chunk (rows of a weight at a time), and the fewest
#: chunks a weight is cut into: the scratch (a float32 copy of the chunk and its
#: temporaries, ~13 bytes an element on a GPU) stays under half a 16-bit weight's size,
#: so the new NVFP4 buffers (~0.56 bytes an element, made twice in passing) and the
#: scratch fit in one layer's dense size
_CHUNK_BYTES = 64 << 20
_CHUNKS_MIN = 32
#: the GEMM's K rule (whole bytes per pair of 16-element blocks; `fp4_dispatch.format.checks`)
_K_MULTIPLE = 2 * BLOCK_SIZE


class MetaWeightsError(ValueError):
    """The model's weights are not loaded (meta device): there is nothing to quantize."""


@dataclass
class ConversionReport:
    """What `quantize_model` did: the converted layers' names (in model order), the MoE
    blocks now `fp4_dispatch.moe.Nvfp4MoE` (``moe``), and for each eligible-looking
    ``nn.Linear`` or MoE block left alone, why."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    moe: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} linear layers to NVFP4"]
        if self.moe:
            lines.append(f"converted {len(self.moe)} MoE blocks to Nvfp4MoE")
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _matches(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern naming module `name`: the full name, its last component
    (``"lm_head"`` names ``model.lm_head``) or an fnmatch pattern (``"*.mlp.gate"``)."""
    last = name.rsplit(".", 1)[-1]
    for p in patterns:
        if name == p or last == p or fnmatch.fnmatchcase(name, p):
            return p
    return None


def _check_skip(skip: Iterable[str] | str | None) -> tuple[str, ...]:
    if skip is None:
        return ()
    if isinstance(skip, str):
        return (skip,)
    skip = tuple(skip)
    bad = [s for s in skip if not isinstance(s, str)]
    if bad:
        raise TypeError(f"skip: expected module names or patterns (str), got {bad[0]!r}")
    return skip


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, layer) of every ``nn.Linear`` below `model`, in model
    order, once per place a shared layer sits."""
    mods = dict(model.named_modules(remove_duplicate=False))
    found = []
    for full, child in mods.items():
        if full and isinstance(child, nn.Linear):
            parent, _, attr = full.rpartition(".")
            found.append((full, mods[parent], attr, child))
    return found


def _why_not(
    name: str,
    parent: nn.Module,
    layer: nn.Linear,
    skip: tuple[str, ...],
    keep: Callable[[str, nn.Module], bool] | None,
) -> str | None:
    """The reason `layer` stays dense, or None when it converts."""
    hit = _matches(name, skip)
    if hit is not None:
        return f"in skip ({hit!r})"
    if layer.in_features % _K_MULTIPLE:
        return (
            f"in_features={layer.in_features} is not a multiple of {_K_MULTIPLE} "
            "(the NVFP4 GEMM's K rule)"
        )
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads its out_proj.weight directly"
    if keep is not None and not keep(name, layer):
        return "refused by filter"
    return None


def _global_scale(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``amax(finite |w|) / (6 * 448)`` (1.0 when 0), float32 on w's device, computed a
    chunk of rows at a time (`fp4_dispatch.format.nvfp4`'s default global scale, same value)."""
    amax = torch.zeros((), dtype=torch.float32, device=w.device)
    for chunk in w.split(rows):
        c = chunk.detach().float()
        c = torch.where(torch.isfinite(c), c.abs(), torch.zeros((), device=c.device))
        amax = torch.maximum(amax, c.amax()) if c.numel() else amax
    g = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def quantize_weight(w: torch.Tensor) -> Nvfp4Tensor:
    """``quantize_nvfp4(w)`` (swizzled scales, default global scale), computed a chunk of
    rows at a time (`_CHUNK_BYTES`, `_CHUNKS_MIN`): the same bytes, bounded scratch."""
    n, k = w.shape
    rows = max(1, min(_CHUNK_BYTES // (4 * k), -(-n // _CHUNKS_MIN)))
    g = _global_scale(w, rows)
    data = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=w.device)
    for start in range(0, n, rows):
        part = w[start : start + rows].detach()
        d, s, _ = quantize_fields(part, g, "linear")
        data[start : start + rows] = d
        scale[start : start + rows] = s
    return Nvfp4Tensor._trusted(data, swizzle_scales(scale), g, "swizzled", (n, k))


def _convert(
    layer: nn.Linear,
    activations: Activations,
    dispatcher: Dispatcher | None,
    precision: str | None,
) -> Nvfp4Linear:
    """One layer as `Nvfp4Linear.from_linear` would make it, quantized in row chunks."""
    w = layer.weight
    bias_dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    with torch.no_grad():
        new = Nvfp4Linear.from_quantized(
            quantize_weight(w),
            layer.bias,
            dispatcher=dispatcher,
            activations=activations,
            bias_dtype=bias_dtype,
            precision=precision,
        )
    new.train(layer.training)
    return new


def quantize_model(
    model: nn.Module,
    *,
    activations: Activations = "auto",
    skip: Iterable[str] | str | None = ("lm_head",),
    filter: Callable[[str, nn.Module], bool] | None = None,
    dispatcher: Dispatcher | None = None,
    precision: str | None = None,
) -> ConversionReport:
    """Replace every eligible ``nn.Linear`` of `model` by an `Nvfp4Linear`, in place.

    - ``activations``: as in `Nvfp4Linear` (``"auto"``: W4A4 on GPUs with FP4 tensor
      cores, W4A16 elsewhere).
    - ``skip``: module names or patterns left dense; a name matches its full dotted name,
      its last component (the default ``("lm_head",)``: the output projection, whose
      rounding every logit sees) or an fnmatch pattern.
    - ``filter(name, module) -> bool``: False keeps a layer dense.
    - ``dispatcher``: the `Dispatcher` the new layers run on (None: the default one of
      the input's device and policy).
    - ``precision``: the layers' precision policy, as in `Nvfp4Linear` (None: the
      dispatcher's, else ``"exact"``; ``"fp8"`` lets dense calls run as W4A8,
      docs/PRECISION.md).

    A transformers sparse MoE block (Mixtral, Qwen3-MoE: router plus fused SiLU-gated
    experts) becomes one `fp4_dispatch.moe.Nvfp4MoE` (grouped NVFP4 GEMMs, the router
    kept dense), listed in the report's ``moe``; ``skip`` and ``filter`` apply to the
    block's name, and a block of another kind stays as it is, its reason in
    ``skipped`` (docs/checkpoints.md, "Mixture-of-experts blocks").

    A layer whose ``in_features`` is not a multiple of 32 stays dense (the GEMM's K
    rule), as does an ``nn.MultiheadAttention`` projection. Each weight is quantized on
    its own device (CPU or GPU) and its dense copy released before the next layer.
    Weights on the meta device raise `MetaWeightsError` before anything changes: load
    the weights first, or load an NVFP4 checkpoint (`fp4_dispatch.load_checkpoint`,
    `fp4_dispatch.from_pretrained`). Returns a `ConversionReport`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
    if filter is not None and not callable(filter):
        raise TypeError(f"filter: expected a callable (name, module) -> bool, got {filter!r}")
    patterns = _check_skip(skip)
    precision_of(precision, dispatcher)  # a bad policy fails before anything changes
    report = ConversionReport()
    blocks = _moe_blocks(model, patterns, filter, report)
    while blocks:  # first: a block's own linears go with it; each dense block freed in turn
        name, parent, attr, block = blocks.pop(0)
        setattr(parent, attr, to_nvfp4_moe(block, activations, dispatcher, precision))
        del block
        report.moe.append(name)
    todo = []
    for name, parent, attr, layer in _candidates(model):
        why = _why_not(name, parent, layer, patterns, filter)
        if why is not None:
            report.skipped[name] = why
            continue
        if layer.weight.is_meta:
            raise MetaWeightsError(
                f"model: {name}.weight is on the meta device: quantize_model needs the "
                "weights. Load them first, or load an NVFP4 checkpoint with "
                "fp4_dispatch.load_checkpoint(model, path) or fp4_dispatch.from_pretrained(path)"
            )
        todo.append((name, parent, attr, layer))
    done: dict[int, Nvfp4Linear] = {}  # a layer shared by two parents converts once
    while todo:
        name, parent, attr, layer = todo.pop(0)
        new = done.get(id(layer))
        if new is None:
            new = done[id(layer)] = _convert(layer, activations, dispatcher, precision)
        setattr(parent, attr, new)
        del layer  # the dense weight goes with its last reference (the parent's, just now)
        report.converted.append(name)
    logger.info(
        "quantize_model: %d converted, %d MoE blocks, %d skipped",
        len(report.converted), len(report.moe), len(report.skipped),
    )  # fmt: skip
    return report


def _moe_blocks(
    model: nn.Module,
    skip: tuple[str, ...],
    keep: Callable[[str, nn.Module], bool] | None,
    report: ConversionReport,
) -> list[tuple[str, nn.Module, str, object]]:
    """(name, parent, attribute, `MoeBlock`) of every MoE block to convert, checked
    whole before any changes (meta weights raise); the others' reasons go in `report`."""
    found = []
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        block = inspect_block(mod) if name else None
        if block is None:
            continue
        hit = _matches(name, skip)
        why = block if isinstance(block, str) else None
        if why is None and hit is not None:
            why = f"in skip ({hit!r})"
        elif why is None and keep is not None and not keep(name, mod):
            why = "refused by filter"
        if why is not None:
            report.skipped[name] = why
            continue
        if block.gate_up.is_meta or block.down.is_meta:
            raise MetaWeightsError(
                f"model: {name}.experts is on the meta device: quantize_model needs the "
                "weights. Load them first, or load an NVFP4 checkpoint with "
                "fp4_dispatch.load_checkpoint(model, path) or fp4_dispatch.from_pretrained(path)"
            )
        parent, _, attr = name.rpartition(".")
        found.append((name, mods[parent], attr, block))
    return found
