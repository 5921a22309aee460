"""The fused MoE routing and combine kernels (`fp4_dispatch.backends.moe_route`) against
the torch path of `fp4_dispatch.integrations.moe` (``route`` + ``sort_by_expert``,
``combine``), which tests/test_moe.py checks against transformers' conventions.

The kernels run under TRITON_INTERPRET=1 in subprocesses (`run_interpreted_split`).
Every routing case runs twice: with the default tile budget and a tiny one
(``_TILE_ELEMS = 8``, ``_COMBINE_BLOCK = 16``) so that small inputs still walk several
token blocks, pair blocks and column blocks. Logits are tie-free (distinct multiples of
1/16 per row, exact in bf16/fp16; or float32 normals): ``torch.topk`` documents no tie
rule, so ties are checked against the kernel's own rule (lowest expert index first),
separately. Ids, order, token and offsets compare bit for bit; weights to float32
rounding (rtol 1e-6: torch's exp and summation order are its own). The combined output
compares bit for bit with float32 products added in slot order (the kernel's
documented order), and to float32 rounding with torch's ``combine``, whose order of the
k additions is its own (on the CPU it changes with H).
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_interpreted_split

from fp4_dispatch import Nvfp4MoE
from fp4_dispatch.integrations.moe import route, sort_by_expert

SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.backends import moe_route as mr
from fp4_dispatch.integrations.moe import combine, route, sort_by_expert

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def logits_of(c, gen):
    t, e = c["t"], c["e"]
    if c["kind"] in ("normal", "wide"):  # wide: exp's arguments down to about -100
        scale = 2 if c["kind"] == "normal" else 25
        return (torch.randn(t, e, generator=gen) * scale).to(DT[c["dtype"]])
    if c["kind"] == "ties":  # few distinct values: many equal logits in every row
        return torch.randint(0, 3, (t, e), generator=gen).to(DT[c["dtype"]])
    if c["kind"] == "nan":  # a NaN in row 1, a row of NaN last
        x = torch.randn(t, e, generator=gen)
        x[1, 2], x[-1] = float("nan"), float("nan")
        return x.to(DT[c["dtype"]])
    perm = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
    return ((perm - e / 2) / 16).to(DT[c["dtype"]])  # distinct, exact in 16 bits


def tie_rule(logits, k, norm):
    # the kernel's documented rule: largest logit first, lowest index among equals,
    # NaN as -inf
    x = logits.float()
    _, ids = torch.sort(x.nan_to_num(nan=-float("inf")), dim=-1, descending=True, stable=True)
    ids = ids[:, :k]
    w = torch.softmax(x, -1).gather(1, ids)
    return (w / w.sum(-1, keepdim=True) if norm else w), ids


def in_slot_order(y, order, w):
    # the kernel's documented sum: float32 products added from slot 0, one at a time
    t, k = w.shape
    pairs = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1).float()
    acc = torch.zeros(t, y.shape[1])
    for j in range(k):
        acc = acc + pairs[:, j] * w[:, j : j + 1]
    return acc, (pairs.abs() * w.unsqueeze(-1)).sum(1)


def bits(t):
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def same(a, b):
    # bit for bit, except that any NaN equals any NaN (payloads and signs are free)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def run(c):
    mr._TILE_ELEMS, mr._COMBINE_BLOCK = (8, 16) if c["tiny"] else (8192, 1024)
    gen = torch.Generator().manual_seed(c["seed"])
    t, e, k, norm = c["t"], c["e"], c["k"], c["norm"]
    logits = logits_of(c, gen)
    w, order, token, offsets, inv = mr.route_sorted(logits, k, norm)
    rw, ids = (tie_rule if c["kind"] in ("ties", "nan") else route)(logits, k, norm)
    ro, rt, roff = sort_by_expert(ids, e)
    r = dict(c)
    r["order"] = torch.equal(order, ro) and order.dtype == torch.int64
    r["token"] = torch.equal(token, rt) and token.dtype == torch.int64
    r["offsets"] = torch.equal(offsets, roff) and offsets.dtype == torch.int32
    r["inv"] = torch.equal(inv.long(), torch.argsort(ro))
    r["weights"] = bool(torch.allclose(w, rw, rtol=1e-6, atol=0, equal_nan=True))
    r["weights"] &= w.dtype == torch.float32 and bool(torch.equal(w.isnan(), rw.isnan()))
    r["combine"] = {}
    h = c["h"]
    for od in ("bf16", "fp16", "fp32"):
        y = torch.randn(t * k, h, generator=gen) * torch.exp(torch.randn(t * k, h, generator=gen))
        y = y.to(DT[od])
        got = mr.combine_rows(y, inv, w, DT[od])
        want, size = in_slot_order(y, ro, w)
        exact = got.dtype == DT[od] and same(got, want.to(DT[od]))
        # torch's own combine adds the k terms in an order of its choosing (on the CPU
        # it depends on H): equal to float32 rounding, then one rounding to the dtype
        err = (combine(y, ro, w) - want).abs()
        nan = want.isnan()
        close = bool(((err <= k * 2.0**-23 * size) | nan).all())
        ulp = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 0.0}[od]  # relative, at most
        near = (got.float() - combine(y, ro, w).to(DT[od]).float()).abs()
        close &= bool(((near <= ulp * want.abs() + k * 2.0**-23 * size) | nan).all())
        r["combine"][od] = [exact, close]
    return r


def rounding(c):
    # float32 -> bf16 in combine_rows (k = 1, weight 1: the product is the value itself)
    # at the hard cases: halfway ties both ways, a carry into the exponent, overflow to
    # inf, inf, NaN, subnormals, signed values
    mr._COMBINE_BLOCK = 16
    f = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 2 - 2**-9, 3.3895e38, 3.4e38, float("inf"),
                      -float("inf"), 1e-40, -1e-40, 2**-133, -2.5 - 2**-7, 0.1, -7.77e-3,
                      65504.0, 1e-8, 12345.678, 0.0], dtype=torch.float32)
    y = f[:, None].repeat(1, c["h"])
    w = torch.ones(len(f), 1)
    inv = torch.arange(len(f), dtype=torch.int32)
    got = mr.combine_rows(y, inv, w, torch.bfloat16)
    want = y.to(torch.bfloat16)  # torch's cast rounds to nearest even
    nan = torch.tensor([float("nan")]).repeat(1, c["h"])
    got_nan = mr.combine_rows(nan, inv[:1], w[:1], torch.bfloat16)
    return {"rounding": torch.equal(bits(got), bits(want)), "nan": bool(got_nan.isnan().all())}


def layer(c):
    # Nvfp4MoE.forward's fused branch on the CPU: `_kernels_for` made to pick the kernels
    # (on CUDA it does so itself), against the torch path of the same layer
    from fp4_dispatch import Nvfp4MoE

    gen = torch.Generator().manual_seed(c["seed"])
    e, h, i, k = 6, 64, 32, 3
    moe = Nvfp4MoE.from_experts((torch.randn(e, h, generator=gen) * 0.1).bfloat16(),
                                (torch.randn(e, 2 * i, h, generator=gen) * 0.05).bfloat16(),
                                (torch.randn(e, h, i, generator=gen) * 0.05).bfloat16(), k,
                                activations="bf16")  # fmt: skip
    calls = []
    Nvfp4MoE._kernels_for = lambda self, logits: calls.append(1) or mr
    for _ in range(50):  # an input whose router logits have no ties (docstring)
        x = torch.randn(c["t"], h, generator=gen).bfloat16()
        s = moe.gate(x).float().sort(dim=-1).values
        if bool((s[:, 1:] != s[:, :-1]).all()):
            break
    with torch.no_grad():
        fused = moe(x)
        again = moe(x)  # a warm layer (its gate/up flag cached) takes the same branch
        moe.fused_routing = False
        Nvfp4MoE._kernels_for = lambda self, logits: False
        plain = moe(x)
    diff = (fused.float() - plain.float()).abs()
    repeat = calls == [1, 1] and torch.equal(fused, again)
    return {"layer": repeat and fused.dtype == plain.dtype and fused.shape == x.shape,
            "close": bool((diff <= 2.0**-7 * plain.float().abs()).all()),  # one bf16 ulp
            "mostly_equal": float((diff == 0).float().mean()) > 0.99}


cases = json.loads(sys.argv[1])
kinds = {"rounding": rounding, "layer": layer}
print(json.dumps([kinds.get(c["kind"], run)(c) for c in cases]))
"""

