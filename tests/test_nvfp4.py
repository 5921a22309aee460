"""Tests for fp4_dispatch.format.nvfp4 against an independent, slow, element-by-element reference.

The reference below shares no code with the module: e4m3 and e2m1 rounding are written
out from the format definitions (grid scan with an explicit tie-to-even rule), scale
offsets come from the documented storage formula evaluated entry by entry, and packing is done
byte by byte. Only float32 arithmetic (the spec's "compute in float32") uses numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fp4_dispatch.format import nvfp4
from fp4_dispatch.format.nvfp4 import (
    E2M1_VALUES,
    Nvfp4Tensor,
    as_uint8_data,
    dequantize,
    e2m1_to_float,
    pack_e2m1,
    quantize_nvfp4,
    reference_gemm,
    swizzle_scales,
    swizzled_scale_shape,
    unpack_e2m1,
    unswizzle_scales,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_SETTINGS = settings(max_examples=50, deadline=None)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
F32 = np.float32

# ---------------------------------------------------------------------------------------
# Independent slow reference
# ---------------------------------------------------------------------------------------


def ref_round_e2m1(v: float) -> int:
    """Nearest grid point by scanning; on equal distance prefer the even code."""
    mag = abs(v)
    best, best_d = 0, abs(mag - GRID[0])
    for code in range(1, len(GRID)):
        d = abs(mag - GRID[code])
        if d < best_d or (d == best_d and code % 2 == 0):
            best, best_d = code, d
    if best != 0 and v < 0:
        best |= 8
    return best


def ref_decode_e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * GRID[code & 7]


def ref_e4m3(v: float) -> float:
    """Round a non-negative finite value <= 448 to e4m3fn, nearest-even (bias 7, 3 bits)."""
    assert 0.0 <= v <= 448.0
    if v == 0.0:
        return 0.0
    _, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    exp = max(e - 1, -6)  # below 2**-6 the subnormal step 2**-9 applies
    step = 2.0 ** (exp - 3)
    q = round(v / step) * step  # python round(): half to even; v / step is exact
    return min(q, 448.0)


def ref_e4m3_bits(q: float) -> int:
    """The e4m3fn byte of a non-negative representable value."""
    if q == 0.0:
        return 0
    _, e = math.frexp(q)
    exp = e - 1
    if exp < -6:
        mant = q / 2.0**-9
        assert mant == int(mant) and 0 < mant < 8
        return int(mant)
    mant = (q / 2.0**exp - 1.0) * 8
    assert mant == int(mant)
    return ((exp + 7) << 3) | int(mant)


def ref_e4m3_from_bits(b: int) -> float:
    exp, mant = (b >> 3) & 0xF, b & 7
    sign = -1.0 if b & 0x80 else 1.0
    if exp == 0:
        return sign * mant * 2.0**-9
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


def ref_default_global(x: np.ndarray) -> np.float32:
    """amax over the FINITE values / (6 * 448); 1.0 when that is 0."""
    finite = np.abs(x[np.isfinite(x)])
    amax = F32(np.max(finite)) if finite.size else F32(0)
    g = F32(amax / F32(6 * 448))
    return F32(1.0) if g == 0 else g


def ref_quantize(x: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [R, K], linear scale bytes uint8 [R, K/16]) for float32 x."""
    r, k = x.shape
    kb = k // 16
    codes = np.zeros((r, k), dtype=np.uint8)
    sbytes = np.zeros((r, kb), dtype=np.uint8)
    with np.errstate(over="ignore"):
        for i in range(r):
            for b in range(kb):
                blk = x[i, b * 16 : (b + 1) * 16]
                if not all(math.isfinite(float(v)) for v in blk):
                    sbytes[i, b] = 0x7F  # e4m3 NaN; codes stay 0
                    continue
                amax = max(abs(float(v)) for v in blk)
                sf = F32(F32(amax) / F32(6.0)) / g
                s = ref_e4m3(min(float(sf), 448.0))
                sbytes[i, b] = ref_e4m3_bits(s)
                denom = F32(F32(s) * g)
                if denom == 0:
                    continue
                ys = (blk / denom).astype(np.float32).tolist()
                for j, y in enumerate(ys):
                    codes[i, b * 16 + j] = ref_round_e2m1(y)
    return codes, sbytes


