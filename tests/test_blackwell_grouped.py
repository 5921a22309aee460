"""Grouped NVFP4 GEMMs on Blackwell/Rubin: family ``fi-grouped-w4a16`` (FlashInfer's SM100
W4A16 grouped GEMM), compiled for sm_100a / sm_103a / sm_107a, never run here.

The routed-tile layout that adapts torch's offsets to FlashInfer's kernel is plain torch
and is tested on the CPU against an exact per-group computation, through the kernel's
own call path with only the launch replaced by an emulation of FlashInfer's documented
tile semantics. Tests that need ``flashinfer-python`` skip when the extra is absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import types

import pytest
import torch
from pydantic import ValidationError

from fp4_dispatch.backends.flashinfer import grouped as fg
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.flashinfer.grouped import (
    FiGroupedW4A16Backend,
    FiGroupedW4A16Tactic,
    tactic_of,
)

HAVE_FI = importlib.util.find_spec("flashinfer") is not None
needs_fi = pytest.mark.skipif(
    not HAVE_FI, reason="flashinfer extra not installed (pip install '.[flashinfer]')"
)
DEVICES = {"sm100": 100, "sm103": 103, "sm107": 107}


# ---- the routed-tile layout (plain torch, CPU) -----------------------------------------


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)


def _random_counts(rng: random.Random, experts: int, tokens: int) -> list[int]:
    """A split of `tokens` rows over `experts`, with empty experts and a heavy one."""
    cuts = sorted(rng.randint(0, tokens) for _ in range(experts - 1))
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    if experts > 2:
        counts[0], counts[-1] = 0, counts[-1] + counts[0]  # one empty expert at least
    return counts


@pytest.mark.parametrize("route_tile", [8, 16, 128])
@pytest.mark.parametrize("seed", range(4))
def test_route_puts_each_expert_on_tile_boundaries(route_tile, seed):
    rng = random.Random(seed)
    experts, tokens = rng.choice([(4, 37), (8, 8), (16, 300), (3, 1)])
    counts = _random_counts(rng, experts, tokens)
    r = fg.route(_offsets(counts), tokens, route_tile)
    assert r.slots == fg.route_slots(tokens, experts, route_tile)
    dest = r.dest.tolist()
    assert len(set(dest)) == tokens and all(0 <= d < r.slots for d in dest)
    used = int(r.num_tiles[0])
    assert used == sum(-(-c // route_tile) for c in counts) <= r.slots // route_tile
    start = 0
    for e, c in enumerate(counts):
        rows = dest[start : start + c]
        start += c
        if not c:
            continue
        assert rows == list(range(rows[0], rows[0] + c))  # contiguous, in order
        assert rows[0] % route_tile == 0  # the expert starts a tile
        for j in range(rows[0] // route_tile, -(-(rows[0] + c) // route_tile)):
            assert int(r.tile_expert[j]) == e
            assert int(r.tile_limit[j]) == rows[0] + c


@pytest.mark.parametrize("route_tile", [1, 8, 192])
def test_route_slots_bounds_every_split(route_tile):
    rng = random.Random(route_tile)
    for _ in range(200):
        experts, tokens = rng.randint(1, 40), rng.randint(0, 500)
        counts = _random_counts(rng, experts, tokens) if experts > 1 else [tokens]
        need = sum(-(-c // route_tile) for c in counts) * route_tile
        assert need <= fg.route_slots(tokens, experts, route_tile)


def test_route_clamps_ends_past_the_rows():
    # offsets[-1] > T is the caller's error; no tile may then cover rows that do not exist
    r = fg.route(torch.tensor([2, 9], dtype=torch.int32), 5, 4)
    assert r.dest.tolist() == [0, 1, 4, 5, 6] and r.valid.all()
    assert int(r.num_tiles[0]) == 2 and r.tile_limit[:2].tolist() == [2, 7]


def test_route_slots_refuses_nonsense():
    with pytest.raises(ValueError, match="experts"):
        fg.route_slots(10, 0, 8)


def _emulate(weights: torch.Tensor):
    """FlashInfer's kernel as its source reads: tile j (< num_tiles) computes rows
    [j*rt, min((j+1)*rt, tile_limit[j])) of the padded buffer with expert
    tile_expert[j]'s weight and alpha; other rows are left as they are."""

    def launch(self, operands, routing, padded, result):
        rt = self.route_tile
        result.fill_(float("nan"))  # rows the kernel does not write must never be read
        for j in range(int(routing.num_tiles[0])):
            e = int(routing.tile_expert[j])
            lo, hi = j * rt, min((j + 1) * rt, int(routing.tile_limit[j]))
            acc = padded[lo:hi].double() @ weights[e].T * float(operands.alpha[e])
            result[lo:hi] = acc.to(result.dtype)

    return launch