#: (T, E, k, norm_topk_prob, logits dtype, kind): T = 1 and k = 1, k = E, E not a power
#: of two, E = 1, a decode step of a Qwen3-30B-A3B-like layer (128 experts, k = 8)
SHAPES = [
    (1, 8, 2, True, "bf16", "perm"),
    (1, 128, 8, True, "bf16", "perm"),
    (1, 5, 1, False, "fp32", "normal"),
    (3, 4, 4, True, "fp16", "perm"),
    (6, 7, 3, False, "fp32", "normal"),
    (13, 60, 4, True, "bf16", "perm"),
    (9, 1, 1, False, "fp32", "normal"),
    (5, 12, 5, False, "bf16", "perm"),
    (7, 12, 4, False, "fp32", "wide"),
    (4, 6, 3, True, "fp32", "ties"),
    (3, 9, 9, False, "bf16", "ties"),
    (4, 10, 3, True, "fp32", "nan"),
]


def _cases() -> list[dict]:
    cases = []
    for t, e, k, norm, dtype, kind in SHAPES:
        for tiny in (False, True):
            cases.append({"t": t, "e": e, "k": k, "norm": norm, "dtype": dtype, "kind": kind,
                          "tiny": tiny, "h": 48})  # fmt: skip
    cases.append({"kind": "rounding", "h": 20})
    cases.append({"kind": "layer", "t": 9})
    for i, c in enumerate(cases):
        c["seed"] = i
    return cases


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_interpreted_split(SCRIPT, _cases())


