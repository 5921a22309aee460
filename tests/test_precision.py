"""The precision policy (issue 34): ``precision="exact"`` never lets a lossy candidate
appear anywhere (candidates, select, explain, the tuning cache); ``"fp8"`` ranks W4A16 and
W4A8 together for dense calls, records the operation, and `Nvfp4Linear` follows the pick
per M. CPU only: simulated devices rank, the portable backends run."""

from __future__ import annotations

import json

import pytest
import torch

from fp4_dispatch import Dispatcher
from fp4_dispatch.backends.reference import w4a8 as emulation
from fp4_dispatch.cli import main
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.contracts.tactics import (
    LOSSY_OPERATIONS,
    check_precision,
    computed_as,
    is_lossy,
    problem_operation,
)
from fp4_dispatch.integrations.nn import Nvfp4Linear
from fp4_dispatch.loading.profiles import profiles
from fp4_dispatch.plugins.reference import ReferenceW4A8Backend
from fp4_dispatch.store.winners import StaleEntry

#: decode to prefill, odd sizes included, and the issue's three weight shapes
SHAPES = [(m, n, k) for m in (1, 3, 16, 64, 100, 256, 1024, 4096, 16384)
          for n, k in ((5120, 5120), (13824, 5120), (3584, 18944), (96, 64))]  # fmt: skip


def test_policy_values_and_errors():
    assert check_precision("exact") == "exact" and check_precision("fp8") == "fp8"
    for bad in ("FP8", "bf16", None, 8):
        with pytest.raises(ValueError, match="precision: expected one of"):
            check_precision(bad)
    assert problem_operation("w4a16", "fp8") == "w4a8"
    assert problem_operation("w4a16", "exact") == "w4a16"
    assert problem_operation("w4a4", "fp8") == "w4a4"  # NVFP4 activations: nothing more
    with pytest.raises(ValueError, match="needs precision='fp8'"):
        problem_operation("w4a8", "exact")
    with pytest.raises(ValueError, match="operation: expected one of"):
        problem_operation("w8a8", "fp8")
    assert {"w4a8"} == LOSSY_OPERATIONS and is_lossy("w4a8") and not is_lossy("w4a16")
    # an exact problem is never computed by a lossy operation
    for op in ("w4a4", "w4a16"):
        assert not any(is_lossy(o) for o in computed_as(op))
    with pytest.raises(ValueError, match="precision"):
        Dispatcher("cpu", precision="fp16", cache=False)


@pytest.mark.parametrize("device", [*sorted(profiles()), "cpu"])
def test_exact_never_offers_a_lossy_candidate(device):
    """Every simulated part and the CPU, both operations, both output dtypes, decode to
    prefill: no lossy candidate in a shortlist or a pick, under the default policy."""
    d = Dispatcher(device, cache=False)
    assert d.precision == "exact"
    for m, n, k in SHAPES:
        for op in ("w4a4", "w4a16"):
            for dtype in ("bfloat16", "float16"):
                sl = d.candidates(m, n, k, dtype, op)
                assert sl.problem.operation == op
                assert not any(c.lossy for c in sl.candidates), (device, m, n, k, op)
                if sl.candidates:
                    assert not d.select(m, n, k, dtype, op).lossy
    with pytest.raises(ValueError, match="needs precision='fp8'"):
        d.candidates(16, 64, 64, operation="w4a8")


def test_fp8_ranks_both_operations_on_hopper():
    d = Dispatcher("sm90", precision="fp8", cache=False)
    assert "precision='fp8'" in repr(d)
    seen = set()
    for m, n, k in SHAPES:
        sl = d.candidates(m, n, k, operation="w4a16")
        assert sl.problem.operation == "w4a8"
        for c in sl.candidates:
            backend = d.registry.backends[c.backend]
            assert c.operation in backend.operations and c.operation in ("w4a16", "w4a8")
            assert c.lossy == (c.operation == "w4a8")
            assert c.to_json()["operation"] == c.operation
            seen.add(c.operation)
        pick = d.select(m, n, k, operation="w4a16")
        assert pick.operation == min(sl.candidates, key=lambda c: c.est_us).operation
    assert seen == {"w4a16", "w4a8"}
    # the estimate's choice: exact W4A16 at decode, W4A8 at large M (issue 34's shapes)
    assert d.select(1, 5120, 5120, operation="w4a16").operation == "w4a16"
    assert d.select(4096, 5120, 5120, operation="w4a16").operation == "w4a8"
    # NVFP4 calls are the same problem under either policy
    exact = Dispatcher("sm90", cache=False)
    for m, n, k in SHAPES[:8]:
        a = [c.to_json() for c in exact.candidates(m, n, k).candidates]
        assert a == [c.to_json() for c in d.candidates(m, n, k).candidates]


