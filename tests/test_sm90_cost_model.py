"""The sm90 cost model: constants from the shipped data file, the documented formula, and
the fitting script (benchmarks/fit_cost_model.py) recovering a planted model.

Performance claims are not made here (benchmarks/data/*_heldout_check.json holds the
measured held-out figure); these tests check that the model is the function its docstring
says, that the data file ships and is complete, and that the fit does what it claims.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import source_root

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90 import (
    TritonSm90Backend,
    TritonSm90Tactic,
    TritonSm90UnpackBackend,
    smem_bytes,
)
from fp4_dispatch.plugins.sm90 import cost_model as cm

SM90 = simulated("sm90")


def test_shipped_file_loads_and_records_its_fit():
    c = cm.constants()  # from the installed package: the wheel must ship the JSON
    assert c["version"] >= 4
    fitted = c["fitted_on"]
    assert fitted["nk"] and fitted["m"] and fitted["rows"] > 100
    assert {"step_us", "mma_eff", "log_factor"} <= set(c["direct"])
    assert all(isinstance(v, float) for v in c["direct"]["log_factor"].values())


def test_load_names_a_missing_constant(tmp_path):
    c = json.loads(cm.MODEL_FILE.read_text())
    del c["direct"]["step_us"]
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"\[direct\] lacks \['step_us'\]"):
        cm.load(bad)


def _no_factors() -> dict:
    c = json.loads(cm.MODEL_FILE.read_text())
    c["direct"]["log_factor"], c["unpack"]["log_factor"] = {}, {}
    return c


def test_without_factors_the_estimate_is_the_roofline():
    c = _no_factors()
    p = Problem(m=32, n=8192, k=8192)
    t = TritonSm90Tactic(tile_m=32, tile_n=128, tile_k=256, split_k=4)
    base = cm.direct_base_us(cm.direct_terms(p, SM90, t), c["direct"])
    assert cm.direct_us(p, SM90, t, c["direct"]) == base
    # the roofline itself: 64 tiles x 4 splits on 132 SMs, 8 K steps of 256 each
    x = cm.direct_terms(p, SM90, t)
    assert (x["ctas"], x["per_sm"], x["steps"]) == (256, 2, 8)
    # one factor multiplies by exactly exp(value); unknown features are ignored
    c["direct"]["log_factor"] = {"tile_n=128": 0.5, "no-such-feature": 9.0}
    assert cm.direct_us(p, SM90, t, c["direct"]) == pytest.approx(base * math.exp(0.5))


def test_the_features_are_knob_indicators():
    f = cm.direct_features(Problem(m=4096, n=64, k=64), TritonSm90Tactic(tile_m=64, tile_n=64))
    assert f["tile_m=64"] == 1.0 and f["tile_n=64"] == 1.0 and f["split_k=1"] == 1.0
    assert "swap=nonpreferred" not in f  # unswapped is preferred at M = 4096


def test_swapped_tactics_are_costed_in_the_kernel_orientation():
    """A swapped 64x16 tactic on 16 x 4096 is the kernel of an unswapped 64x16 tactic on
    4096 x 16: the same roofline; only the swap factor (not the preferred orientation at
    M = 16 is the swapped one) can tell them apart."""
    c = _no_factors()
    p = Problem(m=16, n=4096, k=4096)
    swapped = TritonSm90Tactic(tile_m=64, tile_n=16, swap_ab=True)
    kernel_view = TritonSm90Tactic(tile_m=64, tile_n=16)
    assert cm.direct_terms(p, SM90, swapped) == cm.direct_terms(p.swapped(), SM90, kernel_view)
    assert cm.direct_terms(p, SM90, swapped)["ctas"] == 64
    assert cm.direct_us(p, SM90, swapped, c["direct"]) == cm.direct_us(
        p.swapped(), SM90, kernel_view, c["direct"]
    )
    assert "swap=nonpreferred" in cm.direct_features(p, TritonSm90Tactic(tile_m=16, tile_n=64))


@pytest.mark.parametrize("m,n,k", [(1, 128, 64), (3, 100000, 96), (65536, 65536, 8192)])
def test_estimates_are_positive_and_finite_far_from_the_data(m, n, k):
    p = Problem(m=m, n=n, k=k)
    for backend in (TritonSm90Backend(), TritonSm90UnpackBackend()):
        ests = [backend.estimate_us(p, SM90, t) for t in backend.tactics(p, SM90)]
        assert all(math.isfinite(e) and e > 0 for e in ests), backend.name


# ---- the fitting script ------------------------------------------------------------------

PLANTED = {"tile_n=32": -0.4, "warps=8": 0.3, "tile_k=256": 0.15, "split_k=8": 0.3,
           "tile_m=16": -0.2}  # fmt: skip


def _selection(shapes, c, path: Path) -> None:
    """A selection file in the committed sweeps' form, timed by the planted model `c`
    (with a deterministic +-2% ripple so that nothing ties)."""
    rows = []
    for m, n, k in shapes:
        p = Problem(m=m, n=n, k=k)
        entries = []
        for b, fn in (
            (TritonSm90Backend(), cm.direct_us),
            (TritonSm90UnpackBackend(), cm.unpack_us),
        ):
            part = c["direct"] if fn is cm.direct_us else c["unpack"]
            for i, t in enumerate(b.tactics(p, SM90)):
                us = fn(p, SM90, t, part) * (1 + 0.02 * math.sin(7.0 * i + m))
                entries.append({"tactic": t.model_dump(mode="json"), "us": us,
                                "method": "cuda-graph"})  # fmt: skip
        rows.append({"shape": [m, n, k], "all": entries})
    path.write_text(json.dumps({"meta": {"device": "planted"}, "rows": rows}))


def test_fit_recovers_a_planted_model_and_checks_held_out_shapes(tmp_path):
    root = source_root()
    if root is None:
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    planted = _no_factors()
    planted["direct"]["log_factor"] = dict(PLANTED)
    train, held = tmp_path / "train.json", tmp_path / "held.json"
    _selection([(1, 4096, 4096), (32, 4096, 4096), (256, 4096, 4096), (4096, 4096, 4096),
                (32, 8192, 2048)], planted, train)  # fmt: skip
    _selection([(1, 8192, 8192), (32, 14336, 4096), (256, 2048, 8192)], planted, held)
    script = str(root / "benchmarks" / "fit_cost_model.py")
    model = tmp_path / "model.json"
    bw = str(SM90.mem_bw_gbps)
    fit = subprocess.run([sys.executable, script, str(train), "--out", str(model),
                          "--mem-bw", bw], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "in-sample after: 5/5 shapes" in fit.stdout, fit.stdout
    c = cm.load(model)  # the plugin accepts what the script wrote
    assert c["fitted_on"]["nk"] == [[4096, 4096], [8192, 2048]]
    assert c["fitted_on"]["files"] == ["train.json"]
    assert c["fitted_on"]["grids"]["train.json"]["m"] == [1, 32, 256, 4096]
    assert c["fitted_on"]["date"].endswith("Z")  # UTC, to the second
    # the cross-validation ran (whole fit per fold) and its figures are in the file
    for name, groups in (("leave_one_nk_out", 2), ("leave_one_m_out", 4)):
        assert c[name]["shapes"] == 5 and 0 <= c[name]["hits"] <= 5, c[name]
        assert fit.stdout.count(f"/{groups} (without") >= 1, fit.stdout
    assert "searched" in c["cv_protocol"]
    # the searched constants stay inside their physical bounds, and the file says which
    # of them sit at one
    assert 0.3 <= c["direct"]["bw_fraction"] <= 1.0
    assert 1.0 <= c["direct"]["natural_order_cost"] <= 2.0
    assert isinstance(c["at_bounds"], list)
    assert c["direct"]["log_factor"]["tile_n=32"] < -0.1  # the planted sign is found
    chk = subprocess.run([sys.executable, script, "--check", str(held), "--model", str(model),
                          "--mem-bw", bw], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert chk.returncode == 0, chk.stderr[-3000:]
    assert "(never fitted on): 3/3 shapes" in chk.stdout, chk.stdout


# ---- occupancy, waves and the combination of the roofline terms ---------------------------


@pytest.mark.parametrize(
    "regs,shared,warps,expected",
    [
        (80, 15360, 4, 6),  # registers: 2560 per warp (80 x 32), 6 CTAs of 4 warps in 64K
        (250, 41216, 4, 2),  # 250 -> 8192 per warp: the register file holds 2 CTAs
        (64, 120832, 4, 1),  # shared memory: 228 KiB holds one CTA of 118 KiB (+1 KiB)
        (32, 0, 4, 16),  # neither: 64 resident warps / 4
        (32, 0, 1, 32),  # the 32-CTA limit
    ],
)
def test_resident_ctas_follows_the_hopper_occupancy_limits(regs, shared, warps, expected):
    assert cm.resident_ctas(regs, shared, warps) == expected


def _offered_configs() -> set[str]:
    backend = TritonSm90Backend()
    keys = set()
    for m in (1, 16, 48, 160, 1024, 8192):
        for n, k in ((4096, 4096), (4608, 3584), (3584, 18944), (28672, 8192)):
            keys |= {cm.occupancy_key(t) for t in backend.tactics(Problem(m=m, n=n, k=k), SM90)}
    return keys


def test_the_occupancy_table_covers_every_offered_kernel():
    """Every kernel config the backend offers has measured registers and shared memory
    (the fallback is for configs the file predates, not for the shipped tactic space)."""
    table = cm.constants()["occupancy"]["kernels"]
    missing = _offered_configs() - set(table)
    assert not missing, f"not in cost_model.json's occupancy table: {sorted(missing)}"
    for key, (regs, shared, frame) in table.items():
        assert 16 <= regs <= 255 and 0 < shared <= 227 * 1024 and frame >= 0, key


def test_a_kernel_missing_from_the_table_falls_back_to_the_pessimistic_estimate(monkeypatch):
    c = json.loads(json.dumps(cm.constants()))
    c["occupancy"]["kernels"] = {}
    monkeypatch.setattr(cm, "constants", lambda: c)
    t = TritonSm90Tactic(tile_m=64, tile_n=16)
    regs, shared, frame = cm.kernel_resources(t)
    assert (regs, frame) == (cm.FALLBACK_REGISTERS, 0)
    assert shared == smem_bytes(64, 16, 128, 3)


def test_a_tail_round_costs_like_an_underoccupied_full_round():
    """4 CTAs per SM, 3 resident: the 4th runs alone at 4 of the 8 warps that saturate
    the SM, so it costs 2 CTA-times, not 1 (wave quantization, not the average)."""
    c = {"ctas_per_sm": 32.0, "sat_warps": 8.0}
    x = {"per_sm": 4, "resident": 3, "warps": 4}
    assert cm.sm_ctas(x, c) == pytest.approx(3 + 2)
    assert cm.sm_ctas({**x, "per_sm": 3}, c) == pytest.approx(3)
    # one CTA on the SM: half the issue rate, the same time as two
    assert cm.sm_ctas({**x, "per_sm": 1}, c) == cm.sm_ctas({**x, "per_sm": 2}, c)
    # the fitted cap lowers the rounds' size
    assert cm.sm_ctas(x, {**c, "ctas_per_sm": 2.0}) == pytest.approx(4)


def test_overlap_p_interpolates_between_adding_and_the_largest_term():
    c = json.loads(json.dumps(_no_factors()["direct"]))
    p = Problem(m=96, n=5120, k=5120)
    t = TritonSm90Tactic(tile_m=64, tile_n=64, split_k=2)
    x = cm.direct_terms(p, SM90, t)
    extra = c["launch_us"] + c["split_reduce_us"] * x["split_m1"]
    totals = [cm.direct_base_us(x, {**c, "overlap_p": q}) - extra for q in (1.0, 2.0, 64.0)]
    assert totals[0] > totals[1] > totals[2] > 0
    c1 = {**c, "overlap_p": 1.0, "step_us": 0.0, "in_flight_bytes": 1.0}
    alone = cm.direct_base_us(x, c1) - extra  # latency zeroed: dequant + mma + memory
    c2 = {**c1, "dequant_elems_per_sm_us": 1e30}
    assert alone > cm.direct_base_us(x, c2) - extra  # dropping one term lowers the sum


def test_the_dot_order_rule_is_the_kernels():
    """The model's dequantizer-order threshold is the one the kernel compiles in (read from
    the installed kernel's source, which needs no Triton import)."""
    import importlib.util

    spec = importlib.util.find_spec("fp4_dispatch.backends.sm90.gemm_direct")
    assert spec is not None and spec.origin is not None
    src = Path(spec.origin).read_text()
    rule = (f"DOT_ORDER: tl.constexpr = BLOCK_M >= {cm.DOT_ORDER_MIN_M} and "
            f"BLOCK_K >= {cm.DOT_ORDER_MIN_K}")  # fmt: skip
    assert rule in src
    x = cm.direct_terms(Problem(m=2, n=4096, k=4096), SM90, TritonSm90Tactic(tile_m=16, tile_n=64))
    assert x["natural"] == 1.0
    swapped = TritonSm90Tactic(tile_m=64, tile_n=16, swap_ab=True)
    assert cm.direct_terms(Problem(m=2, n=4096, k=4096), SM90, swapped)["natural"] == 0.0