def ref_pack(codes: np.ndarray) -> np.ndarray:
    r, k = codes.shape
    out = np.zeros((r, k // 2), dtype=np.uint8)
    for i in range(r):
        for j in range(k // 2):
            out[i, j] = int(codes[i, 2 * j]) | (int(codes[i, 2 * j + 1]) << 4)
    return out


def ref_unpack(data: np.ndarray) -> np.ndarray:
    r, kh = data.shape
    out = np.zeros((r, kh * 2), dtype=np.uint8)
    for i in range(r):
        for j in range(kh):
            byte = int(data[i, j])
            out[i, 2 * j] = byte & 0xF
            out[i, 2 * j + 1] = byte >> 4
    return out


def ref_offset(m: int, kb: int, k: int) -> int:
    num_k_tiles = -(-(k // 16) // 4)
    return (
        (m // 128) * num_k_tiles * 512
        + (kb // 4) * 512
        + (m % 32) * 16
        + ((m % 128) // 32) * 4
        + (kb % 4)
    )


def ref_swizzle(lin: np.ndarray, k: int) -> np.ndarray:
    """Flat swizzled storage (uint8) of linear scale bytes [R, K/16]."""
    r, kb = lin.shape
    rp = -(-r // 128) * 128
    kp = -(-kb // 4) * 4
    out = np.zeros(rp * kp, dtype=np.uint8)
    for m in range(r):
        for b in range(kb):
            out[ref_offset(m, b, k)] = lin[m, b]
    return out


def ref_dequant(codes: np.ndarray, sbytes: np.ndarray, g: np.float32) -> np.ndarray:
    r, k = codes.shape
    out = np.zeros((r, k), dtype=np.float32)
    for i in range(r):
        for j in range(k):
            s = ref_e4m3_from_bits(int(sbytes[i, j // 16]))
            prod = ref_decode_e2m1(int(codes[i, j])) * s  # exact
            out[i, j] = F32(F32(prod) * g)
    return out


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).cpu().numpy()


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

rows_st = st.integers(1, 300)
k_st = st.integers(1, 16).map(lambda n: 16 * n)
layout_st = st.sampled_from(["swizzled", "linear"])


def make_input(seed: int, rows: int, k: int, log2_mag: int, zero_frac: float) -> torch.Tensor:
    """Random data with varied per-element magnitude and some all-zero blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, k, generator=gen))
    x = x * 2.0**log2_mag
    zero_blocks = torch.rand(rows, k // 16, 1, generator=gen) < zero_frac
    return x.reshape(rows, k // 16, 16).masked_fill(zero_blocks, 0.0).reshape(rows, k)


# ---------------------------------------------------------------------------------------
# Reference self-checks (so a wrong reference cannot silently agree)
# ---------------------------------------------------------------------------------------


def test_reference_e4m3_matches_all_torch_codes() -> None:
    bits = torch.arange(0, 0x7F, dtype=torch.uint8)  # every finite non-negative pattern
    vals = bits.view(torch.float8_e4m3fn).float().tolist()
    for b, v in zip(bits.tolist(), vals, strict=True):
        assert ref_e4m3_from_bits(b) == v
        assert ref_e4m3(v) == v
        assert ref_e4m3_bits(v) == b


def test_reference_e4m3_rounding_agrees_with_torch_between_codes() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.cat([torch.rand(4000, generator=gen) * 448, torch.rand(2000, generator=gen) / 32])
    got = v.to(torch.float8_e4m3fn).float().tolist()
    for vi, gi in zip(v.tolist(), got, strict=True):
        assert ref_e4m3(vi) == gi


# ---------------------------------------------------------------------------------------
# e2m1 codes
# ---------------------------------------------------------------------------------------


def test_e2m1_values_and_decode_table() -> None:
    assert tuple(E2M1_VALUES) == tuple(GRID)
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_to_float(codes).tolist() == [ref_decode_e2m1(c) for c in range(16)]


TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize(("value", "expected"), TIES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_to_even_through_quantize(value: float, expected: float, sign: float) -> None:
    # A 6.0 in the block pins its scale to exactly 1.0 with global_scale 1.0.
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = sign * value
    q = quantize_nvfp4(x, global_scale=1.0, layout="linear")
    assert q.scale.float().tolist() == [[1.0]]
    d = dequantize(q)
    assert d[0, 1].item() == sign * expected
    assert ref_round_e2m1(sign * value) == int(unpack_e2m1(q.data)[0, 1])


def test_saturation_and_nearest() -> None:
    y = torch.tensor([[0.1, 0.3, 0.74, 0.76, 2.4, 2.6, 4.9, 5.1, 6.0, 100.0, -7.0, -0.0]])
    got = e2m1_to_float(nvfp4.round_to_e2m1(y)).tolist()[0]
    want = [ref_decode_e2m1(ref_round_e2m1(v)) for v in y.tolist()[0]]
    assert got == want
    assert got[-3:] == [6.0, -6.0, 0.0]


@SMALL_SETTINGS
@given(st.integers(1, 20), st.integers(1, 40).map(lambda n: 2 * n), st.integers(0, 2**31))
def test_pack_unpack_match_reference(rows: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), dtype=torch.uint8, generator=gen)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (rows, k // 2)
    np.testing.assert_array_equal(packed.numpy(), ref_pack(codes.numpy()))
    np.testing.assert_array_equal(ref_unpack(packed.numpy()), codes.numpy())
    assert torch.equal(unpack_e2m1(packed), codes)


def test_low_nibble_is_even_column() -> None:
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x43]]


# ---------------------------------------------------------------------------------------
# Scale swizzle
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(rows_st, k_st, st.integers(0, 2**31))
@example(300, 256, 1)
@example(129, 80, 2)
def test_swizzle_matches_formula_and_round_trips(rows: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lin_bits = torch.randint(1, 0x7F, (rows, k // 16), dtype=torch.uint8, generator=gen)
    lin = lin_bits.view(torch.float8_e4m3fn)
    sw = swizzle_scales(lin)
    assert sw.dtype == torch.float8_e4m3fn
    assert tuple(sw.shape) == swizzled_scale_shape(rows, k)
    assert tuple(sw.shape) == (-(-rows // 128) * 128, -(-(k // 16) // 4) * 4)
    assert sw.is_contiguous()
    np.testing.assert_array_equal(bytes_of(sw).reshape(-1), ref_swizzle(lin_bits.numpy(), k))
    assert torch.equal(swizzle_scales(lin, rows, k).view(torch.uint8), sw.view(torch.uint8))
    back = unswizzle_scales(sw, rows, k)
    assert tuple(back.shape) == (rows, k // 16)
    assert torch.equal(back.view(torch.uint8), lin_bits)


def test_swizzle_padding_is_zero() -> None:
    lin = torch.full((5, 3), 2.0).to(torch.float8_e4m3fn)
    flat = bytes_of(swizzle_scales(lin)).reshape(-1)
    used = {ref_offset(m, b, 48) for m in range(5) for b in range(3)}
    assert flat.size == 128 * 4
    for off in range(flat.size):
        assert (flat[off] != 0) == (off in used)


def test_swizzle_shape_checks() -> None:
    lin = torch.zeros(4, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rows"):
        swizzle_scales(lin, rows=5)
    with pytest.raises(ValueError, match="k=64"):
        swizzle_scales(lin, rows=4, k=64)
    with pytest.raises(TypeError, match=r"float8_e4m3fn"):
        swizzle_scales(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="swizzled"):
        unswizzle_scales(torch.zeros(128, 8).to(torch.float8_e4m3fn), 4, 32)


# ---------------------------------------------------------------------------------------
# Quantize / dequantize against the reference
# ---------------------------------------------------------------------------------------

g_mode_st = st.sampled_from(["default", "pow2", "any", "encode"])


@SETTINGS
@given(
    rows_st,
    k_st,
    layout_st,
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    g_mode_st,
    st.integers(-12, 12),
    st.sampled_from([0.0, 0.2]),
    st.integers(0, 2**31),
)
@example(300, 256, "swizzled", torch.float32, "default", 0, 0.2, 3)
@example(257, 48, "linear", torch.bfloat16, "any", 5, 0.0, 4)
def test_quantize_matches_reference(
    rows: int,
    k: int,
    layout: str,
    dtype: torch.dtype,
    g_mode: str,
    log2_mag: int,
    zero_frac: float,
    seed: int,
) -> None:
    x = make_input(seed, rows, k, log2_mag if dtype == torch.float32 else 0, zero_frac).to(dtype)
    xf = x.float().numpy()
    kwargs: dict[str, object] = {}
    if g_mode == "default":
        g = ref_default_global(xf)
    elif g_mode == "pow2":
        g = F32(2.0 ** (log2_mag - 11))
        kwargs["global_scale"] = float(g)
    elif g_mode == "any":
        g = F32(2.0**log2_mag * (0.3 + (seed % 1000) / 700))
        kwargs["global_scale"] = torch.tensor(g)
    else:
        enc = F32(2688.0 / (2.0**log2_mag * (1 + seed % 7)))
        g = F32(F32(1.0) / enc)
        kwargs["encode_scale"] = float(enc)
    q = quantize_nvfp4(x, layout=layout, **kwargs)

    codes, sbytes = ref_quantize(xf, g)
    assert q.shape == (rows, k) and q.rows == rows and q.k == k and q.layout == layout
    assert q.global_scale.dtype == torch.float32 and q.global_scale.dim() == 0
    assert q.global_scale.item() == float(g)
    np.testing.assert_array_equal(bytes_of(q.data), ref_pack(codes))
    if layout == "linear":
        np.testing.assert_array_equal(bytes_of(q.scale), sbytes)
    else:
        np.testing.assert_array_equal(bytes_of(q.scale).reshape(-1), ref_swizzle(sbytes, k))

    # dequantize (both layouts give the same values) against the reference decode
    d = dequantize(q)
    assert d.dtype == torch.float32 and tuple(d.shape) == (rows, k)
    np.testing.assert_array_equal(d.numpy(), ref_dequant(codes, sbytes, g))
    other = q.with_layout("linear" if layout == "swizzled" else "swizzled")
    assert torch.equal(dequantize(other), d)


@SETTINGS
@given(rows_st, k_st, layout_st, st.integers(-8, 8), st.integers(0, 2**31))
@example(300, 256, "swizzled", -3, 5)
def test_exact_round_trip_of_representable_values(
    rows: int, k: int, layout: str, log2_g: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    kb = k // 16
    codes = torch.randint(0, 16, (rows, kb, 16), dtype=torch.uint8, generator=gen)
    # one +-6 per block pins the block amax to exactly 6 * scale * g
    pos = torch.randint(0, 16, (rows, kb, 1), generator=gen)
    sixes = torch.where(torch.rand(rows, kb, 1, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    codes.scatter_(2, pos, sixes)
    # normal e4m3 scales (exponent field 1..15), some all-zero blocks
    scale_bits = torch.randint(8, 0x7F, (rows, kb), dtype=torch.uint8, generator=gen)
    scales = scale_bits.view(torch.float8_e4m3fn).float()
    zero = torch.rand(rows, kb, generator=gen) < 0.1
    scales = scales.masked_fill(zero, 0.0)
    g = 2.0**log2_g
    x = (e2m1_to_float(codes) * scales.unsqueeze(-1) * g).reshape(rows, k)

    q = quantize_nvfp4(x, global_scale=g, layout=layout)
    assert torch.equal(dequantize(q), x)
    # zero blocks give code 0; a negative zero (code 8) is written as code 0 too
    want_codes = codes.masked_fill(zero.unsqueeze(-1) | (codes == 8), 0).reshape(rows, k)
    assert torch.equal(unpack_e2m1(q.data), want_codes)
    assert torch.equal(q.with_layout("linear").scale.float(), scales)


@SMALL_SETTINGS
@given(st.integers(1, 40), st.integers(1, 4).map(lambda n: 16 * n), st.integers(0, 2**31))
def test_encode_scale_equals_inverse_global_scale(rows: int, k: int, seed: int) -> None:
    x = make_input(seed, rows, k, 0, 0.1)
    enc = torch.tensor(2688.0, dtype=torch.float32) / x.abs().amax().clamp(min=1e-6)
    q1 = quantize_nvfp4(x, encode_scale=enc)
    q2 = quantize_nvfp4(x, global_scale=torch.reciprocal(enc))
    assert torch.equal(q1.data, q2.data)
    assert torch.equal(q1.scale.view(torch.uint8), q2.scale.view(torch.uint8))
    assert torch.equal(q1.global_scale, q2.global_scale)


def test_default_global_scale_and_zero_input() -> None:
    x = torch.tensor([[3.0] + [0.0] * 15, [-5376.0] + [1.0] * 15])
    q = quantize_nvfp4(x)
    assert q.global_scale.item() == F32(5376.0) / F32(2688.0) == 2.0
    z = quantize_nvfp4(torch.zeros(3, 32))
    assert z.global_scale.item() == 1.0
    assert not bool(z.data.any()) and not bool(z.scale.view(torch.uint8).any())
    assert not bool(dequantize(z).any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
def test_non_finite_matches_independent_reference(bad: float, layout: str) -> None:
    x = make_input(3, 5, 64, 0, 0.1)
    x[2, 17] = bad
    x[4, 0] = float("nan")
    q = quantize_nvfp4(x, layout=layout)
    xn = x.numpy()
    g = ref_default_global(xn)
    assert q.global_scale.item() == g
    codes, sbytes = ref_quantize(xn, g)
    assert torch.equal(q.data, torch.from_numpy(ref_pack(codes)))
    assert torch.equal(q.linear_scale().view(torch.uint8), torch.from_numpy(sbytes))
    got = q.linear_scale().view(torch.uint8)
    assert int(got[2, 1]) == 0x7F and int(got[4, 0]) == 0x7F
    assert int((got == 0x7F).sum()) == 2  # only the two blocks holding a non-finite value


@pytest.mark.parametrize("given", [None, 0.01])
def test_nan_row_leaves_other_rows_unchanged(given: float | None) -> None:
    """Independent of any reference: NaN at (r, c) vs 0 at (r, c) (the finite amax is the
    same either way) differ only in the block holding (r, c)."""
    gen = torch.Generator().manual_seed(11)
    clean = torch.randn(6, 96, generator=gen) * 4
    clean[3, 40] = 0.0
    dirty = clean.clone()
    dirty[3, 40] = float("nan")
    qc = quantize_nvfp4(clean, global_scale=given, layout="linear")
    qd = quantize_nvfp4(dirty, global_scale=given, layout="linear")
    assert torch.equal(qc.global_scale, qd.global_scale)
    sc, sd = qc.scale.view(torch.uint8).clone(), qd.scale.view(torch.uint8).clone()
    assert int(sd[3, 2]) == 0x7F and int(sc[3, 2]) != 0x7F
    sc[3, 2] = sd[3, 2] = 0
    assert torch.equal(sc, sd)
    cc, cd = unpack_e2m1(qc.data), unpack_e2m1(qd.data)
    assert not bool(cd[3, 32:48].any()) and bool(cc[3, 32:48].any())
    cc[3, 32:48] = 0
    assert torch.equal(cc, cd)
    deq = dequantize(qd)
    assert bool(deq[3, 32:48].isnan().all())
    assert bool(deq.isfinite()[[0, 1, 2, 4, 5]].all()) and bool(deq[3, :32].isfinite().all())


def test_tensor_scale_checked_only_on_request() -> None:
    x = torch.ones(2, 16)
    q = quantize_nvfp4(x, global_scale=torch.tensor(float("nan")))  # no sync, no check
    assert bool(q.global_scale.isnan())
    with pytest.raises(ValueError, match="global_scale: expected a finite value > 0"):
        quantize_nvfp4(x, global_scale=torch.tensor(float("nan")), check_finite=True)
    assert quantize_nvfp4(x, check_finite=True).global_scale.item() == F32(1.0) / F32(2688.0)


def test_nvfp4_tensor_constructor_validates_global_scale_and_repr() -> None:
    q = quantize_nvfp4(torch.randn(3, 32), layout="linear")
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="global_scale: expected a finite value > 0"):
            Nvfp4Tensor(q.data, q.scale, torch.tensor(bad), q.layout, q.shape)
    assert repr(q) == "Nvfp4Tensor(shape=(3, 32), layout='linear', device=cpu)"
    assert torch.equal(q.dequantize(), dequantize(q))
    assert q.dequantize().dtype == torch.float32


def test_zero_scale_block_gives_zero_codes() -> None:
    x = torch.full((2, 32), 1e-5)
    x[:, 16:] = 1.0
    q = quantize_nvfp4(x, global_scale=1.0, layout="linear")
    assert q.scale[:, 0].float().tolist() == [0.0, 0.0]  # 1e-5 / 6 underflows e4m3
    assert not bool(unpack_e2m1(q.data)[:, :16].any())
    assert bool(unpack_e2m1(q.data)[:, 16:].all())


def test_scale_saturates_at_448() -> None:
    x = torch.full((1, 16), 6.0 * 448 * 10)  # would need block scale 4480 with g = 1
    q = quantize_nvfp4(x, global_scale=1.0, layout="linear")
    assert q.scale.float().item() == 448.0
    assert torch.equal(dequantize(q), torch.full((1, 16), 6.0 * 448))


# ---------------------------------------------------------------------------------------
# Reference GEMM
# ---------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 12),
    st.integers(1, 4).map(lambda n: 16 * n),
    layout_st,
    st.integers(0, 2**31),
)
def test_reference_gemm_matches_slow_loop(m: int, n: int, k: int, layout: str, seed: int) -> None:
    a = make_input(seed, m, k, 0, 0.1)
    b = make_input(seed + 1, n, k, 3, 0.1)
    qa = quantize_nvfp4(a, layout=layout)
    qb = quantize_nvfp4(b, global_scale=0.25, layout="linear")
    out = reference_gemm(qa, qb)
    assert out.dtype == torch.float64 and tuple(out.shape) == (m, n)
    ca, sa = ref_quantize(a.numpy(), F32(qa.global_scale.item()))
    cb, sb = ref_quantize(b.numpy(), F32(0.25))
    da = ref_dequant(ca, sa, F32(qa.global_scale.item()))
    db = ref_dequant(cb, sb, F32(0.25))
    for i in range(m):
        for j in range(n):
            terms = [float(da[i, t]) * float(db[j, t]) for t in range(k)]
            want = math.fsum(terms)
            assert math.isclose(out[i, j].item(), want, rel_tol=1e-12, abs_tol=1e-12 * k)


def test_reference_gemm_k_mismatch() -> None:
    qa = quantize_nvfp4(torch.ones(2, 32))
    qb = quantize_nvfp4(torch.ones(2, 64))
    with pytest.raises(ValueError, match="K must match"):
        reference_gemm(qa, qb)


# ---------------------------------------------------------------------------------------
# The tensor type
# ---------------------------------------------------------------------------------------


def test_float4_data_accepted() -> None:
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    if f4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    q = quantize_nvfp4(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
    q4 = Nvfp4Tensor(q.data.view(f4), q.scale, q.global_scale, q.layout, q.shape)
    assert q4.data.dtype == torch.uint8
    assert torch.equal(q4.data, q.data)
    assert torch.equal(dequantize(q4), dequantize(q))
    assert torch.equal(as_uint8_data(q.data.view(f4)), q.data)
    assert torch.equal(unpack_e2m1(q.data.view(f4)), unpack_e2m1(q.data))


def test_as_uint8_data_rejects_other_dtypes() -> None:
    with pytest.raises(TypeError, match="data: expected dtype"):
        as_uint8_data(torch.zeros(2, 2, dtype=torch.int8))
    with pytest.raises(TypeError, match="data"):
        as_uint8_data([1, 2])  # type: ignore[arg-type]


def test_properties_to_and_with_layout() -> None:
    x = torch.randn(130, 48, generator=torch.Generator().manual_seed(2))
    q = quantize_nvfp4(x)
    assert q.layout == "swizzled" and q.rows == 130 and q.k == 48
    assert q.device == torch.device("cpu")
    assert q.to("cpu") is q
    assert q.with_layout("swizzled") is q
    lin = q.with_layout("linear")
    assert tuple(lin.scale.shape) == (130, 3)
    assert tuple(q.scale.shape) == (256, 4)
    assert torch.equal(
        lin.with_layout("swizzled").scale.view(torch.uint8), q.scale.view(torch.uint8)
    )
    assert torch.equal(
        quantize_nvfp4(x, layout="linear").scale.view(torch.uint8), lin.scale.view(torch.uint8)
    )


def _parts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = quantize_nvfp4(
        torch.randn(4, 32, generator=torch.Generator().manual_seed(3)), layout="linear"
    )
    return q.data, q.scale, q.global_scale


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"data": torch.zeros(4, 16, dtype=torch.int8)}, TypeError, "data: expected dtype"),
        (
            {"data": torch.zeros(4, 15, dtype=torch.uint8)},
            ValueError,
            r"data: expected shape \(4, 16\)",
        ),
        ({"scale": torch.zeros(4, 2)}, TypeError, "scale: expected dtype torch.float8_e4m3fn"),
        (
            {"scale": torch.zeros(4, 3).to(torch.float8_e4m3fn)},
            ValueError,
            r"scale: expected shape \(4, 2\)",
        ),
        ({"layout": "swizzled"}, ValueError, r"scale: expected shape \(128, 4\)"),
        ({"layout": "tiled"}, ValueError, "layout: expected one of"),
        (
            {"layout": "swizzled", "scale": torch.zeros(4, 128).to(torch.float8_e4m3fn).t()},
            ValueError,
            "contiguous",
        ),
        ({"global_scale": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "global_scale"),
        ({"global_scale": torch.tensor([1.0])}, TypeError, "global_scale"),
        ({"global_scale": 1.0}, TypeError, "global_scale"),
        ({"shape": (4, 33)}, ValueError, "multiple of 16"),
        ({"shape": (4, 32, 1)}, ValueError, "shape"),
    ],
)
def test_tensor_validation(change: dict, exc: type, match: str) -> None:
    data, scale, g = _parts()
    fields = {"data": data, "scale": scale, "global_scale": g, "layout": "linear", "shape": (4, 32)}
    fields.update(change)
    with pytest.raises(exc, match=match):
        Nvfp4Tensor(**fields)


NAN_ROW = torch.tensor([[float("nan")] + [0.0] * 15])
INF_ROW = torch.tensor([[float("inf")] + [0.0] * 15])
ONES = torch.ones(2, 16)


@pytest.mark.parametrize(
    ("x", "kwargs", "exc", "match"),
    [
        (torch.zeros(4, 32, dtype=torch.int32), {}, TypeError, "x: expected dtype"),
        (torch.zeros(4, 32, dtype=torch.float64), {}, TypeError, "x: expected dtype"),
        (torch.zeros(32), {}, ValueError, "2-D"),
        (torch.zeros(2, 4, 32), {}, ValueError, "2-D"),
        (torch.zeros(4, 33), {}, ValueError, "multiple of 16"),
        (torch.zeros(4, 24), {}, ValueError, "multiple of 16"),
        # non-finite input and tensor scales are checked only on request (a host sync)
        (NAN_ROW, {"check_finite": True}, ValueError, "x: contains NaN or inf"),
        (INF_ROW, {"check_finite": True}, ValueError, "x: contains NaN or inf"),
        (ONES, {"global_scale": torch.tensor(0.0), "check_finite": True}, ValueError, "global_"),
        (ONES, {"global_scale": torch.tensor(-2.0), "check_finite": True}, ValueError, "global_"),
        (ONES, {"encode_scale": torch.tensor(0.0), "check_finite": True}, ValueError, "encode_"),
        (ONES, {"global_scale": 1e39}, ValueError, "global_scale"),  # inf in float32
        (torch.ones(2, 16), {"global_scale": 1.0, "encode_scale": 1.0}, ValueError, "not both"),
        (torch.ones(2, 16), {"global_scale": 0.0}, ValueError, "global_scale"),
        (torch.ones(2, 16), {"global_scale": -1.0}, ValueError, "global_scale"),
        (torch.ones(2, 16), {"global_scale": float("nan")}, ValueError, "global_scale"),
        (torch.ones(2, 16), {"encode_scale": 0.0}, ValueError, "encode_scale"),
        (torch.ones(2, 16), {"global_scale": torch.ones(2)}, ValueError, "global_scale"),
        (torch.ones(2, 16), {"layout": "tiled"}, ValueError, "layout"),
    ],
)
def test_quantize_errors(x: torch.Tensor, kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        quantize_nvfp4(x, **kwargs)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (0, 0)])
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
def test_empty_shapes(shape: tuple[int, int], layout: str) -> None:
    q = quantize_nvfp4(torch.zeros(shape), layout=layout)
    assert q.shape == shape
    assert tuple(dequantize(q).shape) == shape
    assert tuple(reference_gemm(q, q).shape) == (shape[0], shape[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
def test_cuda_matches_cpu(layout: str) -> None:
    x = make_input(7, 300, 256, 0, 0.1)
    qc = quantize_nvfp4(x, layout=layout)
    qg = quantize_nvfp4(x.cuda(), layout=layout)
    assert qg.device.type == "cuda"
    assert torch.equal(qg.data.cpu(), qc.data)
    assert torch.equal(qg.scale.view(torch.uint8).cpu(), qc.scale.view(torch.uint8))
    assert torch.equal(qg.global_scale.cpu(), qc.global_scale)
    assert torch.equal(dequantize(qg).cpu(), dequantize(qc))
    assert torch.equal(qg.to("cpu").data, qc.data)
    assert torch.equal(reference_gemm(qg, qg), reference_gemm(qc, qc))


# ---- the sm90-prepared data layout ------------------------------------------------------


def test_sm90_prepared_layout_round_trips_and_dequantizes_equal():
    """A prepared tensor is a reversible reordering: same values through `dequantize`, the
    reference GEMM, `to`, `with_layout`; `natural` restores the exact bytes."""
    from fp4_dispatch.format.nvfp4 import reference_gemm, sm90_prepare_data, sm90_unprepare_data

    g = torch.Generator().manual_seed(21)
    q = quantize_nvfp4(torch.randn(40, 128, generator=g) * 4.0)
    p = q.with_data_layout("sm90-prepared")
    assert p.data_layout == "sm90-prepared" and q.data_layout == "natural"
    assert p.data.shape == q.data.shape and not torch.equal(p.data, q.data)
    assert torch.equal(sm90_unprepare_data(p.data), q.data)
    assert torch.equal(sm90_prepare_data(q.data), p.data)
    assert torch.equal(p.natural().data, q.data) and p.natural().data_layout == "natural"
    assert torch.equal(dequantize(p), dequantize(q))
    lin = p.with_layout("linear")
    assert lin.data_layout == "sm90-prepared" and torch.equal(dequantize(lin), dequantize(q))
    assert p.to("cpu") is p and p.with_data_layout("sm90-prepared") is p
    assert "sm90-prepared" in repr(p) and "data_layout" not in repr(q)
    qa = quantize_nvfp4(torch.randn(8, 128, generator=g))
    assert torch.equal(reference_gemm(qa, p), reference_gemm(qa, q))
    # every byte value survives the round trip
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    assert torch.equal(sm90_unprepare_data(sm90_prepare_data(every)), every)


def test_sm90_prepared_layout_rejects_bad_arguments():
    from fp4_dispatch.format.nvfp4 import sm90_prepare_data

    q = quantize_nvfp4(torch.randn(4, 96))  # K = 96: not a multiple of 64
    with pytest.raises(ValueError, match="K % 64"):
        q.with_data_layout("sm90-prepared")
    with pytest.raises(ValueError, match="data_layout: expected one of"):
        q.with_data_layout("tiled")
    with pytest.raises(ValueError, match="data_layout"):
        Nvfp4Tensor(q.data, q.scale, q.global_scale, q.layout, q.shape, "sm90-prepared")
    with pytest.raises(TypeError, match="uint8"):
        sm90_prepare_data(torch.zeros(2, 16, dtype=torch.int16))


def test_a_ready_scale_tensor_is_used_as_is_and_never_aliased():
    """A float32 0-dim scale on x's device skips the conversions; the result's global
    scale is still a tensor of its own (writing it never changes the caller's)."""
    from fp4_dispatch.format.nvfp4 import _scale_tensor

    g = torch.tensor(0.02)
    assert _scale_tensor(g, "global_scale", g.device) is g
    assert _scale_tensor(torch.tensor([0.02]), "global_scale", g.device).dim() == 0
    q = quantize_nvfp4(torch.randn(4, 64), g)
    assert q.global_scale is not g and q.global_scale.data_ptr() != g.data_ptr()
    q.global_scale.fill_(1.0)
    assert float(g) == pytest.approx(0.02)