@pytest.mark.parametrize("route_tile", [8, 64])
@pytest.mark.parametrize("past_end", [0, 3])
def test_adapter_is_exact_against_per_group_reference(monkeypatch, route_tile, past_end):
    """Every expert's rows exact; rows at or past offsets[E-1] (no expert) untouched."""
    rng = random.Random(route_tile)
    experts, n, k = 6, 24, 32
    counts = _random_counts(rng, experts, 45)
    tokens = 45 + past_end
    gen = torch.Generator().manual_seed(route_tile)
    # small integers: every product and sum is exact in float64 and in bf16
    a = torch.randint(-3, 4, (tokens, k), generator=gen).to(torch.bfloat16)
    weights = torch.randint(-2, 3, (experts, n, k), generator=gen).double()
    alpha = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.0, 4.0])
    offsets = _offsets(counts)
    if past_end:  # and strided operands: rows of `a` 8 apart wider, `out` column-major
        wide = torch.zeros(tokens, k + 8, dtype=torch.bfloat16)
        wide[:, :k] = a
        a = wide[:, :k]
    operands = types.SimpleNamespace(
        a=a,
        offsets=offsets,
        alpha=alpha,
        b_data=torch.zeros(experts, n, k // 2, dtype=torch.uint8),
        b_scale=None,
    )
    compiled = types.SimpleNamespace(tactic=((128, route_tile, 256), (1, 1), True), experts=experts)
    monkeypatch.setattr(fg.GroupedW4A16Kernel, "launch", _emulate(weights))
    out = torch.full((tokens, n), 7.0, dtype=torch.bfloat16)
    if past_end:
        out = out.t().contiguous().t()
    fg.GroupedW4A16Kernel(compiled)(operands, out)
    want = torch.full((tokens, n), 7.0, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want[start : start + c] = a[start : start + c].double() @ weights[e].T * float(alpha[e])
        start += c
    assert torch.equal(out, want.to(torch.bfloat16))


def test_adapter_refuses_fp16_and_a_wrong_expert_count():
    compiled = types.SimpleNamespace(tactic=((128, 8, 256), (1, 1), True), experts=4)
    kernel = fg.GroupedW4A16Kernel(compiled)
    ops = types.SimpleNamespace(
        a=torch.zeros(3, 32, dtype=torch.float16),
        offsets=_offsets([3]),
        b_data=torch.zeros(4, 8, 16, dtype=torch.uint8),
    )
    with pytest.raises(ValueError, match="a: expected bfloat16"):
        kernel(ops, torch.zeros(3, 8, dtype=torch.bfloat16))
    ops.b_data = torch.zeros(5, 8, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="b_data: compiled for 4 experts, got 5"):
        kernel(ops, torch.zeros(3, 8, dtype=torch.bfloat16))


# ---- tactics ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(tile_m=32, tile_n=256, cluster_n=1),  # 2-CTA needs a cluster pair
        dict(tile_m=8, tile_n=256, cluster_n=2),  # 2-CTA needs >= 16 routed rows
        dict(tile_m=192, tile_n=128),  # FlashInfer: 128 x 192 x 256 does not fit
        dict(tile_m=24, tile_n=128),  # not a FlashInfer routed tile
        dict(tile_m=16, tile_n=128, swap_ab=True),  # the dispatcher never swaps W4A16
    ],
)
def test_impossible_knob_is_a_validation_error(fields):
    with pytest.raises(ValidationError):
        FiGroupedW4A16Tactic(**fields)


