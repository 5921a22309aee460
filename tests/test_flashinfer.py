"""Plugin ``flashinfer``: FlashInfer's CuTe-DSL mm_fp4 kernels as five families.

No Blackwell GPU here: kernels are compiled for their target through FlashInfer's runner
and the cubin's arch is checked; nothing is run on hardware. Tests that need
``flashinfer-python`` skip (with the reason) when the ``flashinfer`` extra is not
installed. "Missing" and "API mismatch" are tested in subprocesses whose imports are
blocked or whose FlashInfer runner function is removed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins import flashinfer as fip
from fp4_dispatch.policy.ranking import estimate_us, shortlist

HAVE_FI = importlib.util.find_spec("flashinfer") is not None
needs_fi = pytest.mark.skipif(
    not HAVE_FI, reason="flashinfer extra not installed (pip install '.[flashinfer]')"
)
HINT = "pip install '.[flashinfer]' in the fp4-dispatch checkout"
NAMES = {"fi-sm100", "fi-sm100-deepk", "fi-sm100-splitk", "fi-sm103", "fi-sm107"}
#: and the grouped families (tests/test_blackwell_grouped.py), which serve no dense problem
LISTED = NAMES | {"fi-grouped-w4a16", "fi-grouped-w4a4", "fi-grouped-w4a4-sm107"}
SM107 = simulated("sm107")
SM100 = simulated("sm100")

# ---- never absent: FlashInfer missing, broken, or with a moved API (subprocesses) ------

BLOCKER = """
import importlib.abc, json, sys
MODE = {mode!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        ours = name == "flashinfer" or name.startswith("flashinfer.")
        if ours and MODE in ("missing", "broken"):
            if MODE == "broken":
                raise ImportError("libcudart.so.13: cannot open shared object file (test)")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Block())
if MODE == "moved":
    import flashinfer.gemm.gemm_base as gb
    del gb._cute_dsl_gemm_fp4_runner  # an internal API that changed between versions
import contextlib, io
from fp4_dispatch.cli import main
rows = {{}}
for dev in ("sm100", "sm107"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["list-backends", "--device", dev, "--json"])
    rows[dev] = [r for r in json.loads(buf.getvalue()) if r["name"].startswith("fi-")]