def _routing(results: list[dict]) -> list[dict]:
    return [r for r in results if "rounding" not in r and "layer" not in r]


def test_every_case_ran(results: list[dict]) -> None:
    assert len(_routing(results)) == 2 * len(SHAPES)
    assert sum(r["tiny"] for r in _routing(results)) == len(SHAPES)


def test_route_sorted_equals_route_and_sort_by_expert(results: list[dict]) -> None:
    fields = ("order", "token", "offsets", "inv", "weights")
    bad = [(r["t"], r["e"], r["k"], r["kind"], r["tiny"], [f for f in fields if not r[f]])
           for r in _routing(results) if not all(r[f] for f in fields)]  # fmt: skip
    assert not bad


def test_ties_go_to_the_lowest_expert_index_first(results: list[dict]) -> None:
    ties = [r for r in _routing(results) if r["kind"] == "ties"]
    assert len(ties) == 4
    assert all(r["order"] and r["offsets"] and r["weights"] for r in ties)


def test_nan_logits_route_as_minus_inf_with_nan_weights(results: list[dict]) -> None:
    nan = [r for r in _routing(results) if r["kind"] == "nan"]
    assert len(nan) == 2
    assert all(r["order"] and r["token"] and r["offsets"] and r["weights"] for r in nan)


def test_combine_rows_adds_in_slot_order_bit_for_bit(results: list[dict]) -> None:
    bad = [(r["t"], r["e"], r["k"], r["tiny"], od)
           for r in _routing(results) for od, ok in r["combine"].items() if not ok[0]]  # fmt: skip
    assert not bad


def test_combine_rows_equals_combine_to_float32_rounding(results: list[dict]) -> None:
    bad = [(r["t"], r["e"], r["k"], r["tiny"], od)
           for r in _routing(results) for od, ok in r["combine"].items() if not ok[1]]  # fmt: skip
    assert not bad