def test_tactic_round_trips_flashinfers_tuple():
    t = FiGroupedW4A16Tactic(tile_m=64, tile_n=256, cluster_n=2)
    assert t.to_fi() == ((256, 64, 256), (2, 1), True)
    assert tactic_of(t.to_fi()) == t
    assert t.ctas_per_tile == 2
    with pytest.raises(ValueError, match="unknown FlashInfer W4A16 tactic"):
        tactic_of(((128, 64, 512), (1, 1), True))


@needs_fi
def test_every_flashinfer_tactic_has_a_typed_twin():
    fis = fg.flashinfer_tactics()
    assert len(fis) >= 10
    assert [tactic_of(fi).to_fi() for fi in fis] == list(fis)


def _backend_problem(t: int, n: int, k: int, e: int, op: str = "grouped_w4a16", **kw):
    from fp4_dispatch.contracts.tactics import Problem

    return Problem(m=t, n=n, k=k, operation=op, groups=e, **kw)


@needs_fi
def test_family_serves_grouped_w4a16_in_bfloat16_only():
    b, dev = FiGroupedW4A16Backend(), simulated("sm100")
    assert list(b.tactics(_backend_problem(8, 1536, 2048, 128), dev))
    for other in (
        _backend_problem(8, 1536, 2048, 128, out_dtype="float16"),
        _backend_problem(8, 1536, 2048, 128, op="grouped_w4a4"),
    ):
        assert not list(b.tactics(other, dev))
    t = next(iter(b.tactics(_backend_problem(8, 1536, 2048, 128), dev)))
    why = b.validate(t, _backend_problem(8, 1536, 2048, 128, out_dtype="float16"), dev)
    assert "bfloat16 only" in why


@needs_fi
@pytest.mark.parametrize(
    "shape", [(8, 1536, 2048, 128), (512, 2048, 768, 128), (64, 4096, 7168, 256)]
)
def test_tactics_and_validate_agree(shape):
    b, dev = FiGroupedW4A16Backend(), simulated("sm107")
    problem = _backend_problem(*shape)
    offered = list(b.tactics(problem, dev))
    assert offered
    for t in offered:
        assert b.validate(t, problem, dev) is None
    others = {tactic_of(fi) for fi in fg.flashinfer_tactics()} - set(offered)
    for t in others:
        assert b.validate(t, problem, dev) is not None


@needs_fi
def test_misaligned_k_gets_no_tactic():
    # K = 2056 bf16 activations: rows of 4112 bytes are not 32-byte aligned (kernel rule)
    assert not fg.valid_tactics(64, 1536, 2056, 8)


def test_estimate_counts_padded_tiles_and_touched_experts():
    from fp4_dispatch.plugins.flashinfer.grouped import estimate

    dev = simulated("sm100")
    narrow = FiGroupedW4A16Tactic(tile_m=8, tile_n=128)
    wide = FiGroupedW4A16Tactic(tile_m=128, tile_n=128)
    decode = _backend_problem(8, 1536, 2048, 128)  # 8 rows on 8 experts
    assert estimate(decode, dev, narrow) < estimate(decode, dev, wide)
    # more experts touched at the same rows: more weight bytes, never cheaper
    few, many = _backend_problem(64, 1536, 2048, 8), _backend_problem(64, 1536, 2048, 128)
    assert estimate(few, dev, narrow) < estimate(many, dev, narrow)


# ---- compile for each arch (no GPU: cubin checked, nothing launched) ----------------------


@needs_fi
def test_one_tactic_compiles_for_each_arch(tmp_path, monkeypatch):
    """sm_100a, sm_103a and sm_107a in one process: each gets its own cubin, and a second
    build of the same class is a memory hit (E=128: Qwen3-30B-A3B's expert count)."""
    from fp4_dispatch.backends import cute as cb

    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))
    b = FiGroupedW4A16Backend()
    problem = _backend_problem(64, 1536, 2048, 128)
    for dev, cc in DEVICES.items():
        device = simulated(dev)
        tactic = FiGroupedW4A16Tactic(tile_m=16, tile_n=128)
        assert b.validate(tactic, problem, device) is None
        kernel = b.build(tactic, problem, device)
        c = kernel.compiled
        assert (c.cubin_sm, c.target, c.sm_count, c.experts) == (cc, f"{cc}a", device.sm_count, 128)
        assert c.max_active_clusters == device.sm_count  # simulated: SMs // cluster size 1
        again = b.build(tactic, _backend_problem(300, 1536, 2048, 128), device)
        assert again.compiled.source == "memory"


