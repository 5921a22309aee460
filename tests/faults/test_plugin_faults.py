"""Fault injection: throwaway plugin distributions, each broken in one way.

For every fault the same four things must hold: the process survives, the GEMM result
is right (through another backend: the faulty one ranks first by its own estimate, so a
fault that is not contained would either raise or run it), the fault is shown with its
plugin's name (list-backends rows / JSON), and strict mode raises naming the plugin.
The two exit cases also run ``fp4-dispatch list-backends`` in a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fp4_dispatch import PluginLoadError, reference_gemm
from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.loading.guard import PluginFault

PLUGIN = "faulty"
BACKEND = "faulty-b"
M, N, K = 3, 64, 64  # M not a power of two: the bucket's pick is re-validated at M

TEMPLATE = """
import math, sys, time
from typing import Literal
import fp4_dispatch
from fp4_dispatch import Support
from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic
{at_import}

class T(ReferenceTactic):
    backend: Literal["faulty-b"] = "faulty-b"

class Other(ReferenceTactic):
    pass

class B(ReferenceBackend):
    name = "faulty-b"
    family = "faulty"
    tactic_type = T

    def tactics(self, problem, device):
        yield T()

    def estimate_us(self, problem, device, tactic):
        return 0.5  # ranks first on CPU: an uncontained fault would be hit

{methods}

@fp4_dispatch.hookimpl
def fp4_dispatch_register_backends(register):
{hook}
"""


def source(at_import: str = "", methods: str = "", hook: str = "register(B())") -> str:
    return TEMPLATE.format(
        at_import=textwrap.dedent(at_import),
        methods=textwrap.indent(textwrap.dedent(methods), "    "),
        hook=textwrap.indent(textwrap.dedent(hook), "    "),
    )


def method(name: str, body: str, args: str) -> str:
    return f"def {name}(self, {args}):\n" + textwrap.indent(textwrap.dedent(body), "    ")


SUPPORTS = "device"
TACTICS = "problem, device"
ESTIMATE = "problem, device, tactic"
VALIDATE = "tactic, problem, device"
BUILD = "tactic, problem, device"

KERNEL_RAISES = """
def kernel(ops, out):
    raise RuntimeError("kernel boom")
return kernel
"""
KERNEL_EXITS = """
def kernel(ops, out):
    out.zero_()  # half-written output: the fallback must rewrite all of it
    sys.exit(5)
