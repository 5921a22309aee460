"""Nvfp4MoE: routing, the device-side sort, and exactness against a float64 reference.

Error model (as tests/test_nn.py for the dense layer). Under W4A16 the layer computes,
per (token, expert) pair, ``h = bf16(x @ dq(W_gu).T)``, ``a = bf16(bf16(silu(h_g)) *
h_u)``, ``y = bf16(a @ dq(W_d).T)`` and sums ``weight * y`` in float32, rounded once to
bf16. The reference below computes the same chain in float64 from the same
dequantized experts and the same routing, rounding to bf16 at the same points, so the
only differences are fp32 versus float64 accumulation and the rounding flips they cause:
elementwise within a few bf16 roundings of the output's scale, and far below the
quantization error (which a wrong scale, layout or expert order would show).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp4_dispatch import Dispatcher, Nvfp4MoE, quantize_nvfp4
from fp4_dispatch.integrations.moe import combine, route, sort_by_expert

E, H, I, TOP_K = 8, 128, 64, 2  # noqa: E741 - the issue's names
ROUND16 = 2.0**-7  # two bf16 roundings


def make(seed: int = 0, **kw) -> tuple[Nvfp4MoE, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    router = (torch.randn(E, H, generator=gen) * 0.1).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) * 0.05).bfloat16()
    kw.setdefault("activations", "bf16")
    return Nvfp4MoE.from_experts(router, gate_up, down, TOP_K, **kw), router, gate_up, down


def reference(moe: Nvfp4MoE, x: torch.Tensor) -> torch.Tensor:
    """float64 of the layer's chain (module docstring), from its dequantized experts."""
    gu, dn = (t.double() for t in moe.dequantized_experts())
    x2 = x.reshape(-1, moe.hidden_size)
    weights, ids = route(F.linear(x2, moe.gate.weight), moe.top_k, moe.norm_topk_prob)
    out = torch.zeros(x2.shape, dtype=torch.float64)
    i = moe.intermediate_size
    for t in range(x2.shape[0]):
        for s in range(moe.top_k):
            e = int(ids[t, s])
            h = (x2[t].double() @ gu[e].T).bfloat16()
            a = (F.silu(h[:i]) * h[i:]).double()
            y = (a @ dn[e].T).bfloat16().double()
            out[t] += float(weights[t, s]) * y
    return out.reshape(x.shape)


