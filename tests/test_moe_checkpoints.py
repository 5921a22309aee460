"""load_checkpoint / save_checkpoint with MoE experts: both formats load into Nvfp4MoE bit
for bit, a bad checkpoint changes nothing, and a saved model reads back exactly.

Checkpoints are written by each format's own library (tests/ckpt_makers.py), one linear
per expert projection as the exporters write them: ModelOpt sharing one global scale
between an expert's gate and up (its MoE export), compressed-tensors with a global scale
per projection (so the layer runs gate and up as two grouped GEMMs), and Mixtral's hub
names (``block_sparse_moe``, ``w1``/``w3``/``w2``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

import ckpt_makers as mk

from fp4_dispatch import CheckpointError, Nvfp4MoE, load_checkpoint, quantize_model

FORMATS = ["modelopt", "compressed-tensors"]
BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]
PROJ = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def use_lib() -> bool:
    return mk.modelopt_library() is not None


@pytest.fixture(scope="module")
def source():
    return mk.tiny_qwen3_moe()


@pytest.fixture(scope="module")
def ckpt_dirs(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-ckpts")
    out = {}
    for fmt in FORMATS:
        sd = mk.moe_checkpoint_tensors(source, fmt, use_lib())
        out[fmt] = mk.write_checkpoint(root / fmt, source, fmt, tensors=sd)
    return out


def decode(fmt: str, t: torch.Tensor) -> torch.Tensor:
    """A stored global or input scale as the float32 decode value."""
    t = t.reshape(())
    return t if fmt == "modelopt" else (1.0 / t.double()).float()


def check_experts(layer: Nvfp4MoE, tensors: dict, block: str, fmt: str, hub: bool) -> None:
    """Every code byte, block-scale byte and global scale is the checkpoint's."""
    data = "weight" if fmt == "modelopt" else "weight_packed"
    g_name = "weight_scale_2" if fmt == "modelopt" else "weight_global_scale"
    i_name = "input_scale" if fmt == "modelopt" else "input_global_scale"
    for e in range(layer.num_experts):
        for j, which in enumerate(("gate", "up", "down")):
            p = f"{block}.experts.{e}.{PROJ[which][hub]}"
            q = layer.expert_weight(which, e)
            assert torch.equal(q.natural_data(), tensors[f"{p}.{data}"]), p
            lin = q.linear_scale().view(torch.uint8)
            assert torch.equal(lin, tensors[f"{p}.weight_scale"].view(torch.uint8)), p
            assert torch.equal(q.global_scale, decode(fmt, tensors[f"{p}.{g_name}"])), p
            assert torch.equal(layer.input_scales[j, e], decode(fmt, tensors[f"{p}.{i_name}"]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_load_bit_for_bit(fmt, ckpt_dirs, source):
    model = mk.tiny_qwen3_moe(seed=7)
    report = load_checkpoint(model, ckpt_dirs[fmt])
    assert report.format == fmt and report.moe == BLOCKS
    assert "2 NVFP4 MoE blocks" in str(report)
    assert len(report.quantized) == 8  # the attention projections
    tensors = mk.moe_checkpoint_tensors(source, fmt, use_lib())
    for block in BLOCKS:
        layer = dict(model.named_modules())[block]
        assert isinstance(layer, Nvfp4MoE) and layer.norm_topk_prob is True
        assert torch.equal(layer.gate.weight, tensors[f"{block}.gate.weight"])
        check_experts(layer, tensors, block, fmt, hub=False)
        # ModelOpt shares gate/up global scales (one grouped GEMM), this
        # compressed-tensors checkpoint does not (two)
        assert layer._is_fused() == (fmt == "modelopt")


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_pretrained_builds_it_and_matches_its_dequantized_twin(fmt, ckpt_dirs):
    """The whole path a user takes (a meta-device model from config.json, then the
    loader): the logits match a bf16 model holding the loaded, dequantized weights."""
    from fp4_dispatch import from_pretrained

    model = from_pretrained(ckpt_dirs[fmt], device="cpu", activations="bf16")
    assert [n for n, m in model.named_modules() if isinstance(m, Nvfp4MoE)] == BLOCKS
    twin = mk.tiny_qwen3_moe()
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, mod in twin.named_modules():
            if name in BLOCKS:
                gu, dn = mods[name].dequantized_experts()
                mod.experts.gate_up_proj.copy_(gu)
                mod.experts.down_proj.copy_(dn)
            elif name in report_linears(model):
                mod.weight.copy_(mods[name].dequantized_weight())
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits.double().flatten(), twin(ids).logits.double().flatten()
    cos = float(a @ b / (a.norm() * b.norm()))
    assert cos >= 0.999, cos


def report_linears(model) -> set[str]:
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    return {n for n, m in model.named_modules() if isinstance(m, Nvfp4Linear)}


def test_mixtral_hub_names_load_into_the_transformers_block(source):
    model, src = mk.tiny_mixtral(seed=3), mk.tiny_mixtral()
    sd = mk.moe_checkpoint_tensors(src, "modelopt", use_lib(), hub_names=True)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in sd
    report = load_checkpoint(model, sd)
    assert report.moe == BLOCKS
    for block in BLOCKS:
        layer = dict(model.named_modules())[block]
        hub = block.replace(".mlp", ".block_sparse_moe")
        assert torch.equal(layer.gate.weight, sd[f"{hub}.gate.weight"])
        check_experts(layer, sd, hub, "modelopt", hub=True)


# ---- bad input: one clear error naming tensor and file; the model unchanged -------------

B0 = "model.layers.0.mlp"


def _missing_expert(sd):
    for k in [k for k in sd if k.startswith(f"{B0}.experts.5.up_proj.")]:
        del sd[k]
    return f"{B0}.experts.5.up_proj.weight in <state dict>: missing"


def _wrong_expert_shape(sd):
    n = f"{B0}.experts.2.down_proj.weight"
    sd[n] = sd[n][:64].contiguous()
    return n


def _expert_beyond_the_model(sd):
    for k in [k for k in sd if k.startswith(f"{B0}.experts.0.")]:
        sd[k.replace(".experts.0.", ".experts.8.")] = sd[k]
    return "expert 8, but model module 'model.layers.0.mlp' has 8 experts"


def _missing_router(sd):
    del sd[f"{B0}.gate.weight"]
    return f"{B0}.gate.weight in <state dict>: missing"


def _zero_expert_global_scale(sd):
    n = next(k for k in sd if k.startswith(f"{B0}.experts.1.gate_proj.weight_scale_2"))
    sd[n] = torch.zeros_like(sd[n])
    return n


BAD = [_missing_expert, _wrong_expert_shape, _expert_beyond_the_model, _missing_router,
       _zero_expert_global_scale]  # fmt: skip


@pytest.mark.parametrize("corrupt", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_a_bad_moe_checkpoint_raises_and_leaves_the_model_unchanged(corrupt, source):
    sd = mk.moe_checkpoint_tensors(source, "modelopt", use_lib())
    what = corrupt(sd)
    model = mk.tiny_qwen3_moe(seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, sd)
    assert what in str(info.value), str(info.value)
    assert not any(isinstance(m, Nvfp4MoE) for m in model.modules())
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_bad_shard_file_names_the_file(ckpt_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(ckpt_dirs["compressed-tensors"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = f"{B0}.experts.4.gate_proj.weight_scale"
    file = index["weight_map"][name]
    sd = load_file(str(path / file))
    sd[name] = sd[name].float()
    save_file(sd, str(path / file), metadata={"format": "pt"})
    model = mk.tiny_qwen3_moe(seed=9)
    with pytest.raises(CheckpointError, match=rf"{name} in {file}: expected float8_e4m3fn"):
        load_checkpoint(model, path)
    assert not any(isinstance(m, Nvfp4MoE) for m in model.modules())


# ---- save_checkpoint: per-expert ModelOpt layout, read back bit for bit ------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_loaded_moe_model_saves_and_loads_back_bit_for_bit(fmt, ckpt_dirs, tmp_path):
    from fp4_dispatch import save_checkpoint

    model = mk.tiny_qwen3_moe(seed=4)
    load_checkpoint(model, ckpt_dirs[fmt])
    path = save_checkpoint(model, tmp_path / "saved", max_shard_bytes=200_000)
    hq = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert f"{B0}.gate" in hq["exclude_modules"]
    again = mk.tiny_qwen3_moe(seed=5)
    report = load_checkpoint(again, path)
    assert report.format == "modelopt" and report.moe == BLOCKS
    sa, sb = model.state_dict(), again.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(
            sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8)
        ), k


def test_a_converted_moe_model_saves_and_loads_back(tmp_path):
    from fp4_dispatch import save_checkpoint

    model = mk.tiny_mixtral()
    quantize_model(model)
    path = save_checkpoint(model, tmp_path / "saved")
    again = mk.tiny_mixtral(seed=2)
    assert load_checkpoint(again, path).moe == BLOCKS
    for k, v in model.state_dict().items():
        assert torch.equal(v.reshape(-1).view(torch.uint8),
                           again.state_dict()[k].reshape(-1).view(torch.uint8)), k  # fmt: skip
