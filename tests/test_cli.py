"""The console script, as a user runs it, from the installed wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

EXE = shutil.which("fp4-dispatch") or os.path.join(os.path.dirname(sys.executable), "fp4-dispatch")


def cli(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, env=full_env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_list_backends_json_on_cpu():
    rows = json.loads(cli("list-backends", "--device", "cpu", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    ref = by_name["torch-reference"]
    assert ref["status"] == "available" and ref["family"] == "portable"
    assert ref["origin"] == "built-in" and isinstance(ref["tactics"], int) and ref["tactics"] > 0
    for row in rows:
        assert {"name", "family", "origin", "version", "status", "reason", "tactics"} <= set(row)
        assert row["status"] in {"available", "unsupported", "failed", "disabled"}
        if row["status"] != "available":
            assert row["reason"], row


def test_list_backends_table_mentions_every_family():
    out = cli("list-backends", "--device", "cpu").stdout
    for family in ("portable", "sm90", "sm100", "sm103", "sm107"):
        assert family in out, out


def test_devices_lists_simulated_parts():
    data = json.loads(cli("devices", "--json").stdout)
    assert data["sm107"]["sm_count"] == 212 and data["sm100"]["sm_count"] == 148
    assert data["detected"]["kind"] in {"cpu", "cuda"}


def test_sm_count_override():
    """--sm-count replaces the part's SM count in every row's device, and the compute rates
    the cost model reads scale with it (148 SMs is the sm100 part's own count)."""

    def devices(*extra):
        rows = json.loads(cli("list-backends", "--device", "sm100", *extra, "--json").stdout)
        assert rows
        return [r["device"] for r in rows]

    own, cut = devices(), devices("--sm-count", "100")
    assert {d["sm_count"] for d in own} == {148} and {d["sm_count"] for d in cut} == {100}
    assert all("(100 SMs)" in d["name"] for d in cut)
    ratio = cut[0]["bf16_tflops"] / own[0]["bf16_tflops"]
    assert ratio == pytest.approx(100 / 148)


def test_doctor_passes_on_cpu():
    proc = cli("doctor", "--device", "cpu")
    assert "torch-reference" in proc.stdout and "PASS" in proc.stdout


def test_doctor_json_reports_errors():
    data = json.loads(cli("doctor", "--device", "cpu", "--json", "--shape", "40,64,128").stdout)
    results = {r["backend"]: r for r in data["results"]}
    assert results["torch-reference"]["result"] == "PASS"
    assert results["torch-reference"]["rel_error"] < 1e-2


def test_bad_device_is_a_clear_error():
    proc = cli("list-backends", "--device", "sm999", check=False)
    assert proc.returncode == 2 and "--device" in proc.stderr and "'sm999'" in proc.stderr


@pytest.mark.parametrize("cmd", [["--help"], ["list-backends", "--help"], ["doctor", "--help"]])
def test_help(cmd):
    assert "usage" in cli(*cmd).stdout