def test_combine_rows_rounds_to_bf16_to_nearest_even(results: list[dict]) -> None:
    (r,) = [r for r in results if "rounding" in r]
    assert r["rounding"] and r["nan"]


def test_the_layers_fused_branch_equals_its_torch_path(results: list[dict]) -> None:
    """`Nvfp4MoE.forward` with the kernels (interpreted) against the same layer's torch
    path: same rows through the same GEMMs; the weights agree to float32 rounding, so
    the bf16 output may differ by one rounding step where a sum sits next to a tie."""
    (r,) = [r for r in results if "layer" in r]
    assert r["layer"] and r["close"] and r["mostly_equal"]


def test_sizes_beyond_one_program_are_refused() -> None:
    pytest.importorskip("triton")
    from fp4_dispatch.backends import moe_route as mr

    assert mr.fits(1, 128, 8) and mr.fits(mr.MAX_PAIRS // 8, mr.MAX_EXPERTS, 8)
    assert not mr.fits(mr.MAX_PAIRS // 8 + 1, 128, 8)
    assert not mr.fits(1, mr.MAX_EXPERTS + 1, 1)
    assert not mr.fits(0, 8, 2)
    with pytest.raises(ValueError, match="limits"):
        mr.route_sorted(torch.zeros(mr.MAX_PAIRS + 1, 4), 1, True)
    with pytest.raises(ValueError, match="limits"):
        mr.route_sorted(torch.zeros(2, 4), 5, True)
    with pytest.raises(TypeError, match="logits"):
        mr.route_sorted(torch.zeros(2, 4, dtype=torch.float64), 2, True)


# ---- on a GPU: the compiled kernels, and the layer's forward with them ----------------


def _distinct_logits(t: int, e: int, gen: torch.Generator) -> torch.Tensor:
    perm = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
    return ((perm - e / 2) / 16).bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (16, 128, 8), (300, 60, 4), (7, 8, 8)])
