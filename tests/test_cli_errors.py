"""The console script's error contract, as a user meets it (subprocesses, installed package).

One line per error naming the argument, the value and what is expected; exit status 2 for
usage errors, 1 for runtime failures; no traceback unless asked; a closed pipe ends the
command quietly; -v/-q on either side of the subcommand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

EXE = shutil.which("fp4-dispatch") or os.path.join(os.path.dirname(sys.executable), "fp4-dispatch")


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "FP4_DISPATCH_PROGRESS": "0", **(env or {})}
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Assert exit `code`, no traceback, and one ``error:`` line holding every needle."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["explain", "128", "64", "64", "--device", "sm80"], ["--device", "'sm80'", "sm100"]),
        (["explain", "128", "64", "64", "--sm-count", "0"], ["--sm-count", "'0'", "positive"]),
        (["explain", "128", "64", "64", "--device", "cuda:x"], ["--device", "cuda:N"]),
        (["doctor", "--shape", "1x2"], ["--shape", "'1x2'", "M,N,K"]),
        (["tune", "--shapes", "1,1024,1000", "--device", "cpu"], ["--shapes", "1000", "32"]),
        (["tune", "--shapes", "1x1024x1024", "0,64,64"], ["--shapes", "'0,64,64'", "positive"]),
        (["compile", "0", "64", "64"], ["argument M", "'0'", "positive"]),
        (["explain", "1", "64", "48"], ["argument K", "48", "multiple of 32"]),
        (["explain", "1", "64"], ["K"]),
        (["explain", "128", "64", "64", "--budget", "-1"], ["--budget", "'-1'"]),
        (["compile", "128", "64", "64", "--jobs", "zero"], ["--jobs", "'zero'"]),
        (["no-such-command"], ["'no-such-command'"]),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, needles):
    one_line_error(cli(*args), 2, *needles)


def test_runtime_failure_is_one_line_exit_1_and_traceback_on_request():
    proc = cli("explain", "128", "64", "64", "--device", "cuda:7")
    if proc.returncode == 0:
        pytest.skip("this machine has a CUDA device 7")
    line = one_line_error(proc, 1, "cuda:7")
    assert "--traceback" in line
    tb = cli("explain", "128", "64", "64", "--device", "cuda:7", "--traceback")
    assert tb.returncode == 1 and "Traceback" in tb.stderr


def test_simulated_tune_is_a_usage_error():
    one_line_error(cli("tune", "--shapes", "1,64,64", "--device", "sm100"), 2, "simulated")


def test_version_and_help_are_fast_and_import_no_torch():
    from fp4_dispatch import __version__

    def best_of_3(argv):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
        return min(times), proc

    # the 1 s target (benchmarks serving --cases first-contact) is the tool's own cost: the
    # interpreter's start-up is subtracted, so a loaded CI machine does not need slack
    bare, _ = best_of_3([sys.executable, "-c", "pass"])
    code = "import sys; from fp4_dispatch.cli import main; sys.exit(main(['--version']))"
    wall, proc = best_of_3([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == f"fp4-dispatch {__version__}"
    code = "import sys; from fp4_dispatch.cli import main\ntry:\n    main(['--help'])\n"
    code += "except SystemExit:\n    print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
    assert wall - bare < 1.0, (wall, bare)


@pytest.mark.parametrize(
    "cmd", ["list-backends", "devices", "explain", "doctor", "compile", "tune", "cache"]
)
def test_every_subcommand_help_has_a_description_and_an_example(cmd):
    proc = cli(cmd, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    if cmd != "cache":  # its help text belongs to the cache module
        assert "examples:" in proc.stdout and f"fp4-dispatch {cmd}" in proc.stdout
    if cmd in ("explain", "compile"):  # the positional names are M N K
        assert " M N K" in proc.stdout, proc.stdout


def test_verbose_and_quiet_on_both_sides_of_the_subcommand():
    for args in (["-v", "devices"], ["devices", "-v"], ["-q", "devices", "-q"], ["devices", "-vv"]):
        proc = cli(*args)
        assert proc.returncode == 0, (args, proc.stderr)
    loud = cli("list-backends", "--device", "cpu", "-vv")
    assert "DEBUG" in loud.stderr or "INFO" in loud.stderr, loud.stderr


def test_broken_pipe_exits_quietly():
    """``fp4-dispatch ... --json | head -1``: no traceback, no 'Exception ignored'."""
    proc = subprocess.run(
        f"'{EXE}' explain 128 4096 4096 --device sm100 --json | head -c 10",
        shell=True, capture_output=True, text=True, timeout=300,
        env={**os.environ, "FP4_DISPATCH_PLUGINS": ""},
    )  # fmt: skip
    assert proc.returncode == 0 and len(proc.stdout) == 10
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_list_backends_json_types_and_device():
    proc = cli("list-backends", "--device", "sm100", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and all(isinstance(r["tactics"], int) or r["tactics"] is None for r in rows)
    for r in rows:
        assert r["device"]["name"] == rows[0]["device"]["name"]
        assert r["device"]["kind"] == "simulated"
        assert isinstance(r["tactics_error"], str)
        if r["status"] != "available":
            assert r["tactics"] is None


def test_list_backends_strict_prints_the_table_then_fails():
    proc = cli("list-backends", "--device", "cpu", "--strict")
    statuses = cli("list-backends", "--device", "cpu", "--json")
    failed = [r for r in json.loads(statuses.stdout) if r["status"] == "failed"]
    if not failed:
        assert proc.returncode == 0
        pytest.skip("no failing plugin installed (the broken example plugin is not here)")
    assert "backend" in proc.stdout and "torch-reference" in proc.stdout  # the table printed
    one_line_error(proc, 1, "--strict", failed[0]["name"])


def test_tune_json_cache_is_a_path(tmp_path):
    cache = tmp_path / "t.json"
    proc = cli("tune", "--shapes", "4x64x64", "--device", "cpu", "--budget", "1", "--json",
               env={"FP4_DISPATCH_CACHE": str(cache), "FP4_DISPATCH_PLUGINS": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["cache"] == str(cache) and data["device"]["kind"] == "cpu"
    nosave = cli("tune", "--shapes", "4,64,64", "--device", "cpu", "--budget", "1", "--json",
                 "--no-save", env={"FP4_DISPATCH_CACHE": str(cache)})  # fmt: skip
    assert json.loads(nosave.stdout)["cache"] is None


def test_cache_show_on_a_directory_is_one_line(tmp_path):
    proc = cli("cache", "show", env={"FP4_DISPATCH_CACHE": str(tmp_path)})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and str(tmp_path) in proc.stderr, proc.stderr
    assert len([x for x in proc.stderr.splitlines() if "error" in x.lower()]) == 1, proc.stderr


# ---- doctor --------------------------------------------------------------------------------


def _doctor(*args: str, env: dict | None = None) -> tuple[int, dict]:
    proc = cli("doctor", "--json", *args, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_doctor_on_cpu_runs_the_reference():
    code, data = _doctor("--device", "cpu", env={"FP4_DISPATCH_PLUGINS": ""})
    assert code == 0 and data["device"]["kind"] == "cpu"
    (ref,) = [r for r in data["results"] if r["backend"] == "torch-reference"]
    assert ref["result"] == "PASS" and ref["checks"]["run"]["result"] == "PASS"
    assert ref["rel_error"] < 1e-2


@pytest.mark.parametrize("device", ["sm100", "sm107"])
def test_doctor_on_a_simulated_blackwell_compiles_and_skips_the_run(device):
    pytest.importorskip("cutlass")
    code, data = _doctor("--device", device, env={"FP4_DISPATCH_PLUGINS": ""})
    assert code == 0, data
    cute = [r for r in data["results"] if r["backend"].startswith("cute-")]
    assert cute, data
    for r in cute:
        assert r["result"] == "PASS", r
        assert r["checks"]["build"]["result"] == "PASS", r  # compiled ahead of time
        assert r["checks"]["run"]["result"] == "SKIP", r


def test_doctor_on_simulated_hopper_skips_build_and_run():
    code, data = _doctor("--device", "sm90", env={"FP4_DISPATCH_PLUGINS": ""})
    assert code == 0, data
    names = {r["backend"]: r for r in data["results"]}
    for name in ("triton-sm90", "triton-sm90-unpack"):
        if name in names:
            assert names[name]["checks"]["tactic"]["result"] == "PASS", names[name]
            assert names[name]["checks"]["run"]["result"] == "SKIP"


def test_doctor_lists_a_broken_plugin_and_fails_on_it_when_strict():
    code, data = _doctor("--device", "cpu")
    failed = [s for s in data["not_run"] if s["status"] == "failed"]
    if not failed:
        pytest.skip("the broken example plugin is not installed here")
    assert code == 0 and failed[0]["reason"]  # listed with its error, as list-backends does
    assert all(r["result"] == "PASS" for r in data["results"])  # the others are checked
    code, data = _doctor("--device", "cpu", "--strict")
    broken = [r for r in data["results"] if r["checks"]["load"]["result"] == "FAIL"]
    assert code == 1 and broken and broken[0]["result"] == "FAIL" and broken[0]["error"]
    assert any(r["result"] == "PASS" for r in data["results"])  # the others still checked
