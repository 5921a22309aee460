"""The grouped GEMM through the dispatcher on the CPU (torch reference family): the call,
its checks, ranking (families opt in), plans, tuning and the cache, torch.compile."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import pytest
import torch

from fp4_dispatch import Dispatcher
from fp4_dispatch.autotune.harness import CHECK_RTOL, make_inputs
from fp4_dispatch.autotune.timers import Timing
from fp4_dispatch.contracts.backend import Backend, Support
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.engine import torch_ops
from fp4_dispatch.format.grouped import grouped_reference, quantize_experts
from fp4_dispatch.format.nvfp4 import quantize_nvfp4
from fp4_dispatch.policy.ranking import Ranker

E, N, K = 6, 48, 64


def offsets_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 1, E).view(E, 1, 1)  # experts far apart: a mix-up shows
    return quantize_experts(torch.randn(E, N, K, generator=gen) * scales)


@pytest.fixture
def d(tmp_path):
    return Dispatcher("cpu", cache=tmp_path / "tuning.json")


# random offsets, empty experts (first, middle, last) and one expert with most rows
SIZES = [[0, 3, 0, 1, 9, 0], [1, 1, 1, 1, 1, 1], [0, 0, 40, 0, 0, 2], [5, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_w4a16_matches_the_reference(d, experts, sizes, dtype):
    gen = torch.Generator().manual_seed(sum(sizes))
    a = (torch.randn(sum(sizes), K, generator=gen) * 3).to(dtype)
    off = offsets_of(sizes)
    out = d.grouped_gemm(a, experts, off)
    assert out.dtype == dtype and out.shape == (sum(sizes), N)
    ref = grouped_reference(a, experts, off)
    for e, (start, end) in enumerate(zip([0, *off.tolist()], off.tolist(), strict=False)):
        if end > start:  # each expert's rows right on their own (scales differ 1e4x)
            assert rel_err(out[start:end], ref[start:end]) < CHECK_RTOL, e


@pytest.mark.parametrize("sizes", SIZES[:3])
def test_grouped_w4a4_matches_the_reference(d, experts, sizes):
    gen = torch.Generator().manual_seed(7)
    qa = quantize_nvfp4(torch.randn(sum(sizes), K, generator=gen))
    off = offsets_of(sizes)
    out = d.grouped_gemm(qa, experts, off, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert rel_err(out, grouped_reference(qa, experts, off)) < CHECK_RTOL
    plan = d.cached_plan(sum(sizes), N, K, "float16", "grouped_w4a4", E)
    assert plan is not None and plan.warm


def test_caller_out_is_written(d, experts):
    a = torch.randn(4, K).to(torch.bfloat16)
    off = offsets_of([1, 0, 0, 2, 1, 0])
    out = torch.full((4, N), float("nan"), dtype=torch.bfloat16)
    assert d.grouped_gemm(a, experts, off, out=out) is out
    assert rel_err(out, grouped_reference(a, experts, off)) < CHECK_RTOL


def test_argument_errors_name_the_argument(d, experts):
    a = torch.randn(4, K).to(torch.bfloat16)
    off = offsets_of([1, 0, 0, 2, 1, 0])
    with pytest.raises(TypeError, match="b: expected an Nvfp4Experts"):
        d.grouped_gemm(a, experts.expert(0), off)
    with pytest.raises(TypeError, match=r"offsets: expected dtype torch\.int32"):
        d.grouped_gemm(a, experts, off.long())
    with pytest.raises(ValueError, match=r"offsets: expected shape \(6,\)"):
        d.grouped_gemm(a, experts, off[:5])
    with pytest.raises(ValueError, match="b: K must match a's K=32"):
        d.grouped_gemm(a[:, :32], experts, off)
    with pytest.raises(TypeError, match="a: expected dtype"):
        d.grouped_gemm(a.float(), experts, off)
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 48\)"):
        d.grouped_gemm(a, experts, off, out=torch.empty(4, 47, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="groups: operation 'grouped_w4a16' needs"):
        d.tune([(8, N, K)], operation="grouped_w4a16")
    with pytest.raises(ValueError, match="groups: only the grouped operations"):
        d.tune([(8, N, K)], operation="w4a16", groups=4)


def test_plans_are_keyed_by_expert_count(d, experts):
    a = torch.randn(6, K).to(torch.bfloat16)
    d.grouped_gemm(a, experts, offsets_of([1] * 6))
    fewer = quantize_experts(torch.randn(3, N, K))
    d.grouped_gemm(a, fewer, offsets_of([2, 2, 2]))
    assert (6, N, K, "bfloat16", "grouped_w4a16", 6) in d._plans
    assert (6, N, K, "bfloat16", "grouped_w4a16", 3) in d._plans
    assert d.cached_plan(6, N, K, "bfloat16", "grouped_w4a16", 3) is not d.cached_plan(
        6, N, K, "bfloat16", "grouped_w4a16", 6
    )


# ---- families opt in ---------------------------------------------------------------------


class DenseOnlyTactic(Tactic):
    backend: Literal["dense-only"] = "dense-only"


class DenseOnly(Backend):
    """A family that lists no grouped operation: it must never be asked about one."""

    name = "dense-only"
    family = "test"
    version = "1"
    tactic_type = DenseOnlyTactic
    operations = ("w4a4", "w4a16")

    def __init__(self) -> None:
        self.asked: list[Problem] = []

    def supports(self, device) -> Support:
        return Support(True)

    def tactics(self, problem, device) -> Iterator[Tactic]:
        self.asked.append(problem)
        yield DenseOnlyTactic(tile_m=64, tile_n=64)

    def build(self, tactic, problem, device):
        raise AssertionError("never built here")


def test_a_family_without_grouped_operations_never_sees_a_grouped_problem(d):
    from fp4_dispatch.plugins.reference import ReferenceBackend

    fam = DenseOnly()
    ranker = Ranker([fam, ReferenceBackend()], d.device)
    for op in ("grouped_w4a16", "grouped_w4a4"):
        sl = ranker.shortlist(Problem(m=8, n=N, k=K, operation=op, groups=E))
        assert {c.backend for c in sl.candidates} == {"torch-reference"}
        ranker.pick(8, N, K, "bfloat16", op, E)
    assert fam.asked == []
    ranker.shortlist(Problem(m=8, n=N, k=K, operation="w4a16"))
    assert len(fam.asked) == 1


# ---- tuning and the cache ----------------------------------------------------------------


def fixed_timer(cand, launch, best) -> Timing:
    launch(0)
    return Timing((10.0 if cand.tactic.compute_dtype == "float32" else 20.0,) * 3, "fake")


def test_grouped_tuning_is_cached_under_its_expert_count(tmp_path, experts):
    path = tmp_path / "tuning.json"
    d = Dispatcher("cpu", cache=path)
    dense = quantize_nvfp4(torch.randn(N, K))
    d.tune([(8, N, K)], operation="w4a16", timer=fixed_timer, progress=False)
    (r,) = d.tune([(5, N, K)], operation="grouped_w4a16", groups=E, timer=fixed_timer,
                  progress=False)  # fmt: skip
    assert r.source == "measured" and r.bucket == (N, K, 8, "bfloat16", "grouped_w4a16", E)
    entries = json.loads(path.read_text())["entries"]
    by_op = {e["operation"]: e for e in entries}
    assert by_op["grouped_w4a16"]["groups"] == E and by_op["grouped_w4a16"]["m_bucket"] == 8
    assert "groups" not in by_op["w4a16"]  # dense entries are written as before
    # a new process reads both back: the grouped one only for its own E
    d2 = Dispatcher("cpu", cache=path, verify_cache=False)
    hit = d2.winners.cached_result((N, K, 8, "bfloat16", "grouped_w4a16", E), (5, N, K))
    assert hit is not None and hit.source == "cache" and hit.problem.groups == E
    assert d2.winners.pick(5, N, K, "bfloat16", "grouped_w4a16", E + 1) is None
    assert d2.winners.pick(5, N, K, "bfloat16", "w4a16") is not None
    # the tuned grouped winner runs
    a = torch.randn(5, K).to(torch.bfloat16)
    off = offsets_of([1, 0, 2, 0, 2, 0])
    out = d2.grouped_gemm(a, experts, off)
    assert rel_err(out, grouped_reference(a, experts, off)) < CHECK_RTOL
    assert d2.cached_plan(5, N, K, "bfloat16", "grouped_w4a16", E).candidate.reason.startswith(
        "tuned"
    )
    d2.gemm(torch.randn(3, K).to(torch.bfloat16), dense)  # dense still fine


def test_an_old_dense_entry_keeps_its_key(tmp_path):
    """An entry written before grouped operations existed (no ``groups``) is read as the
    dense bucket it always was."""
    path = tmp_path / "tuning.json"
    d = Dispatcher("cpu", cache=path)
    d.tune([(8, N, K)], operation="w4a16", timer=fixed_timer, progress=False)
    data = json.loads(path.read_text())
    assert all("groups" not in e for e in data["entries"])
    d2 = Dispatcher("cpu", cache=path, verify_cache=False)
    assert set(d2.winners.entries()) == {(N, K, 8, "bfloat16", "w4a16")}


def test_grouped_inputs_use_balanced_routing_and_distinct_experts():
    d = Dispatcher("cpu", cache=False)
    p = Problem(m=8, n=N, k=K, operation="grouped_w4a4", groups=16)
    inputs = make_inputs(p, d.device, copies=2)
    ops = inputs.copies[0]
    assert ops.offsets.tolist() == [(e + 1) * 8 // 16 for e in range(16)]
    assert ops.a_scale is not None and tuple(ops.alpha.shape) == (16,)
    assert not torch.equal(ops.b_data[0], ops.b_data[1])
    assert inputs.copies[1].b_data.data_ptr() != ops.b_data.data_ptr()


# ---- torch.compile -------------------------------------------------------------------------


def test_grouped_gemm_compiles_fullgraph_through_the_op(experts):
    d = Dispatcher("cpu", cache=False)

    def layer(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return d.grouped_gemm(x, experts, offsets).float().relu()

    explained = torch._dynamo.explain(layer)(
        torch.randn(7, K).to(torch.bfloat16), offsets_of([1, 0, 2, 0, 4, 0])
    )
    assert explained.graph_break_count == 0
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "fp4_dispatch.grouped_gemm" in targets
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for sizes in ([1, 0, 2, 0, 4, 0], [0, 0, 0, 0, 0, 7]):
        x = torch.randn(7, K).to(torch.bfloat16)
        off = offsets_of(sizes)
        got = compiled(x, off)
        assert rel_err(got, grouped_reference(x, experts, off).relu()) < CHECK_RTOL
        assert torch.equal(got, layer(x, off))


def test_the_public_op_checks_its_operands(experts):
    a = torch.randn(4, K).to(torch.bfloat16)
    off = offsets_of([1, 0, 0, 2, 1, 0])
    y = torch.ops.fp4_dispatch.grouped_gemm(
        a, None, experts.data, experts.scale, experts.global_scale, off, torch.bfloat16
    )
    assert rel_err(y, grouped_reference(a, experts, off)) < CHECK_RTOL
    with pytest.raises(ValueError, match=r"alpha: expected shape \(6,\)"):
        torch.ops.fp4_dispatch.grouped_gemm(
            a, None, experts.data, experts.scale, experts.global_scale[:5], off, torch.bfloat16
        )
    y2 = torch_ops.run_grouped(
        None, a, None, experts.data, experts.scale, experts.global_scale, off, torch.bfloat16
    )
    assert torch.equal(y, y2)


def test_reference_capturable_path_matches_the_eager_one(experts):
    """The reference family's path for a CUDA-graph capture (offsets never read on the
    host: each row's expert found by a device search) computes what the eager one does,
    rows past the last offset left as they were."""
    from fp4_dispatch.backends import reference
    from fp4_dispatch.contracts.backend import GroupedOperands

    gen = torch.Generator().manual_seed(5)
    a = torch.randn(9, K, generator=gen).to(torch.bfloat16)
    off = offsets_of([0, 3, 0, 1, 4, 0])  # 8 rows: row 8 belongs to no expert
    ops = GroupedOperands(a, experts.data, experts.scale, experts.global_scale, off)
    eager = torch.full((9, N), float("nan"), dtype=torch.bfloat16)
    reference.gemm_grouped(ops, eager, "float32", 0)
    device_path = torch.full((9, N), float("nan"), dtype=torch.bfloat16)
    reference._grouped_on_device(ops, a.to(torch.float32), device_path, torch.float32, 0)
    assert torch.equal(eager[:8], device_path[:8])
    assert torch.isnan(eager[8]).all() and torch.isnan(device_path[8]).all()
    assert rel_err(eager[:8], grouped_reference(a, experts, off)[:8]) < CHECK_RTOL


# ---- the CLI ---------------------------------------------------------------------------


def test_cli_explain_and_tune_take_groups(tmp_path, capsys, monkeypatch):
    from fp4_dispatch.cli import main

    assert main(["explain", "64", "1536", "2048", "--op", "grouped_w4a16", "--groups", "128",
                 "--device", "sm90", "--json"]) == 0  # fmt: skip
    shown = json.loads(capsys.readouterr().out)
    assert shown["problem"]["groups"] == 128 and shown["problem"]["operation"] == "grouped_w4a16"
    assert {c["backend"] for c in shown["candidates"]} == {
        "triton-sm90-grouped",
        "triton-sm90-grouped-mma",  # 64 rows over 64+ experts: 1 row per expert
    }
    assert main(["explain", "8", "48", "64", "--op", "grouped_w4a4", "--groups", "6",
                 "--device", "cpu"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "over E=6 experts" in text and "torch-reference" in text
    assert main(["explain", "8", "48", "64", "--op", "grouped_w4a16"]) == 2
    assert "needs --groups E" in capsys.readouterr().err
    assert main(["explain", "8", "48", "64", "--groups", "6"]) == 2
    assert "only for --op grouped" in capsys.readouterr().err
    cache = tmp_path / "c.json"
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(cache))
    assert main(["tune", "--shapes", "8,48,64", "--op", "grouped_w4a16", "--groups", "6",
                 "--device", "cpu", "--no-progress", "--json"]) == 0  # fmt: skip
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["problem"]["groups"] == 6 and result["winner"] is not None
    assert json.loads(cache.read_text())["entries"][0]["groups"] == 6


# ---- a third-party grouped family: first use checked, a wrong kernel falls back --------


class WrongGroupedTactic(Tactic):
    backend: Literal["wrong-grouped"] = "wrong-grouped"


class WrongGrouped(Backend):
    """A plugin's grouped family that ranks first and reads expert 0's weight for every
    row (the classic grouped bug): the first-use check must catch it."""

    name = "wrong-grouped"
    family = "third-party"
    version = "1"
    tactic_type = WrongGroupedTactic
    operations = ("grouped_w4a16",)

    def supports(self, device) -> Support:
        return Support(True)

    def tactics(self, problem, device) -> Iterator[Tactic]:
        yield WrongGroupedTactic(tile_m=16, tile_n=16)

    def estimate_us(self, problem, device, tactic) -> float:
        return 0.001  # ranks first

    def build(self, tactic, problem, device):
        from fp4_dispatch.contracts.backend import GroupedOperands
        from fp4_dispatch.format.grouped import reference_output

        def kernel(ops: GroupedOperands, out: torch.Tensor) -> None:
            e = ops.groups
            same = GroupedOperands(ops.a, ops.b_data[:1].expand(e, -1, -1).contiguous(),
                                   ops.b_scale[:1].expand(e, -1, -1).contiguous(),
                                   ops.alpha[:1].expand(e).contiguous(), ops.offsets)  # fmt: skip
            out.copy_(reference_output(same).to(out.dtype))

        return kernel


def test_a_wrong_third_party_grouped_kernel_is_caught_on_first_use(monkeypatch, experts):
    import fp4_dispatch.loading.registry as registry_mod
    from fp4_dispatch.engine import firstuse
    from fp4_dispatch.plugins.reference import ReferenceBackend

    def make_registry(strict=None):
        reg = registry_mod.Registry()
        report = registry_mod.PluginReport("fake", "tests", "tests", "0", builtin=False)
        for b in (WrongGrouped(), ReferenceBackend()):
            reg.backends[b.name] = b
            reg.plugin_of[b.name] = report
            report.backends.append(b.name)
        reg.plugins.append(report)
        return reg

    monkeypatch.setattr(registry_mod, "load", make_registry)
    firstuse.forget()
    d = Dispatcher("cpu", cache=False, verify_plugins=True)
    assert d.select(6, N, K, "bfloat16", "grouped_w4a16", E).backend == "wrong-grouped"
    a = torch.randn(6, K).to(torch.bfloat16)
    off = offsets_of([1, 1, 1, 1, 1, 1])
    out = d.grouped_gemm(a, experts, off)
    assert rel_err(out, grouped_reference(a, experts, off)) < CHECK_RTOL  # the fallback's
    assert any(name == "wrong-grouped" for name, _ in d.guard.broken)
    plan = d.cached_plan(6, N, K, "bfloat16", "grouped_w4a16", E)
    assert plan.candidate.backend == "torch-reference"
    firstuse.forget()


# ---- the conformance kit ---------------------------------------------------------------


def test_conformance_kit_checks_grouped_operations():
    """A backend serving grouped operations is checked on grouped problems: the reference
    family's kernels run against the float64 per-expert reference on the CPU (a grouped
    kernel that ignores the routing fails), the Hopper family's build on a simulated sm90
    (asked dense problems, it gets them as grouped ones)."""
    from fp4_dispatch.plugins.reference import ReferenceBackend
    from fp4_dispatch.plugins.sm90.grouped import TritonSm90GroupedBackend
    from fp4_dispatch.testing import check_backend

    problems = [Problem(m=9, n=32, k=64, operation="grouped_w4a16", groups=4),
                Problem(m=40, n=48, k=96, out_dtype="float16", operation="grouped_w4a4",
                        groups=3)]  # fmt: skip
    report = check_backend(ReferenceBackend(), device="cpu", problems=problems, samples=2)
    report.raise_for_failures()
    assert any(c.category == "numerics" for c in report.passed), report.summary()

    class FirstExpertOnly(ReferenceBackend):
        def build(self, tactic, problem, device):
            def kernel(ops, out):
                out.copy_((ops.a.float() @ ops.a.float()[:1].T).expand(-1, out.shape[1]))

            return kernel if problem.grouped else super().build(tactic, problem, device)

    bad = check_backend(FirstExpertOnly(), device="cpu", problems=problems[:1], samples=2)
    assert any(c.category == "numerics" for c in bad.failures), bad.summary()
    sim = check_backend(TritonSm90GroupedBackend(), device="sm90",
                        problems=[Problem(m=8, n=64, k=128)], samples=2)  # fmt: skip
    sim.raise_for_failures()
    assert any(c.category == "build" for c in sim.passed), sim.summary()


def test_cli_compile_takes_a_grouped_problem(capsys):
    """``compile --op grouped_w4a4 --groups E`` ranks the grouped problem (without the
    flashinfer extra no family compiles it ahead of time on sm100: a clear error naming
    the device; with it, fi-grouped-w4a4 does)."""
    from fp4_dispatch.cli import main

    assert main(["compile", "64", "1536", "2048", "--device", "sm100", "--op",
                 "grouped_w4a4"]) == 2  # fmt: skip
    assert "needs --groups E" in capsys.readouterr().err
    code = main(["compile", "64", "1536", "2048", "--device", "sm100", "--op", "grouped_w4a4",
                 "--groups", "128", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        assert code != 0 and "nothing to compile on" in err, err
    else:  # fi-grouped-w4a4 compiles it for sm_100a (tests/test_blackwell_grouped.py)
        assert code == 0, err


def test_grouped_w4a16_writes_the_activations_dtype_only():
    """The problem's output dtype names A's dtype too (a family may serve bf16 only), so a
    grouped W4A16 call with another ``out_dtype`` is refused, naming the argument."""
    d = Dispatcher(device="cpu", cache=False)
    w = quantize_experts(torch.randn(2, 32, 64))
    a = torch.randn(4, 64, dtype=torch.bfloat16)
    offsets = torch.tensor([1, 4], dtype=torch.int32)
    assert d.grouped_gemm(a, w, offsets).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"out_dtype: .*bfloat16.*got torch.float16"):
        d.grouped_gemm(a, w, offsets, out_dtype=torch.float16)
