"""Parallel precompile (fp4_dispatch.autotune.precompile): work spread over spawned processes,
failures and crashes reported per job, the deadline, and the step inside Dispatcher.tune.

The test backends live in a module written to a temporary folder on sys.path, so the
spawned workers import them (they receive each backend by pickle) without torch.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from typing import ClassVar

import pytest
from conftest import TARGET_ONLY

from fp4_dispatch import Dispatcher
from fp4_dispatch.autotune import precompile as pc
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem

BACKENDS = '''
import json, os, time
from typing import Literal
from fp4_dispatch.contracts.backend import Backend, Support
from fp4_dispatch.contracts.tactics import Tactic

class MarkTactic(Tactic):
    backend: Literal["pc-mark"] = "pc-mark"
    tile_m: Literal[128] = 128
    tile_n: int = 128
    mode: Literal["ok", "raise", "exit"] = "ok"

class Compiled:
    def __init__(self, source):
        self.source, self.cubin_sm, self.seconds = source, 90, 0.25

class Kernel:
    def __init__(self, source):
        self.compiled = Compiled(source)
    def __call__(self, operands, out):
        raise RuntimeError("not for running")

class MarkBackend(Backend):
    """build writes a marker (pid, tactic, problem) into `folder`, after `sleep_s`."""
    name = "pc-mark"
    family = "pc-test"
    version = "1"
    tactic_type = MarkTactic

    def __init__(self, folder, sleep_s=0.0):
        self.folder, self.sleep_s = folder, sleep_s

    def supports(self, device):
        return Support(True)

    def tactics(self, problem, device):
        return [MarkTactic(tile_n=n) for n in (16, 32, 64, 128)]

    def build(self, tactic, problem, device):
        if tactic.mode == "raise":
            raise ValueError(f"no kernel for tile_n={tactic.tile_n}")
        if tactic.mode == "exit":
            os._exit(7)
        time.sleep(self.sleep_s)
        name = f"{tactic.tile_n}-{problem.m}x{problem.n}x{problem.k}-{os.getpid()}.json"
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump({"pid": os.getpid(), "tile_n": tactic.tile_n, "m": problem.m}, f)
        return Kernel("compiled")
'''


@pytest.fixture
def mark(tmp_path, monkeypatch):
    """The test backend module, importable here and in spawned workers; markers folder."""
    (tmp_path / "pc_backends.py").write_text(textwrap.dedent(BACKENDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    markers = tmp_path / "markers"
    markers.mkdir()
    import pc_backends

    pc.forget_ready()
    yield pc_backends, markers
    pc.shutdown()
    pc.forget_ready()
    sys.modules.pop("pc_backends", None)


CPU = DeviceInfo(name="cpu", kind="cpu")


def _jobs(mod, folder, modes, sleep_s=0.0, m=64):
    backend = mod.MarkBackend(str(folder), sleep_s)
    return [
        pc.Job(backend, mod.MarkTactic(tile_n=16 * (i + 1), mode=mode), Problem(m=m, n=256, k=512))
        for i, mode in enumerate(modes)
    ]


def _markers(folder):
    return [json.loads(p.read_text()) for p in folder.iterdir()]


def test_work_is_split_over_worker_processes_and_results_come_back(mark):
    mod, folder = mark
    jobs = _jobs(mod, folder, ["ok"] * 6, sleep_s=0.5)
    seen = []
    report = pc.precompile(jobs, CPU, workers=2, on_outcome=seen.append)
    assert [o.status for o in report.outcomes] == ["compiled"] * 6, report.to_json()
    assert [o.job for o in report.outcomes] == jobs  # in job order
    assert len(seen) == 6 and report.workers == 2
    assert report.outcomes[0].details == {"source": "compiled", "cubin_sm": 90, "compile_s": 0.25}
    marks = _markers(folder)
    assert sorted(x["tile_n"] for x in marks) == [16, 32, 48, 64, 80, 96]
    pids = {x["pid"] for x in marks}
    assert os.getpid() not in pids  # compiled in workers, not here
    assert len(pids) == 2, pids  # both workers got a share
    assert all(pc.is_ready(j) for j in jobs)


def test_a_failing_build_is_reported_and_the_others_compile(mark):
    mod, folder = mark
    jobs = _jobs(mod, folder, ["ok", "raise", "ok"])
    report = pc.precompile(jobs, CPU, workers=2)
    assert [o.status for o in report.outcomes] == ["compiled", "failed", "compiled"]
    bad = report.failed[0]
    assert bad.job is jobs[1]
    assert "ValueError" in bad.reason and "tile_n=32" in bad.reason, bad.reason
    assert not pc.is_ready(jobs[1]) and pc.is_ready(jobs[0])
    assert "2 compiled, 1 failed, 0 skipped" in report.summary()


def test_a_crashing_worker_is_contained(mark):
    mod, folder = mark
    jobs = _jobs(mod, folder, ["ok", "exit", "ok", "ok", "ok"], sleep_s=0.2)
    report = pc.precompile(jobs, CPU, workers=2)
    status = [o.status for o in report.outcomes]
    assert status == ["compiled", "failed", "compiled", "compiled", "compiled"], report.to_json()
    assert "worker process died (exit code 7)" in report.outcomes[1].reason
    # the pool is still usable afterwards
    again = pc.precompile(_jobs(mod, folder, ["ok"], m=128), CPU, workers=2)
    assert again.outcomes[0].status == "compiled"


def test_the_deadline_skips_what_has_not_started(mark):
    mod, folder = mark
    jobs = _jobs(mod, folder, ["ok"] * 3)
    report = pc.precompile(jobs, CPU, workers=1, deadline_s=0.0)
    assert [o.status for o in report.outcomes] == ["skipped"] * 3
    assert all("deadline" in o.reason for o in report.outcomes)
    assert _markers(folder) == []


def test_a_hung_compile_is_cut_at_the_deadline_and_its_worker_stopped(mark):
    mod, folder = mark
    t0 = time.perf_counter()
    report = pc.precompile(_jobs(mod, folder, ["ok"], sleep_s=120), CPU, workers=1,
                           deadline_s=3.0)  # fmt: skip
    assert time.perf_counter() - t0 < 60
    assert report.outcomes[0].status == "skipped", report.to_json()
    assert "deadline" in report.outcomes[0].reason
    assert _markers(folder) == []  # stopped before it finished
    again = pc.precompile(_jobs(mod, folder, ["ok"], m=128), CPU, workers=1)
    assert again.outcomes[0].status == "compiled" and len(_markers(folder)) == 1


def test_zero_workers_compiles_nothing(mark):
    mod, folder = mark
    report = pc.precompile(_jobs(mod, folder, ["ok"]), CPU, workers=0)
    assert report.skipped and not report.compiled and _markers(folder) == []


def test_jobs_are_bucketed_swapped_and_deduplicated(mark):
    mod, folder = mark
    backend = mod.MarkBackend(str(folder))
    t = mod.MarkTactic(tile_n=16)
    swapped = t.model_copy(update={"swap_ab": True})
    pairs = [(backend, t, Problem(m=5, n=256, k=512)), (backend, t, Problem(m=7, n=256, k=512)),
             (backend, swapped, Problem(m=5, n=256, k=512))]  # fmt: skip
    jobs = pc.jobs_for(pairs)
    assert len(jobs) == 2  # M=5 and M=7 share a bucket (one kernel)
    assert jobs[0].problem.m == 8 and jobs[1].problem.m == 256  # bucketed; swapped
    pc.mark_ready(jobs[:1])
    assert pc.jobs_for(pairs) == jobs[1:]
    assert len(pc.jobs_for(pairs, skip_ready=False)) == 2


def test_default_workers(monkeypatch):
    monkeypatch.delenv(pc.ENV_WORKERS, raising=False)
    assert pc.default_workers(1) == 1
    assert pc.default_workers(1000) == max(1, min(16, (os.cpu_count() or 2) - 1))
    monkeypatch.setenv(pc.ENV_WORKERS, "3")
    assert pc.default_workers(10) == 3 and pc.default_workers(2) == 2
    monkeypatch.setenv(pc.ENV_WORKERS, "0")
    assert pc.default_workers(10) == 0


# ---- workers never import the user's main module -------------------------------------

#: a user's script without an ``if __name__ == "__main__":`` guard: every run of its body
#: appends a line to RUNS; it precompiles two jobs of a module backend and one of a backend
#: defined in the script itself (never importable by a worker: it must fail, not re-run)
UNGUARDED = """
import json, os, sys
sys.path.insert(0, {folder!r})
with open({runs!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
import pc_backends
from fp4_dispatch import precompile as pc
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem

class MainBackend(pc_backends.MarkBackend):
    name = "pc-main"

p = Problem(m=64, n=256, k=512)
jobs = [pc.Job(pc_backends.MarkBackend({markers!r}), pc_backends.MarkTactic(tile_n=n), p)
        for n in (16, 32)]
jobs.append(pc.Job(MainBackend({markers!r}), pc_backends.MarkTactic(tile_n=64), p))
report = pc.precompile(jobs, DeviceInfo(name="cpu", kind="cpu"), workers=2)
print(json.dumps([o.status for o in report.outcomes]))
"""


@pytest.mark.parametrize("how", ["file", "-c", "stdin"])
def test_workers_never_rerun_an_unguarded_main_script(mark, tmp_path, how):
    import subprocess

    _, folder = mark
    runs = tmp_path / "runs.txt"
    script = UNGUARDED.format(folder=str(tmp_path), runs=str(runs), markers=str(folder))
    path = tmp_path / "user_script.py"
    path.write_text(script)
    argv = {"file": [str(path)], "-c": ["-c", script], "stdin": ["-"]}[how]
    proc = subprocess.run([sys.executable, *argv], input=script if how == "stdin" else None,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ["compiled", "compiled", "failed"]
    assert len(runs.read_text().splitlines()) == 1  # the body ran once: in the parent only
    marks = _markers(folder)
    assert sorted(x["tile_n"] for x in marks) == [16, 32]
    assert "Traceback" not in proc.stderr, proc.stderr


def test_workers_start_as_a_module_of_this_package(mark):
    mod, folder = mark
    report = pc.precompile(_jobs(mod, folder, ["ok"]), CPU, workers=1)
    assert report.outcomes[0].status == "compiled"
    (pool,) = [pc._POOL]
    args = pool._workers[0].process._popen.args
    assert args[:3] == [sys.executable, "-m", "fp4_dispatch.autotune.precompile_worker"]


# ---- inside Dispatcher.tune ------------------------------------------------------------

PLUGIN = '''
import json, os
from typing import Literal
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic

class SlowRefTactic(ReferenceTactic):
    backend: Literal["slow-ref"] = "slow-ref"

class SlowRefBackend(ReferenceBackend):
    """The reference kernels; precompile leaves a marker per (tactic, problem)."""
    name = "slow-ref"
    family = "slow-ref"
    tactic_type = SlowRefTactic

    def __init__(self):
        self.folder = os.environ["PC_MARKERS"]

    def tactics(self, problem, device):
        return [SlowRefTactic(compute_dtype=d) for d in ("bfloat16", "float32")]

    def precompile(self, tactic, problem, device):
        name = f"{tactic.compute_dtype}-{problem.m}-{os.getpid()}.json"
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump({"pid": os.getpid(), "m": problem.m}, f)
        return self.build(tactic, problem, device)

@hookimpl
def fp4_dispatch_register_backends(register):
    register(SlowRefBackend())
'''


class _Bar:
    """Stands in for the progress bar: records its total and every update."""

    instances: ClassVar[list[_Bar]] = []

    def __init__(self, iterable, *, total=None, **_):
        self.total, self.updates, self.descs = total, 0, []
        _Bar.instances.append(self)

    def update(self, n=1):
        self.updates += n

    def set_description_str(self, s):
        self.descs.append(s)

    def set_postfix_str(self, s):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_tune_precompiles_first_with_one_bar_for_both_phases(plugin_dist, tmp_path, monkeypatch):
    from fp4_dispatch.engine import runner as dmod

    markers = tmp_path / "tune-markers"
    markers.mkdir()
    monkeypatch.setenv("PC_MARKERS", str(markers))
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "reference")  # the built-in portable plugin
    monkeypatch.setenv("FP4_DISPATCH_PLUGINS", "slowref")
    plugin_dist("slowref-dist", {"slowref": PLUGIN})
    monkeypatch.setattr(dmod, "bar_of", _Bar)
    _Bar.instances.clear()
    pc.forget_ready()
    try:
        d = Dispatcher(device="cpu", cache=False)
        assert [b.name for b in d.available] == ["slow-ref"]
        t0 = time.perf_counter()
        (res,) = d.tune([(3, 64, 128)], precompile=True)
        assert res.winner is not None and res.winner.backend == "slow-ref"
        marks = _markers(markers)
        assert sorted(x["m"] for x in marks) == [4, 4]  # both tactics, bucket M=4
        assert os.getpid() not in {x["pid"] for x in marks}
        bar = _Bar.instances[-1]
        measured = len(res.measurements)
        assert bar.total == 2 + measured and bar.updates == 2 + measured, vars(bar)
        assert any("compiling 2 kernels" in s for s in bar.descs)
        # again, same kernels: nothing to compile, no worker asked
        calls = []
        monkeypatch.setattr(pc, "precompile", lambda *a, **k: calls.append(a))
        d.tune([(3, 64, 128)], force=True, precompile=True)
        assert calls == [] and _Bar.instances[-1].total == measured
        # precompile off (the CPU default): no compile phase at all
        d.tune([(100, 64, 128)], precompile=None)
        assert calls == [] and len(_markers(markers)) == 2
    finally:
        pc.shutdown()
        pc.forget_ready()
    assert time.perf_counter() - t0 < 300


# ---- the Triton sm90 kernel: compiled without a launch (and without a GPU) --------------

TRITON_SCRIPT = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.contracts.backend import GemmOperands, kernel_problem, launch
from fp4_dispatch.backends.sm90 import gemm_direct
from fp4_dispatch.plugins.sm90 import PROFILE, TritonSm90Backend, TritonSm90Tactic
from fp4_dispatch.contracts.tactics import Problem

backend, dev = TritonSm90Backend(), PROFILE.device
cache = gemm_direct._nvfp4_gemm_kernel.device_caches[0][0]  # compiled variants, this process
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90Tactic(**spec["tactic"])
    problem = Problem(m=spec["m"], n=spec["n"], k=spec["k"], out_dtype=spec["dtype"])
    assert backend.validate(tactic, problem, dev) is None, spec
    before = len(cache)
    compiled = backend.precompile(tactic, kernel_problem(problem, tactic), dev)
    after_precompile = len(cache)
    # what a real call passes: record __call__'s (grid, args) instead of launching, then
    # compile those: the same specialization must be found, nothing new compiled
    kernel = backend.build(tactic, kernel_problem(problem, tactic), dev)
    even = problem.k % tactic.tile_k == 0
    bound = kernel._bound[even]
    seen = []

    class Recorder:  # stands in for the binding: records instead of launching
        def launch_keyed(self, key, grid, args):
            seen.append((grid, args))

        def __call__(self, grid, args):
            seen.append((grid, args))

    kernel._bound[even] = Recorder()
    try:
        m, n, k = problem.m, problem.n, problem.k
        a = torch.zeros(m, k // 2, dtype=torch.uint8)
        b = torch.zeros(n, k // 2, dtype=torch.uint8)
        sa = torch.zeros(-(-m // 128) * 128, -(-(k // 16) // 4) * 4, dtype=torch.float8_e4m3fn)
        sb = torch.zeros(-(-n // 128) * 128, -(-(k // 16) // 4) * 4, dtype=torch.float8_e4m3fn)
        res = torch.empty(m, n, dtype=getattr(torch, spec["dtype"]))
        launch(kernel, GemmOperands(a, sa, b, sb, torch.ones(1)), res, tactic.swap_ab)
    finally:
        kernel._bound[even] = bound
    (grid, args), = seen
    bound.warmup(grid, args)
    out[spec["name"]] = {"new_by_precompile": after_precompile - before,
                         "new_by_real_args": len(cache) - after_precompile,
                         "type": type(compiled).__name__}
# the unpack backend: a real call with Triton's launch turned into a compile-only run
from fp4_dispatch.backends.sm90 import gemm_unpack
from fp4_dispatch.plugins.sm90 import Sm90UnpackTactic, TritonSm90UnpackBackend

ub, uk = TritonSm90UnpackBackend(), gemm_unpack.unpack_nvfp4_kernel
ucache = uk.device_caches[0][0]
run = uk.run
uk.run = lambda *a, grid, warmup, **kw: run(*a, grid=grid, warmup=True, **kw)
problem = Problem(m=256, n=384, k=512)
tactic = Sm90UnpackTactic(block_r=32, block_k=128)
ub.precompile(tactic, kernel_problem(problem, tactic), dev)
after_precompile = len(ucache)
kernel = ub.build(tactic, kernel_problem(problem, tactic), dev)
a = torch.zeros(256, 256, dtype=torch.uint8)
b = torch.zeros(384, 256, dtype=torch.uint8)
sa = torch.zeros(256, 32, dtype=torch.float8_e4m3fn)
sb = torch.zeros(384, 32, dtype=torch.float8_e4m3fn)
launch(kernel, GemmOperands(a, sa, b, sb, torch.ones(1)), torch.empty(256, 384,
       dtype=torch.bfloat16), False)
out["unpack"] = {"new_by_precompile": after_precompile, "new_by_real_args":
                 len(ucache) - after_precompile, "type": "CompiledKernel"}
out["cache_files"] = len(os.listdir(os.environ["TRITON_CACHE_DIR"]))
print(json.dumps(out))
"""
)


def test_triton_sm90_precompile_compiles_what_a_call_launches(tmp_path):
    """Compiles for sm_90 on a CPU (a target-only driver) and checks that the arguments of
    a real call (recorded from `__call__`) hit the variant precompile made: swapped and
    not, split-K and not, bf16 and fp16 output."""
    import subprocess

    pytest.importorskip("triton")
    cases = [
        {"name": "plain", "m": 5, "n": 256, "k": 512, "dtype": "bfloat16",
         "tactic": {"tile_m": 16, "tile_n": 64, "tile_k": 128}},
        {"name": "swap-splitk", "m": 3, "n": 512, "k": 1024, "dtype": "float16",
         "tactic": {"tile_m": 64, "tile_n": 16, "tile_k": 128, "split_k": 2, "swap_ab": True}},
        # a wgmma tile with 64-wide K tiles: its dot-order variant failed Triton's
        # TritonGPUOptimizeDotOperands pass (seen on the H200); it must compile
        {"name": "wgmma-k64", "m": 256, "n": 13824, "k": 5120, "dtype": "bfloat16",
         "tactic": {"tile_m": 128, "tile_n": 128, "tile_k": 64, "group_m": 8, "swap_ab": True}},
    ]  # fmt: skip
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in cases:
        row = got[case["name"]]
        assert row == {"new_by_precompile": 1, "new_by_real_args": 0,
                       "type": "CompiledKernel"}, got  # fmt: skip
    # the unpack backend: A's and B's passes (one variant here: 256 and 384 rows are both
    # multiples of 16), nothing left to compile for the call
    assert got["unpack"]["new_by_precompile"] == 1 and got["unpack"]["new_by_real_args"] == 0
    assert got["cache_files"] >= 2  # on disk, where another process finds them


W4A16_SCRIPT = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.backends.sm90 import gemm_unpack, gemm_w4a16
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90 import PROFILE
from fp4_dispatch.plugins.sm90.w4a16 import TritonSm90W4A16Backend, TritonSm90W4A16Tactic
from fp4_dispatch.contracts.tactics import Problem


def operands(m, n, k, dtype):
    b = torch.zeros(n, k // 2, dtype=torch.uint8)
    sb = torch.zeros(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn)
    return DenseOperands(torch.zeros(m, k, dtype=dtype), b, sb, torch.ones(1)), torch.empty(
        m, n, dtype=dtype)


backend, dev = TritonSm90W4A16Backend(), PROFILE.device
direct = gemm_w4a16._w4a16_kernel.device_caches[0][0]
unpack = gemm_unpack.unpack_nvfp4_kernel.device_caches[0][0]
dot = gemm_w4a16._dot_order_kernel.device_caches[0][0]


def dot_order_compile_only(a, prepared):  # the activation pass of x_dot variants, compiled
    m, k = a.shape
    grid = (-(-m // gemm_w4a16.DOT_ORDER_ROWS), k // 128)
    gemm_w4a16._dot_order_binding(prepared).warmup(grid, (a, a, m, k, a.stride(0)))
    return a


gemm_w4a16.dot_order_activations = dot_order_compile_only
run = gemm_unpack.unpack_nvfp4_kernel.run
gemm_unpack.unpack_nvfp4_kernel.run = lambda *a, grid, warmup, **kw: run(
    *a, grid=grid, warmup=True, **kw)
out = {}
for spec in json.loads(sys.argv[1]):
    tactic = TritonSm90W4A16Tactic(**spec["tactic"])
    problem = Problem(m=spec["m"], n=spec["n"], k=spec["k"], out_dtype=spec["dtype"],
                      operation="w4a16")
    why = backend.validate(tactic, problem, dev)
    assert why is None, (spec, why)
    cache = unpack if tactic.path == "unpack" else direct
    before, dot_before = len(cache), len(dot)
    backend.precompile(tactic, problem, dev)
    after, dot_after = len(cache), len(dot)
    kernel = backend.build(tactic, problem, dev)
    ops, res = operands(problem.m, problem.n, problem.k, getattr(torch, spec["dtype"]))
    if tactic.path == "unpack":  # a real call, Triton's launch turned into a compile-only run
        kernel(ops, res)
    else:  # record the real call's (grid, args), then compile exactly those
        compile_real_call(kernel, ops, res, problem.k, ops.a.dtype)
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         "dot_pass": [dot_after - dot_before, len(dot) - dot_after]}
print(json.dumps(out))
"""
)


def test_triton_sm90_w4a16_precompile_compiles_what_a_call_launches(tmp_path):
    """The W4A16 backend compiles for sm_90 on a CPU without a launch, and a real call's
    arguments (direct kernel, with and without split-K, bf16 and fp16, with the
    activation pass of a 64-token tile; the unpack path's weight pass) hit the variants
    precompile made: nothing is left to JIT on first use."""
    import subprocess

    pytest.importorskip("triton")
    cases = [
        {"name": "direct-bf16", "m": 4, "n": 256, "k": 512, "dtype": "bfloat16",
         "tactic": {"path": "direct", "tile_m": 16, "tile_n": 128, "tile_k": 128}},
        {"name": "direct-fp16-splitk", "m": 1, "n": 512, "k": 1024, "dtype": "float16",
         "tactic": {"path": "direct", "tile_m": 16, "tile_n": 128, "tile_k": 128,
                    "split_k": 2}},
        {"name": "unpack", "m": 512, "n": 384, "k": 512, "dtype": "bfloat16",
         "tactic": {"path": "unpack", "tile_m": 128, "tile_n": 128, "tile_k": 128,
                    "block_r": 64}},
        {"name": "direct-x-dot", "m": 70, "n": 256, "k": 512, "dtype": "bfloat16",
         "tactic": {"path": "direct", "tile_m": 64, "tile_n": 64, "tile_k": 128,
                    "num_stages": 4, "split_k": 2}},
    ]  # fmt: skip
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", W4A16_SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in cases:
        # the activation pass of an x_dot variant (64-token tiles) is compiled ahead too
        dot_pass = [1, 0] if case["name"] == "direct-x-dot" else [0, 0]
        assert got[case["name"]] == {"new_by_precompile": 1, "new_by_real_args": 0,
                                     "dot_pass": dot_pass}, got  # fmt: skip
