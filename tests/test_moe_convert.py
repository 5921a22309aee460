"""quantize_model on transformers MoE models: every sparse block becomes one Nvfp4MoE and
the model keeps its outputs (logits against the twin holding the dequantized experts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import ckpt_makers as mk

from fp4_dispatch import Nvfp4MoE, quantize_model
from fp4_dispatch.integrations.moe_convert import inspect_block
from fp4_dispatch.integrations.nn import Nvfp4Linear

MODELS = {"qwen3-moe": mk.tiny_qwen3_moe, "mixtral": mk.tiny_mixtral}


def load_dequantized(twin, converted) -> None:
    """Put each converted block's dequantized experts into the twin's fused tensors, and
    each converted linear's dequantized weight into the twin's linear."""
    mods = dict(twin.named_modules())
    with torch.no_grad():
        for name, mod in converted.named_modules():
            if isinstance(mod, Nvfp4Linear):
                mods[name].weight.copy_(mod.dequantized_weight())
            if isinstance(mod, Nvfp4MoE):
                gu, dn = mod.dequantized_experts()
                mods[name].experts.gate_up_proj.copy_(gu)
                mods[name].experts.down_proj.copy_(dn)


def logits_cosine(a, b, ids) -> float:
    with torch.no_grad():
        x, y = a(ids).logits.double().flatten(), b(ids).logits.double().flatten()
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_moe_block_converts_and_the_model_keeps_its_logits(kind):
    model = MODELS[kind]()
    twin = MODELS[kind]()
    blocks = mk.moe_blocks(model)
    report = quantize_model(model, activations="bf16")
    assert report.moe == blocks == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "converted 2 MoE blocks to Nvfp4MoE" in str(report)
    for name in blocks:
        mod = dict(model.named_modules())[name]
        assert isinstance(mod, Nvfp4MoE) and mod.num_experts == 8 and mod.top_k == 2
        assert mod.gate.weight.dtype == torch.bfloat16  # the router stays dense
        assert mod.norm_topk_prob is True
    assert report.converted and all(".mlp." not in n for n in report.converted)
    load_dequantized(twin, model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cos = logits_cosine(model, twin, ids)
    assert cos >= 0.999, cos


def test_qwen3_norm_topk_prob_false_is_carried_and_changes_the_output():
    model = mk.tiny_qwen3_moe(norm_topk_prob=False)
    quantize_model(model, activations="bf16")
    block = model.model.layers[0].mlp
    assert block.norm_topk_prob is False
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        y = block(x)
        block.norm_topk_prob = True
        assert not torch.allclose(y, block(x))


def test_the_converted_block_matches_transformers_block_on_the_same_experts():
    """Block level, both routers' rules: transformers' own forward (its grouped_mm or
    loop implementation) on the dequantized experts gives the same output."""
    for kind, make in MODELS.items():
        model, twin = make(), make()
        quantize_model(model, activations="bf16")
        load_dequantized(twin, model)
        ours, theirs = model.model.layers[1].mlp, twin.model.layers[1].mlp
        x = torch.randn(1, 7, 128, dtype=torch.bfloat16)
        with torch.no_grad():
            a, b = ours(x).double(), theirs(x).double()
        rel = float((a - b).norm() / b.norm())
        assert rel < 2.0**-6, (kind, rel)


def test_skip_filter_and_unsupported_blocks_are_reported():
    model = mk.tiny_qwen3_moe()
    report = quantize_model(model, skip=("lm_head", "model.layers.0.mlp"))
    assert report.moe == ["model.layers.1.mlp"]
    assert report.skipped["model.layers.0.mlp"] == "in skip ('model.layers.0.mlp')"
    assert not isinstance(model.model.layers[0].mlp, Nvfp4MoE)
    model = mk.tiny_mixtral()
    report = quantize_model(model, filter=lambda name, m: name != "model.layers.1.mlp")
    assert report.moe == ["model.layers.0.mlp"]
    assert report.skipped["model.layers.1.mlp"] == "refused by filter"
    block = mk.tiny_mixtral().model.layers[0].mlp
    block.shared = torch.nn.Linear(4, 4)  # a block with more than router and experts
    assert "more than a router and experts (shared)" in inspect_block(block)


def test_meta_experts_raise_before_anything_changes():
    from transformers import Qwen3MoeForCausalLM

    from fp4_dispatch.integrations.convert import MetaWeightsError

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(mk.tiny_qwen3_moe().config)
    with pytest.raises(MetaWeightsError, match=r"model\.layers\.0\.mlp\.experts"):
        quantize_model(model)
    assert not any(isinstance(m, Nvfp4MoE) for m in model.modules())
