"""quantize_model: what it converts, what it skips and why, and the accuracy a model keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4_dispatch import ConversionReport, Dispatcher, quantize_model, quantize_nvfp4
from fp4_dispatch.integrations.convert import MetaWeightsError, quantize_weight
from fp4_dispatch.integrations.nn import Nvfp4Linear


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(128, 48)  # K = 128: converts
        self.narrow = nn.Linear(48, 64, bias=False)  # K = 48: not a multiple of 32
        self.attn = nn.MultiheadAttention(64, 4)
        self.lm_head = nn.Linear(64, 32)


def test_report_names_what_converted_and_why_the_rest_did_not():
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16)
    report = quantize_model(model, filter=lambda name, m: name != "up")
    assert isinstance(report, ConversionReport)
    assert report.converted == ["odd"]
    assert report.skipped == {
        "up": "refused by filter",
        "narrow": "in_features=48 is not a multiple of 32 (the NVFP4 GEMM's K rule)",
        "attn.out_proj": "nn.MultiheadAttention reads its out_proj.weight directly",
        "lm_head": "in skip ('lm_head')",
    }
    assert isinstance(model.odd, Nvfp4Linear) and type(model.up) is nn.Linear
    assert "converted 1 linear layers" in str(report) and "skipped lm_head" in str(report)


def test_precision_reaches_every_layer_and_a_bad_policy_changes_nothing():
    model = Block().to(torch.bfloat16)
    with pytest.raises(ValueError, match="precision"):
        quantize_model(model, precision="fp4")
    assert type(model.up) is nn.Linear and type(model.odd) is nn.Linear
    with pytest.raises(ValueError, match="precision"):  # a policy against the dispatcher's
        quantize_model(model, precision="fp8", dispatcher=Dispatcher(device="cpu"))
    assert type(model.up) is nn.Linear
    quantize_model(model, precision="fp8")
    assert model.up.precision == "fp8" and model.odd.precision == "fp8"
    exact = Block().to(torch.bfloat16)
    quantize_model(exact)
    assert exact.up.precision == "exact"


def test_skip_matches_full_names_last_components_and_patterns():
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), nn.Linear(32, 32))
    report = quantize_model(model, skip=("0.1", "1*"))
    assert report.converted == ["0.0"]
    assert report.skipped == {"0.1": "in skip ('0.1')", "1": "in skip ('1*')"}
    with pytest.raises(TypeError, match="skip"):
        quantize_model(nn.Linear(32, 32), skip=(3,))
    with pytest.raises(ValueError, match="activations"):
        quantize_model(nn.Linear(32, 32), activations="fp8")


def test_layers_hold_exactly_what_from_linear_would():
    torch.manual_seed(1)
    lin = nn.Linear(256, 96).to(torch.bfloat16)
    expected = Nvfp4Linear.from_linear(lin)
    model = nn.Sequential(lin)
    quantize_model(model, activations="nvfp4")
    got = model[0]
    for name, buf in expected.state_dict().items():
        assert torch.equal(
            got.state_dict()[name].reshape(-1).view(torch.uint8), buf.reshape(-1).view(torch.uint8)
        ), name
    assert got.activations == "nvfp4" and got.bias.dtype == torch.bfloat16


def test_row_chunks_give_the_bytes_of_a_whole_tensor_quantization(monkeypatch):
    import fp4_dispatch.integrations.convert as convert

    w = torch.randn(300, 256) * 3
    w[7, 3] = float("nan")  # the global scale is over finite values, as quantize_nvfp4's
    whole = quantize_nvfp4(w)
    monkeypatch.setattr(convert, "_CHUNK_BYTES", 4 * 256 * 7)  # 7 rows a chunk
    chunked = quantize_weight(w)
    assert torch.equal(chunked.data, whole.data)
    assert torch.equal(chunked.scale.view(torch.uint8), whole.scale.view(torch.uint8))
    assert torch.equal(chunked.global_scale, whole.global_scale)


def test_meta_weights_raise_before_anything_changes():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, device="meta"))
    with pytest.raises(MetaWeightsError, match=r"1\.weight is on the meta device.*load_checkpoint"):
        quantize_model(model)
    assert type(model[0]) is nn.Linear  # nothing converted


def test_a_shared_layer_converts_once_and_stays_shared():
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    quantize_model(model, dispatcher=Dispatcher(device="cpu"))
    assert model["a"][0] is model["b"][0] and isinstance(model["a"][0], Nvfp4Linear)


def test_default_activations_keep_a_small_llama_within_the_target():
    """Issue 31's CPU target: logits cosine >= 0.999 against the bf16 twin holding the
    dequantized weights, under the default activations (W4A16 on the CPU)."""
    pytest.importorskip("transformers")
    import ckpt_makers as mk

    model = mk.tiny_llama(hidden_size=256, intermediate_size=512, vocab_size=512)
    twin = mk.tiny_llama(hidden_size=256, intermediate_size=512, vocab_size=512)
    twin.load_state_dict(model.state_dict())
    report = quantize_model(model)
    assert len(report.converted) == 14 and list(report.skipped) == ["lm_head"]
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name in report.converted:
            twin.get_submodule(name).weight.copy_(mods[name].dequantized_weight())
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits.double(), twin(ids).logits.double()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos >= 0.999, float(cos)
    assert mods[report.converted[0]].operation("cpu") == "w4a16"


@pytest.mark.gpu
def test_peak_gpu_memory_is_the_model_plus_one_layer():
    """On a GPU: converting never holds more than the model plus one layer's weight in
    its original dtype (layer by layer, dense weights freed as it goes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)])
    model = model.to(dev, torch.bfloat16)
    layer_bytes = 4096 * 4096 * 2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    quantize_model(model)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev)
    assert peak <= before + layer_bytes, (peak - before) / layer_bytes
    assert torch.cuda.memory_allocated(dev) < before / 3  # NVFP4: ~0.28x bf16
