"""The mixture-of-experts configs and variants of `bench_model.py` (issue 35, item 4).

Models are transformers Qwen3-MoE decoders (attention, RMSNorm, a sparse MoE block in
every layer: router, top-k, fused SiLU-gated experts) built from a config with random
weights, nothing downloaded:

- ``qwen3-moe``: Qwen3-30B-A3B's published shapes (hidden 2048, 128 experts, top-8,
  expert intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151936,
  ``norm_topk_prob``), 8 of its 48 layers by default;
- ``deepseek-like``: DeepSeek-V3's MoE shapes (hidden 7168, 256 routed experts, top-8,
  expert intermediate 2048, vocabulary 129280) on Qwen3-MoE's block and attention (56
  heads of 128, 8 KV heads), so without DeepSeek's MLA, shared expert and grouped
  sigmoid routing: the expert GEMMs are DeepSeek's, the rest is a stand-in. 2 layers by
  default (one layer's bf16 experts are 22.5 GB);
- ``tiny-moe``: the CPU smoke.

Variants (`MOE_VARIANTS`), all in one process on the same weights:

- ``bf16``: the model itself with transformers' ``grouped_mm`` experts implementation
  (``torch._grouped_mm`` / ``torch.nn.functional.grouped_mm``, bf16), holding the
  dequantized NVFP4 weights (the twin: every cosine is against it);
- ``bf16-loop``: the same weights with transformers' ``eager`` experts implementation,
  a Python loop over the experts hit (one pair of dense GEMMs each; it reads which
  experts were hit on the host, so it does not capture in a CUDA graph: its graph rows
  say so instead of a time);
- ``w4a16``: `fp4_dispatch.quantize_model` (``activations="bf16"``): every MoE block an
  `Nvfp4MoE` (two grouped W4A16 GEMMs a layer), the attention projections `Nvfp4Linear`;
- ``nvfp4-loop``: the same NVFP4 weights, the experts run as a loop of dense W4A16
  ``gemm`` calls, one pair per expert hit (`ExpertLoop`, the issue's "loop of dense gemm
  calls" baseline; host-synchronising, eager only like ``bf16-loop``).

The loop variants share every tensor with their model (`shared_copy`): no extra memory;
so does the copy that `quantize_model` converts, until its blocks are replaced.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from fp4_dispatch.engine import torch_ops
from fp4_dispatch.integrations.moe import Nvfp4MoE, combine, route, sort_by_expert

log = logging.getLogger("bench_model.moe")

#: Qwen3MoeConfig arguments per config (``num_hidden_layers``: the default layer count)
MOE_CONFIGS: dict[str, dict] = {
    "qwen3-moe": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                  "num_experts_per_tok": 8, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                  "intermediate_size": 6144, "num_hidden_layers": 8},
    "deepseek-like": {"hidden_size": 7168, "moe_intermediate_size": 2048, "num_experts": 256,
                      "num_experts_per_tok": 8, "num_attention_heads": 56,
                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 129280,
                      "intermediate_size": 18432, "num_hidden_layers": 2},
    "tiny-moe": {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
                 "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 64, "vocab_size": 512, "intermediate_size": 512,
                 "num_hidden_layers": 2},
}  # fmt: skip
MOE_VARIANTS = ("bf16", "bf16-loop", "w4a16", "nvfp4-loop")
#: why the loop variants have no graph rows (`bench_model` reads a model's ``no_graph``)
NO_GRAPH = "per-expert loop: reads which experts were hit on the host (no CUDA graph)"


def moe_config(name: str, layers: int | None):
    """A transformers `Qwen3MoeConfig` of `MOE_CONFIGS`[name] (``layers`` overrides)."""
    from transformers import Qwen3MoeConfig

    shape = dict(MOE_CONFIGS[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return Qwen3MoeConfig(**shape, norm_topk_prob=True, max_position_embeddings=8192,
                          tie_word_embeddings=False)  # fmt: skip


def build_bf16(config, device: torch.device) -> nn.Module:
    """A random-weight Qwen3-MoE in bf16 on `device` (transformers' init, seeded; made
    in bf16 directly: deepseek-like's experts would need 90 GB in float32). The router
    gets random values too: a zero router ties every expert, which sends every token to
    the same top-k and is nothing like a real model's routing."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, config.initializer_range)
    return model.to(torch.bfloat16).eval()


def set_experts_implementation(model: nn.Module, implementation: str) -> None:
    """transformers' experts implementation of `model` (``"grouped_mm"`` or ``"eager"``)."""
    model.config._experts_implementation = implementation


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules and config that shares every parameter and buffer
    (a deep copy whose memo maps each tensor to itself): a second view of one model."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def build_moe_variants(config, device: torch.device, variants) -> dict[str, nn.Module]:
    """{variant: model} of `MOE_VARIANTS` asked for, bf16 always (the twin)."""
    from fp4_dispatch import quantize_model

    base = build_bf16(config, device)
    q = shared_copy(base)  # conversion replaces modules, never writes the dense tensors
    report = quantize_model(q, activations="bf16")
    log.info("w4a16: %d MoE blocks and %d linears converted", len(report.moe),
             len(report.converted))  # fmt: skip
    load_dequantized(base, q)
    set_experts_implementation(base, "grouped_mm")
    models: dict[str, nn.Module] = {"bf16": base}
    if "bf16-loop" in variants:
        models["bf16-loop"] = shared_copy(base)
        set_experts_implementation(models["bf16-loop"], "eager")
        models["bf16-loop"].no_graph = NO_GRAPH
    if "w4a16" in variants:
        models["w4a16"] = q
    if "nvfp4-loop" in variants:
        models["nvfp4-loop"] = to_expert_loops(shared_copy(q))
        models["nvfp4-loop"].no_graph = NO_GRAPH
    return {v: models[v] for v in ("bf16", *variants) if v in models}


def load_dequantized(twin: nn.Module, quantized: nn.Module) -> None:
    """Copy each `Nvfp4Linear`'s dequantized weight and each `Nvfp4MoE`'s dequantized
    experts into `twin`'s module of that name (bf16)."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    mods = dict(twin.named_modules())
    with torch.no_grad():
        for name, mod in quantized.named_modules():
            if isinstance(mod, Nvfp4Linear):
                mods[name].weight.copy_(mod.dequantized_weight().to(torch.bfloat16))
            elif isinstance(mod, Nvfp4MoE):
                for x in range(mod.num_experts):  # one expert at a time: bounded scratch
                    experts = mods[name].experts
                    gate, up = mod.expert_weight("gate", x), mod.expert_weight("up", x)
                    experts.gate_up_proj[x].copy_(torch.cat([gate.dequantize(), up.dequantize()]))
                    experts.down_proj[x].copy_(mod.expert_weight("down", x).dequantize())


class ExpertLoop(nn.Module):
    """An `Nvfp4MoE`'s computation with the experts as a loop of dense W4A16 GEMMs, one
    gate/up and one down call per expert hit (`fp4_dispatch.engine.torch_ops.run_w4a16` on
    the expert's slab of the stacked buffers): routing, sort and weighted sum as the
    layer's own. Reads the per-expert row counts on the host, as any such loop must."""

    def __init__(self, moe: Nvfp4MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.moe
        x2 = x.reshape(-1, m.hidden_size)
        weights, ids = route(m.gate(x2), m.top_k, m.norm_topk_prob)
        order, token, offsets = sort_by_expert(ids, m.num_experts)
        a = x2.index_select(0, token)
        y = torch.empty_like(a)
        ends = offsets.tolist()  # the host sync every per-expert loop has
        i, start = m.intermediate_size, 0
        for e, end in enumerate(ends):
            if end > start:
                h = self._gemm(a[start:end], m.gate_up_data, m.gate_up_scale,
                               m.gate_global_scale, e)  # fmt: skip
                act = F.silu(h[:, :i]) * h[:, i:]
                y[start:end] = self._gemm(act, m.down_data, m.down_scale, m.down_global_scale, e)
            start = end
        return combine(y, order, weights).to(x.dtype).reshape(x.shape)

    @staticmethod
    def _gemm(a, data, scale, g, e) -> torch.Tensor:
        return torch_ops.run_w4a16(None, a.contiguous(), data[e], scale[e], g[e : e + 1], a.dtype)


def to_expert_loops(model: nn.Module) -> nn.Module:
    """`model` with every `Nvfp4MoE` (gate and up sharing global scales, as converted)
    run as an `ExpertLoop`."""
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, Nvfp4MoE):
                setattr(mod, name, ExpertLoop(child))
    return model


def grouped_plans(models: dict[str, nn.Module], ms: list[int], device: torch.device) -> list:
    """(backend, tactic, problem) of each grouped GEMM the models' `Nvfp4MoE` layers run
    for steps of `ms` tokens (``m * top_k`` rows; gate/up ``[E, 2I, H]`` and down ``[E, H,
    I]``): what `bench_model.precompile` compiles ahead, beside the dense ones."""
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.engine.torch_ops import default_dispatcher

    shapes = {(m.num_experts, m.intermediate_size, m.hidden_size, m.top_k, m.operation(device))
              for model in models.values() for m in model.modules()
              if isinstance(m, Nvfp4MoE)}  # fmt: skip
    planned = []
    d = default_dispatcher(device)
    for e, i, h, k, op in sorted(shapes):
        operation = f"grouped_{op}"
        for rows in sorted({m * k for m in ms}):
            for n, kk in ((2 * i, h), (h, i)):
                c = d.select(rows, n, kk, "bfloat16", operation, e)
                problem = Problem(m=rows, n=n, k=kk, out_dtype="bfloat16",
                                  operation=c.operation, groups=e)  # fmt: skip
                planned.append((d.registry.backends[c.backend], c.tactic, problem))
    return planned
