"""Small NVFP4 checkpoints made in a test's tmp_path, by each format's own library.

- compressed-tensors ``nvfp4-pack-quantized``: the library's own scale functions
  (``generate_gparam``, ``calculate_qparams``) and compressor
  (``NVFP4PackedCompressor.compress``), as llm-compressor calls them.
- ModelOpt NVFP4: ``modelopt``'s ``NVFP4QTensor.quantize`` (nvidia-modelopt imports on a
  CPU) when installed; otherwise `modelopt_quantize` below, written from the arithmetic
  of ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py`` in
  NVIDIA/TensorRT-Model-Optimizer (``get_weights_scaling_factor_2``: ``amax / (6 *
  448)``; ``get_weights_scaling_factor``: ``e4m3(block_amax / (6 * scale_2))`` with a
  zero block scale set to 1.0; ``quantize``: ``x / (float32(scale) * scale_2)`` rounded to
  e2m1 nearest-even, sign bit from ``x < 0``; low nibble = even element;
  ``dequantize``: ``e2m1 * (float32(scale) * scale_2)`` in float32).

A checkpoint is a directory as each exporter writes it: ``config.json`` (with
``quantization_config`` for compressed-tensors), ``hf_quant_config.json`` (ModelOpt),
safetensors shards and ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def tiny_llama_config(**kw):
    from transformers import LlamaConfig

    args = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    args.update(kw)
    return LlamaConfig(**args)


def tiny_llama(seed: int = 0, **kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).to(torch.bfloat16).eval()
    with torch.no_grad():  # biases are zero-initialised: give them values to load
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.02)
    return model


def quantized_linears(model: nn.Module, skip=("lm_head",)) -> list[tuple[str, nn.Linear]]:
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in skip
    ]


# ---- ModelOpt --------------------------------------------------------------------------


def _codes_rne(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of float32 `y` (|y| <= 6 after scaling): nearest, ties to even code,
    sign bit set for y < 0 (so -0.1 -> code 8, as ModelOpt's ``x < 0`` sign)."""
    mag = y.abs()
    dist = (mag.unsqueeze(-1) - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    # among tied codes prefer the even one (ties happen between two neighbours)
    even = torch.arange(8) % 2 == 0
    code = torch.where(
        (ties & even).any(-1), (ties & even).float().argmax(-1), ties.float().argmax(-1)
    )
    return code.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)