def test_explain_marks_lossy_candidates(capsys):
    assert main(["explain", "4096", "5120", "5120", "--op", "w4a16", "--device", "sm90",
                 "--precision", "fp8"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "w4a8: dense activations under precision fp8" in text.splitlines()[0]
    assert "w4a8 (lossy)" in text and "w4a16" in text
    assert main(["explain", "4096", "5120", "5120", "--op", "w4a16", "--device", "sm90",
                 "--json", "--precision", "fp8"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    ops = {(c["operation"], c["lossy"]) for c in data["candidates"]}
    assert ("w4a8", True) in ops and ("w4a16", False) in ops
    assert main(["explain", "4096", "5120", "5120", "--op", "w4a16", "--device", "sm90"]) == 0
    text = capsys.readouterr().out
    assert "lossy" not in text and "w4a8" not in text
    with pytest.raises(SystemExit):
        main(["explain", "16", "64", "64", "--precision", "int8"])


def _cpu_w4a8_wins_from(monkeypatch, m_min: int) -> None:
    """Make the portable W4A8 twin the heuristic pick on a CPU from `m_min` tokens on
    (its real estimate never wins there), so a CPU test can watch the policy work."""

    def estimate(self, problem, device, tactic):
        return 1e-3 if problem.m >= m_min else 1e9

    monkeypatch.setattr(ReferenceW4A8Backend, "estimate_us", estimate)


def test_nvfp4_linear_follows_the_pick_per_m(monkeypatch):
    _cpu_w4a8_wins_from(monkeypatch, 64)
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96).to(torch.bfloat16)
    fp8 = Dispatcher("cpu", precision="fp8", cache=False)
    layer = Nvfp4Linear.from_linear(lin, fp8, activations="bf16")
    assert layer.precision == "fp8" and "precision=fp8" in repr(layer)
    exact_layer = Nvfp4Linear.from_linear(lin, Dispatcher("cpu", cache=False),
                                          activations="bf16")  # fmt: skip
    qw = layer.quantized_weight()
    for m, op in ((4, "w4a16"), (64, "w4a8"), (200, "w4a8")):
        x = torch.randn(m, 128).to(torch.bfloat16)
        assert layer.computed_operation(m) == op
        assert exact_layer.computed_operation(m) == "w4a16"
        y, y_exact = layer(x), exact_layer(x)
        want = torch.empty(m, 96, dtype=torch.bfloat16)
        emulation.gemm_w4a8(DenseOperands(x, qw.data, qw.scale, qw.global_scale.reshape(1),
                                          bias=None), want)  # fmt: skip
        want = (want.float() + lin.bias.float()).to(torch.bfloat16)  # the plan adds the bias
        if op == "w4a8":
            assert torch.equal(y, want)
            assert not torch.equal(y, y_exact)
        else:
            assert torch.equal(y, y_exact)


def test_nvfp4_linear_precision_argument():
    with pytest.raises(ValueError, match="precision: expected one of"):
        Nvfp4Linear(64, 32, precision="bf16")
    with pytest.raises(ValueError, match="dispatcher's policy 'exact'"):
        Nvfp4Linear(64, 32, precision="fp8", dispatcher=Dispatcher("cpu", cache=False))
    fp8 = Dispatcher("cpu", precision="fp8", cache=False)
    assert Nvfp4Linear(64, 32, dispatcher=fp8).precision == "fp8"
    assert Nvfp4Linear(64, 32).precision == "exact"
    default_fp8 = Nvfp4Linear(64, 32, precision="fp8", activations="bf16")
    assert default_fp8.computed_operation(8, "cpu") in ("w4a16", "w4a8")
    assert Nvfp4Linear(64, 32, precision="fp8", activations="nvfp4").computed_operation(8) == "w4a4"


def test_tuned_fp8_winner_stays_out_of_exact(tmp_path, monkeypatch):
    """An fp8 tuning of a dense bucket is cached as operation w4a8 with the winner's
    operation; an exact dispatcher on the same cache file never uses it, and an entry
    forged under the exact bucket is stale (its backend does not compute w4a16)."""
    _cpu_w4a8_wins_from(monkeypatch, 1)
    path = tmp_path / "c.json"
    fp8 = Dispatcher("cpu", precision="fp8", cache=path)
    (result,) = fp8.tune([(32, 64, 128)], operation="w4a16", measure="eager", progress=False,
                         precompile=False)  # fmt: skip
    assert result.problem.operation == "w4a8"
    entries = json.loads(path.read_text())["entries"]
    (entry,) = entries
    assert entry["operation"] == "w4a8"
    assert entry["winner_operation"] == result.winner.operation
    exact = Dispatcher("cpu", cache=path)
    assert exact.winners.pick(32, 64, 128, "bfloat16", "w4a16") is None
    assert not exact.select(32, 64, 128, operation="w4a16").lossy
    forged = dict(entry, operation="w4a16", backend="torch-reference-w4a8",
                  tactic={"backend": "torch-reference-w4a8", "tile_m": 128, "tile_n": 128,
                          "cluster_m": 1, "cluster_n": 1, "swap_ab": False})  # fmt: skip
    forged.pop("winner_operation")
    forged["backend_version"] = exact.registry.backends["torch-reference-w4a8"].version
    with pytest.raises(StaleEntry, match="does not compute a w4a16 problem"):
        exact.winners.validate(forged)


def test_default_dispatchers_per_policy():
    """The op-level default ids: -1 the exact default dispatcher of a device, -2 the fp8
    one (what a compiled `Nvfp4Linear(precision="fp8")` without a dispatcher names)."""
    from fp4_dispatch.engine import torch_ops

    cpu = torch.device("cpu")
    exact = torch_ops.get_dispatcher(torch_ops.DEFAULT, cpu)
    fp8 = torch_ops.get_dispatcher(torch_ops.DEFAULT_FP8, cpu)
    assert exact.precision == "exact" and fp8.precision == "fp8" and exact is not fp8
    assert torch_ops.default_dispatcher("cpu", "fp8") is fp8
    with pytest.raises(ValueError, match="precision"):
        torch_ops.default_dispatcher("cpu", "int8")


@pytest.mark.gpu
def test_fp8_layer_on_hopper_follows_the_pick():
    """On an sm90 GPU, `Nvfp4Linear(activations="auto", precision="fp8")`: whatever the
    pick per M, a W4A8 forward matches the emulation (fp32 summation order apart) and a
    W4A16 one the exact product; the exact twin never computes W4A8."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    torch.manual_seed(0)
    lin = torch.nn.Linear(5120, 5120, bias=False).to("cuda", torch.bfloat16)
    layer = Nvfp4Linear.from_linear(lin, precision="fp8")
    exact = Nvfp4Linear.from_linear(lin)
    qw = layer.quantized_weight()
    seen = set()
    for m in (1, 64, 4096):
        x = torch.randn(m, 5120, device="cuda").to(torch.bfloat16)
        op = layer.computed_operation(m)
        seen.add(op)
        assert exact.computed_operation(m) == "w4a16"
        y = layer(x)
        if op == "w4a8":
            want = torch.empty_like(y)
            emulation.gemm_w4a8(DenseOperands(x, qw.data, qw.scale,
                                              qw.global_scale.reshape(1)), want)  # fmt: skip
        else:
            want = (x.double() @ qw.dequantize().double().T).to(torch.bfloat16)
        err = float((y.double() - want.double()).norm() / want.double().norm())
        assert err < 4e-3, (m, op, err)
    assert "w4a16" in seen  # decode stays exact
