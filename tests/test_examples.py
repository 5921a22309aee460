"""The example third-party plugin and its deliberately broken sibling, installed for real."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch
from test_cli import cli

from fp4_dispatch import Dispatcher, reference_gemm


@pytest.fixture(autouse=True)
def need_examples():
    names = {d.metadata["Name"] for d in metadata.distributions()}
    missing = {"fp4-dispatch-example-plugin", "fp4-dispatch-broken-plugin"} - names
    if missing:
        pytest.fail(f"the test environment must install examples/: missing {missing}")


def rows(*extra: str, env: dict | None = None) -> dict:
    out = cli("list-backends", "--device", "cpu", "--json", *extra, env=env).stdout
    return {r["plugin"]: r for r in json.loads(out)}


def test_example_available_and_broken_failed_with_its_error():
    by_plugin = rows()
    ex = by_plugin["example"]
    assert ex["status"] == "available" and ex["name"] == "example-rowblock"
    assert ex["origin"] == "fp4-dispatch-example-plugin" and ex["version"] == "0.1.0"
    broken = by_plugin["broken"]
    assert broken["status"] == "failed" and broken["origin"] == "fp4-dispatch-broken-plugin"
    assert "ImportError" in broken["reason"] and "libfp4broken.so" in broken["reason"]
    assert "Traceback" in broken["error"]["traceback"]


def test_failed_plugin_does_not_fail_the_command_unless_strict():
    assert cli("list-backends", "--device", "cpu").returncode == 0
    proc = cli("list-backends", "--device", "cpu", check=False, env={"FP4_DISPATCH_STRICT": "1"})
    assert proc.returncode != 0 and "libfp4broken.so" in proc.stderr


def test_allowlist_and_blocklist_from_the_cli():
    assert rows(env={"FP4_DISPATCH_PLUGINS": ""})["example"]["status"] == "disabled"
    assert rows(env={"FP4_DISPATCH_DISABLE": "broken"})["broken"]["status"] == "disabled"


def test_gemm_still_works_and_example_backend_runs(operands):
    d = Dispatcher(device="cpu")
    qa, qb = operands(70, 48, 128)
    ref = reference_gemm(qa, qb)
    out = d.gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    shortlist = d.candidates(70, 48, 128)
    ex = next(c for c in shortlist.candidates if c.backend == "example-rowblock")
    from fp4_dispatch import GemmOperands

    got = torch.empty(70, 48, dtype=torch.bfloat16)
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    d.run_candidate(ex, GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha), got)
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3
