"""Fused MoE routing and combine in Triton: the work around `Nvfp4MoE`'s grouped GEMMs.

Why: the torch path of `fp4_dispatch.integrations.moe` (``route``: softmax, topk, sum,
div; ``sort_by_expert``: sort, arange, searchsorted, floor-div; ``combine``:
index_copy_, float, mul, sum, cast) is ~15 small device kernels a layer, at decode
about as much GPU time as the layer's two grouped GEMMs (an H100 profile of a
Qwen3-30B-A3B-like layer, one token: issue 35). Here they are two launches:

- `route_sorted`: ONE program computes the softmax, the top-k and a counting sort of
  the ``P = T * k`` (token, slot) pairs by expert. Phase A walks blocks of ``BT``
  tokens (``[BT, E]`` logits a tile): float32 softmax, then k rounds of "largest
  remaining logit per row, lowest expert index among equal logits", which also counts
  the pairs per expert; the expert ids go to the ``inv`` output as scratch. The
  inclusive cumsum of the counts is ``offsets``. Phase B walks blocks of ``BP`` pairs
  in flat order: a pair's sorted row is its expert's start plus the number of earlier
  pairs of that expert (a running per-expert count plus an in-block cumsum of the
  one-hot ``[BP, E]`` matrix), which is exactly the stable sort by expert id. It
  overwrites ``inv`` with that row and scatters ``order`` and ``token``. One
  ``debug_barrier`` (``bar.sync``, which also orders the program's global writes)
  separates the phases.
- `combine_rows`: one program per (token, column block): ``out[t] = sum_j w[t, j] *
  y[inv[t * k + j]]`` in float32, added one at a time from slot 0, each product
  rounded before its add (``enable_fp_fusion=False``: no FMA, as torch's separate mul
  and sum), rounded once to the output dtype (bf16 by hand, `_bf16_rn`). It reads each
  expert row where the GEMM wrote it, so the ``index_copy_`` back to pair order
  disappears. torch's ``combine`` adds the k terms in an order of its own choosing,
  so the two agree to float32 rounding, bit for bit only where that order is slot
  order.

Semantics equal the torch path's (tests/test_moe_route.py): ``ids`` are chosen by the
float32 logits, not the probabilities (softmax is monotone, so the same experts, and
no two logits that round to one probability can swap); among EQUAL logits the lowest
expert index comes first. ``torch.topk`` documents no tie rule, so with ties the two
paths may pick or order experts differently (float32 random logits have none; bf16
router logits tie now and then). A NaN logit is chosen as if it were -inf
(``torch.topk`` takes NaN as the largest); its row's probabilities are NaN in both
paths, so that token's output is NaN either way, and every index stays valid. The
weights are the probabilities of the chosen experts, renormalised by their sum when
``norm_topk_prob``, computed as torch does (``exp(x - max) / sum``, divisions rounded
to nearest, the exp range-reduced: `_exp_nonpositive`): equal to float32 rounding (a
few ulps, not bits: torch's exp and summation order are its own).

Limits (one program: decode-sized calls): ``T * k <= MAX_PAIRS`` and ``E <=
MAX_EXPERTS`` (`fits`); the caller uses the torch path beyond them. Both constants are
issue 35's bounds for a one-program kernel, not fitted on a GPU (a large prefill may
well be faster on the torch path); the tile sizes (`_TILE_ELEMS`) and warp counts
(`_ONE_WARP_ELEMS`) are not tuned either.

No host synchronisation and no allocation besides the ``torch.empty`` outputs: a warm
call captures in a CUDA graph. Launches go through `fp4_dispatch.backends.triton_launch`,
both with ``enable_fp_fusion=False`` (the same arithmetic whatever a Triton version's
default; tests/test_moe_route.py compiles both for sm90 and sm100 on the CPU).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .triton_launch import CachedLauncher

log = logging.getLogger(__name__)

__all__ = ["LOGIT_DTYPES", "MAX_EXPERTS", "MAX_PAIRS", "combine_rows", "fits", "route_sorted"]

#: the most (token, slot) pairs one `route_sorted` program takes (issue 35; not fitted)
MAX_PAIRS = 4096
#: the most experts (issue 35; not fitted: a ``[BT, E]`` logits tile per block)
MAX_EXPERTS = 1024
#: elements of one 2-D tile (``[BT, E_PAD]`` in phase A, ``[BP, E_PAD]`` in phase B);
#: a register budget for 4 warps, not tuned
_TILE_ELEMS = 8192
#: up to this many elements in the larger tile, `route_sorted` runs as one warp: its
#: row reductions (three a top-k round) are then warp shuffles with no CTA barrier (a decode:
#: ``[1, 128]`` and ``[8, 128]`` for Qwen3-30B-A3B); a guess, not measured
_ONE_WARP_ELEMS = 2048
#: columns of ``y`` one `combine_rows` program sums (not tuned)
_COMBINE_BLOCK = 1024

#: the router logits' dtypes the kernel reads
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fits(tokens: int, experts: int, top_k: int) -> bool:
    """Whether `route_sorted` takes a call of this size (one program's limits)."""
    return 0 < tokens * top_k <= MAX_PAIRS and 0 < experts <= MAX_EXPERTS


@triton.jit
def _exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0`` (or -inf) to about 2 ulps on a GPU too. Why not
    ``tl.exp``: on NVIDIA it is ``ex2.approx(x * log2(e))``, whose product rounding
    costs ``|x| * 2^-24`` relative error (7e-7 at ``x = -10``) before the approximation's
    own. Cody-Waite: ``x = n ln2 + r`` with ``|r| <= ln2 / 2`` (``ln2`` split in two so
    ``n * LN2_HI`` is exact for ``|n| <= 126``), ``exp(r)`` by ``tl.exp``, times ``2^n``
    made from its bits. Below ``2^-126`` (``n`` clamped) the result is only approximate,
    as probabilities that small are."""
    n = tl.maximum(tl.floor(x * 1.4426950408889634 + 0.5), -126.0)
    r = (x - n * 0.693145751953125) - n * 1.4286068202862268e-06
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.exp(r) * scale


@triton.jit
def _route_sorted_kernel(
    logits_ptr,
    weights_ptr,
    order_ptr,
    token_ptr,
    offsets_ptr,
    inv_ptr,
    T,
    E,
    stride_t,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BT: tl.constexpr,
    BP: tl.constexpr,
    NORM: tl.constexpr,
):
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    slots = tl.arange(0, K_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    # phase A: softmax and top-k per token block; ids to inv (scratch), counts per expert
    for t0 in range(0, T, BT):
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < T
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=ok,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
        x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
        m = tl.max(x, axis=1)
        ex = _exp_nonpositive(x - m[:, None])
        probs = tl.math.div_rn(ex, tl.sum(ex, axis=1)[:, None])
        free = col_ok[None, :] & (rows[:, None] >= 0)  # [BT, E_PAD]: not yet chosen
        x = tl.where(x == x, x, float("-inf"))  # NaN: chosen as -inf (its probs stay NaN)
        w = tl.zeros([BT, K_PAD], dtype=tl.float32)
        ids = tl.zeros([BT, K_PAD], dtype=tl.int32)
        for j in tl.static_range(K):
            key = tl.where(free, x, float("-inf"))
            best = tl.max(key, axis=1)
            hit = free & (key == best[:, None])
            idx = tl.min(tl.where(hit, cols[None, :], E_PAD), axis=1)  # lowest index
            sel = cols[None, :] == idx[:, None]
            pj = tl.sum(tl.where(sel, probs, 0.0), axis=1)
            w = tl.where(slots[None, :] == j, pj[:, None], w)
            ids = tl.where(slots[None, :] == j, idx[:, None], ids)
            counts += tl.sum((sel & row_ok[:, None]).to(tl.int32), axis=0)
            free = free & ~sel
        if NORM:
            w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None])
        pair = rows[:, None] * K + slots[None, :]
        keep = row_ok[:, None] & (slots[None, :] < K)
        tl.store(weights_ptr + pair, w, mask=keep)
        tl.store(inv_ptr + pair, ids, mask=keep)
    ends = tl.cumsum(counts, axis=0)
    tl.store(offsets_ptr + cols, ends, mask=col_ok)
    start = ends - counts
    tl.debug_barrier()  # phase A's id writes before phase B's reads (one CTA)
    # phase B: stable counting sort of the pairs in flat order
    P = T * K
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # pairs of each expert in earlier blocks
    for p0 in range(0, P, BP):
        pid = p0 + tl.arange(0, BP)
        p_ok = pid < P
        eid = tl.load(inv_ptr + pid, mask=p_ok, other=E_PAD)  # padding matches no expert
        hot = (eid[:, None] == cols[None, :]).to(tl.int32)
        upto = tl.cumsum(hot, axis=0)  # pairs of each expert in this block up to p
        row = tl.sum(hot * (start[None, :] + seen[None, :] + upto - 1), axis=1)
        seen += tl.sum(hot, axis=0)
        tl.store(inv_ptr + pid, row, mask=p_ok)
        tl.store(order_ptr + row, pid.to(tl.int64), mask=p_ok)
        tl.store(token_ptr + row, (pid // K).to(tl.int64), mask=p_ok)


@triton.jit
def _combine_kernel(
    y_ptr,
    inv_ptr,
    weights_ptr,
    out_ptr,
    H,
    stride_y,
    stride_o,
    K: tl.constexpr,
    BH: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(weights_ptr + t * K + j)
        r = tl.load(inv_ptr + t * K + j).to(tl.int64)
        v = tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + w * v  # no FMA: launched with enable_fp_fusion=False
    out = _bf16_rn(acc) if OUT_BF16 else acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + cols, out, mask=ok)


@triton.jit
def _bf16_rn(x):
    """float32 -> bfloat16, round to nearest even, on the bits: the interpreter's own
    cast truncates (Triton 3.9), so the GPU's ``cvt.rn.bf16.f32`` bits are made by hand
    (NaN stays a quiet NaN; a carry out of the mantissa rounds up to the next binade or
    to inf, as it should)."""
    bits = x.to(tl.int32, bitcast=True)
    up = bits + (0x7FFF + ((bits >> 16) & 1))
    hi = tl.where(x != x, 0x7FC0, (up >> 16) & 0xFFFF)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


_route = CachedLauncher(_route_sorted_kernel)
_combine = CachedLauncher(_combine_kernel)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def route_sorted(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing and the sort by expert of router ``logits`` ``[T, E]``, one launch.

    Returns (weights float32 ``[T, k]``, order int64 ``[T*k]``, token int64 ``[T*k]``,
    offsets int32 ``[E]``, inv int32 ``[T*k]``): the first four as
    ``route`` + ``sort_by_expert`` of `fp4_dispatch.integrations.moe` compute them (module
    docstring: ties and rounding); ``inv`` is the inverse of ``order`` (the sorted row of
    each flat pair), which `combine_rows` reads. int32 suffices: ``T*k <= MAX_PAIRS``.
    Checks nothing a caller of `fits` already knows; raises on a size beyond it.
    """
    t, e = logits.shape
    if not fits(t, e, top_k) or top_k > e:
        raise ValueError(f"route_sorted: T={t}, E={e}, k={top_k} beyond the kernel's limits")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits: expected float32, float16 or bfloat16, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev, p = logits.device, t * top_k
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    order = torch.empty(p, dtype=torch.int64, device=dev)
    token = torch.empty(p, dtype=torch.int64, device=dev)
    offsets = torch.empty(e, dtype=torch.int32, device=dev)
    inv = torch.empty(p, dtype=torch.int32, device=dev)
    e_pad = _pow2(e)
    per_tile = max(1, _TILE_ELEMS // e_pad)
    meta = {"K": top_k, "K_PAD": _pow2(top_k), "E_PAD": e_pad, "NORM": bool(norm_topk_prob),
            "BT": min(_pow2(t), per_tile), "BP": min(_pow2(p), per_tile)}  # fmt: skip
    warps = 1 if max(meta["BT"], meta["BP"]) * e_pad <= _ONE_WARP_ELEMS else 4
    bound = _route.bind(meta, num_warps=warps, enable_fp_fusion=False)  # as any Triton
    bound((1,), (logits, weights, order, token, offsets, inv, t, e, logits.stride(0)))
    return weights, order, token, offsets, inv


def combine_rows(
    y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: ``out[t] = sum_j weights[t, j] * y[inv[t*k + j]]``.

    ``y`` ``[T*k, H]`` holds the expert rows in sorted order (the grouped GEMM's output),
    ``inv`` the sorted row of each flat pair (`route_sorted`), ``weights`` float32 ``[T,
    k]``. Float32 products, added one at a time from slot 0, rounded once. Equal to
    ``combine(y, order, weights).to(out_dtype)`` to float32 rounding: torch's sum over
    the k slots picks its own order of additions (on the CPU it changes with H), so the
    bits agree only where that order is slot order. Why ``inv`` and not ``order``: a
    program reads its token's k rows directly, with no scatter back to pair order.
    """
    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    bh = min(_pow2(h), _COMBINE_BLOCK)
    meta = {"K": k, "BH": bh, "OUT_BF16": out_dtype == torch.bfloat16}
    bound = _combine.bind(meta, num_warps=4, enable_fp_fusion=False)
    bound((t, triton.cdiv(h, bh)), (y, inv, weights, out, h, y.stride(0), out.stride(0)))
    return out
