"""The sm90 cost model: constants from the shipped data file, the documented formula, and
the fitting script (benchmarks/fit_cost_model.py) recovering a planted model.

Performance claims are not made here (benchmarks/data/*_heldout_check.json holds the
measured held-out figure); these tests check that the model is the function its docstring
says, that the data file ships and is complete, and that the fit does what it claims.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4_dispatch.plugins.sm90 import (
    TritonSm90Backend,
    TritonSm90Tactic,
    TritonSm90UnpackBackend,
)
from fp4_dispatch.plugins.sm90 import cost_model as cm
from fp4_dispatch.profiles import simulated
from fp4_dispatch.tactics import Problem

SM90 = simulated("sm90")


def _source_root() -> Path | None:
    """The repository (benchmarks/ is not in the wheel): FP4_DISPATCH_SOURCE_ROOT in CI."""
    for root in (os.environ.get("FP4_DISPATCH_SOURCE_ROOT"), Path(__file__).parents[1]):
        if root and (Path(root) / "benchmarks" / "fit_cost_model.py").exists():
            return Path(root)
    return None


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
    c["direct"]["log_factor"] = {"tile=32x128": 0.5, "no-such-feature": 9.0}
    assert cm.direct_us(p, SM90, t, c["direct"]) == pytest.approx(base * math.exp(0.5))


def test_log_m_interpolates_and_clamps():
    vals = [cm.log_m(Problem(m=m, n=64, k=64)) for m in (1, 64, 4096, 1 << 30)]
    assert vals == [-1.0, 0.0, 1.0, 1.5]
    f = cm.direct_features(Problem(m=4096, n=64, k=64), TritonSm90Tactic(tile_m=64, tile_n=64))
    assert f["tile=64x64"] == 1.0 and f["tile=64x64*logm"] == 1.0
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

PLANTED = {"tile=64x32": -0.4, "warps=8": 0.3, "tile_k=256": 0.15, "split_k=8*logm": 0.3,
           "tile=16x256": -0.2}  # fmt: skip


def _selection(shapes, c, path: Path) -> None:
    """A selection file as bench_selection writes it, timed by the planted model `c`
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
    root = _source_root()
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
    fit = subprocess.run([sys.executable, script, str(train), "--out", str(model), "--no-cv",
                          "--mem-bw", bw], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "in-sample after: 5/5 shapes" in fit.stdout, fit.stdout
    c = cm.load(model)  # the plugin accepts what the script wrote
    assert c["fitted_on"]["nk"] == [[4096, 4096], [8192, 2048]]
    assert c["direct"]["log_factor"]["tile=64x32"] < -0.1  # the planted sign is found
    chk = subprocess.run([sys.executable, script, "--check", str(held), "--model", str(model),
                          "--mem-bw", bw], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert chk.returncode == 0, chk.stderr[-3000:]
    assert "(never fitted on): 3/3 shapes" in chk.stdout, chk.stdout