def test_spill_is_the_compiled_kernels_stack_frame():
    """128x128x128 with 4 warps runs out of registers (255) and spills; with 8 warps it
    does not: the feature comes from the occupancy table, per 256 bytes per thread."""
    table = cm.constants()["occupancy"]["kernels"]
    p = Problem(m=4096, n=4096, k=4096)
    four = TritonSm90Tactic(tile_m=128, tile_n=128, num_warps=4)
    eight = TritonSm90Tactic(tile_m=128, tile_n=128, num_warps=8)
    frame = table["128x128x128/w4"][2]
    assert frame > 0 and table["128x128x128/w8"][2] == 0
    assert cm.direct_features(p, four)["spill"] == frame / cm.SPILL_UNIT_BYTES
    assert "spill" not in cm.direct_features(p, eight)


def _fit_check(*flags: str) -> dict[str, tuple[float, float, str]]:
    """``fit_w4a16_model.py --check`` (plus `flags`): {in-sample/held-out: (mean, worst,
    the line)}; skipped where the source tree is not around."""
    root = source_root()
    if root is None or not (root / "benchmarks" / "fit_w4a16_model.py").exists():
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    script = str(root / "benchmarks" / "fit_w4a16_model.py")
    run = subprocess.run([sys.executable, script, "--check", *flags], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for ln in run.stdout.splitlines():
        if "pick/best" in ln:
            words = ln.replace(",", "").split()
            mean = float(words[words.index("mean") + 1])
            out[ln.split(":")[0]] = (mean, float(words[words.index("worst") + 1]), ln)
    return out


def test_w4a16_direct_model_picks_as_measured_on_the_committed_sweep():
    """The W4A16 direct constants against the H200 decode sweep they were fitted on
    (benchmarks/data/sm90_w4a16_decode_run5.json, benchmarks/fit_w4a16_model.py): the
    untuned pick among the offered tactics is on average within 3% of the measured best
    of the in-sample shapes and within 5% on every held-out one (M 2 and 8, shapes fixed
    before the fit). The worst in-sample shape is allowed 15%: with every split width to
    8 offered, 18944x3584 picks split 2 where split 3 at 3 stages measured 12-14% faster
    (RESULTS.md, "Hopper W4A16" run 5). Fails when the formula, the rules or the
    constants drift from the measurement."""
    got = _fit_check()
    mean, worst, line = got["in-sample"]
    assert mean <= 1.03 and worst <= 1.15 and "(18 shapes)" in line, line
    mean, worst, line = got["held-out"]
    assert worst <= 1.05 and "(6 shapes)" in line, line


def test_dense_w4a4_model_picks_as_measured_on_the_committed_sweep():
    """The ``triton-sm90-dense`` constants (dense_step_scale, dense_time_scale) against
    the H200 W4A4 decode sweep they were fitted on (benchmarks/data/
    sm90_w4a4_decode_run5.json, ``fit_w4a16_model.py --dense``): the untuned dense pick
    within 7% of the best dense tactic on every in-sample shape, 2% on the held-out ones."""
    got = _fit_check("--dense")
    assert got["in-sample"][1] <= 1.07 and "(18 shapes)" in got["in-sample"][2], got
    assert got["held-out"][1] <= 1.02 and "(6 shapes)" in got["held-out"][2], got


def test_w4a16_mid_m_model_picks_as_measured_on_the_committed_sweep():
    """The M = 32-256 terms (mid_step_scale, mma_eff at tile_m 32/64/128) against the H200
    sweep they were fitted on (benchmarks/data/sm90_w4a16_mid_run5.json,
    ``fit_w4a16_model.py --mid``): the untuned direct pick on average within 6% of the
    best direct tactic in-sample (M 64 and 256), and within 15% on every held-out shape
    (M 32 and 128 x three (N, K), fixed before the fit). Before these terms the pick was
    13% off on average on both (RESULTS.md, "Hopper W4A16" run 5)."""
    got = _fit_check("--mid")
    mean, _, line = got["in-sample"]
    assert mean <= 1.06 and "(12 shapes)" in line, line
    mean, worst, line = got["held-out"]
    assert mean <= 1.06 and worst <= 1.15 and "(6 shapes)" in line, line


def test_ws_model_picks_as_measured_on_the_committed_sweep():
    """The ``triton-sm90-ws`` constants (deq_step_us, mma_eff, fixed_us) against the H200
    sweep they were fitted on (benchmarks/data/sm90_w4a16_ws_run6.json,
    ``fit_w4a16_model.py --ws``): the untuned ws pick is the best ws tactic on every
    in-sample shape (M 64 and 256) and within 5% on every held-out one (M 32 and 128 x
    three (N, K), fixed before the fit); and the pick among both W4A16 backends (the
    dispatcher's untuned choice: direct, unpack or ws) is within 6% of the best of both
    on average in-sample and within 15% on every held-out shape. The worst in-sample
    shape is allowed 30%: at 256x5120² the unpack path's estimate (41.9 µs) is 17%
    optimistic and wins over ws (43.6 estimated, 40.6 measured; RESULTS.md "Hopper
    W4A16" run 6)."""
    got = _fit_check("--ws")
    mean, worst, line = got["in-sample"]
    assert worst <= 1.0 + 1e-9 and "(12 shapes)" in line, line
    mean, worst, line = got["held-out"]
    assert worst <= 1.05 and "(6 shapes)" in line, line
    mean, worst, line = got["in-sample, both backends"]
    assert mean <= 1.06 and worst <= 1.30 and "(12 shapes)" in line, line
    mean, worst, line = got["held-out, both backends"]
    assert worst <= 1.15 and "(6 shapes)" in line, line


def test_rs_model_picks_as_measured_on_the_committed_sweep():
    """The ``triton-sm90-rs`` constants against the H200 sweep they were fitted on
    (benchmarks/data/sm90_w4a16_rs_run11.json, ``fit_w4a16_model.py --rs``, the two-CTA
    and 256-token tactics included): the untuned rs pick is the best rs tactic on every
    in-sample shape (M 64 and 256) and within 2% on average, 13% at worst, on the held-out
    ones (M 128 and 192, chosen before the fit: 1.016, worst 1.127); against ws (timed in
    the same run) the pick among both is the best of both on every in-sample shape and
    within 2% on average held-out. And the committed constants are the fit's."""
    import json as _json

    from fp4_dispatch.plugins.sm90 import cost_model

    got = _fit_check("--rs")
    mean, worst, line = got["in-sample"]
    assert worst <= 1.0 + 1e-9 and "(12 shapes)" in line, line
    mean, worst, line = got["held-out"]
    assert mean <= 1.02 and worst <= 1.13 and "(12 shapes)" in line, line
    mean, worst, line = got["in-sample, both backends"]
    assert worst <= 1.0 + 1e-9 and "(12 shapes" in line, line
    mean, worst, line = got["held-out, both backends"]
    assert mean <= 1.02 and "(12 shapes" in line, line
    root = source_root()
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "fit_w4a16_model.py"), "--rs"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    fitted = _json.loads(run.stdout.strip().splitlines()[0])
    assert fitted == {k: cost_model.constants()["rs"][k] for k in fitted}, fitted


