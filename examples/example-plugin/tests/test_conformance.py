"""The example plugin checks itself with fp4-dispatch's conformance kit.

Copy this file into your own plugin's tests and change ``entry_point``: it needs the
plugin installed (``pip install -e .``) so that its entry point is visible.
"""

from __future__ import annotations

from fp4_dispatch import Problem
from fp4_dispatch.testing import PluginConformance, check_plugin


class TestExamplePlugin(PluginConformance):
    """One test per check category, on the CPU and (when there is one) a CUDA GPU."""

    entry_point = "example"
    devices = ("cpu", "cuda")


def test_decode_shapes_as_a_function():
    """The same kit as a plain function, on the shapes this plugin cares most about."""
    decode = [Problem(m=m, n=512, k=256) for m in (1, 2, 8, 16)]
    report = check_plugin("example", device="cpu", problems=decode, samples=3)
    report.raise_for_failures()
    assert {c.category for c in report.passed} >= {"load", "json", "validity", "numerics"}
