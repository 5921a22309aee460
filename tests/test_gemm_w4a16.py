"""Tests of the Hopper W4A16 backend: kernels under TRITON_INTERPRET=1, and the plugin.

The interpreter runs the element-wise twin of the PTX dequantizer and fp16 activations
(it mishandles bf16 operands of ``tl.dot``); bf16 and the PTX path are checked on the
H200 by ``python -m benchmarks kernels --cases w4a16``.
"""

from __future__ import annotations

import ptx_model
import pytest
import torch
from conftest import run_interpreted

from fp4_dispatch.contracts.device import CPU
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.w4a16 import (
    DIRECT_MAX_M,
    UNPACK_MIN_M,
    TritonSm90W4A16Backend,
    TritonSm90W4A16Tactic,
    why_invalid,
)

SM90 = simulated("sm90")

# Shared by the interpreter scripts: operands with all 16 codes and e4m3 subnormal scales.
_PRELUDE = r"""
import json, sys
import torch
from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize, quantize_nvfp4, swizzle_scales

assert not mod._USE_ASM, "TRITON_INTERPRET was not honoured"


def weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = quantize_nvfp4(torch.randn(n, k, generator=g) * 3.0)
    return q


def operands(m, n, k, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed + 7)
    x = (torch.randn(m, k, generator=g) * 2.0).to(dtype)
    q = weights(n, k, seed)
    ops = mod.W4A16Operands(x, q.data, q.scale, q.global_scale.reshape(1))
    ref = x.double() @ dequantize(q).double().T
    return ops, ref


def rel_err(out, ref):
    # NaN if any element was left unwritten (the output is poisoned with NaN)
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out.double() - ref).norm() / ref.norm())
"""

_KERNEL_SCRIPT = (
    _PRELUDE
    + r"""
results = []
for m, n, k, cfg in json.loads(sys.argv[1]):
    kernel = mod.build(mod.W4A16Config(**cfg))
    ops, ref = operands(m, n, k, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    mod.check_operands(ops, out)
    kernel(ops, out)
    out_t = torch.full((n, m), float("nan"), dtype=torch.float16)
    kernel(ops, out_t.t())  # a transposed (column-major) out view
    again = torch.full((m, n), float("nan"), dtype=torch.float16)
    kernel(ops, again)  # split-K reuses its workspace: counters must have been reset
    counters = sum(int(c.abs().sum()) for _, c in kernel._scratch.pairs())
    # the prepared byte order computes the same tensor, so the result is bit-identical
    same_p = None  # the prepared layout needs K % 64 == 0
    if k % 64 == 0:
        prep = mod.W4A16Operands(ops.a, mod.prepare_weight(ops.b_data), ops.b_scale,
                                 ops.alpha, prepared=True)
        out_p = torch.full((m, n), float("nan"), dtype=torch.float16)
        kernel(prep, out_p)
        # the dispatcher's way in: natural b_data plus the prepared copy (b_prepared)
        from fp4_dispatch.contracts.backend import DenseOperands
        both = DenseOperands(ops.a, ops.b_data, ops.b_scale, ops.alpha,
                             b_prepared=prep.b_data)
        out_b = torch.full((m, n), float("nan"), dtype=torch.float16)
        kernel(both, out_b)
        same_p = bool(torch.equal(out, out_p)) and bool(torch.equal(out, out_b))
    results.append([m, n, k, cfg, rel_err(out, ref), rel_err(out_t.t(), ref),
                    bool(torch.equal(out, again)), counters, same_p])
unpack = []
for m, n, k in [(33, 72, 96), (3, 130, 256)]:
    for dtype in (torch.float16, torch.bfloat16):
        ops, ref = operands(m, n, k, seed=n + k, dtype=dtype)
        kern = mod.build_unpack(32, 64)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        kern(ops, out)
        out_t = torch.full((n, m), float("nan"), dtype=dtype)
        kern(ops, out_t.t())
        same_p = None  # the prepared layout needs K % 64 == 0
        if k % 64 == 0:
            prep = mod.W4A16Operands(ops.a, mod.prepare_weight(ops.b_data), ops.b_scale,
                                     ops.alpha, prepared=True)
            out_p = torch.full((m, n), float("nan"), dtype=dtype)
            kern(prep, out_p)
            same_p = bool(torch.equal(out, out_p))
        unpack.append([m, n, k, str(dtype), rel_err(out, ref), rel_err(out_t.t(), ref),
                       same_p])
# the bias epilogue: out = alpha * a @ dq(b).T + bias (fp32 add, one rounding), split-K too
from fp4_dispatch.contracts.backend import DenseOperands
biased = []
for m, n, k, cfg in json.loads(sys.argv[1]):
    kernel = mod.build(mod.W4A16Config(**cfg))
    ops, ref = operands(m, n, k, seed=m * 1000 + n + k)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * ref.std()).half()
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    kernel(DenseOperands(ops.a, ops.b_data, ops.b_scale, ops.alpha, bias=bias), out)
    biased.append([m, n, k, cfg, rel_err(out, ref + bias.double()),
                   float(bias.double().norm() * m**0.5 / ref.norm())])  # bias vs product
print(json.dumps({"direct": results, "unpack": unpack, "bias": biased}))
"""
)