def tie_free_input(moe: Nvfp4MoE, tokens: int, seed: int) -> torch.Tensor:
    """bf16 ``[tokens, H]`` on the layer's device whose router logits have no two equal
    values in a row: where bf16 logits tie, which expert a path picks is its own rule
    (``torch.topk`` documents none; the fused CUDA routing takes the lowest index,
    docs/moe.md), so a GPU forward and a CPU reference could route a tied token apart."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(50):
        x = torch.randn(tokens, H, generator=gen).bfloat16().to(moe.gate.weight.device)
        s = moe.gate(x).float().sort(dim=-1).values
        if bool((s[:, 1:] != s[:, :-1]).all()):
            return x
    raise AssertionError("no tie-free input in 50 draws")


def test_routing_follows_transformers_conventions():
    logits = torch.randn(6, E)
    w, ids = route(logits, 3, norm_topk_prob=True)
    top = logits.topk(3).indices
    assert torch.equal(ids, top)
    # renormalised softmax over all == softmax over the chosen logits (Mixtral's rule)
    assert torch.allclose(w, torch.softmax(logits.gather(1, top), -1), atol=1e-6)
    w2, _ = route(logits, 3, norm_topk_prob=False)  # Qwen3-MoE without norm_topk_prob
    assert torch.allclose(w2, torch.softmax(logits, -1).gather(1, top), atol=1e-7)
    assert (w2.sum(-1) < 1).all()


def test_sort_by_expert_offsets_with_empty_experts():
    ids = torch.tensor([[3, 1], [1, 6], [3, 0], [6, 1]])
    order, token, offsets = sort_by_expert(ids, E)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [1, 4, 4, 6, 6, 6, 8, 8]
    flat = ids.reshape(-1)
    assert flat[order].tolist() == [0, 1, 1, 1, 3, 3, 6, 6]
    assert token.tolist() == (order // 2).tolist()
    assert token[1:4].tolist() == [0, 1, 3]  # stable: an expert's rows in token order


def test_combine_puts_rows_back_and_sums_each_tokens_weighted_terms():
    ids = torch.tensor([[3, 1], [1, 6], [3, 0]])
    order, _, _ = sort_by_expert(ids, E)
    per_pair = torch.randn(6, 5)  # the output of pair (token t, slot s) in row 2t + s
    weights = torch.rand(3, 2)
    got = combine(per_pair[order], order, weights)  # rows as the grouped GEMM has them
    want = (per_pair.view(3, 2, 5) * weights.unsqueeze(-1)).sum(1)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_w4a16_is_exact_against_the_float64_reference():
    moe, *_ = make()
    x = torch.randn(3, 5, H, dtype=torch.bfloat16)
    with torch.no_grad():
        y = moe(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    ref = reference(moe, x)
    scale = ref.abs().amax(-1, keepdim=True)
    assert ((y.double() - ref).abs() <= 4 * ROUND16 * scale).all()
    rel = float((y.double() - ref).norm() / ref.norm())
    assert rel < ROUND16, rel


def test_the_experts_are_the_quantized_dense_ones_in_order():
    """A wrong expert order or gate/up swap would show far above the rounding."""
    moe, router, gate_up, down = make()
    gu, dn = moe.dequantized_experts()
    for e in (0, 5):
        ref_gu = quantize_nvfp4(gate_up[e]).dequantize()
        assert torch.equal(gu[e], ref_gu)
        assert torch.equal(dn[e], quantize_nvfp4(down[e]).dequantize())
    assert torch.equal(moe.gate.weight, router)


def test_w4a4_rounds_the_activations_too():
    exact, *_ = make()
    w4a4, *_ = make(activations="nvfp4")
    assert exact.operation() == "w4a16" and w4a4.operation() == "w4a4"
    x = torch.randn(16, H, dtype=torch.bfloat16)
    ref = reference(exact, x)
    with torch.no_grad():
        e1 = float((exact(x).double() - ref).norm() / ref.norm())
        e2 = float((w4a4(x).double() - ref).norm() / ref.norm())
    assert e2 > 5 * e1 and e2 < 0.25, (e1, e2)


def test_gate_and_up_with_their_own_global_scales_run_split_and_exact():
    """A checkpoint whose gate and up rows have different global scales: two grouped
    GEMMs, same result as the reference of those weights."""
    moe, _, gate_up, down = make()
    for e in range(E):
        up = quantize_nvfp4(gate_up[e, I:] * 3)  # another global scale than gate's
        moe.load_expert(e, gate=quantize_nvfp4(gate_up[e, :I]), up=up, down=quantize_nvfp4(down[e]))
    assert not torch.equal(moe.gate_global_scale, moe.up_global_scale)
    x = torch.randn(9, H, dtype=torch.bfloat16)
    with torch.no_grad():
        y = moe(x)
    assert not moe._is_fused()
    ref = reference(moe, x)
    assert float((y.double() - ref).norm() / ref.norm()) < ROUND16


def test_state_dict_round_trip_and_dtype_casts_keep_the_format():
    moe, *_ = make()
    moe.set_input_scales(torch.full((3, E), 0.01))
    sd = moe.state_dict()
    assert {"gate.weight", "gate_up_data", "gate_up_scale", "gate_global_scale",
            "up_global_scale", "down_data", "down_scale", "down_global_scale",
            "input_scales"} == set(sd)  # fmt: skip
    other, *_ = make(seed=1)
    other.load_state_dict(sd)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(other(x), moe(x))
    moe.half()
    assert moe.gate_up_data.dtype == torch.uint8 and moe.down_scale.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.float16
    assert "activation_scale=static" in repr(moe)


def test_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match="hidden_size: expected a positive multiple of 32"):
        Nvfp4MoE(100, 64, 8, 2)
    with pytest.raises(ValueError, match="top_k: expected at most num_experts=8"):
        Nvfp4MoE(128, 64, 8, 9)
    with pytest.raises(ValueError, match="activations"):
        Nvfp4MoE(128, 64, 8, 2, activations="fp8")
    with pytest.raises(ValueError, match="precision"):
        Nvfp4MoE(128, 64, 8, 2, precision="fp8", dispatcher=Dispatcher(device="cpu"))
    moe, *_ = make()
    with pytest.raises(ValueError, match=r"x: expected last dimension 128"):
        moe(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"down: expected shape \(128, 64\)"):
        moe.load_expert(0, gate=quantize_nvfp4(torch.randn(128, 128)),
                        down=quantize_nvfp4(torch.randn(64, 128)))  # fmt: skip


def test_inference_only():
    moe, *_ = make()
    x = torch.randn(2, H, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        moe(x)


@pytest.mark.gpu
def test_a_warm_forward_captures_in_a_cuda_graph_and_replays_new_routing():
    """No host sync anywhere in the forward: it captures, and a replay with new inputs
    (new routing, so new offsets on the device) gives the eager result."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    moe, *_ = make()
    moe = moe.cuda()
    x = tie_free_input(moe, 16, seed=0)
    with torch.inference_mode():
        moe(x)  # plans, compiles, decides the fused flag
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe(x)
        x.copy_(tie_free_input(moe, 16, seed=1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, moe(x))
        ref = reference(moe.cpu(), x.cpu())
    assert float((y.cpu().double() - ref).norm() / ref.norm()) < ROUND16


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_torch_compile_traces_the_whole_forward_without_a_graph_break(activations):
    """fullgraph=True: routing, the device-side sort and both grouped GEMMs (the
    ``fp4_dispatch::grouped_gemm`` op) trace as one graph, and compute the eager bits."""
    moe, *_ = make(activations=activations)
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = moe(x)
        compiled = torch.compile(moe, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), eager)


def test_a_given_dispatcher_runs_the_grouped_gemms():
    d = Dispatcher(device="cpu")
    moe, *_ = make(dispatcher=d)
    other, *_ = make()
    x = torch.randn(5, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(moe(x), other(x))
    assert any(len(key) == 6 and key[-1] == E for key in d._plans), list(d._plans)
