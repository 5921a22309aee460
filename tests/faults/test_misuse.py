"""API and CLI misuse (issue 32, item 6): each one a clear error naming the argument, or
the right behaviour, never a stray exception from deep inside."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from test_cache_faults import K, M, N, _timer

from fp4_dispatch import Dispatcher, quantize_nvfp4
from fp4_dispatch.contracts import device
from fp4_dispatch.store.cache import FORMAT, TuningCache


@pytest.fixture
def cpu():
    return Dispatcher(device="cpu", cache=False)


def test_tune_none_names_shapes(cpu):
    with pytest.raises(TypeError, match=r"shapes: expected an iterable of \(M, N, K\) tuples, got "
                       r"NoneType"):  # fmt: skip
        cpu.tune(None)


@pytest.mark.parametrize("band", [-1, math.nan, math.inf])
def test_bad_band_is_a_value_error_naming_it(cpu, band):
    with pytest.raises(ValueError, match="band: expected a finite number >= 0"):
        cpu.tune([(16, 32, 64)], band=band, progress=False)


def test_band_of_the_wrong_type(cpu):
    with pytest.raises(TypeError, match="band: expected a number >= 0 or None, got str"):
        cpu.tune([(16, 32, 64)], band="5%", progress=False)


@pytest.mark.parametrize("budget", [True, False, 2.0])
def test_budget_must_be_a_real_int(budget):
    with pytest.raises(ValueError, match="budget: expected a positive int"):
        Dispatcher(device="cpu", budget=budget, cache=False)


def test_huge_dimensions_are_refused(cpu):
    with pytest.raises(ValueError, match=r"M: expected at most 2147483647 \(2\*\*31 - 1\)"):
        cpu.select(10**20, 4096, 4096)
    assert cpu.select(2**31 - 1, 64, 64).backend  # the limit itself is a problem


def test_explain_of_a_huge_m_is_a_usage_error():
    from fp4_dispatch.cli.common import MAX_INT
    from fp4_dispatch.format.checks import MAX_DIM

    assert MAX_INT == MAX_DIM
    proc = _cli("explain", "99999999999999999999", "4096", "4096")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "at most 2147483647" in proc.stderr and "Traceback" not in proc.stderr


def _cli(*args, env=None):
    code = "import sys; from fp4_dispatch.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip


@pytest.mark.parametrize("us", [-5.0, 0.0])
def test_cache_entry_with_a_non_positive_time_is_not_adopted(tmp_path, caplog, us):
    path = tmp_path / "tuning.json"
    d = Dispatcher(device="cpu", cache=path)
    d.tune([(M, N, K)], timer=_timer, progress=False)
    raw = json.loads(path.read_text())
    raw["entries"][0]["us"] = us
    path.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING):
        pick = Dispatcher(device="cpu", cache=path).select(M, N, K)
    assert not pick.reason.startswith("tuned")
    assert "not a positive finite number" in caplog.text


def test_no_driver_note_is_one_short_line():
    class DynamicLibNotFoundError(RuntimeError):
        pass

    long = DynamicLibNotFoundError(
        '"cuda" is an NVIDIA driver library and can only be found via system search. '
        "Ensure the NVIDIA display driver is installed.\nmore text"
    )
    assert device.no_device_note(long) == "no CUDA driver (CPU only)"
    assert device.no_device_note(ImportError("no module cuda")) == "no CUDA driver (CPU only)"
    other = device.no_device_note(RuntimeError("CUDA_ERROR_NO_DEVICE\nsecond line"))
    assert other == "no CUDA device: RuntimeError: CUDA_ERROR_NO_DEVICE"


def test_cpu_only_cli_output_starts_with_the_short_note():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    first = _cli("list-backends").stdout.splitlines()[0]
    assert first.startswith("device: cpu (cpu)") and len(first) < 100, first


def test_cache_show_into_a_closed_pipe_blames_nobody(tmp_path):
    path = tmp_path / "big.json"
    entries = [{"device": "gpu|9.0|132", "n": 64 * (i + 1), "k": 64, "m_bucket": 1,
                "out_dtype": "bfloat16", "backend": "x", "backend_version": "1",
                "tactic": {"backend": "x"}, "us": 1.0} for i in range(3000)]  # fmt: skip
    path.write_text(json.dumps({"format": FORMAT, "format_version": 1, "metadata": {},
                                "entries": entries}))  # fmt: skip
    code = "import sys; from fp4_dispatch.cli import main; sys.exit(main(['cache', 'show']))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**_env(), "FP4_DISPATCH_CACHE": str(path)},
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and first  # 128 + SIGPIPE, quietly
    assert "tuning cache" not in err and "BrokenPipe" not in err, err


def _env():
    import os

    return dict(os.environ)


def test_cache_export_into_a_missing_folder_names_the_destination(tmp_path):
    src = tmp_path / "tuning.json"
    TuningCache(src).put([{"device": "g|9.0|1", "n": 64, "k": 64, "m_bucket": 1,
                           "out_dtype": "bfloat16", "backend": "x", "backend_version": "1",
                           "tactic": {"backend": "x"}, "us": 1.0}])  # fmt: skip
    dest = tmp_path / "missing" / "out.json"
    proc = _cli("cache", "export", str(dest), env={**_env(), "FP4_DISPATCH_CACHE": str(src)})
    assert proc.returncode == 1
    assert str(dest.parent) in proc.stdout and str(src) not in proc.stdout, proc.stdout
    assert not (tmp_path / "missing").exists()
    ok = tmp_path / "out.json"
    assert _cli("cache", "export", str(ok), env={**_env(), "FP4_DISPATCH_CACHE": str(src)}
                ).returncode == 0  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tuning.json", "tuning.json.lock", "out.json"]
    )  # no out.json.lock beside the export


def test_dsl_chatter_goes_to_the_log_not_stdout_or_stderr(caplog, capsys):
    from fp4_dispatch.backends.flashinfer import dsl_chatter_to_log

    with caplog.at_level(logging.DEBUG), dsl_chatter_to_log():
        print("[DSL INFO] compiling kernel foo")
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert "DSL: [DSL INFO] compiling kernel foo" in caplog.text


def test_mm_fp4_list_descale_is_a_type_error(cpu):
    qa = quantize_nvfp4(torch.randn(16, 64))
    qb = quantize_nvfp4(torch.randn(32, 64))
    with pytest.raises(TypeError, match=r"a_descale: expected a torch\.Tensor, got list"):
        cpu.mm_fp4(qa.data, qb.data.T, qa.scale.tolist(), qb.scale)