@needs_fi
def test_compiled_kernels_are_cached_on_disk_and_checked(tmp_path, monkeypatch):
    """A new process (memory cleared) loads the object file; an entry whose key differs is
    recompiled, and an entry whose cubin names another SM is refused."""
    from fp4_dispatch.backends import cute as cb

    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))
    b, device = FiGroupedW4A16Backend(), simulated("sm100")
    problem = _backend_problem(64, 1536, 2048, 8)
    tactic = FiGroupedW4A16Tactic(tile_m=8, tile_n=128)
    first = b.build(tactic, problem, device).compiled
    assert first.source == "compiled" and first.path and first.cubin_sm == 100
    fg._memory.clear()
    again = b.build(tactic, problem, device).compiled
    assert (again.source, again.path, again.cubin_sm) == ("disk", first.path, 100)
    assert callable(again.function)
    # the same entry name holding another key (a planted or stale file): recompiled
    meta = tmp_path / first.path.rsplit("/", 1)[1].replace(".o", ".json")
    meta.write_text('{"key": ["something else"], "cubin_sm": 100}')
    fg._memory.clear()
    assert b.build(tactic, problem, device).compiled.source == "compiled"
    # an sm_100a object where an sm_103a kernel is expected: refused, recompiled
    text = '["key"]'
    obj = tmp_path / "fp4fig_x.o"
    obj.write_bytes((tmp_path / first.path.rsplit("/", 1)[1]).read_bytes())
    (tmp_path / "fp4fig_x.json").write_text(json.dumps({"key": [text]}))
    assert fg._load("fp4fig_x", obj, tmp_path / "fp4fig_x.json", text, "103a", "t") is None


def test_compile_key_leaves_the_token_count_out():
    fi = FiGroupedW4A16Tactic(tile_m=16, tile_n=256, cluster_n=2).to_fi()
    assert fg.compile_key(fi, 1536, 2048, 128) == fg.compile_key(fi, 1536, 2048, 128)
    assert fg.compile_key(fi, 1536, 2048, 128) != fg.compile_key(fi, 1536, 2048, 64)
    assert fg.compile_key(fi, 1536, 256, 128)[2] == 128  # K == one K tile: wide fragments
    assert fg.compile_key(fi, 1000, 2048, 128)[3] is False  # N not whole cluster tiles
    b = FiGroupedW4A16Backend()
    t = tactic_of(fi)
    assert b.precompile_key(t, _backend_problem(8, 1536, 2048, 128)) == b.precompile_key(
        t, _backend_problem(4096, 1536, 2048, 128)
    )


# ---- ranking: no family starved on grouped problems (simulated Blackwell/Rubin) -----------

GROUPED_SHAPES = [
    (8, 1536, 2048, 128),  # Qwen3-30B-A3B-like gate/up, batch 1 x top-8
    (512, 2048, 768, 128),  # its down projection, batch 64 x top-8
    (32768, 1536, 2048, 128),  # prefill 4,096 tokens x top-8
    (64, 4096, 7168, 256),  # DeepSeek-like, batch 8 x top-8
]


