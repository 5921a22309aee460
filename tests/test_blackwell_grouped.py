"""Grouped NVFP4 GEMMs on Blackwell/Rubin: family ``fi-grouped-w4a16`` (FlashInfer's SM100
W4A16 grouped GEMM), compiled for sm_100a / sm_103a / sm_107a, never run here.

The routed-tile layout that adapts torch's offsets to FlashInfer's kernel is plain torch
and is tested on the CPU against an exact per-group computation, through the kernel's
own call path with only the launch replaced by an emulation of FlashInfer's documented
tile semantics. Tests that need ``flashinfer-python`` skip when the extra is absent.
"""

from __future__ import annotations

import importlib.util
import random
import types

import pytest
import torch
from pydantic import ValidationError

from fp4_dispatch.backends.flashinfer import grouped as fg
from fp4_dispatch.plugins.flashinfer.grouped import (
    FiGroupedW4A16Backend,
    FiGroupedW4A16Tactic,
    tactic_of,
)
from fp4_dispatch.profiles import simulated

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
def test_adapter_is_exact_against_per_group_reference(monkeypatch, route_tile):
    rng = random.Random(route_tile)
    experts, tokens, n, k = 6, 45, 24, 32
    counts = _random_counts(rng, experts, tokens)
    gen = torch.Generator().manual_seed(route_tile)
    # small integers: every product and sum is exact in float64 and in bf16
    a = torch.randint(-3, 4, (tokens, k), generator=gen).to(torch.bfloat16)
    weights = torch.randint(-2, 3, (experts, n, k), generator=gen).double()
    alpha = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.0, 4.0])
    offsets = _offsets(counts)
    operands = types.SimpleNamespace(
        a=a, offsets=offsets, alpha=alpha,
        b_data=torch.zeros(experts, n, k // 2, dtype=torch.uint8), b_scale=None,
    )  # fmt: skip
    compiled = types.SimpleNamespace(tactic=((128, route_tile, 256), (1, 1), True),
                                     experts=experts)  # fmt: skip
    monkeypatch.setattr(fg.GroupedW4A16Kernel, "launch", _emulate(weights))
    out = torch.full((tokens, n), 7.0, dtype=torch.bfloat16)
    fg.GroupedW4A16Kernel(compiled)(operands, out)
    want = torch.empty(tokens, n, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want[start : start + c] = a[start : start + c].double() @ weights[e].T * float(alpha[e])
        start += c
    assert torch.equal(out, want.to(torch.bfloat16))


def test_adapter_refuses_fp16_and_a_wrong_expert_count():
    compiled = types.SimpleNamespace(tactic=((128, 8, 256), (1, 1), True), experts=4)
    kernel = fg.GroupedW4A16Kernel(compiled)
    ops = types.SimpleNamespace(a=torch.zeros(3, 32, dtype=torch.float16), offsets=_offsets([3]),
                                b_data=torch.zeros(4, 8, 16, dtype=torch.uint8))  # fmt: skip
    with pytest.raises(ValueError, match="a: expected contiguous bfloat16"):
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