# (m, n, k, W4A16Config kwargs): M in {1, 2, 5, 9, 16, 33}, ragged N, K in {32, ..., 704},
# K tails (K not a multiple of block_k), split-K on and off
CASES = [
    (1, 40, 32, dict(block_n=64, block_m=16, block_k=64)),
    (5, 72, 96, dict(block_n=64, block_m=16, block_k=64, split_k=2)),
    (16, 130, 256, dict(block_n=128, block_m=16, block_k=128, split_k=2)),
    (33, 20, 256, dict(block_n=64, block_m=32, block_k=64, split_k=3)),
    (33, 72, 96, dict(block_n=64, block_m=64, block_k=128)),
    (9, 72, 192, dict(block_n=64, block_m=16, block_k=128)),  # prepared with a K tail
    # split widths between powers of two: 11 K tiles over 5 splits of 3, the last empty
    (2, 72, 704, dict(block_n=64, block_m=16, block_k=64, split_k=5)),
]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_KERNEL_SCRIPT, CASES)


def test_direct_kernel_matches_float64(interpreted):
    rows = interpreted["direct"]
    assert len(rows) == len(CASES)
    for m, n, k, cfg, plain, transposed, _, _, _ in rows:
        assert plain <= 1e-2, f"{m}x{n}x{k} {cfg}: rel err {plain}"
        assert transposed <= 1e-2, f"{m}x{n}x{k} {cfg} (out.T): rel err {transposed}"


def test_direct_kernel_adds_the_bias_in_its_epilogue(interpreted):
    assert len(interpreted["bias"]) == len(CASES)
    for m, n, k, cfg, err, weight in interpreted["bias"]:
        assert weight > 0.3  # the bias is not negligible next to the product
        assert err <= 1e-2, f"{m}x{n}x{k} {cfg}: rel err {err} against a @ dq(b).T + bias"


def test_direct_kernel_is_deterministic_and_resets_split_k_counters(interpreted):
    for m, n, k, cfg, _, _, same, counters, _ in interpreted["direct"]:
        assert same, f"{m}x{n}x{k} {cfg}: two calls differ"
        assert counters == 0, f"{m}x{n}x{k} {cfg}: counters left at {counters}"
    split = [r for r in interpreted["direct"] if r[3].get("split_k", 1) > 1]
    assert split, "no split-K case ran"


def test_unpack_path_matches_float64(interpreted):
    rows = interpreted["unpack"]
    assert len(rows) == 4
    for m, n, k, dtype, plain, transposed, _ in rows:
        assert plain <= 1e-2, f"unpack {m}x{n}x{k} {dtype}: rel err {plain}"
        assert transposed <= 1e-2, f"unpack {m}x{n}x{k} {dtype} (out.T): rel err {transposed}"


def test_prepared_weights_give_identical_results(interpreted):
    """The sm90-prepared bytes (as W4A16Operands(prepared=True) and as the dispatcher's
    DenseOperands.b_prepared beside natural b_data) give the natural run's exact bits."""
    ran = 0
    for m, n, k, cfg, *_, same in interpreted["direct"]:
        assert same is not False, f"direct {m}x{n}x{k} {cfg}: prepared layout changed it"
        ran += same is True
    for m, n, k, dtype, *_, same in interpreted["unpack"]:
        assert same is not False, f"unpack {m}x{n}x{k} {dtype}: prepared layout changed it"
        ran += same is True
    assert ran >= 5, f"only {ran} prepared cases ran (K % 64 == 0 needed)"