print("ROWS=" + json.dumps(rows))
"""


def _blocked_rows(mode: str) -> dict[str, list[dict]]:
    code = textwrap.dedent(BLOCKER.format(mode=mode))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS="))
    return json.loads(line[5:])


def test_families_unsupported_with_hint_when_flashinfer_missing():
    rows = _blocked_rows("missing")
    for dev in ("sm100", "sm107"):
        by_name = {r["name"]: r for r in rows[dev]}
        assert set(by_name) == LISTED, rows[dev]
        assert by_name["fi-sm100"]["status"] == "unsupported"
        assert HINT in by_name["fi-sm100"]["reason"]
    assert {r["status"] for r in rows["sm107"]} == {"unsupported"}


def test_families_failed_with_exception_when_flashinfer_broken():
    rows = _blocked_rows("broken")
    by_name = {r["name"]: r for r in rows["sm107"]}
    assert set(by_name) == LISTED
    for row in by_name.values():
        assert row["status"] == "failed", row
        assert "libcudart.so.13" in row["reason"]


@needs_fi
def test_families_failed_with_version_when_runner_api_moved():
    rows = _blocked_rows("moved")
    by_name = {r["name"]: r for r in rows["sm107"]}
    assert set(by_name) == LISTED
    for row in by_name.values():
        assert row["status"] == "failed", row
        assert "_cute_dsl_gemm_fp4_runner" in row["reason"]
        assert "0.7.2.post1" in row["reason"]  # the installed FlashInfer version


@needs_fi
def test_runner_api_change_at_enumeration_is_reported_with_the_version(monkeypatch):
    from fp4_dispatch.backends import flashinfer as fb

    class Moved:
        def get_valid_tactics(self, inputs):  # the profile argument went away
            raise AssertionError("not reached")

    monkeypatch.setattr(fb, "_runner", lambda cc, dtype: Moved())
    fb.valid_tactics.cache_clear()
    try:
        with pytest.raises(fb.FlashInferUnavailable, match=r"TypeError.*0\.7\.2\.post1"):
            list(fip.FiSm100Backend().tactics(Problem(m=3, n=72, k=512), SM107))
    finally:
        fb.valid_tactics.cache_clear()


# ---- typed tactics ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (fip.FiSm100DeepKTactic, dict(tile_m=128, tile_n=64)),  # deep-K only for narrow N
        (fip.FiSm100SplitKTactic, dict(tile_m=128, tile_n=8, split_k=3)),
        (fip.FiSm100SplitKTactic, dict(tile_m=128, tile_n=8, split_k=2, swap_ab=False)),
        (fip.FiSm107Tactic, dict(tile_m=128, tile_n=64, inst_m=128, prefetch_dist=1)),
        (fip.FiSm103Tactic, dict(tile_m=128, tile_n=64, use_tma_store=True)),
        (fip.FiSm100Tactic, dict(tile_m=128, tile_n=24)),
    ],
)
def test_impossible_knob_is_a_validation_error(cls, fields):
    with pytest.raises(ValidationError):
        cls(**fields)


def test_unknown_flashinfer_tuple_is_refused():
    with pytest.raises(ValueError, match="unknown FlashInfer"):
        fip.tactic_of(((128, 8), (1, 1), True, False, "sm200", None))


# ---- FlashInfer's enumeration, split into families --------------------------------------

SHAPES = [(1, 7168, 2048), (32, 4096, 8192), (300, 28672, 8192), (4096, 7168, 2048)]


@needs_fi
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_families_partition_flashinfers_valid_tactics(m, n, k):
    from fp4_dispatch.backends import flashinfer as fb

    valid = fb.valid_tactics(m, n, k, "bfloat16", 107, SM107.sm_count)
    problem = Problem(m=m, n=n, k=k)
    seen, unbuildable = [], []
    for cls in fip.BACKENDS:
        b = cls()
        tactics = list(b.tactics(problem, SM107))
        assert all(isinstance(t, cls.tactic_type) for t in tactics)
        seen += [t.to_fi() for t in tactics]
        unbuildable += [fi for fi in valid if b._mine(fi) and b.unbuildable(fi)]
    # each valid tactic in exactly one family, or named as unbuildable by the installed DSL
    assert sorted(map(repr, seen + unbuildable)) == sorted(map(repr, valid))
    assert all(fi[4] == "sm103" and fi[5] is False for fi in unbuildable)


@needs_fi
def test_flashinfer_offers_narrow_split_and_deep_k_at_decode():
    problem = Problem(m=1, n=7168, k=2048)
    by = {cls.name: list(cls().tactics(problem, SM107)) for cls in fip.BACKENDS}
    assert {t.tile_n for t in by["fi-sm100"]} <= {8, 16, 32}  # FlashInfer's M <= 32 rule
    assert {t.split_k for t in by["fi-sm100-splitk"]} >= {2}
    assert all(t.tile_k == 512 for t in by["fi-sm100-deepk"]) and by["fi-sm100-deepk"]
    assert by["fi-sm107"], "FlashInfer's SM107 kernel accepts M=1"


@needs_fi
def test_round_trip_json_and_validate_agree():
    problem = Problem(m=32, n=4096, k=8192)
    for cls in fip.BACKENDS:
        b = cls()
        for t in list(b.tactics(problem, SM107))[:40]:
            assert cls.tactic_type.model_validate_json(t.model_dump_json()) == t
            assert fip.tactic_of(t.to_fi()) == t
            assert b.validate(t, problem, SM107) is None
    deep = fip.FiSm100DeepKTactic(tile_m=128, tile_n=8, swap_ab=True)
    why = fip.FiSm100DeepKBackend().validate(deep, Problem(m=1, n=7168, k=2304), SM107)
    assert why is not None and "does not list" in why  # K % 512 != 0: FlashInfer says no


@needs_fi
def test_sm103_direct_store_tactics_refused_when_the_dsl_cannot_build_them():
    from fp4_dispatch.backends import flashinfer as fb

    b = fip.FiSm103Backend()
    problem = Problem(m=300, n=7168, k=2048)
    offered = {t.use_tma_store for t in b.tactics(problem, SM107)}
    if fb.direct_store_epilogue_builds():
        assert offered == {True, False}
    else:
        assert offered == {True}
        t = fip.FiSm103Tactic(tile_m=128, tile_n=128, use_tma_store=False)
        assert "CopyStgOp" in (b.validate(t, problem, SM107) or "")
        assert "CopyStgOp" in b.supports(SM107).reason


@needs_fi
def test_sm103_and_sm107_kernels_only_on_cc107():
    sm103 = simulated("sm103")
    assert fip.FiSm103Backend().supports(SM107).ok
    assert not fip.FiSm103Backend().supports(sm103).ok
    assert not fip.FiSm107Backend().supports(SM100).ok
    assert fip.FiSm100Backend().supports(SM100).ok


@needs_fi
def test_flashinfer_own_shortlist_is_its_top_32():
    from fp4_dispatch.backends import flashinfer as fb

    own = fb.flashinfer_shortlist(300, 28672, 8192, "bfloat16", 107, SM107.sm_count)
    valid = fb.valid_tactics(300, 28672, 8192, "bfloat16", 107, SM107.sm_count)
    assert len(own) == 32 and set(own) <= set(valid)


# ---- the shared cost model understands split-K and deep-K --------------------------------


def test_shared_model_credits_split_k_where_the_grid_leaves_sms_idle():
    problem = Problem(m=1, n=2048, k=8192)  # 16 weight tiles of 128: most SMs idle
    plain = fip.FiSm100Tactic(tile_m=128, tile_n=8, swap_ab=True)
    split = fip.FiSm100SplitKTactic(tile_m=128, tile_n=8, split_k=4)
    assert estimate_us(problem, SM107, split) < estimate_us(problem, SM107, plain)


def test_shared_model_deep_k_changes_only_what_declares_it():
    problem = Problem(m=16, n=28672, k=8192)
    base = fip.FiSm100Tactic(tile_m=128, tile_n=16, swap_ab=True)
    deep = fip.FiSm100DeepKTactic(tile_m=128, tile_n=16, swap_ab=True)
    a, b = estimate_us(problem, SM107, base), estimate_us(problem, SM107, deep)
    assert a != b and abs(a - b) / a < 0.05  # a percent-level effect, not a new scale


# ---- ranking with everyone ---------------------------------------------------------------


@needs_fi
@pytest.mark.parametrize("m", [1, 32, 300])
def test_sm107_shortlist_keeps_every_family(m):
    from fp4_dispatch.loading.registry import load

    reg = load(strict=False)
    backends = [b for b in reg.backends.values() if b.supports(SM107).ok]
    sl = shortlist(Problem(m=m, n=7168, k=2048), SM107, backends, budget=32)
    kept = {c.family for c in sl.candidates}
    with_valid = {f for f, cut in sl.cut.items()}  # every family with a valid tactic
    assert with_valid >= {"fi-sm100", "fi-sm107", "fi-sm103", "sm100"}
    assert kept == with_valid, (kept, sl.cut)


# ---- compile through FlashInfer's runner (not run) ---------------------------------------


@needs_fi
@pytest.mark.parametrize("name", sorted(NAMES))
def test_one_tactic_per_family_compiles_for_sm107a(name):
    cls = next(c for c in fip.BACKENDS if c.name == name)
    b = cls()
    problem = Problem(m=1, n=7168, k=2048)
    tactic = next(iter(b.tactics(problem, SM107)))
    kernel = b.build(tactic, problem.swapped() if tactic.swap_ab else problem, SM107)
    assert kernel.compiled.cubin_sm == 107
    assert kernel.compiled.target == "107a"
    assert kernel.compiled.max_active_clusters >= 1


@needs_fi
def test_one_tactic_compiles_for_each_arch_in_one_process():
    # FlashInfer's own kernel cache is keyed by device index only: a second arch must
    # still get its own cubin (this caught sm_100 code handed out for sm_107a)
    b = fip.FiSm100Backend()
    problem = Problem(m=32, n=4096, k=8192)
    tactic = next(iter(b.tactics(problem, SM100)))
    kp = problem.swapped() if tactic.swap_ab else problem
    for dev, sm, sms in (("sm100", 100, 148), ("sm107", 107, 212), ("sm103", 103, 160)):
        kernel = b.build(tactic, kp, simulated(dev))
        assert (kernel.compiled.cubin_sm, kernel.compiled.sm_count) == (sm, sms)


@needs_fi
def test_cli_compile_builds_flashinfer_tactics_for_sm107a(tmp_path, monkeypatch, capsys):
    from fp4_dispatch.cli import main

    monkeypatch.setenv("FP4_DISPATCH_KERNEL_CACHE", str(tmp_path))
    argv = ["compile", "1", "7168", "2048", "--device", "sm107", "--budget", "6"]
    rc = main([*argv, "--jobs", "2", "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    fams = out["families"]
    assert {f for f in fams if f.startswith("fi-")} == NAMES  # one slot per family
    for f in NAMES:
        assert fams[f]["compiled"] == fams[f]["shortlisted"] >= 1
    assert {r["cubin_sm"] for r in out["results"]} == {107}


@needs_fi
@pytest.mark.parametrize("swap", [False, True])
def test_launcher_hands_flashinfer_its_own_orientation(monkeypatch, swap):
    """The dispatcher swaps operands for swap_ab; FlashInfer's runner swaps by itself."""
    import torch

    from fp4_dispatch.backends import flashinfer as fb
    from fp4_dispatch.contracts.backend import GemmOperands

    m, n, k = 4, 24, 64
    a, b = torch.randint(0, 255, (m, k // 2), dtype=torch.uint8), torch.zeros(n, k // 2).byte()
    sa, sb = torch.ones(128, 4), torch.full((128, 4), 2.0)
    out = torch.empty(m, n)
    seen = {}

    class FakeRunner:
        def forward(self, inputs, tactic=None):
            seen["inputs"], seen["tactic"] = inputs, tactic

    monkeypatch.setattr(fb, "_runner", lambda cc, dtype: FakeRunner())
    tactic = ((128, 8), (1, 1), swap, False, "sm100", None)
    kernel = fb.FlashInferKernel(
        fb.CompiledKernel(tactic, None, "107a", 212, 107, 212, 0.0, "compiled"), "bfloat16", 107
    )
    ops = GemmOperands(a, sa, b, sb, torch.ones(1))
    kernel(ops.swapped() if swap else ops, out.t() if swap else out)
    x = seen["inputs"]
    assert seen["tactic"] == tactic
    assert x[0] is a and x[2] is sa and x[3] is sb  # caller's A and scales, never swapped
    assert x[1].shape == (k // 2, n) and x[1].t().data_ptr() == b.data_ptr()
    assert x[6].data_ptr() == out.data_ptr() and x[6].is_contiguous()


# ---- conformance kit ---------------------------------------------------------------------


@needs_fi
@pytest.mark.parametrize("device", ["cpu", "sm100", "sm107"])
def test_conformance_kit(device):
    from fp4_dispatch.testing import DEFAULT_PROBLEMS, check_plugin

    # the kit's problems have K <= 512 and no decode M with K % 512 == 0, where deep-K
    # and split-K exist at all: add two decode shapes (as the kit's message asks)
    problems = (*DEFAULT_PROBLEMS, Problem(m=1, n=2048, k=8192), Problem(m=16, n=7168, k=2048))
    # and grouped ones for fi-grouped-w4a16 and fi-grouped-w4a4 (which serve nothing else)
    grouped = {"m": 64, "n": 1536, "k": 2048, "groups": 8}
    problems += tuple(Problem(**grouped, operation=op) for op in ("grouped_w4a16", "grouped_w4a4"))
    report = check_plugin(
        "flashinfer", device=device, problems=problems, samples=1, show_progress=False
    )
    report.raise_for_failures()
    statuses = {c.status for c in report.checks}
    if device == "cpu":
        assert "PASS" not in {c.status for c in report.checks if c.category == "build"}
    else:
        assert any(c.category == "build" and c.status == "PASS" for c in report.checks)
    assert statuses
