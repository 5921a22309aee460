"""`backends.sm90.splitk`: the split-K epilogue the sm90 Triton GEMMs share, under
TRITON_INTERPRET=1: the K-tile shares of `k_tile_range`, and `store_tile`'s protocol
(partials in the workspace, the last split sums them in split order, scales, adds the
bias, rounds once, stores through a mask and resets the tile's counter)."""

from __future__ import annotations

import math

from conftest import run_interpreted

_SCRIPT = r"""
import json, sys
import torch
import triton
import triton.language as tl
from fp4_dispatch.backends.sm90.splitk import k_tile_range, store_tile


@triton.jit
def ranges(out_ptr, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_k = tl.program_id(0)
    kt0, kt1 = k_tile_range(K, BLOCK_K, SPLIT_K, pid_k)
    tl.store(out_ptr + 2 * pid_k, kt0)
    tl.store(out_ptr + 2 * pid_k + 1, kt1)


@triton.jit
def tiles(out_ptr, ws_ptr, cnt_ptr, scale, M, N, ROWS: tl.constexpr, COLS: tl.constexpr,
          SPLIT_K: tl.constexpr, ADD_BIAS: tl.constexpr):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    r = pid * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    # split s contributes (s + 1) * (r * COLS + c): the sum over splits is known
    acc = ((pid_k + 1) * (r * COLS + c)).to(tl.float32)
    store_tile(acc, scale, out_ptr + r * N + c, (r < M) & (c < N), ws_ptr, cnt_ptr, pid,
               pid_k, ROWS, COLS, SPLIT_K, 0.5, ADD_BIAS)


res = {"ranges": [], "tiles": []}
for k, block_k, split_k in json.loads(sys.argv[1])["ranges"]:
    out = torch.full((split_k, 2), -1, dtype=torch.int32)
    ranges[(split_k,)](out, k, BLOCK_K=block_k, SPLIT_K=split_k)
    res["ranges"].append(out.tolist())
for m, n, split_k, bias in json.loads(sys.argv[1])["tiles"]:
    rows, cols = 16, 16
    n_tiles = triton.cdiv(m, rows)
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    ws = torch.full((n_tiles * split_k * rows * cols,), float("nan"), dtype=torch.float32)
    cnt = torch.zeros(n_tiles, dtype=torch.int32)
    calls = []
    for _ in range(2):  # the second call finds the counters reset
        out.fill_(float("nan"))
        tiles[(n_tiles, split_k)](out, ws, cnt, 2.0, m, n, ROWS=rows, COLS=cols,
                                  SPLIT_K=split_k, ADD_BIAS=bias)
        calls.append(out.tolist())
    res["tiles"].append({"calls": calls, "counters": cnt.tolist()})
print(json.dumps(res))
"""

RANGES = [(1024, 128, 1), (1024, 128, 3), (1000, 64, 4), (256, 128, 4), (8192, 256, 7)]
TILES = [(20, 12, 1, False), (20, 12, 3, True), (32, 16, 4, False)]


def _run() -> dict:
    return run_interpreted(_SCRIPT, {"ranges": RANGES, "tiles": TILES})


def test_split_k_shares_and_tiles():
    got = _run()
    for (k, block_k, split_k), shares in zip(RANGES, got["ranges"], strict=True):
        k_tiles = math.ceil(k / block_k)
        per = math.ceil(k_tiles / split_k)
        # equal shares in split order; the last may be shorter or empty; together all tiles
        assert [s[0] for s in shares] == [i * per for i in range(split_k)]
        assert [s[1] for s in shares] == [min((i + 1) * per, k_tiles) for i in range(split_k)]
        covered = [t for lo, hi in shares for t in range(lo, hi)]
        assert covered == list(range(k_tiles)), (k, block_k, split_k)
    for (m, n, split_k, bias), tile in zip(TILES, got["tiles"], strict=True):
        total = split_k * (split_k + 1) // 2  # sum over splits of (s + 1)
        want = [[2.0 * total * (r * 16 + c) + (0.5 if bias else 0.0) for c in range(n)]
                for r in range(m)]  # fmt: skip
        assert tile["calls"] == [want, want], (m, n, split_k, bias)
        assert tile["counters"] == [0] * len(tile["counters"])  # ready for the next call