return kernel
"""

# id -> (plugin source, text the shown fault contains)
CASES: dict[str, tuple[str, str]] = {
    # import
    "import-ImportError": (source(at_import="import no_such_module_xyz"), "no_such_module_xyz"),
    "import-SyntaxError": (source(at_import="def broken(:\n    pass"), "SyntaxError"),
    "import-sys.exit(3)": (source(at_import="sys.exit(3)"), "sys.exit(3)"),
    "import-RuntimeError": (source(at_import="raise RuntimeError('boom at import')"), "boom at"),
    "import-RecursionError": (source(at_import="def f():\n    f()\nf()"), "RecursionError"),
    "import-ZeroDivisionError": (source(at_import="1 / 0"), "ZeroDivisionError"),
    # hook
    "hook-raises": (source(hook="raise ValueError('boom in hook')"), "boom in hook"),
    "hook-sys.exit": (source(hook="sys.exit('bye')"), "sys.exit('bye')"),
    "hook-registers-then-raises": (
        source(hook="register(B())\nraise RuntimeError('after register')"),
        "after register",
    ),
    "hook-registers-nothing": (source(hook="pass"), "registered no backend"),
    "hook-non-backend": (source(hook="register(object())"), "expects an fp4_dispatch.Backend"),
    "hook-duplicate-name": (
        source(hook="B.name = 'torch-reference'\nregister(B())"),
        "duplicate backend name 'torch-reference'",
    ),
    "hook-missing": (source().split("@fp4_dispatch.hookimpl")[0], "defines no"),
    "hook-slow": (source(hook="time.sleep(0.6)"), "registered no backend"),
    # supports
    "supports-raises": (source(methods=method("supports", "raise OSError('no lib')", SUPPORTS)),
                        "no lib"),
    "supports-True": (source(methods=method("supports", "return True", SUPPORTS)),
                      "expected an fp4_dispatch.Support"),
    "supports-None": (source(methods=method("supports", "return None", SUPPORTS)),
                      "returned NoneType"),
    "supports-SystemExit": (source(methods=method("supports", "raise SystemExit(2)", SUPPORTS)),
                            "sys.exit(2)"),
    # tactics
    "tactics-raises": (source(methods=method("tactics", "raise KeyError('tile')", TACTICS)),
                       "KeyError"),
    "tactics-None": (source(methods=method("tactics", "return None", TACTICS)),
                     "expected an iterable"),
    "tactics-non-iterable": (source(methods=method("tactics", "return 42", TACTICS)),
                             "returned int 42"),
    "tactics-wrong-type": (source(methods=method("tactics", "return [Other()]", TACTICS)),
                           "expected a T"),
    "tactics-other-backend": (
        source(methods=method("tactics", "return [ReferenceTactic()]", TACTICS)),
        "expected a T",
    ),
    "tactics-generator-raises-midway": (
        source(methods=method("tactics", "yield T()\nraise RuntimeError('midway')", TACTICS)),
        "midway",
    ),
    # estimate_us
    "estimate-raises": (source(methods=method("estimate_us", "raise ValueError('est')", ESTIMATE)),
                        "est"),
    "estimate-str": (source(methods=method("estimate_us", "return 'fast'", ESTIMATE)),
                     "returned str 'fast'"),
    "estimate-nan": (source(methods=method("estimate_us", "return math.nan", ESTIMATE)),
                     "nan"),
    "estimate-negative": (source(methods=method("estimate_us", "return -1.0", ESTIMATE)),
                          "-1.0"),
    "estimate-inf": (source(methods=method("estimate_us", "return math.inf", ESTIMATE)), "inf"),
    "estimate-bool": (source(methods=method("estimate_us", "return True", ESTIMATE)),
                      "returned bool"),
    # validate
    "validate-raises": (source(methods=method("validate", "raise TypeError('val')", VALIDATE)),
                        "val"),
    "validate-int": (source(methods=method("validate", "return 7", VALIDATE)), "returned int 7"),
    "validate-SystemExit": (source(methods=method("validate", "sys.exit(4)", VALIDATE)),
                            "sys.exit(4)"),
    # build
    "build-raises": (source(methods=method("build", "raise RuntimeError('nvcc')", BUILD)),
                     "nvcc"),
    "build-None": (source(methods=method("build", "return None", BUILD)), "expected a callable"),
    "build-non-callable": (source(methods=method("build", "return 42", BUILD)), "returned int 42"),
    "build-SystemExit": (source(methods=method("build", "sys.exit(6)", BUILD)), "sys.exit(6)"),
    # the built kernel
    "kernel-raises": (source(methods=method("build", KERNEL_RAISES, BUILD)), "kernel boom"),
    "kernel-SystemExit": (source(methods=method("build", KERNEL_EXITS, BUILD)), "sys.exit(5)"),
}  # fmt: skip

RUN_TIME = ("build-", "kernel-")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("FP4_DISPATCH_PLUGINS", "FP4_DISPATCH_DISABLE", "FP4_DISPATCH_STRICT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def qab():
    from fp4_dispatch import quantize_nvfp4

    g = torch.Generator().manual_seed(1)
    return quantize_nvfp4(torch.randn(M, K, generator=g)), quantize_nvfp4(
        torch.randn(N, K, generator=g)
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def shown(d: Dispatcher) -> list[dict]:
    """Rows of list-backends (JSON form) that belong to the faulty plugin and say so."""
    rows = [st.to_json() for st in d.backends()]
    return [
        r
        for r in rows
        if r["plugin"] == PLUGIN and (r["status"] in ("failed", "empty") or r["faults"])
    ]


def test_at_least_thirty_distinct_faults():
    assert len(CASES) >= 30
    assert len({src for src, _ in CASES.values()}) == len(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fault_contained(case, plugin_dist, qab, caplog):
    src, expect = CASES[case]
    plugin_dist("faulty-dist", {PLUGIN: src})
    caplog.set_level(logging.WARNING)
    d = Dispatcher("cpu", cache=False)  # survives
    qa, qb = qab
    out = d.gemm(qa, qb)
    assert rel_err(out, reference_gemm(qa, qb)) < 1e-2
    assert d.select(M, N, K).backend != BACKEND  # the faulty backend is not what runs
    rows = shown(d)
    assert rows, f"{case}: no list-backends row shows plugin {PLUGIN!r}"
    assert expect in json.dumps(rows), json.dumps(rows)[:2000]
    if case.startswith(RUN_TIME):
        fallbacks = [r for r in caplog.records if "falling back" in r.getMessage()]
        assert len(fallbacks) == 1 and BACKEND in fallbacks[0].getMessage()
        d.gemm(qa, qb)  # remembered: no second attempt, no second warning
        assert len([r for r in caplog.records if "falling back" in r.getMessage()]) == 1
    if case == "hook-registers-then-raises":
        assert BACKEND not in d.registry.backends  # rolled back: contributes nothing
    if case == "hook-slow":
        (row,) = rows
        assert row["load_s"] > 0.5


@pytest.mark.parametrize("case", sorted(c for c in CASES if c not in ("hook-registers-nothing",
                                                                       "hook-slow")))  # fmt: skip
def test_fault_strict_raises(case, plugin_dist, qab, monkeypatch):
    src, expect = CASES[case]
    plugin_dist("faulty-dist", {PLUGIN: src})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", PLUGIN)  # other installed plugins stay out
    with pytest.raises((PluginLoadError, PluginFault)) as info:
        d = Dispatcher("cpu", cache=False, strict=True)
        d.gemm(*qab)
    text = str(info.value)
    assert repr(PLUGIN) in text and expect in text
    if isinstance(info.value, PluginFault) and case.startswith(("tactics-", "supports-")):
        assert info.value.fault.backend == BACKEND


def test_strict_env_variable(plugin_dist, qab, monkeypatch):
    plugin_dist("faulty-dist", {PLUGIN: CASES["build-raises"][0]})
    monkeypatch.setenv("FP4_DISPATCH_STRICT", "1")
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", PLUGIN)
    with pytest.raises(
        PluginFault, match=r"backend 'faulty-b' tactic \{.*build\(\) raised RuntimeError: nvcc"
    ):
        Dispatcher("cpu", cache=False).gemm(*qab)


def test_keyboard_interrupt_still_propagates(plugin_dist, qab):
    body = "def kernel(ops, out):\n    raise KeyboardInterrupt\nreturn kernel\n"
    plugin_dist("faulty-dist", {PLUGIN: source(methods=method("build", body, BUILD))})
    with pytest.raises(KeyboardInterrupt):
        Dispatcher("cpu", cache=False).gemm(*qab)


def test_explain_shows_fault_with_plugin(plugin_dist, capsys):
    from fp4_dispatch.cli import main

    plugin_dist("faulty-dist", {PLUGIN: CASES["tactics-raises"][0]})
    assert main(["explain", str(M), str(N), str(K), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "plugin faults" in text and f"plugin '{PLUGIN}' backend '{BACKEND}'" in text


def test_list_backends_shows_slow_and_empty(plugin_dist, capsys):
    from fp4_dispatch.cli import main

    plugin_dist("faulty-dist", {PLUGIN: CASES["hook-slow"][0]})
    assert main(["list-backends", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"<{PLUGIN}>")]
    assert "empty" in line and "registered no backend" in line and "slow to load" in line


def test_exit_does_not_end_the_cli(plugin_dist, tmp_path):
    """Both exit cases in one distribution: two subprocesses in all (each takes seconds)."""
    cases = {"exitimport": "import-sys.exit(3)", "exithook": "hook-sys.exit"}
    plugin_dist("faulty-dist", {ep: CASES[case][0] for ep, case in cases.items()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    env.pop("FP4_DISPATCH_STRICT", None)
    env["FP4_DISPATCH_PLUGINS"] = ",".join(cases)  # strict's exit 1 must come from these
    exe = Path(sys.executable).with_name("fp4-dispatch")
    cmd = [str(exe), "list-backends", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch-reference" in proc.stdout
    for ep, case in cases.items():
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"<{ep}>")]
        assert "failed" in line and CASES[case][1] in line
    strict = subprocess.run([*cmd, "--strict"], capture_output=True, text=True, env=env,
                            timeout=120)  # fmt: skip
    assert strict.returncode == 1 and "<exitimport>" in strict.stdout


def test_no_working_candidate_left_says_why(plugin_dist, qab, monkeypatch):
    plugin_dist("faulty-dist", {PLUGIN: CASES["build-raises"][0]})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", PLUGIN)
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "torch-reference")  # nothing to fall back to
    d = Dispatcher("cpu", cache=False)
    with pytest.raises(RuntimeError, match=r"faulty-b.*failed to build or run in this process"):
        d.gemm(*qab)
    (fault,) = d.faults
    assert (fault.plugin, fault.backend, fault.call) == (PLUGIN, BACKEND, "build()")
    assert "nvcc" in fault.message and '"backend":"faulty-b"' in fault.tactic


@pytest.mark.parametrize("case", ["kernel-SystemExit", "build-SystemExit", "kernel-raises"])
def test_tuning_survives_exiting_plugin(case, plugin_dist, qab):
    plugin_dist("faulty-dist", {PLUGIN: CASES[case][0]})
    d = Dispatcher("cpu", cache=False)
    (result,) = d.tune([(M, N, K)], save=False, progress=False)
    assert result.winner is not None and result.winner.backend != BACKEND
    assert BACKEND in json.dumps([str(f) for f in result.failures])
    qa, qb = qab
    assert rel_err(d.gemm(qa, qb), reference_gemm(qa, qb)) < 1e-2


def test_list_backends_json_carries_faults(plugin_dist, capsys):
    from fp4_dispatch.cli import main

    plugin_dist("faulty-dist", {PLUGIN: CASES["supports-True"][0]})
    assert main(["list-backends", "--device", "cpu", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows[BACKEND]
    assert row["status"] == "failed" and row["plugin"] == PLUGIN
    (fault,) = row["faults"]
    assert fault["call"] == "supports()" and "expected an fp4_dispatch.Support" in fault["message"]
    assert isinstance(row["load_s"], float)


# ---- slow plugin code is named when it happens, and list-backends shows the times ----------


@pytest.mark.parametrize("call", ["supports", "build"])
def test_slow_hook_is_named_as_it_happens(call, plugin_dist, qab, caplog, monkeypatch):
    from fp4_dispatch.loading import guard

    monkeypatch.setattr(guard, "SLOW_CALL_S", 0.2)
    args = SUPPORTS if call == "supports" else BUILD
    body = "time.sleep(0.4)\nreturn super()." + call + f"({args})"
    plugin_dist("faulty-dist", {PLUGIN: source(methods=method(call, body, args))})
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", PLUGIN)
    caplog.set_level(logging.WARNING)
    d = Dispatcher("cpu", cache=False)
    if call == "build":
        assert not caplog.records  # nothing slow yet: build runs on the first call
        qa, qb = qab
        d.gemm(qa, qb)
    (line,) = [r.getMessage() for r in caplog.records if "slow plugin code" in r.getMessage()]
    assert f"plugin '{PLUGIN}' backend '{BACKEND}': {call}() took 0." in line
    (row,) = [st.to_json() for st in d.backends() if st.name == BACKEND]
    hook = row["hooks"][f"{call}()"]
    assert hook["calls"] == 1 and 0.4 <= hook["max_s"] == hook["seconds"] < 30


def test_list_backends_table_shows_load_and_hook_times(plugin_dist, capsys, monkeypatch):
    from fp4_dispatch.cli import main
    from fp4_dispatch.loading import guard

    monkeypatch.setattr(guard, "SLOW_CALL_S", 0.2)
    body = "time.sleep(0.3)\nreturn super().supports(device)"
    plugin_dist("faulty-dist", {PLUGIN: source(methods=method("supports", body, SUPPORTS))})
    assert main(["list-backends", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "load+hooks s" in text.splitlines()[3]
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{BACKEND} ")]
    times = re.search(r" (\d+\.\d\d)\+(\d+\.\d\d) ", line)
    assert times and float(times.group(2)) >= 0.3, line
    assert "slow supports(): 0." in line
    assert main(["list-backends", "--device", "cpu", "--json"]) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["name"] == BACKEND]
    assert row["hooks"]["supports()"]["seconds"] >= 0.3 and row["load_s"] >= 0
