"""Conformance kit for backend plugins (is my plugin right?): its entry points and pytest glue.

What a third-party backend author runs (and what CI runs on the built-in plugins):

- **load**: the entry point exists in the ``fp4_dispatch`` group, imports, its hook runs
  and registers at least one backend, with no load error;
- **backend**: the backend object is a `Backend` with name/family/version, a frozen
  ``extra="forbid"`` tactic model whose ``backend`` field is ``Literal[name]``, diversity
  axes that are fields of that model, and a ``supports()`` that answers;
- **tactics**: ``tactics(problem, device)`` answers for every sample problem with
  instances of the tactic model that survive re-validation, the same set every call,
  at least one for some problem, and ``estimate_us`` (if any) gives None or a finite
  number >= 0;
- **json**: every tactic round-trips JSON exactly (``model_dump_json`` ->
  ``model_validate_json``, and the ``mode="json"`` dict the tuning cache stores);
- **validity**: ``validate(tactic, problem, device)`` accepts every tactic ``tactics()``
  offered for that problem;
- **dispatcher**: a real `Dispatcher` lists the backend as available, merges its
  tactics without dropping any, and runs its top candidate correctly;
- **build** / **numerics**: sampled tactics build for the problem as the dispatcher
  hands it over (M bucketed, swapped when ``swap_ab``), and - on a device that runs
  kernels - produce ``alpha * A @ B.T`` within ``tolerance`` (relative Frobenius error
  against the float64 reference), writing every element of ``out`` (pre-filled with
  NaN) and honouring ``out``'s strides (a swapped tactic writes ``out.T``).

Use it as a function::

    from fp4_dispatch.testing import check_plugin
    check_plugin("myplugin", device="cuda").raise_for_failures()

or in pytest, by subclassing (one test per check category and device)::

    from fp4_dispatch.testing import PluginConformance

    class TestMyPlugin(PluginConformance):
        entry_point = "myplugin"
        devices = ("cpu", "cuda", "sm100")   # cuda is skipped without a GPU

or as a pytest plugin (``pytest -p fp4_dispatch.testing`` or ``pytest_plugins =
["fp4_dispatch.testing"]``), which adds ``--fp4-device`` (overrides ``devices``) and the
``fp4_conformance`` fixture (``fp4_conformance("myplugin")`` runs `check_plugin` and
fails the test with the report). Nothing is registered through a ``pytest11`` entry
point, so installing fp4-dispatch changes no other project's pytest runs.

The checks themselves are `fp4_dispatch.integrations.conformance`, their results
`fp4_dispatch.integrations.conformance_report`; both are re-exported here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.integrations.conformance import (
    DEFAULT_PROBLEMS,
    DEFAULT_TOLERANCE,
    check_backend,
    check_plugin,
)
from fp4_dispatch.integrations.conformance_report import (
    CATEGORIES,
    Check,
    ConformanceError,
    ConformanceReport,
    Status,
)

__all__ = [
    "CATEGORIES",
    "DEFAULT_PROBLEMS",
    "DEFAULT_TOLERANCE",
    "Check",
    "ConformanceError",
    "ConformanceReport",
    "PluginConformance",
    "Status",
    "check_backend",
    "check_plugin",
]

_REPORTS: dict[tuple, ConformanceReport] = {}


class PluginConformance:
    """Subclass as ``class TestX(PluginConformance): entry_point = "x"`` in a test module.

    One test per check category and device. ``devices``: where to check ("cuda" is
    skipped without a GPU; simulated families build but do not run kernels); the
    ``--fp4-device`` option (with ``-p fp4_dispatch.testing``) overrides it.
    """

    entry_point: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    problems: Sequence[Problem] | None = None
    samples: int = 4
    tolerance: float = DEFAULT_TOLERANCE

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "fp4_device" in metafunc.fixturenames:
            forced = _device_option(metafunc.config)
            devices = (forced,) if forced else tuple(self.devices)
            metafunc.parametrize("fp4_device", devices)

    def _report(self, device: str) -> ConformanceReport:
        import pytest  # noqa: PLC0415 - optional: only the pytest plugin needs it

        if not self.entry_point:
            pytest.fail(f"{type(self).__name__}.entry_point is not set")
        if device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        problems = None if self.problems is None else tuple(self.problems)
        key = (self.entry_point, device, problems, self.samples, self.tolerance)
        if key not in _REPORTS:
            _REPORTS[key] = check_plugin(
                self.entry_point, device, problems, self.samples, tolerance=self.tolerance
            )
        return _REPORTS[key]

    def _expect(self, category: str, device: str) -> None:
        import pytest  # noqa: PLC0415 - optional: only the pytest plugin needs it

        report = self._report(device)
        checks = report.of(category)
        failed = [c for c in checks if c.status == "FAIL"]
        if failed:
            pytest.fail("\n".join(str(c) for c in failed), pytrace=False)
        if not any(c.status == "PASS" for c in checks):
            why = "; ".join(c.message for c in checks) or "not reached (see earlier failures)"
            if category in ("load", "backend") or not report.passed:
                pytest.fail(f"{category}: no check passed ({why})", pytrace=False)
            pytest.skip(f"{category}: {why}")

    def test_loads_through_entry_point(self, fp4_device: str) -> None:
        self._expect("load", fp4_device)

    def test_backend_contract(self, fp4_device: str) -> None:
        self._expect("backend", fp4_device)

    def test_tactics_are_proper(self, fp4_device: str) -> None:
        self._expect("tactics", fp4_device)

    def test_tactics_round_trip_json(self, fp4_device: str) -> None:
        self._expect("json", fp4_device)

    def test_tactics_valid_for_problems(self, fp4_device: str) -> None:
        self._expect("validity", fp4_device)

    def test_dispatcher_merges_and_runs(self, fp4_device: str) -> None:
        self._expect("dispatcher", fp4_device)

    def test_sampled_tactics_build(self, fp4_device: str) -> None:
        self._expect("build", fp4_device)

    def test_sampled_tactics_match_reference(self, fp4_device: str) -> None:
        self._expect("numerics", fp4_device)


def _device_option(config: Any) -> str | None:
    """``--fp4-device``; None when not given or this module is not loaded as a plugin."""
    return config.getoption("fp4_device", default=None)


def pytest_addoption(parser: Any) -> None:
    """With ``-p fp4_dispatch.testing``: ``--fp4-device`` for PluginConformance classes."""
    group = parser.getgroup("fp4-dispatch", "fp4-dispatch plugin conformance")
    group.addoption(
        "--fp4-device",
        default=None,
        help="device for PluginConformance tests (cpu, cuda, sm100, ...)",
    )


if importlib.util.find_spec("pytest") is not None:
    import pytest

    @pytest.fixture
    def fp4_conformance(request: Any) -> Callable[..., ConformanceReport]:
        """``fp4_conformance("myplugin", device=None, **kw)``: check_plugin, failing the test.

        ``device`` defaults to ``--fp4-device`` or "cpu".
        """

        def run(entry_point: str, device: str | None = None, **kwargs: Any) -> ConformanceReport:
            dev = device or _device_option(request.config) or "cpu"
            report = check_plugin(entry_point, dev, **kwargs)
            if not report.ok:
                pytest.fail(report.summary(failures_only=True), pytrace=False)
            return report

        return run