def test_compiled_kernels_equal_the_torch_path_on_a_gpu(t: int, e: int, k: int) -> None:
    """Routing bit for bit (weights to float32 rounding) against torch on the same GPU;
    combine bit for bit against float32 products added in slot order on the CPU (no FMA
    contraction, round-to-nearest casts)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fp4_dispatch.backends import moe_route as mr

    gen = torch.Generator().manual_seed(t * e + k)
    logits = _distinct_logits(t, e, gen).cuda()
    w, order, token, offsets, inv = mr.route_sorted(logits, k, True)
    rw, ids = route(logits, k, True)
    ro, rt, roff = sort_by_expert(ids, e)
    assert torch.equal(order, ro) and torch.equal(token, rt) and torch.equal(offsets, roff)
    assert torch.equal(inv.long(), torch.argsort(ro))
    assert torch.allclose(w, rw, rtol=1e-6, atol=0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        y = (torch.randn(t * k, 2048, generator=gen) * 4).to(dtype)
        got = mr.combine_rows(y.cuda(), inv, w, dtype).cpu()
        pairs = torch.empty_like(y).index_copy_(0, ro.cpu(), y).view(t, k, -1).float()
        acc = torch.zeros(t, y.shape[1])
        for j in range(k):
            acc = acc + pairs[:, j] * w.cpu()[:, j : j + 1]
        assert torch.equal(got, acc.to(dtype)), dtype


def _moe_with_tie_free_logits(t: int) -> tuple[Nvfp4MoE, torch.Tensor]:
    """A small bf16 layer on the GPU and an input whose router logits have no two equal
    values in a row (ties may order differently in the two paths: module docstring)."""
    e, h, i, k = 8, 128, 64, 2
    gen = torch.Generator().manual_seed(0)
    router = (torch.randn(e, h, generator=gen) * 0.1).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.05).bfloat16()
    down = (torch.randn(e, h, i, generator=gen) * 0.05).bfloat16()
    moe = Nvfp4MoE.from_experts(router, gate_up, down, k, activations="bf16").cuda()
    for _ in range(50):
        x = torch.randn(t, h, generator=gen).bfloat16().cuda()
        s = moe.gate(x).sort(dim=-1).values
        if bool((s[:, 1:] != s[:, :-1]).all()):
            return moe, x
    raise AssertionError("no tie-free input in 50 draws")


@pytest.mark.gpu
def test_the_fused_forward_equals_the_torch_path_and_captures(monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fp4_dispatch.backends import moe_route as mr

    calls = []
    for name in ("route_sorted", "combine_rows"):
        real = getattr(mr, name)
        monkeypatch.setattr(mr, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    moe, x = _moe_with_tie_free_logits(16)
    assert moe.fused_routing is True  # the default, for 16 x 2 pairs <= the bound
    assert 16 * moe.top_k <= moe.fused_routing_max_pairs
    with torch.inference_mode():
        fused = moe(x)
        assert torch.equal(moe(x), fused)  # warm: the same branch again
        assert calls == ["route_sorted", "combine_rows"] * 2
        moe.fused_routing = False
        plain = moe(x)
        assert len(calls) == 4  # the torch path ran
        moe.fused_routing = True
        moe.fused_routing_max_pairs = 16 * moe.top_k - 1  # one pair over: torch again
        assert torch.equal(moe(x), plain) and len(calls) == 4
        del moe.fused_routing_max_pairs  # back to the class's bound
        # same rows, same GEMMs; the weights agree to float32 rounding, so the bf16
        # output may differ by one rounding step where a sum sits next to a tie
        diff = (fused.float() - plain.float()).abs()
        assert bool((diff <= 2.0**-7 * plain.float().abs()).all())  # one bf16 ulp
        assert float((diff == 0).float().mean()) > 0.99
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe(x)
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, moe(x))


# ---- compiled for a GPU (PTX, on the CPU: no GPU needed) --------------------------------


def _compile(kernel, types: dict, consts: dict, arch: int, **options):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    src = ASTSource(
        fn=kernel,
        signature={n: "constexpr" if n in consts else types[n] for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_hopper_and_blackwell(arch: int) -> None:
    """Both kernels compile for sm90 and sm100 at a decode size (Qwen3-30B-A3B's 128
    experts, top-8); the routing program's phases are separated by a CTA barrier and
    its divisions are IEEE (``div.rn``); the combine has no FMA (each product rounded
    before its add, as torch's mul then sum) and rounds to bf16 by hand (no ``cvt``)."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends import moe_route as mr

    route_types = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "order_ptr": "*i64",
                   "token_ptr": "*i64", "offsets_ptr": "*i32", "inv_ptr": "*i32",
                   "T": "i32", "E": "i32", "stride_t": "i32"}  # fmt: skip
    route_consts = {"K": 8, "K_PAD": 8, "E_PAD": 128, "BT": 1, "BP": 8, "NORM": True}
    for warps in (1, 4):  # decode sizes run as one warp (`_ONE_WARP_ELEMS`)
        ptx = _compile(mr._route_sorted_kernel, route_types, route_consts, arch,
                       num_warps=warps, enable_fp_fusion=False).asm["ptx"]  # fmt: skip
        assert "bar.sync" in ptx and "div.rn.f32" in ptx
    combine_types = {"y_ptr": "*bf16", "inv_ptr": "*i32", "weights_ptr": "*fp32",
                     "out_ptr": "*bf16", "H": "i32", "stride_y": "i32",
                     "stride_o": "i32"}  # fmt: skip
    combine_consts = {"K": 8, "BH": 1024, "OUT_BF16": True}
    ptx = _compile(mr._combine_kernel, combine_types, combine_consts, arch, num_warps=4,
                   enable_fp_fusion=False).asm["ptx"]  # fmt: skip
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx and "add.rn.f32" in ptx
    assert "cvt.rn.bf16.f32" not in ptx
