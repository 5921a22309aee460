"""load_checkpoint: both NVFP4 formats load exactly, and a bad checkpoint changes nothing.

What "exact" means here (docs/checkpoints.md, "Exactness"), checked layer by layer
against checkpoints written by each format's own library (tests/ckpt_makers.py):

- the e2m1 codes and the e4m3 block-scale bytes we hold are the checkpoint's, bit for
  bit (block scales read back through the swizzle);
- our float32 decode global scale is ModelOpt's ``weight_scale_2`` itself, and for
  compressed-tensors the correctly rounded float32 of ``1 / weight_global_scale``;
- so our float32 dequantization is the correctly rounded value of ``e2m1 * scale *
  decode`` (asserted bit for bit against float64), within 2**-23 relative of the
  library's exact rational value; against the libraries' own outputs: ModelOpt's
  float32 dequantize (``e2m1 * float32(scale * scale_2)``, which rounds twice) within one
  float32 ulp, compressed-tensors' bfloat16 decompression within one bfloat16 rounding.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

import ckpt_makers as mk

from fp4_dispatch import CheckpointError, load_checkpoint
from fp4_dispatch.format.nvfp4 import unpack_e2m1
from fp4_dispatch.integrations.nn import Nvfp4Linear

FORMATS = ["modelopt", "compressed-tensors"]


@pytest.fixture(scope="module")
def source_model():
    return mk.tiny_llama()


@pytest.fixture(scope="module")
def ckpt_dirs(source_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    use_lib = mk.modelopt_library() is not None
    return {f: mk.write_checkpoint(root / f, source_model, f, use_library=use_lib) for f in FORMATS}


def fresh_model():
    """Same architecture, different random weights: loading must overwrite them all."""
    return mk.tiny_llama(seed=123)


def snapshot(model: nn.Module) -> dict:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    return {"state": state, "types": types}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    assert {n: type(m) for n, m in model.named_modules()} == before["types"]
    after = model.state_dict()
    assert after.keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after[k], v), k


def exact_dequant(codes_packed, scale, decode) -> torch.Tensor:
    """float64 e2m1 * scale * decode (exact: at most 2 + 4 + 24 significant bits)."""
    codes = unpack_e2m1(codes_packed)
    vals = mk.E2M1[(codes & 7).long()].double() * torch.where(codes >= 8, -1.0, 1.0).double()
    n, k = vals.shape
    per = scale.double() * decode.double()
    return (vals.reshape(n, k // 16, 16) * per.unsqueeze(-1)).reshape(n, k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_scales_and_dequantization_are_exact(fmt, ckpt_dirs, source_model):
    model = fresh_model()
    report = load_checkpoint(model, ckpt_dirs[fmt])
    assert report.format == fmt
    names = [n for n, _ in mk.quantized_linears(source_model)]
    assert report.quantized == sorted(names) and len(names) == 14
    tensors = mk.checkpoint_tensors(source_model, fmt, mk.modelopt_library() is not None)
    mods = dict(model.named_modules())
    for name in names:
        layer = mods[name]
        assert isinstance(layer, Nvfp4Linear)
        q = layer.quantized_weight()
        if fmt == "modelopt":
            packed, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
            decode = tensors[f"{name}.weight_scale_2"].reshape(())
        else:
            packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
            enc = tensors[f"{name}.weight_global_scale"]
            decode = (1.0 / enc.double()).float().reshape(())
        assert torch.equal(q.data, packed)  # every e2m1 code
        assert torch.equal(q.linear_scale().view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(q.global_scale, decode)
        ours = layer.dequantized_weight()
        exact = exact_dequant(packed, scale, decode)
        assert torch.equal(ours, exact.float())  # correctly rounded, bit for bit
        if fmt == "modelopt":
            theirs = mk.modelopt_dequantize(packed, scale, decode)
            ulp = torch.finfo(torch.float32).eps * exact.abs()
            assert ((ours.double() - theirs.double()).abs() <= ulp).all()
        else:
            lib = mk.ct_decompress(
                {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
            )
            lib_exact = exact_dequant(packed, scale, 1.0 / enc.double())
            assert ((ours.double() - lib_exact).abs() <= 2.0**-23 * lib_exact.abs()).all()
            bf16_ulp = 2.0**-7 * lib_exact.abs()
            assert ((lib.double() - ours.double()).abs() <= bf16_ulp).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_static_input_scales_become_decode_scales(fmt, ckpt_dirs, source_model):
    model = fresh_model()
    load_checkpoint(model, ckpt_dirs[fmt])
    tensors = mk.checkpoint_tensors(source_model, fmt, mk.modelopt_library() is not None)
    name = "model.layers.1.mlp.down_proj"
    layer = dict(model.named_modules())[name]
    if fmt == "modelopt":
        expected = tensors[f"{name}.input_scale"].reshape(())
    else:
        expected = (1.0 / tensors[f"{name}.input_global_scale"].double()).float().reshape(())
    assert torch.equal(layer.input_global_scale, expected)
    assert "activation_scale=static" in repr(layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_model_matches_its_dequantized_twin(fmt, ckpt_dirs, source_model):
    """Every other tensor is loaded too (embeddings, norms, lm_head, biases): the loaded
    model's logits match a bf16 model holding the checkpoint's dequantized weights."""
    model = fresh_model()
    load_checkpoint(model, ckpt_dirs[fmt])
    twin = fresh_model()
    twin.load_state_dict(source_model.state_dict())
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, lin in mk.quantized_linears(twin):
            lin.weight.copy_(mods[name].dequantized_weight())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits.double(), twin(ids).logits.double()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos >= 0.999, float(cos)
    assert torch.equal(model.lm_head.weight, source_model.lm_head.weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_state_dict_loads_like_the_directory(fmt, ckpt_dirs, source_model):
    use_lib = mk.modelopt_library() is not None
    a, b = fresh_model(), fresh_model()
    load_checkpoint(a, ckpt_dirs[fmt])
    load_checkpoint(b, mk.checkpoint_tensors(source_model, fmt, use_lib))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(
            sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8)
        ), k


def test_a_meta_model_is_materialized_on_the_device(ckpt_dirs):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(mk.tiny_llama_config())
    load_checkpoint(model, ckpt_dirs["modelopt"], device="cpu")
    tensors = dict(model.named_parameters()) | {
        n: b for n, b in model.named_buffers() if "rotary" not in n
    }
    assert tensors and not any(t.is_meta for t in tensors.values())


def test_the_documented_modelopt_arithmetic_is_the_library_s():
    """tests/ckpt_makers.modelopt_quantize (the fallback where nvidia-modelopt does not
    import) gives ModelOpt's own bytes, and its dequantization ModelOpt's values."""
    lib = mk.modelopt_library()
    if lib is None:
        pytest.skip("nvidia-modelopt does not import here")
    w = torch.randn(96, 256, dtype=torch.bfloat16) * 0.05
    w[3, :16] = 0  # a zero block: ModelOpt sets its scale to 1.0
    q, scale, scale_2 = lib.quantize(w.float(), 16)
    packed, s2, g2 = mk.modelopt_quantize(w)
    assert torch.equal(q._quantized_data, packed)
    assert torch.equal(scale.view(torch.uint8), s2.view(torch.uint8))
    assert torch.equal(scale_2.reshape(()), g2.reshape(()))
    theirs = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2,
                          block_sizes={-1: 16})  # fmt: skip
    assert torch.equal(theirs, mk.modelopt_dequantize(packed, s2, g2))


# ---- bad input: one clear error naming tensor and file; the model unchanged -------------


def _edit_tensor(path, name, change):
    """Rewrite the shard holding `name` with change(sd) applied."""
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = index["weight_map"][name]
    sd = load_file(str(path / file))
    change(sd)
    save_file(sd, str(path / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
    index["weight_map"].update(dict.fromkeys(sd, file))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return file


L0 = "model.layers.0.self_attn.q_proj"


def _bad_scale_shape(p, fmt):
    n = f"{L0}.weight_scale"
    return n, _edit_tensor(p, n, lambda sd: sd.__setitem__(n, sd[n][:, :-1].contiguous()))


def _bad_data_dtype(p, fmt):
    n = f"{L0}.{'weight' if fmt == 'modelopt' else 'weight_packed'}"
    return n, _edit_tensor(p, n, lambda sd: sd.__setitem__(n, sd[n].to(torch.int16)))


def _missing_global_scale(p, fmt):
    n = f"{L0}.{'weight_scale_2' if fmt == 'modelopt' else 'weight_global_scale'}"
    return n, _edit_tensor(p, n, lambda sd: sd.pop(n))


def _zero_global_scale(p, fmt):
    n = f"{L0}.{'weight_scale_2' if fmt == 'modelopt' else 'weight_global_scale'}"
    return n, _edit_tensor(p, n, lambda sd: sd[n].zero_())


def _unknown_module(p, fmt):
    data = "weight" if fmt == "modelopt" else "weight_packed"
    old, new = f"{L0}.", "model.layers.0.self_attn.qq_proj."

    def rename(sd):
        for k in [k for k in sd if k.startswith(old)]:
            sd[k.replace(old, new)] = sd.pop(k)

    return new + data, _edit_tensor(p, f"{L0}.{data}", rename)


def _unknown_format(p, fmt):
    if fmt == "modelopt":
        qc = json.loads((p / "hf_quant_config.json").read_text())
        qc["quantization"]["quant_algo"] = "FP8"
        (p / "hf_quant_config.json").write_text(json.dumps(qc))
        return "quant_algo 'FP8'", "hf_quant_config.json"
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"]["format"] = "float-quantized"
    for g in cfg["quantization_config"]["config_groups"].values():
        g["format"] = "float-quantized"
    (p / "config.json").write_text(json.dumps(cfg))
    return "float-quantized", "config.json"


def _truncated_shard(p, fmt):
    f = sorted(p.glob("*.safetensors"))[-1]
    f.write_bytes(f.read_bytes()[:-100])
    return "not a readable safetensors file", f.name


def _wrong_plain_shape(p, fmt):
    n = "model.norm.weight"
    return n, _edit_tensor(p, n, lambda sd: sd.__setitem__(n, torch.ones(7)))


BAD = [
    _bad_scale_shape,
    _bad_data_dtype,
    _missing_global_scale,
    _zero_global_scale,
    _unknown_module,
    _unknown_format,
    _truncated_shard,
    _wrong_plain_shape,
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("corrupt", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_a_bad_checkpoint_raises_and_leaves_the_model_unchanged(fmt, corrupt, ckpt_dirs, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt_dirs[fmt], path)
    what, file = corrupt(path, fmt)
    model = fresh_model()
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, path)
    assert what in str(info.value) and file in str(info.value), str(info.value)
    assert_unchanged(model, before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_wants_every_tensor_placed_and_every_model_tensor_filled(
    fmt, ckpt_dirs, source_model
):
    sd = mk.checkpoint_tensors(source_model, fmt, mk.modelopt_library() is not None)
    extra = {**sd, "model.extra.weight": torch.ones(3)}
    model = fresh_model()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"model\.extra\.weight in <state dict>"):
        load_checkpoint(model, extra)
    assert_unchanged(model, before)
    report = load_checkpoint(model, extra, strict=False)
    assert report.unused == ["model.extra.weight"] and len(report.quantized) == 14
    short = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    model = fresh_model()
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .*missing"):
        load_checkpoint(model, short)
    norm = model.model.norm.weight.detach().clone()
    load_checkpoint(model, short, strict=False)  # a real model keeps what is not loaded
    assert torch.equal(model.model.norm.weight, norm)


def test_format_argument_must_match_the_checkpoint(ckpt_dirs):
    model = fresh_model()
    with pytest.raises(CheckpointError, match="format='compressed-tensors' was asked for"):
        load_checkpoint(model, ckpt_dirs["modelopt"], format="compressed-tensors")
    with pytest.raises(ValueError, match="format: expected one of"):
        load_checkpoint(model, ckpt_dirs["modelopt"], format="gguf")
    with pytest.raises(CheckpointError, match="no NVFP4 tensors"):
        load_checkpoint(model, model.state_dict())


def test_kv_cache_scales_are_reported_unused(source_model):
    sd = mk.checkpoint_tensors(source_model, "modelopt", mk.modelopt_library() is not None)
    sd["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    report = load_checkpoint(fresh_model(), sd)
    assert report.unused == ["model.layers.0.self_attn.k_proj.k_scale"]


# ---- save_checkpoint: ModelOpt layout, read back bit for bit ------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_a_converted_model_saves_and_loads_back_bit_for_bit(tied, tmp_path):
    from fp4_dispatch import quantize_model, save_checkpoint

    model = mk.tiny_llama(tie_word_embeddings=tied)
    quantize_model(model)
    layer = model.model.layers[0].mlp.down_proj
    layer.set_input_global_scale(0.01)
    path = save_checkpoint(model, tmp_path / "saved", max_shard_bytes=60_000)
    assert len(list(path.glob("*.safetensors"))) > 2
    hq = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["exclude_modules"] == ["lm_head"]
    again = mk.tiny_llama(seed=5, tie_word_embeddings=tied)
    report = load_checkpoint(again, path)
    assert report.format == "modelopt" and len(report.quantized) == 14
    sa, sb = model.state_dict(), again.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(
            sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8)
        ), k
    assert torch.equal(again.model.layers[0].mlp.down_proj.input_global_scale, torch.tensor(0.01))
    if tied:
        assert again.lm_head.weight is again.model.embed_tokens.weight
    # loaded on the CPU, nothing is left sharing the files' pages (safetensors maps them):
    # the files may be rewritten in place
    for f in path.glob("*.safetensors"):
        with open(f, "r+b") as fh:
            start = 8 + int.from_bytes(fh.read(8), "little")  # past the header: the data
            fh.seek(start)
            fh.write(bytes(f.stat().st_size - start))
    for k, v in again.state_dict().items():
        assert torch.equal(v.reshape(-1).view(torch.uint8), sa[k].reshape(-1).view(torch.uint8)), k


def test_an_unknown_tensor_of_a_quantized_layer_is_named(source_model):
    sd = mk.checkpoint_tensors(source_model, "compressed-tensors")
    sd[f"{L0}.weight_zero_point"] = torch.zeros(128, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"weight_zero_point in <state dict>: not a tensor"):
        load_checkpoint(fresh_model(), sd)
