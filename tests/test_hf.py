"""from_pretrained: a transformers model from an NVFP4 checkpoint directory, generate() works."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

import ckpt_makers as mk

from fp4_dispatch import CheckpointError, from_pretrained
from fp4_dispatch.integrations.nn import Nvfp4Linear


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("tied", [False, True])
def test_generate_works_on_a_loaded_checkpoint(fmt, tied, tmp_path):
    source = mk.tiny_llama(tie_word_embeddings=tied)
    path = mk.write_checkpoint(
        tmp_path / fmt, source, fmt, use_library=mk.modelopt_library() is not None
    )
    model = from_pretrained(path, device="cpu")
    assert not model.training
    assert sum(isinstance(m, Nvfp4Linear) for m in model.modules()) == 14
    assert (
        model.lm_head.weight.device.type == "cpu" and model.lm_head.weight.dtype == torch.bfloat16
    )
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    ids = torch.tensor([[1, 5, 9, 3]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10) and torch.equal(out[:, :4], ids)
    # greedy decoding continues with the argmax of the model's own logits
    with torch.no_grad():
        first = model(ids).logits[0, -1].argmax()
    assert out[0, 4] == first


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        from_pretrained(tmp_path)