def test_mma_model_picks_as_measured_on_the_committed_sweep():
    """The ``triton-sm90-mma`` constants against the H200 decode sweep they were fitted on
    (benchmarks/data/sm90_w4a16_mma_run7.json, ``fit_w4a16_model.py --mma``): the untuned
    mma pick is within 1% of the best offered mma tactic on every in-sample shape (M 1
    and 4; M 16 is not offered) and every held-out one (M 2 and 8 x three (N, K), fixed in
    run 4); the pick among both W4A16 backends within 1% on average in-sample (M 16 picks
    the direct kernel) and 9% held-out. The worst held-out shape is allowed 34%: at
    2x28672x8192 the mma estimate charges three whole rounds of CTAs (71.1 µs against the
    direct kernel's 61.5) and the direct kernel is picked, 71.8 µs measured against the
    mma kernel's 53.7 (RESULTS.md "Hopper W4A16" run 7)."""
    got = _fit_check("--mma")
    mean, worst, line = got["in-sample"]
    assert worst <= 1.01 and "(12 shapes)" in line, line
    mean, worst, line = got["held-out"]
    assert worst <= 1.01 and "(6 shapes)" in line, line
    mean, worst, line = got["in-sample, both backends"]
    assert mean <= 1.01 and worst <= 1.12 and "(18 shapes)" in line, line
    mean, worst, line = got["held-out, both backends"]
    assert mean <= 1.09 and worst <= 1.34 and "(6 shapes)" in line, line


