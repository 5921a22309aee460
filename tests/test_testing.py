"""The conformance kit: passes the real plugins, and each check fails on a plugin built to
break it (so a PASS means something)."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import pytest
import torch
from conftest import good_plugin
from pydantic import ConfigDict, field_serializer

from fp4_dispatch import Problem, Support
from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic
from fp4_dispatch.testing import (
    CATEGORIES,
    ConformanceError,
    ConformanceReport,
    check_backend,
    check_plugin,
)

pytest_plugins = ["pytester"]

SMALL = (Problem(m=1, n=64, k=64), Problem(m=37, n=96, k=128, out_dtype="float16"))


def categories_passed(report: ConformanceReport) -> set[str]:
    return {c.category for c in report.passed}


# ---- the real plugins ----------------------------------------------------------------------


@pytest.mark.parametrize("entry_point", ["reference", "example"])
def test_installed_plugins_conform_on_cpu(entry_point):
    report = check_plugin(entry_point, device="cpu")
    assert report.ok, report.summary()
    assert categories_passed(report) == set(CATEGORIES)
    assert report.raise_for_failures() is report
    blob = json.loads(json.dumps(report.to_json()))
    assert (
        blob["ok"] and blob["plugin"] == entry_point and len(blob["checks"]) == len(report.checks)
    )


def test_broken_plugin_fails_at_load_with_its_error():
    report = check_plugin("broken")
    assert not report.ok
    [fail] = report.failures
    assert fail.category == "load" and fail.name == "import"
    assert "ImportError" in fail.message and "libfp4broken.so" in fail.message
    with pytest.raises(ConformanceError, match=r"libfp4broken\.so") as e:
        report.raise_for_failures()
    assert e.value.report is report


def test_unknown_entry_point_lists_what_is_installed():
    report = check_plugin("no-such-plugin")
    [fail] = report.failures
    assert "no entry point 'no-such-plugin'" in fail.message and "reference" in fail.message


def test_disabled_plugin_is_a_failure_not_a_pass(monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "example")
    report = check_plugin("example")
    assert not report.ok and any("FP4_DISPATCH_DISABLE" in c.message for c in report.failures)


HOOK = (
    "import fp4_dispatch\n@fp4_dispatch.hookimpl\ndef fp4_dispatch_register_backends(register):\n"
)


@pytest.mark.parametrize(
    ("body", "stage", "needle"),
    [
        ("    raise RuntimeError('hook exploded')\n", "hook", "hook exploded"),
        ("    register(object())\n", "register", "Backend instance"),
        ("    pass\n", "register", "registered no backend"),
    ],
)
def test_plugin_level_failures(plugin_dist, body, stage, needle):
    plugin_dist("fp4-bad-dist", {"badplug": HOOK + body})
    report = check_plugin("badplug")
    assert not report.ok
    assert any(c.category == "load" and c.name == stage and needle in c.message
               for c in report.failures), report.summary()  # fmt: skip


def test_third_party_plugin_through_a_real_entry_point(plugin_dist):
    plugin_dist("fp4-good-dist", {"goodplug": good_plugin("good-backend", "goodfam")})
    report = check_plugin("goodplug", problems=SMALL, samples=2)
    assert report.ok, report.summary()
    assert any(c.category == "dispatcher" and c.name == "run" and c.status == "PASS"
               for c in report.checks)  # fmt: skip


# ---- deliberately broken backends: each check can fail -----------------------------------


def variant(name: str, **overrides):
    """A reference-backend subclass named `name`, with its own tactic model, plus overrides."""
    tactic_cls = overrides.pop("tactic_cls", None)
    if tactic_cls is None:
        tactic_cls = type(f"T_{name}", (ReferenceTactic,), {
            "__annotations__": {"backend": Literal[name]}, "backend": name,
        })  # fmt: skip

    def tactics(self, problem, device):
        for t in ReferenceBackend.tactics(self, problem, device):
            yield tactic_cls(**{**t.model_dump(), "backend": name})

    attrs = {"name": name, "family": "synthetic", "tactic_type": tactic_cls, "tactics": tactics}
    attrs.update(overrides)
    return type(f"B_{name}", (ReferenceBackend,), attrs)()


class LossyTactic(ReferenceTactic):
    backend: Literal["lossy"] = "lossy"

    @field_serializer("k_chunk", when_used="json")
    def _drop(self, v: int) -> int:
        return 0  # JSON forgets the K chunk: the tuning cache would restore the wrong tactic


class MutableTactic(ReferenceTactic):
    model_config = ConfigDict(frozen=False, extra="allow")
    backend: Literal["mutable"] = "mutable"


class LooseNameTactic(ReferenceTactic):
    backend: str = "loose"


def _unvalidated_tactics(self, problem, device):
    yield self.tactic_type()
    # model_construct skips validation: k_chunk=32 is not one of the model's Literal values
    yield self.tactic_type.model_construct(**{**self.tactic_type().model_dump(), "k_chunk": 32})


def _no_alpha(self, tactic, problem, device):
    from fp4_dispatch.backends import reference

    def kernel(ops, out):
        reference.gemm(
            dataclasses.replace(ops, alpha=torch.ones_like(ops.alpha)), out, "float32", 0
        )

    return kernel


class _FactorKernel:
    """Declares ``alpha_factors``; honours ``alpha_b`` unless ``ignore``."""

    alpha_factors = True

    def __init__(self, ignore: bool) -> None:
        self.ignore = ignore

    def __call__(self, ops, out):
        from fp4_dispatch.backends import reference

        alpha = ops.alpha if self.ignore or ops.alpha_b is None else ops.alpha * ops.alpha_b
        reference.gemm(dataclasses.replace(ops, alpha=alpha, alpha_b=None), out, "float32", 0)


def _factors(ignore: bool):
    return lambda self, tactic, problem, device: _FactorKernel(ignore)


def _half_written(self, tactic, problem, device):
    from fp4_dispatch.backends import reference

    def kernel(ops, out):
        full = torch.empty_like(out)
        reference.gemm(ops, full, "float32", 0)
        out[: max(1, out.shape[0] // 2)].copy_(full[: max(1, out.shape[0] // 2)])

    return kernel


def _swap_tactics(self, problem, device):
    yield self.tactic_type(swap_ab=False)
    yield self.tactic_type(swap_ab=True)


def _ignores_strides(self, tactic, problem, device):
    from fp4_dispatch.backends import reference

    def kernel(ops, out):
        full = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        reference.gemm(ops, full, "float32", 0)
        # writes row-major into out's storage whatever out's strides: wrong for out.T
        torch.as_strided(out, out.shape, (out.shape[1], 1)).copy_(full)

    return kernel


def _foreign(self, problem, device):
    yield ReferenceTactic()  # another backend's tactic type


def _raises(exc: Exception):
    def method(self, *args, **kwargs):
        raise exc

    return method


def _unstable(self, problem, device):
    self.calls = getattr(self, "calls", 0) + 1
    yield self.tactic_type(swap_ab=bool(self.calls % 2))  # a different tactic every call


BROKEN = {
    "not a Backend": (lambda: object(), "backend", "Backend instance"),
    "lossy json": (lambda: variant("lossy", tactic_cls=LossyTactic,
                                   tactics=lambda self, p, d: iter([LossyTactic(k_chunk=512)])),
                   "json", "came back as"),
    "mutable tactic model": (lambda: variant("mutable", tactic_cls=MutableTactic),
                             "backend", "frozen=True"),
    "backend field not a Literal": (lambda: variant("loose", tactic_cls=LooseNameTactic),
                                    "backend", "Literal['loose']"),
    "diversity axis not a field": (lambda: variant("axes", diversity_axes=("prefetch",)),
                                   "backend", "prefetch"),
    "supports raises": (lambda: variant("sup", supports=_raises(OSError("no driver"))),
                        "backend", "no driver"),
    "tactics raises": (lambda: variant("tacr", tactics=_raises(KeyError("tile table"))),
                       "tactics", "tile table"),
    "tactic fails validation": (lambda: variant("construct", tactics=_unvalidated_tactics),
                                "tactics", "re-validation"),
    "foreign tactic": (lambda: variant("foreign", tactics=_foreign),
                       "tactics", "expected T_foreign"),
    "unstable tactics": (lambda: variant("unstable", tactics=_unstable), "tactics", "different"),
    "estimate NaN": (lambda: variant("nan", estimate_us=lambda self, p, d, t: float("nan")),
                     "tactics", "nan"),
    "validate rejects offered": (lambda: variant("picky", validate=lambda self, t, p, d: "nope"),
                                 "validity", "nope"),
    "build raises": (lambda: variant("nobuild", build=_raises(RuntimeError("ptxas died"))),
                     "build", "ptxas died"),
    "ignores alpha": (lambda: variant("noalpha", build=_no_alpha), "numerics", "relative error"),
    "declares alpha_factors, ignores alpha_b": (
        lambda: variant("factors", build=_factors(ignore=True)), "numerics", "alpha_factors"),
    "leaves output unwritten": (lambda: variant("half", build=_half_written),
                                "numerics", "not written"),
    "ignores out strides when swapped": (
        lambda: variant("strides", tactics=_swap_tactics, build=_ignores_strides),
        "numerics", "swap_ab\":true"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_fails_on_a_backend_built_to_break_it(case):
    make, category, needle = BROKEN[case]
    report = check_backend(make(), device="cpu", problems=SMALL, samples=4)
    assert not report.ok
    failed = [c for c in report.failures if c.category == category]
    assert failed, report.summary()
    assert any(needle in c.message for c in failed), report.summary()
    with pytest.raises(ConformanceError):
        report.raise_for_failures()


def test_a_correct_variant_passes_every_backend_category():
    report = check_backend(variant("fine", tactics=_swap_tactics), problems=SMALL)
    assert report.ok, report.summary()
    assert categories_passed(report) == set(CATEGORIES) - {"load", "dispatcher"}


def test_a_kernel_that_takes_alpha_factors_passes():
    report = check_backend(variant("goodfactors", build=_factors(ignore=False)), problems=SMALL)
    assert report.ok, report.summary()


def test_simulated_device_builds_but_does_not_run():
    sim_ok = variant("simok", supports=lambda self, d: Support(True, "builds anywhere"))
    report = check_backend(sim_ok, device="sm100", problems=SMALL)
    assert report.ok, report.summary()
    assert [c.status for c in report.of("numerics")] == ["SKIP"]
    assert [c.status for c in report.of("build")] == ["PASS"]


def test_report_api():
    empty = ConformanceReport("x", "cpu")
    assert not empty.ok  # nothing passed is not a pass
    with pytest.raises(ValueError, match="category"):
        empty.of("nonsense")
    empty.add("load", "entry-point", "PASS", "fine")
    assert empty.ok and "1 passed, 0 failed" in str(empty)


# ---- pytest integration ----------------------------------------------------------------------


def test_subclassing_plugin_conformance_in_pytest(pytester):
    pytester.makepyfile(
        test_conf="""
        from fp4_dispatch.testing import PluginConformance

        class TestReference(PluginConformance):
            entry_point = "reference"

        class TestBroken(PluginConformance):
            entry_point = "broken"
            devices = ("cpu",)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    # reference: 8 categories pass on cpu, 8 skip on cuda (no GPU here);
    # broken: load fails, backend fails (nothing to check), the other 6 are not reached
    outcomes = result.parseoutcomes()
    cuda = torch.cuda.is_available()
    assert outcomes.get("passed") == (16 if cuda else 8)
    assert outcomes.get("failed") == 2
    result.stdout.fnmatch_lines(["*TestBroken::test_loads_through_entry_point*cpu*"])