_X_DOT_SCRIPT = (
    _PRELUDE
    + r"""
rows = []
for m, n, k, cfg in json.loads(sys.argv[1]):
    ops, ref = operands(m, n, k, seed=m + n + k)
    prep = mod.W4A16Operands(ops.a, mod.prepare_weight(ops.b_data), ops.b_scale, ops.alpha,
                             prepared=True)
    got = {}
    for x_dot in (False, True):
        kernel = mod.build(mod.W4A16Config(**cfg, x_dot=x_dot))
        for name, o in (("natural", ops), ("prepared", prep)):
            out = torch.full((m, n), float("nan"), dtype=torch.float16)
            kernel(o, out)
            got[(x_dot, name)] = out
    # the activation pass is a permutation of each 128-wide K tile
    perm = mod.dot_order_activations(ops.a, False)
    tiles = ops.a.reshape(m, k // 128, 128).sort(-1).values
    same_values = bool(torch.equal(perm.reshape(m, k // 128, 128).sort(-1).values, tiles))
    moved = not bool(torch.equal(perm, ops.a))
    rows.append([m, n, k, cfg, rel_err(got[(True, "natural")], ref),
                 bool(torch.equal(got[(True, "natural")], got[(False, "natural")])),
                 bool(torch.equal(got[(True, "prepared")], got[(False, "prepared")])),
                 same_values, moved])
print(json.dumps(rows))
"""
)


def test_activations_in_dot_order_give_identical_results():
    """X_DOT (`W4A16Config.x_dot`: the activations put in the dot's K order by one pass,
    then read as they are) computes the in-kernel permutation's exact bits, on natural and
    prepared weight bytes, with masked token rows, split-K and a ragged N."""
    cases = [
        (70, 72, 256, dict(block_n=64, block_m=64, block_k=128, split_k=2)),
        (5, 130, 384, dict(block_n=128, block_m=64, block_k=128)),
    ]
    rows = run_interpreted(_X_DOT_SCRIPT, cases)
    assert len(rows) == len(cases)
    for m, n, k, cfg, err, same_n, same_p, permuted, moved in rows:
        assert err <= 1e-2, f"{m}x{n}x{k} {cfg}: rel err {err}"
        assert same_n and same_p, f"{m}x{n}x{k} {cfg}: X_DOT changed the result"
        assert permuted and moved, f"{m}x{n}x{k}: the activation pass is not a permutation"


_DEQUANT_SCRIPT = (
    _PRELUDE
    + r"""
g = torch.Generator().manual_seed(5)
rows, k = 40, 128
# every byte value (so every code in both nibbles) appears, in random order per row
data = torch.stack([torch.randperm(256, generator=g)[: k // 2] for _ in range(rows)])
data = data.to(torch.uint8)
# e4m3 scales: random bytes (no NaN 0x7F/0xFF), subnormals included
raw = torch.randint(0, 0x7F, (rows, k // 16), generator=g, dtype=torch.uint8)
raw |= torch.randint(0, 2, raw.shape, generator=g, dtype=torch.uint8) << 7
lin = raw.view(torch.float8_e4m3fn)
q = Nvfp4Tensor(data, swizzle_scales(lin), torch.tensor(0.37, dtype=torch.float32),
                "swizzled", (rows, k))
got = mod.dequantize_weight(q.data, q.scale) * q.global_scale
got_p = mod.dequantize_weight(mod.prepare_weight(q.data), q.scale, prepared=True)
got_b = mod.dequantize_weight(mod.prepare_weight(q.data), q.scale, prepared=True, bf16=True)
got_bn = mod.dequantize_weight(q.data, q.scale, bf16=True)
want = dequantize(q)
codes = sorted(set(int(b) & 15 for b in data.flatten()) | set(int(b) >> 4 for b in data.flatten()))
print(json.dumps({"equal": bool(torch.equal(got, want)), "codes": codes,
                  "prepared_equal": bool(torch.equal(got_p * q.global_scale, want)),
                  "bf16_equal": bool(torch.equal(got_b * q.global_scale, want)),
                  "bf16_natural_equal": bool(torch.equal(got_bn * q.global_scale, want)),
                  "subnormal_scales": int(((raw & 0x78) == 0).sum()),
                  "mismatch": int((got != want).sum())}))
"""
)