def _run_fit_mma_scale(*flags: str) -> dict[str, float]:
    """``fit_w4a16_model.py --mma-scale`` (plus `flags`): {"time_scale": chosen, "<op>
    <set>": mean pick/best}; skipped where the source tree is not around."""
    root = source_root()
    if root is None or not (root / "benchmarks" / "fit_w4a16_model.py").exists():
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    script = str(root / "benchmarks" / "fit_w4a16_model.py")
    run = subprocess.run([sys.executable, script, "--mma-scale", *flags], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for ln in run.stdout.splitlines():
        if ln.startswith("time_scale"):
            out["time_scale"] = float(ln.split()[1])
        elif "pick/best" in ln:
            out[ln.split(":")[0]] = float(ln.split("mean ")[1].split()[0])
    return out


def test_mma_time_scale_is_the_fit_and_ranks_the_backends_as_measured():
    """``time_scale`` of the mma part is what ``fit_w4a16_model.py --mma-scale`` chooses on run 8's
    in-sample rows, and with it the untuned pick across backends (W4A4: mma, dense,
    triton-sm90; W4A16: mma, direct) is within 1% of the best timed tactic on average,
    in-sample and on the held-out shapes fixed in run 4 (W4A4 with the factor at 1:
    10-11% off, the dense kernel picked where the mma path is 1.17-1.46x faster). W4A16
    held-out stays 7.6%: 28672x8192 keeps the direct kernel (RESULTS.md run 8)."""
    from fp4_dispatch.plugins.sm90 import cost_model

    fitted = _run_fit_mma_scale()
    assert fitted["time_scale"] == cost_model.constants()["mma"]["time_scale"] < 1.0
    got = _run_fit_mma_scale("--check")
    assert got["w4a4 in-sample"] <= 1.01 and got["w4a4 held-out"] <= 1.01, got
    assert got["w4a16 in-sample"] <= 1.02 and got["w4a16 held-out"] <= 1.08, got