@needs_fi
@pytest.mark.parametrize("dev", sorted(DEVICES))
@pytest.mark.parametrize("shape", GROUPED_SHAPES)
def test_explain_keeps_every_familys_floor_on_grouped_problems(dev, shape):
    from fp4_dispatch.loading.registry import load
    from fp4_dispatch.policy.ranking import default_floor, shortlist

    device = simulated(dev)
    reg = load(strict=False)
    backends = [b for b in reg.backends.values() if b.supports(device).ok]
    for op in ("grouped_w4a16", "grouped_w4a4"):
        problem = _backend_problem(*shape, op=op)
        sl = shortlist(problem, device, backends, budget=8)
        serving = {b.family for b in backends if op in b.operations}
        assert set(sl.cut) <= serving  # dense-only families never see a grouped problem
        kept: dict[str, int] = {}
        for c in sl.candidates:
            kept[c.family] = kept.get(c.family, 0) + 1
            assert c.operation == op
        floor = default_floor(8, len(sl.cut))
        for family, cut in sl.cut.items():
            assert kept.get(family, 0) >= min(floor, kept.get(family, 0) + cut), (family, sl.cut)
        if op == "grouped_w4a16":
            assert kept.get("fi-grouped-w4a16", 0) >= floor
        else:  # FlashInfer's Blackwell W4A4 kernel on cc 100/103, its Rubin one on 107
            family = "fi-grouped-w4a4-sm107" if dev == "sm107" else "fi-grouped-w4a4"
            assert kept.get(family, 0) >= floor


