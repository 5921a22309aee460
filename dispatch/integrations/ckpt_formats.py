"""The two NVFP4 checkpoint formats people download, and how each maps onto this project's.

- **ModelOpt NVFP4** (NVIDIA TensorRT Model Optimizer's Hugging Face export;
  ``hf_quant_config.json`` ``quantization.quant_algo == "NVFP4"``, or ``config.json``
  ``quantization_config.quant_method == "modelopt"``). Per quantized linear ``L``:
  ``L.weight`` uint8 ``[N, K/2]`` (two e2m1 codes per byte, even element in the low
  nibble), ``L.weight_scale`` e4m3 ``[N, K/16]`` (linear layout), ``L.weight_scale_2``
  float32, one element: the DECODE scale (``amax / (6 * 448)``), ``L.input_scale``
  float32, one element: the activations' decode scale. Unquantized modules are listed in
  ``exclude_modules`` and hold plain tensors.
- **compressed-tensors ``nvfp4-pack-quantized``** (llm-compressor's output;
  ``config.json`` ``quantization_config.quant_method == "compressed-tensors"``). Per
  quantized linear: ``L.weight_packed`` uint8 ``[N, K/2]`` (same nibble order),
  ``L.weight_scale`` e4m3 ``[N, K/16]``, ``L.weight_global_scale`` float32 ``[1]``: an
  ENCODE scale (``448 * 6 / amax``; the library decodes with ``scale / global``), and,
  for static activation scales, ``L.input_global_scale`` (also an encode scale).
  Unquantized modules are listed in ``ignore``.

Both become an `Nvfp4Tensor` with swizzled block scales and a float32 decode global
scale: ModelOpt's ``weight_scale_2`` as it is, compressed-tensors' ``1 / global`` rounded
once to float32 (docs/checkpoints.md, "Exactness").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fp4_dispatch.integrations.ckpt_sources import CheckpointError, Source, TensorInfo

__all__ = ["FORMATS", "Format", "LayerFormat", "detect_format", "layer_format"]

Format = Literal["auto", "modelopt", "compressed-tensors"]
FORMATS: tuple[str, ...] = ("auto", "modelopt", "compressed-tensors")
CT_FORMAT = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class LayerFormat:
    """Tensor-name suffixes of one format's quantized linear, and its scale conventions."""

    name: str
    data: str  # packed e2m1 codes, uint8 [N, K/2]
    scale: str  # e4m3 block scales, [N, K/16], linear layout
    global_scale: str  # float32, one element
    input_scale: str  # float32, one element, optional
    encode: bool  # True: the global and input scales are encode scales (1 / decode)
    #: per-module tensors this project does not use (KV-cache scales): ignored, logged
    unused: tuple[str, ...] = ()

    def decode(self, value: torch.Tensor) -> torch.Tensor:
        """The float32 0-dim decode scale of a stored global or input scale: the value
        itself, or its reciprocal correctly rounded to float32 (a float64 division of
        float32 operands, then one rounding: no double-rounding error, since 53 >= 2*24+2)."""
        v = value.detach().reshape(()).to(torch.float64)
        return (1.0 / v if self.encode else v).to(torch.float32)


MODELOPT = LayerFormat(
    "modelopt",
    "weight",
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    encode=False,
    unused=("k_scale", "v_scale", "output_scale"),
)
COMPRESSED_TENSORS = LayerFormat(
    "compressed-tensors",
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
    encode=True,
    unused=("k_scale", "v_scale"),
)
_BY_NAME = {f.name: f for f in (MODELOPT, COMPRESSED_TENSORS)}


def layer_format(name: str) -> LayerFormat:
    return _BY_NAME[name]


def _where(src: Source, entry: str) -> str:
    return f"{entry} in {src.label}"


def _from_modelopt_config(src: Source) -> str | None:
    """'modelopt' when hf_quant_config.json (or config.json) says ModelOpt NVFP4; raises
    for a ModelOpt checkpoint of another algorithm; None when neither file says ModelOpt."""
    qc = src.quant_config
    where = "hf_quant_config.json"
    if qc is None:
        qc = src.config.get("quantization_config")
        where = "config.json quantization_config"
        if not isinstance(qc, dict) or qc.get("quant_method") != "modelopt":
            return None
    q = qc.get("quantization", qc)
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointError(
            f"{_where(src, where)}: quant_algo {algo!r} is not NVFP4; fp4-dispatch loads "
            f"ModelOpt NVFP4 and compressed-tensors {CT_FORMAT}"
        )
    group = q.get("group_size", 16)
    if group != 16:
        raise CheckpointError(f"{_where(src, where)}: group_size {group}, NVFP4 needs 16")
    return "modelopt"


def _from_ct_config(src: Source) -> str | None:
    """'compressed-tensors' when config.json says nvfp4-pack-quantized; raises for a
    compressed-tensors checkpoint of another format; None when it is not one."""
    qc = src.config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    formats = {qc.get("format")} | {
        g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)
    }
    formats.discard(None)
    formats.discard("dense")  # groups left unquantized
    if formats != {CT_FORMAT}:
        raise CheckpointError(
            f"{_where(src, 'config.json quantization_config')}: format "
            f"{sorted(formats) or None} is not {CT_FORMAT!r}; fp4-dispatch loads ModelOpt "
            f"NVFP4 and compressed-tensors {CT_FORMAT}"
        )
    return "compressed-tensors"


def _from_names(infos: dict[str, TensorInfo]) -> str | None:
    mo = any(n.endswith("." + MODELOPT.global_scale) for n in infos)
    ct = any(n.endswith("." + COMPRESSED_TENSORS.data) for n in infos)
    if mo and ct:
        return "mixed"
    return "modelopt" if mo else "compressed-tensors" if ct else None


def detect_format(src: Source, requested: str) -> LayerFormat:
    """The format of `src`: from its config files when it has them, else from tensor
    names; `requested` (not "auto") must agree. Raises `CheckpointError` naming the
    file for an unknown or contradictory format."""
    if requested not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {requested!r}")
    by_config = _from_modelopt_config(src) or _from_ct_config(src)
    by_names = _from_names(src.infos())
    if by_names == "mixed":
        raise CheckpointError(
            f"source {src.label}: holds both ModelOpt (*.weight_scale_2) and "
            "compressed-tensors (*.weight_packed) tensors"
        )
    found = by_config or by_names
    if found is None:
        raise CheckpointError(
            f"source {src.label}: no NVFP4 tensors (ModelOpt '*.weight_scale_2' or "
            f"compressed-tensors '*.weight_packed') and no quantization config naming either"
        )
    if by_config and by_names and by_config != by_names:
        raise CheckpointError(
            f"source {src.label}: the config says {by_config}, the tensor names say {by_names}"
        )
    if requested != "auto" and requested != found:
        raise CheckpointError(
            f"source {src.label}: format={requested!r} was asked for, the checkpoint is {found}"
        )
    return _BY_NAME[found]