def test_pytest_plugin_mode_fixture_and_device_option(pytester):
    pytester.makepyfile(
        test_fixture="""
        from fp4_dispatch.testing import PluginConformance

        def test_example(fp4_conformance):
            report = fp4_conformance("example")
            assert report.device == "simulated B200 (sm100)"

        class TestExample(PluginConformance):
            entry_point = "example"
        """
    )
    result = pytester.runpytest("-p", "fp4_dispatch.testing", "--fp4-device", "sm100",
                                "-p", "no:cacheprovider", "-q")  # fmt: skip
    # on a simulated device the example backend is unsupported: load/backend/dispatcher
    # pass, the kernel checks skip with the backend's reason
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") is None, result.stdout.str()
    assert outcomes.get("passed") == 4 and outcomes.get("skipped") == 5


def test_a_weight_only_backend_is_checked_on_w4a16_problems():
    """The kit hands a W4A16 backend dense activations (DenseOperands) and compares
    against float64 of the unrounded activation; a kernel that ignores it fails."""
    from fp4_dispatch.plugins.reference import ReferenceBackend
    from fp4_dispatch.testing import check_backend

    class DenseOnly(ReferenceBackend):
        operations = ("w4a16",)

    good = check_backend(DenseOnly(), device="cpu")
    assert good.ok, good.summary(failures_only=True)
    assert [c for c in good.of("numerics") if c.status == "PASS"]

    class Zeros(DenseOnly):
        def build(self, tactic, problem, device):
            def kernel(ops, out):
                assert type(ops).__name__ == "DenseOperands"
                out.zero_()

            return kernel

    bad = check_backend(Zeros(), device="cpu")
    assert [c for c in bad.failures if c.category == "numerics"], bad.summary()