def test_dequantizer_twin_is_bit_exact():
    res = run_interpreted(_DEQUANT_SCRIPT, [])
    assert res["codes"] == list(range(16))
    assert res["subnormal_scales"] > 0
    assert res["equal"], f"{res['mismatch']} elements differ from nvfp4.dequantize"
    assert res["prepared_equal"], "the prepared-layout dequantizer differs"
    assert res["bf16_equal"], "the bf16 dequantizer's twin (prepared layout) differs"
    assert res["bf16_natural_equal"], "the bf16 dequantizer's twin (natural layout) differs"


def test_prepare_weight_round_trips_and_permutes_within_groups():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16 import prepare_weight, unprepare_weight

    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (7, 64), generator=g, dtype=torch.uint8)
    prep = prepare_weight(data)
    assert prep.shape == data.shape and prep.dtype == torch.uint8
    assert not torch.equal(prep, data)
    assert torch.equal(unprepare_weight(prep), data)
    # a permutation inside each 32-byte group: natural byte 8q + 4c + 2h + e (q = scale
    # block) -> 16c + 4q + 2h + e; bytes < 16 keep their value (high nibble 0)
    ramp = torch.arange(16, dtype=torch.uint8).repeat(3, 4)  # row: 0..15, 0..15, ...
    got = prepare_weight(ramp)[0, :32].tolist()
    natural = [(8 * q + 4 * c + 2 * h + e) % 16 for c in range(2) for q in range(4)
               for h in range(2) for e in range(2)]  # fmt: skip
    assert got == natural
    assert torch.equal(prepare_weight(ramp)[:, 32:], prepare_weight(ramp)[:, :32])
    with pytest.raises(ValueError, match="K % 64"):
        prepare_weight(torch.zeros(2, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 64"):
        unprepare_weight(torch.zeros(2, 48, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        unprepare_weight(torch.zeros(2, 16, dtype=torch.int16))


def test_prepared_bytes_rotate_the_high_nibble():
    """The prepared byte keeps the even element's nibble and rotates the odd one's: sign
    to bit 4, magnitude to bits 5-7 (what the bf16 dequantizer's shift pairs read)."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90.gemm_w4a16 import (
        rotate_high_nibbles,
        unrotate_high_nibbles,
    )

    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    r = rotate_high_nibbles(b)
    assert sorted(r.tolist()) == list(range(256))  # a bijection on bytes
    assert torch.equal(unrotate_high_nibbles(r), b)
    assert torch.equal(r & 0x0F, b & 0x0F)  # the even element is untouched
    assert r[0x80].item() == 0x10  # odd element's sign -> bit 4
    assert r[0x70].item() == 0xE0  # odd element's magnitude 7 -> bits 5-7
    assert r[0x10].item() == 0x20  # magnitude 1 -> bit 5


# ---- in-process checks (no interpreter) -----------------------------------------------


def test_config_and_operand_checks_name_the_problem():
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    with pytest.raises(ValueError, match="block_n"):
        mod.W4A16Config(block_n=32)
    with pytest.raises(ValueError, match="split_k"):
        mod.W4A16Config(split_k=0)
    with pytest.raises(ValueError, match="bf16_dequant"):
        mod.W4A16Config(bf16_dequant="fast")
    q = quantize_nvfp4(torch.randn(8, 64))
    alpha = q.global_scale.reshape(1)
    ops = mod.W4A16Operands(torch.randn(4, 64).half(), q.data, q.scale, alpha)
    mod.check_operands(ops, torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out: expected shape"):
        mod.check_operands(ops, torch.empty(8, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="out: expected bfloat16 or float16"):
        mod.check_operands(ops, torch.empty(4, 8, dtype=torch.float32))
    bad = mod.W4A16Operands(torch.randn(4, 64), q.data, q.scale, alpha)
    with pytest.raises(TypeError, match="a: expected bfloat16 or float16"):
        mod.check_operands(bad, torch.empty(4, 8, dtype=torch.float16))
    short = mod.W4A16Operands(torch.randn(4, 32).half(), q.data, q.scale, alpha)
    with pytest.raises(ValueError, match="K mismatch"):
        mod.check_operands(short, torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_r"):
        mod.build_unpack(48, 64)
    q96 = quantize_nvfp4(torch.randn(8, 96))
    prep96 = mod.W4A16Operands(torch.randn(4, 96).half(), q96.data, q96.scale,
                               q96.global_scale.reshape(1), prepared=True)  # fmt: skip
    with pytest.raises(ValueError, match="K % 64"):
        mod.check_operands(prep96, torch.empty(4, 8, dtype=torch.float16))


def test_supports_only_sm90():
    b = TritonSm90W4A16Backend()
    assert not b.supports(CPU)
    assert not b.supports(simulated("sm100"))
    assert b.operations == ("w4a16",)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 8192, 8192), (16, 5120, 5120), (64, 13824, 5120), (256, 10240, 8192), (4096, 8192, 8192),
     (3, 100, 96)],
)  # fmt: skip
def test_tactics_are_valid_and_round_trip(m, n, k):
    b = TritonSm90W4A16Backend()
    p = Problem(m=m, n=n, k=k)
    ts = list(b.tactics(p, SM90))
    assert ts, f"no tactic for {p}"
    assert len(ts) == len(set(ts))
    for t in ts:
        assert b.validate(t, p, SM90) is None
        assert t.swap_ab is False
        assert TritonSm90W4A16Tactic.model_validate_json(t.model_dump_json()) == t
        est = b.estimate_us(p, SM90, t)
        assert est is not None and est > 0
    paths = {t.path for t in ts}
    assert ("direct" in paths) == (m <= DIRECT_MAX_M)
    assert ("unpack" in paths) == (m >= UNPACK_MIN_M)


def test_estimate_picks_direct_for_decode_and_unpack_for_prefill():
    """At 1x8192x8192 the direct kernel measured faster than the best gemv on the H200
    (25.9 vs 27.8 µs, RESULTS.md "W4A16 decode"): the untuned pick is the direct kernel."""
    b = TritonSm90W4A16Backend()
    for m, want in ((1, "direct"), (16, "direct"), (4096, "unpack")):
        p = Problem(m=m, n=8192, k=8192)
        best = min(b.tactics(p, SM90), key=lambda t: b.estimate_us(p, SM90, t))
        assert best.path == want, f"M={m}: picked {best}"
    decode = Problem(m=1, n=8192, k=8192)
    direct = [t for t in b.tactics(decode, SM90) if t.path == "direct"]
    best = min(direct, key=lambda t: b.estimate_us(decode, SM90, t))
    assert best.split_k > 1  # 64 weight tiles cannot fill 132 SMs without split-K


@pytest.mark.parametrize(("n", "k", "split"), [(8192, 8192, 5), (5120, 5120, 8), (10240, 8192, 4)])
def test_direct_estimate_ranks_decode_tiles_as_measured(n, k, split):
    """RESULTS.md ("Hopper W4A16" run 5, M = 1, benchmarks/data/sm90_w4a16_decode_run5.json):
    64 weight rows, tile_k 128, 4 stages and this split-K were the fastest direct tactic of
    every one of these shapes (at M = 16 too, but 5120², where split 6 measured 1.3%
    faster than 8). The untuned direct pick must have those knobs at M = 1 and 16."""
    b = TritonSm90W4A16Backend()
    for m in (1, 16):
        p = Problem(m=m, n=n, k=k)
        direct = [t for t in b.tactics(p, SM90) if t.path == "direct"]
        best = min(direct, key=lambda t: (b.estimate_us(p, SM90, t), t.canonical_json()))
        knobs = (best.tile_n, best.tile_k, best.num_stages, best.split_k)
        assert knobs == (64, 128, 4, split), best


def test_token_tiles_of_64_or_more_take_activations_in_dot_order():
    """X_DOT_MIN_TILE_M: decode tiles keep the in-kernel permutation (it measured faster
    there); 64- and 128-token tiles take the per-call pass (RESULTS.md run 5)."""
    pytest.importorskip("triton")
    from fp4_dispatch.plugins.sm90.w4a16 import X_DOT_MIN_TILE_M

    assert X_DOT_MIN_TILE_M == 64
    for tm, want in ((16, False), (32, False), (64, True), (128, True)):
        warps = 8 if tm == 128 else 4
        t = TritonSm90W4A16Tactic(tile_m=tm, tile_n=128, num_warps=warps)
        assert t.kernel_config().x_dot is want, (tm, t.kernel_config())


def test_rules_reject_what_does_not_fit():
    p = Problem(m=1, n=8192, k=8192)
    big = TritonSm90W4A16Tactic(tile_m=64)
    assert "tile_m" in why_invalid(big, p, SM90)
    t128 = TritonSm90W4A16Tactic(tile_m=128, num_warps=4)
    assert why_invalid(t128, Problem(m=512, n=8192, k=8192), SM90) is not None
    tall = TritonSm90W4A16Tactic(split_k=16, tile_k=128)
    assert "K steps" in why_invalid(tall, Problem(m=1, n=1024, k=2048), SM90)
    # 8 CTAs per SM at most for split-K (64-row decode tiles run 6 at once)
    assert why_invalid(TritonSm90W4A16Tactic(tile_n=64, split_k=8), p, SM90) is None
    many = TritonSm90W4A16Tactic(tile_n=64, split_k=16)
    assert "8 CTAs per SM" in why_invalid(many, p, SM90)
    unpack = TritonSm90W4A16Tactic(path="unpack", tile_m=128, tile_n=128)
    assert "direct kernel wins" in why_invalid(unpack, p, SM90)
    assert "multiple of 32" in why_invalid(TritonSm90W4A16Tactic(), Problem(m=1, n=64, k=48), SM90)
    with pytest.raises(ValueError):
        TritonSm90W4A16Tactic(swap_ab=True)
    # decode knobs measured on the H200 (RESULTS.md, "Hopper W4A16" runs 2 and 4): 8 warps
    # need the 128-row tile (two 64-row warpgroups); 6 stages and tile_k 256 were slower
    # than 4 stages and tile_k 128 on every shape measured: not offered
    assert why_invalid(TritonSm90W4A16Tactic(num_warps=8), p, SM90) is None
    assert "tile_n=128" in why_invalid(TritonSm90W4A16Tactic(num_warps=8, tile_n=64), p, SM90)
    assert "6 stages" in why_invalid(TritonSm90W4A16Tactic(num_stages=6), p, SM90)
    assert "tile_k=256" in why_invalid(TritonSm90W4A16Tactic(tile_k=256), p, SM90)


# ---- the PTX dequantizers, executed by a small PTX model on the CPU ---------------------


def _assert_every_lane_exact(name: str, asm: str, scales: dict, dtype, prepared: bool) -> None:
    """The shared PTX model's check (`tests/ptx_model.py`)."""
    ptx_model.assert_every_lane_exact(name, asm, scales, dtype, prepared)


@pytest.mark.parametrize(
    ("name", "dtype", "prepared"),
    [
        ("_F16_NATURAL", torch.float16, False),
        ("_F16_PREPARED", torch.float16, True),
        ("_BF16_NATURAL", torch.bfloat16, False),
        ("_BF16_PREPARED", torch.bfloat16, True),
    ],
)
def test_ptx_dequantizers_are_exact_on_every_byte(name, dtype, prepared):
    """Every byte value through the PTX (run by a model of its 5 instructions): each output
    lane is ``e2m1 * scale * 2**-14`` of its own byte, so the "or" forms' shifted-in zeros
    really keep the magnitude and sign sources apart."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod

    # scale 1 in the kernel's convention: fp16 1.0; bf16 carries 2**112 (bits 0x7780)
    one = 0x3C00 if dtype == torch.float16 else 0x7780
    ones = one | one << 16
    _assert_every_lane_exact(name, getattr(mod, name), {"$5": ones, "$6": ones}, dtype, prepared)


@pytest.mark.parametrize(("name", "prepared"), [("_NATURAL", False), ("_PREPARED", True)])
def test_gemv_ptx_nibble_expansion_is_exact_on_every_byte(name, prepared):
    """The gemv kernel's unscaled PTX (`gemm_w4a16_decode`, the fp16 pairs without the scale
    multiply): every output lane is ``e2m1 * 2**-14`` of its own byte's nibble."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90 import gemm_w4a16_decode as dec

    _assert_every_lane_exact(name, getattr(dec, name), {}, torch.float16, prepared)


# ---- GPU ------------------------------------------------------------------------------


def _sm90_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_ptx_dequantizers_bit_exact():
    """The PTX dequantizers (fp16 and bf16, natural and prepared) against nvfp4.dequantize
    on every byte value and e4m3 scales with subnormals, on the GPU."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
    from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize, swizzle_scales

    g = torch.Generator().manual_seed(5)
    rows, k = 300, 512
    data = torch.stack([torch.randperm(256, generator=g) for _ in range(rows)]).to(torch.uint8)
    raw = torch.randint(0, 0x7F, (rows, k // 16), generator=g, dtype=torch.uint8)
    raw |= torch.randint(0, 2, raw.shape, generator=g, dtype=torch.uint8) << 7
    q = Nvfp4Tensor(data, swizzle_scales(raw.view(torch.float8_e4m3fn)),
                    torch.tensor(1.0), "swizzled", (rows, k))  # fmt: skip
    want = dequantize(q)
    d, s = q.data.cuda(), q.scale.cuda()
    p = mod.prepare_weight(d)
    for prepared in (False, True):
        for bf16 in (False, True):
            got = mod.dequantize_weight(p if prepared else d, s, prepared=prepared, bf16=bf16)
            bad = int((got.cpu() != want).sum())
            assert bad == 0, f"prepared={prepared} bf16={bf16}: {bad} elements differ"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_direct_tactics_natural_and_prepared():
    """The estimate's 12 best direct tactics of a small decode shape (split-K included),
    bf16 and fp16 activations, natural and prepared weights: within 1e-2 of float64, and
    prepared within fp32 summation-order noise of natural (the two layouts feed the MMA
    in different K orders). (12: each compile costs about a second.)"""
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
    from fp4_dispatch.contracts.device import detect
    from fp4_dispatch.format.nvfp4 import dequantize, quantize_nvfp4

    b = TritonSm90W4A16Backend()
    info = detect()
    m, n, k = 5, 320, 1024
    g = torch.Generator().manual_seed(3)
    q = quantize_nvfp4(torch.randn(n, k, generator=g)).to("cuda")
    x32 = torch.randn(m, k, generator=g)
    ref = x32.double() @ dequantize(q.to("cpu")).double().T
    prep = mod.prepare_weight(q.data)
    alpha = q.global_scale.reshape(1)
    p = Problem(m=m, n=n, k=k)
    for dtype in (torch.bfloat16, torch.float16):
        x = x32.to(dtype).cuda()
        refd = x.double().cpu() @ dequantize(q.to("cpu")).double().T
        direct = [t for t in b.tactics(p, info) if t.path == "direct"]
        for t in sorted(direct, key=lambda t: b.estimate_us(p, info, t))[:12]:
            kern = b.build(t, p, info)
            outs = []
            for data, flag in ((q.data, False), (prep, True)):
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                kern(mod.W4A16Operands(x, data, q.scale, alpha, flag), out)
                err = float((out.double().cpu() - refd).norm() / refd.norm())
                assert err <= 1e-2, f"{t.canonical_json()} {dtype} prepared={flag}: {err}"
                outs.append(out)
            diff = float((outs[0].double() - outs[1].double()).norm() / outs[0].double().norm())
            assert diff <= 1e-2, f"{t.canonical_json()} {dtype}: natural vs prepared {diff}"
    assert ref.norm() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs a CUDA device of compute capability 9.x")
def test_gpu_activations_in_dot_order_are_bit_identical():
    """X_DOT on the GPU (bf16 PTX path, 64- and 128-token tiles, split-K, masked token
    rows): the same bits as the in-kernel permutation, natural and prepared weights."""
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as mod
    from fp4_dispatch.format.nvfp4 import dequantize, quantize_nvfp4

    m, n, k = 200, 384, 2048
    g = torch.Generator().manual_seed(11)
    q = quantize_nvfp4(torch.randn(n, k, generator=g)).to("cuda")
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    ref = x.double().cpu() @ dequantize(q.to("cpu")).double().T
    alpha = q.global_scale.reshape(1)
    prep = mod.W4A16Operands(x, mod.prepare_weight(q.data), q.scale, alpha, True)
    nat = mod.W4A16Operands(x, q.data, q.scale, alpha)
    for cfg in (dict(block_n=64, block_m=64, split_k=2, num_stages=4),
                dict(block_n=128, block_m=128, num_warps=8, num_stages=3)):  # fmt: skip
        for ops in (nat, prep):
            outs = []
            for x_dot in (False, True):
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                mod.build(mod.W4A16Config(**cfg, x_dot=x_dot))(ops, out)
                outs.append(out)
            err = float((outs[1].double().cpu() - ref).norm() / ref.norm())
            assert err <= 1e-2 and torch.equal(outs[0], outs[1]), (cfg, ops.prepared, err)