@needs_fi
@pytest.mark.parametrize("dev", sorted(DEVICES))
def test_list_backends_shows_the_family_compile_only(capsys, dev):

    from fp4_dispatch.cli import main

    assert main(["list-backends", "--device", dev, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["fi-grouped-w4a16"]
    assert row["status"] == "available", row
    assert "grouped_w4a16" in row["reason"]
    assert "not been run on hardware" in row["note"]


# ---- fi-grouped-w4a4: FlashInfer's block-scaled contiguous grouped GEMM (cc 100/103) ------


def _w4a4_operands(counts: list[int], n: int, k: int, seed: int):
    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.format.grouped import quantize_experts
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    gen = torch.Generator().manual_seed(seed)
    tokens, experts = sum(counts), len(counts)
    qa = quantize_nvfp4(torch.randn(tokens, k, generator=gen))
    w = quantize_experts(torch.randn(experts, n, k, generator=gen))
    alpha = (qa.global_scale * w.global_scale).to(torch.float32)
    return GroupedOperands(qa.data, w.data, w.scale, alpha, _offsets(counts), a_scale=qa.scale)


def test_scale_repack_moves_each_rows_scales_to_its_padded_row():
    from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4
    from fp4_dispatch.format.nvfp4 import unswizzle_scales

    ops = _w4a4_operands([5, 0, 130, 1], n=128, k=128, seed=1)
    r = fg.route(ops.offsets, 136, 128)
    packed = g4.repack_scales(ops.a_scale, r.dest, 128, r.slots)
    # the swizzle is a permutation within 128-row atoms: linear index order agrees
    rows = torch.arange(256)
    assert torch.equal(
        g4.swizzled_index(rows[:, None], torch.arange(8)[None, :], 8).flatten().sort().values,
        torch.arange(256 * 8),
    )
    before = unswizzle_scales(ops.a_scale, 136, 128).view(torch.uint8)
    after = unswizzle_scales(packed.view(r.slots, 8), r.slots, 128).view(torch.uint8)
    assert torch.equal(after[r.dest], before)


def _unscaled(data: torch.Tensor, scale: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """float64 e2m1 x block scale [rows, K] (swizzled scales), from the public format API."""
    from fp4_dispatch.format.nvfp4 import e2m1_to_float, unpack_e2m1, unswizzle_scales

    vals = e2m1_to_float(unpack_e2m1(data)).to(torch.float64).view(rows, k // 16, 16)
    return (vals * unswizzle_scales(scale, rows, k).to(torch.float64)[..., None]).view(rows, k)


def _emulate_w4a4(seen: dict):
    """FlashInfer's GEMM2 epilogues as their source reads: tile j (< num_tiles) computes
    padded rows [j*t, min((j+1)*t, limit[j])) with expert tile_expert[j] and sends row p,
    scaled by alpha[e], to out[expanded[p]]: written (Blackwell, deterministic mode) or
    added (Rubin, always a reduce-add); nothing else is touched."""

    def launch(self, operands, p, out):
        t, k = self.route_tile, p.a.shape[1] * 2
        x = _unscaled(p.a, p.a_scale.view(p.routing.slots, k // 16), p.routing.slots, k)
        n = operands.b_data.shape[1]
        result = torch.full((out.shape[0], n), float("nan"), dtype=torch.float64)
        for j in range(int(p.routing.num_tiles[0])):
            e = int(p.routing.tile_expert[j])
            w = _unscaled(operands.b_data[e], operands.b_scale[e], n, k)
            for row in range(j * t, min((j + 1) * t, int(p.routing.tile_limit[j]))):
                dst = int(p.expanded[row])
                result[dst] = (x[row] @ w.T) * float(operands.alpha[e])
        seen["result"] = result
        rows = result.isfinite().all(dim=1)
        if self.compiled.kind == "sm107":
            out[rows] += result[rows].to(out.dtype)
        else:
            out[rows] = result[rows].to(out.dtype)

    return launch


@pytest.mark.parametrize(
    "kind, tactic",
    [
        ("sm100", ((128, 128), (1, 1), False)),
        ("sm100", ((256, 128), (2, 1), False)),
        ("sm107", ((256, 128, 256), (128, 128, 128), (1, 1), False)),
    ],
)
def test_w4a4_adapter_matches_the_grouped_reference(monkeypatch, kind, tactic):
    from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4
    from fp4_dispatch.format.grouped import reference_output

    counts = [3, 0, 140, 1, 0, 20]
    ops = _w4a4_operands([*counts, 2], n=128, k=128, seed=len(tactic))
    # the last 2 rows belong to no expert: offsets end at 164 of 166 rows
    ops = dataclasses.replace(ops, alpha=ops.alpha[:-1], offsets=ops.offsets[:-1],
                              b_data=ops.b_data[:-1], b_scale=ops.b_scale[:-1])  # fmt: skip
    seen: dict = {}
    monkeypatch.setattr(g4.GroupedW4A4Kernel, "launch", _emulate_w4a4(seen))
    compiled = types.SimpleNamespace(tactic=tactic, kind=kind)
    # stale contents, and a column-major view: the kernel's layout goes through a copy
    out = torch.full((128, sum(counts) + 2), 7.0, dtype=torch.bfloat16).t()
    g4.GroupedW4A4Kernel(compiled)(ops, out)
    want = reference_output(ops)
    torch.testing.assert_close(seen["result"][:-2], want[:-2], rtol=1e-12, atol=1e-9)
    assert torch.equal(out[:-2], want[:-2].to(torch.bfloat16))  # every row written, once
    assert (out[-2:] == 7.0).all()  # rows of no expert left as they were


@pytest.mark.parametrize(
    "fields",
    [dict(tile_m=256, tile_n=128, cluster_m=1), dict(tile_m=128, tile_n=128, cluster_m=2)],
)
def test_w4a4_impossible_knob_is_a_validation_error(fields):
    from fp4_dispatch.plugins.flashinfer.grouped_w4a4 import FiGroupedW4A4Tactic

    with pytest.raises(ValidationError):
        FiGroupedW4A4Tactic(**fields)


@needs_fi
def test_w4a4_family_offers_flashinfers_tactics_where_its_layout_is_ours():
    from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4
    from fp4_dispatch.plugins.flashinfer.grouped_w4a4 import FiGroupedW4A4Backend, tactic_of

    b, dev = FiGroupedW4A4Backend(), simulated("sm100")
    fis = g4.flashinfer_tactics()
    assert [tactic_of(fi).to_fi() for fi in fis] == list(fis)
    problem = _backend_problem(64, 1536, 2048, 128, op="grouped_w4a4")
    offered = list(b.tactics(problem, dev))
    assert {t.to_fi() for t in offered} == set(fis)
    assert all(b.validate(t, problem, dev) is None for t in offered)
    for n, k in ((1500, 2048), (1536, 2080)):  # padded scale strides would differ
        odd = _backend_problem(64, n, k, 128, op="grouped_w4a4")
        assert not list(b.tactics(odd, dev))
        assert "N % 128 == 0 and K % 64 == 0" in b.validate(offered[0], odd, dev)
    assert not b.supports(simulated("sm107")).ok  # FlashInfer's Rubin kernel: not offered
    assert not list(b.tactics(_backend_problem(64, 1536, 2048, 128), dev))  # w4a16


@needs_fi
def test_w4a4_one_tactic_compiles_for_each_arch(tmp_path, monkeypatch):
    from fp4_dispatch.backends import cute as cb
    from fp4_dispatch.plugins.flashinfer.grouped_w4a4 import (
        FiGroupedW4A4Backend,
        FiGroupedW4A4Sm107Backend,
    )

    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))

    problem = _backend_problem(64, 1536, 2048, 128, op="grouped_w4a4")
    for dev, b in (("sm100", FiGroupedW4A4Backend()), ("sm103", FiGroupedW4A4Backend()),
                   ("sm107", FiGroupedW4A4Sm107Backend())):  # fmt: skip
        device = simulated(dev)
        tactic = next(iter(b.tactics(problem, device)))
        c = b.build(tactic, problem, device).compiled
        assert (c.cubin_sm, c.sm_count, c.kind) == (DEVICES[dev], device.sm_count, b.kind)
        assert c.path is not None and c.path.startswith(str(tmp_path))


@needs_fi
def test_w4a4_rubin_family_offers_flashinfers_rubin_tactics():
    from fp4_dispatch.backends.flashinfer import grouped_w4a4 as g4
    from fp4_dispatch.plugins.flashinfer.grouped_w4a4 import FiGroupedW4A4Sm107Backend, tactic_of

    b, dev = FiGroupedW4A4Sm107Backend(), simulated("sm107")
    fis = g4.flashinfer_tactics("sm107")
    assert fis and [tactic_of(fi).to_fi() for fi in fis] == list(fis)
    problem = _backend_problem(512, 2048, 768, 128, op="grouped_w4a4")
    offered = list(b.tactics(problem, dev))
    assert offered and all(b.validate(t, problem, dev) is None for t in offered)
    assert not b.supports(simulated("sm100")).ok


@needs_fi
@pytest.mark.parametrize("dev", sorted(DEVICES))
def test_cli_explain_shows_each_grouped_familys_floor(capsys, dev):
    """``fp4-dispatch explain --op grouped_* --groups E --device sm10x``: every family with a
    valid tactic keeps its floor (here each operation has one family per device)."""

    from fp4_dispatch.cli import main

    want = {
        "grouped_w4a16": "fi-grouped-w4a16",
        "grouped_w4a4": "fi-grouped-w4a4-sm107" if dev == "sm107" else "fi-grouped-w4a4",
    }
    for op, family in want.items():
        argv = ["explain", "64", "1536", "2048", "--op", op, "--groups", "128"]
        assert main([*argv, "--device", dev, "--budget", "8", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        kept: dict[str, int] = {}
        for c in out["candidates"]:
            kept[c["family"]] = kept.get(c["family"], 0) + 1
        assert family in kept, out["cut"]
        for fam, cut in out["cut"].items():
            assert kept.get(fam, 0) >= min(out["floor"], kept.get(fam, 0) + cut), (fam, out)


# ---- the one-launch routing (Triton; under the interpreter here) --------------------------

_ROUTE_SCRIPT = r"""
import json, random, sys
import torch
from fp4_dispatch.backends.flashinfer import grouped as fg
from fp4_dispatch.backends.flashinfer import route_triton as rt

results = []
for seed, experts, tokens, tile, past_end in json.loads(sys.argv[1]):
    rng = random.Random(seed)
    cuts = sorted(rng.randint(0, tokens) for _ in range(experts - 1))
    ends = torch.tensor([*cuts, tokens], dtype=torch.int32)
    if past_end:  # rows of no expert, and an end past T (both clamped the same way)
        ends[-2:] = torch.tensor([tokens - 2, tokens + 5], dtype=torch.int32)
        ends[:-1] = ends[:-1].clamp(max=tokens - 2)
    want = fg.route(ends, tokens, tile)  # CPU tensors: the torch path
    n = want.slots // tile
    got = (torch.empty(tokens, dtype=torch.int64), torch.empty(tokens, dtype=torch.bool),
           torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32),
           torch.empty(1, dtype=torch.int32))
    rt.route_into(ends, tokens, tile, want.slots, got)
    same = [torch.equal(g, w) for g, w in zip(got, (want.dest, want.valid, want.tile_expert,
                                                     want.tile_limit, want.num_tiles))]
    results.append(same)
print(json.dumps(results))
"""


def test_one_launch_routing_equals_the_torch_routing():
    from conftest import run_interpreted

    cases = [(0, 8, 37, 8, False), (1, 128, 64, 16, False), (2, 6, 300, 128, True),
             (3, 1, 5, 8, False), (4, 256, 100, 256, True)]  # fmt: skip
    for case, same in zip(cases, run_interpreted(_ROUTE_SCRIPT, cases), strict=True):
        assert all(same), (case, same)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, tokens, tile", [(128, 8, 8), (128, 512, 16), (256, 32768, 128)])
def test_routing_on_a_gpu_equals_the_cpu_routing(experts, tokens, tile):
    """On any CUDA GPU (the H200 in CI): the Triton routing equals the torch routing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(tokens)
    picks = torch.randint(0, experts, (tokens,), generator=gen)
    ends = torch.cumsum(torch.bincount(picks, minlength=experts), 0).to(torch.int32)
    want = fg.route(ends, tokens, tile)
    got = fg.route(ends.cuda(), tokens, tile)
    for name in ("dest", "valid", "tile_expert", "tile_limit", "num_tiles"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.gpu
def test_w4a16_adapter_on_a_gpu_with_the_launch_emulated(monkeypatch):
    """The adapter's device ops on CUDA (routing, scatter, gather, select; no host sync
    needed), the FlashInfer launch replaced by the tile emulation (it needs Blackwell)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    counts = [3, 0, 40, 1, 0, 20]
    tokens, n, k = sum(counts) + 2, 24, 32
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(-3, 4, (tokens, k), generator=gen).to(torch.bfloat16)
    weights = torch.randint(-2, 3, (len(counts), n, k), generator=gen).double()
    alpha = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.0, 4.0])

    def launch(self, operands, routing, padded, result):  # the emulation, on the CPU
        host = torch.full(result.shape, float("nan"), dtype=torch.float64)
        p = padded.cpu()
        for j in range(int(routing.num_tiles[0])):
            e = int(routing.tile_expert[j])
            lo, hi = j * self.route_tile, min((j + 1) * self.route_tile, int(routing.tile_limit[j]))
            host[lo:hi] = p[lo:hi].double() @ weights[e].T * float(alpha[e])
        result.copy_(host.to(result.dtype))

    monkeypatch.setattr(fg.GroupedW4A16Kernel, "launch", launch)
    operands = types.SimpleNamespace(a=a.cuda(), offsets=_offsets(counts).cuda(),
                                     alpha=alpha.cuda(), b_scale=None,
                                     b_data=torch.zeros(len(counts), n, k // 2,
                                                        dtype=torch.uint8).cuda())  # fmt: skip
    compiled = types.SimpleNamespace(tactic=((128, 16, 256), (1, 1), True), experts=len(counts))
    out = torch.full((tokens, n), 7.0, dtype=torch.bfloat16, device="cuda")
    fg.GroupedW4A16Kernel(compiled)(operands, out)
    want = torch.full((tokens, n), 7.0, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want[start : start + c] = a[start : start + c].double() @ weights[e].T * float(alpha[e])
        start += c
    assert torch.equal(out.cpu(), want.to(torch.bfloat16))


@needs_fi
def test_cli_compile_builds_a_grouped_tactic_once_then_loads_it(tmp_path, monkeypatch, capsys):
    """``fp4-dispatch compile --op grouped_w4a16 --groups E``: compiled for sm_100a, then a
    second run compiles nothing (a worker still holding it, or the on-disk cache)."""
    from fp4_dispatch.backends import cute as cb
    from fp4_dispatch.cli import main

    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))
    argv = ["compile", "64", "1536", "2048", "--op", "grouped_w4a16", "--groups", "128",
            "--device", "sm100", "--budget", "1", "--jobs", "1", "--no-progress"]  # fmt: skip
    sources = []
    for _ in range(2):
        assert main([*argv, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert set(report["families"]) == {"fi-grouped-w4a16"}, report["families"]
        (row,) = report["results"]
        assert row["ok"] and row["cubin_sm"] == 100, row
        sources.append(row["source"])
    assert sources[0] == "compiled" and sources[1] in ("memory", "disk"), sources