def modelopt_quantize(
    w: torch.Tensor, scale_2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], e4m3 scale [N, K/16], float32 scale_2 []) by ModelOpt's
    documented arithmetic (module docstring); `scale_2` given: used as it is (ModelOpt's
    ``weights_scaling_factor_2``, as its MoE export shares one between gate and up)."""
    wf = w.float()
    n, k = wf.shape
    scale_2 = wf.abs().amax() / (6.0 * 448.0) if scale_2 is None else scale_2.float()
    blocks = wf.reshape(n, k // 16, 16)
    per_block = blocks.abs().amax(-1) / (6.0 * scale_2)
    per_block[per_block == 0] = 1.0
    scale = per_block.to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * scale_2).unsqueeze(-1)
    codes = _codes_rne(scaled.reshape(n, k))
    return (codes[:, 1::2] << 4) | codes[:, 0::2], scale, scale_2


def modelopt_dequantize(packed, scale, scale_2) -> torch.Tensor:
    """float32 ``e2m1 * (float32(scale) * scale_2)``: ModelOpt's dequantize, in its order."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    vals = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    per_block = scale.float() * scale_2
    n, k = vals.shape
    return (vals.reshape(n, k // 16, 16) * per_block.unsqueeze(-1)).reshape(n, k)


def modelopt_library():
    """ModelOpt's NVFP4QTensor, or None where nvidia-modelopt does not import."""
    try:
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    except ImportError:
        return None
    return NVFP4QTensor


def modelopt_tensors(
    w: torch.Tensor, use_library: bool, scale_2: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    if use_library:
        q, scale, scale_2 = modelopt_library().quantize(
            w.float(), 16, weights_scaling_factor_2=scale_2
        )
        packed = q._quantized_data
    else:
        packed, scale, scale_2 = modelopt_quantize(w, scale_2)
    return {
        "weight": packed.contiguous(),
        "weight_scale": scale.contiguous(),
        "weight_scale_2": scale_2.float().reshape(()).clone(),  # its own memory (shared s2)
    }


# ---- compressed-tensors ----------------------------------------------------------------


def ct_scheme():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", ["Linear"])


def ct_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own scales and compressor, as llm-compressor runs them."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = ct_scheme()
    wf = w.float()
    g = generate_gparam(wf.min(), wf.max()).reshape(1)
    blocks = wf.reshape(wf.shape[0], -1, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, g)
    out = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme
    )
    return {
        k: v
        for k, v in out.items()
        if k in ("weight_packed", "weight_scale", "weight_global_scale")
    }


def ct_decompress(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The library's own decompression (bfloat16, as it writes it)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return NVFP4PackedCompressor.decompress(dict(t), ct_scheme())["weight"]


def ct_quantization_config() -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(
        config_groups={"group_0": ct_scheme()},
        ignore=["lm_head"],
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
    )
    return {**qc.model_dump(mode="json"), "quant_method": "compressed-tensors"}


# ---- writing a checkpoint directory -----------------------------------------------------


def checkpoint_tensors(
    model: nn.Module, fmt: str, use_library: bool = True, input_scales: bool = True
) -> dict[str, torch.Tensor]:
    """The model's state dict with every linear but lm_head in `fmt`'s NVFP4 tensors."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        del sd["lm_head.weight"]  # as save_pretrained writes a tied model: one copy
    gen = torch.Generator().manual_seed(1)
    for name, lin in quantized_linears(model):
        del sd[f"{name}.weight"]
        if fmt == "modelopt":
            parts = modelopt_tensors(lin.weight.detach(), use_library)
            if input_scales:  # a calibrated activation amax / (6 * 448): a decode scale
                parts["input_scale"] = (
                    torch.tensor(1.0 + torch.rand((), generator=gen).item()) / 2688.0
                )
        else:
            parts = ct_tensors(lin.weight.detach())
            if input_scales:  # 448 * 6 / amax: an encode scale
                parts["input_global_scale"] = torch.tensor(
                    [2688.0 / (1.0 + torch.rand((), generator=gen).item())]
                )
        sd.update({f"{name}.{k}": v for k, v in parts.items()})
    return sd


def write_checkpoint(
    path: Path,
    model: nn.Module,
    fmt: str,
    shards: int = 2,
    use_library: bool = True,
    input_scales: bool = True,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """`tensors` (default `checkpoint_tensors`) written as the format's exporter does."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    sd = checkpoint_tensors(model, fmt, use_library, input_scales) if tensors is None else tensors
    config = model.config.to_dict()
    if fmt == "compressed-tensors":
        config["quantization_config"] = ct_quantization_config()
    else:
        (path / "hf_quant_config.json").write_text(
            json.dumps(
                {
                    "producer": {"name": "modelopt", "version": "0.47.0"},
                    "quantization": {
                        "quant_algo": "NVFP4",
                        "kv_cache_quant_algo": None,
                        "group_size": 16,
                        "exclude_modules": ["lm_head"],
                    },
                }
            )
        )
    (path / "config.json").write_text(json.dumps(config))
    names = list(sd)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


# ---- mixture-of-experts models ----------------------------------------------------------


def tiny_qwen3_moe(seed: int = 0, **kw):
    """A small Qwen3-MoE (transformers 5: fused experts, a router module), bf16."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    args = dict(vocab_size=256, hidden_size=128, intermediate_size=256,
                moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, max_position_embeddings=64, norm_topk_prob=True,
                tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    args.update(kw)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**args)).to(torch.bfloat16).eval()
    _randomize_router(model)
    return model


def tiny_mixtral(seed: int = 0, **kw):
    """A small Mixtral (transformers 5: fused experts, a router module), bf16."""
    from transformers import MixtralConfig, MixtralForCausalLM

    args = dict(vocab_size=256, hidden_size=128, intermediate_size=64, num_local_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    args.update(kw)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**args)).to(torch.bfloat16).eval()
    _randomize_router(model)
    return model


def _randomize_router(model: nn.Module) -> None:
    """Qwen3-MoE's router starts at zero (a tie between all experts): give it values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)


def moe_blocks(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(getattr(m, "experts", None),
                                                           "gate_up_proj")]  # fmt: skip


def moe_checkpoint_tensors(
    model: nn.Module,
    fmt: str,
    use_library: bool = True,
    input_scales: bool = True,
    hub_names: bool = False,
    shared_gate_up: bool | None = None,
) -> dict[str, torch.Tensor]:
    """`checkpoint_tensors`, with each MoE block's fused experts written one linear per
    expert projection as the exporters do: ``<block>.experts.<e>.gate_proj`` / ``up_proj``
    / ``down_proj`` (``hub_names``: Mixtral's ``block_sparse_moe`` and ``w1``/``w3``/``w2``).
    ``shared_gate_up`` (default: ModelOpt yes, compressed-tensors no): gate and up get
    one global scale, from the amax of both (ModelOpt's MoE export); else each its own."""
    sd = checkpoint_tensors(model, fmt, use_library, input_scales)
    shared = (fmt == "modelopt") if shared_gate_up is None else shared_gate_up
    names = ("w1", "w3", "w2") if hub_names else ("gate_proj", "up_proj", "down_proj")
    gen = torch.Generator().manual_seed(2)
    for block in moe_blocks(model):
        gu = sd.pop(f"{block}.experts.gate_up_proj")
        dn = sd.pop(f"{block}.experts.down_proj")
        out = block.replace(".mlp", ".block_sparse_moe") if hub_names else block
        sd[f"{out}.gate.weight"] = sd.pop(f"{block}.gate.weight")
        i = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            s2 = gu[e].float().abs().amax() / (6.0 * 448.0) if shared else None
            act = 1.0 + torch.rand((), generator=gen).item()
            for proj, w in zip(names, (gu[e, :i], gu[e, i:], dn[e]), strict=True):
                if fmt == "modelopt":
                    parts = modelopt_tensors(w, use_library, s2 if proj != names[2] else None)
                    if input_scales:
                        parts["input_scale"] = torch.tensor(act / 2688.0)
                else:
                    parts = ct_tensors(w) if not shared else ct_tensors_shared(w, gu[e])
                    if input_scales:
                        parts["input_global_scale"] = torch.tensor([2688.0 / act])
                sd.update({f"{out}.experts.{e}.{proj}.{k}": v for k, v in parts.items()})
    return sd


def ct_tensors_shared(w: torch.Tensor, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """`ct_tensors` of `w` with the global scale of `fused` (llm-compressor's fused
    gate/up global scale)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = ct_scheme()
    ff = fused.float()
    g = generate_gparam(ff.min(), ff.max()).reshape(1)
    wf = w.float()
    blocks = wf.reshape(wf.shape[0], -1, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, g)
    out = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme
    )
    return {k: v for k, v in out.items() if k in ("weight_packed", "weight_scale",
                                                  "weight_global_scale")}  # fmt: skip
