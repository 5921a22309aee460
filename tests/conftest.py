"""Shared fixtures: fake plugin distributions on sys.path, quantized operands."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Install a fake distribution with entry points by putting a dist-info on sys.path.

    ``plugin_dist("my-dist", {"ep_name": "module source"})`` writes each module and the
    ``entry_points.txt`` so that importlib.metadata (and so the registry) finds them.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(dist: str, plugins: dict[str, str], version: str = "1.2.3") -> Path:
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[fp4_dispatch]"]
        for ep, source in plugins.items():
            module = f"fakeplug_{ep}"
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{ep} = {module}")
            made.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return info

    yield make
    for module in made:
        sys.modules.pop(module, None)


#: the compile-only test scripts' preamble: a Triton driver that targets sm_90 with no GPU,
#: and ``compile_real_call`` (compile what a kernel's real call would launch)
TARGET_ONLY = r"""
import json, os, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class TargetOnly:
    # no GPU here: Triton compiles for sm_90 (ptxas ships with it); nothing can launch
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(TargetOnly())


class _Recorder:
    # stands in for a kernel's launcher binding: records (grid, args), launches nothing
    last_compiled = None

    def __init__(self):
        self.seen = []

    def __call__(self, grid, args):
        self.seen.append((grid, args))

    def launch_keyed(self, key, grid, args):
        self.seen.append((grid, args))


def compile_real_call(kernel, ops, res, k, act_dtype):
    # kernel(ops, res) with the binding recorded, then compile exactly that (grid, args)
    binding = kernel._binding
    rec = _Recorder()
    kernel._binding = lambda *a: rec
    kernel(ops, res)
    kernel._binding = binding
    (grid, args), = rec.seen
    binding(k, False, act_dtype).warmup(grid, args)
"""


#: a compile-only script's helper (after `TARGET_ONLY`): ``loop_stats(compiled, name)``
#: disassembles a compiled kernel's cubin (Triton's nvdisasm, the file kept in
#: TRITON_CACHE_DIR as ``name.cubin``) and counts its main loop (the longest backward
#: branch): instructions, HMMAs, shared-memory accesses and barriers; and the kernel's
#: register spills. ``sass_loops(sass)``: every backward branch's body, opcodes only
#: (predicates dropped), in program order
SASS_LOOP = r"""
import collections, pathlib, re, subprocess


def sass_loops(sass):
    labels, seq = {}, []
    for line in sass.splitlines():
        s = line.strip()
        lab = re.match(r"\.(L_x_\d+):", s)
        if lab:
            labels[lab.group(1)] = len(seq)
        ins = re.match(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;", s)
        if ins:
            seq.append(ins.group(1))
    loops = []
    for i, ins in enumerate(seq):
        br = re.search(r"BRA[^`]*`\(\.(L_x_\d+)\)", ins)
        if br and labels.get(br.group(1), 1 << 30) <= i:
            loops.append([re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                          for t in seq[labels[br.group(1)]: i + 1]])
    return loops


def loop_stats(compiled, name):
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    path = pathlib.Path(os.environ["TRITON_CACHE_DIR"]) / f"{name}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True,
                          text=True).stdout
    body = max(sass_loops(sass), key=len, default=[])
    ops = collections.Counter(op.split(".")[0] for op in body)
    return {"loop": len(body), "hmma": ops["HMMA"], "sass": sass,
            "loop_shared_or_barrier": ops["LDS"] + ops["STS"] + ops["BAR"] + ops["LDSM"],
            "spills": len(re.findall(r"\b(STL|LDL)\b", sass))}
"""


#: compile-only script (after `TARGET_ONLY` + `SASS_LOOP`) for a grouped Gluon backend:
#: argv[1] is ``{"plugin": module, "backend": class, "tactic": class, "cases": [...]}``;
#: each case (name, t, n, k, e, dtype, tactic knobs) is precompiled, then a real call's
#: arguments (CPU stand-ins) warm the binding; prints per case the kernels each step
#: added to the launcher's cache, `loop_stats` and the SASS
GROUPED_GLUON_COMPILE = r"""
import importlib
from fp4_dispatch.contracts.backend import GroupedOperands
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape
from fp4_dispatch.plugins.sm90 import PROFILE

job = json.loads(sys.argv[1])
plugin = importlib.import_module(job["plugin"])
backend, dev = getattr(plugin, job["backend"])(), PROFILE.device
tactic_type = getattr(plugin, job["tactic"])
out = {}
for spec in job["cases"]:
    tactic = tactic_type(**spec["tactic"])
    t, n, k, e = spec["t"], spec["n"], spec["k"], spec["e"]
    dtype = getattr(torch, spec["dtype"])
    p = Problem(m=t, n=n, k=k, out_dtype=spec["dtype"], operation="grouped_w4a16", groups=e)
    assert backend.validate(tactic, p, dev) is None, (spec, backend.validate(tactic, p, dev))
    kernel = backend.build(tactic, p, dev)
    cache = kernel.launcher.kernel.device_caches[0][0]
    before = len(cache)
    compiled = backend.precompile(tactic, p, dev)
    after = len(cache)
    ops = GroupedOperands(torch.zeros(t, k, dtype=dtype),
                          torch.zeros(e, n, k // 2, dtype=torch.uint8),
                          torch.zeros(e, *swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                          torch.ones(e), torch.zeros(e, dtype=torch.int32))
    grid, args, meta = kernel._launch(ops, torch.empty(t, n, dtype=dtype))
    kernel._binding(meta).warmup(grid, args)  # the real call's variant
    out[spec["name"]] = {"new_by_precompile": after - before,
                         "new_by_real_args": len(cache) - after,
                         **loop_stats(compiled, spec["name"])}
print(json.dumps(out))
"""


def compile_grouped_gluon(tmp_path: Path, plugin: str, backend: str, tactic: str,
                          cases: list[dict]) -> dict:  # fmt: skip
    """Run `GROUPED_GLUON_COMPILE` for `cases` (sm_90, no GPU): its per-case dict."""
    pytest.importorskip("triton")
    job = {"plugin": plugin, "backend": backend, "tactic": tactic, "cases": cases}
    proc = subprocess.run([sys.executable, "-c", TARGET_ONLY + SASS_LOOP + GROUPED_GLUON_COMPILE,
                           json.dumps(job)], capture_output=True, text=True,
                          env=sm90_compile_env(tmp_path), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {c["name"] for c in cases}, got.keys()
    for name, row in got.items():
        assert row["new_by_precompile"] == 1 and row["new_by_real_args"] == 0, (name, row)
        assert row["spills"] == 0, (name, row)
    return got


def check_grouped_replays(kernel, b, check) -> None:
    """A grouped split-K kernel's recorded driver replay and a CUDA graph, each replayed
    with new routing (offsets changed in place) over 16 experts of `b` (`Nvfp4Experts`
    on the GPU): 8 bf16 rows, one an expert; ``check(kernel, ops, out)`` after each."""
    import torch

    from fp4_dispatch.contracts.backend import GroupedOperands

    n, k = b.data.shape[1], b.data.shape[2] * 2
    sizes = [1] * 8 + [0] * 8
    a = torch.randn(8, k, device="cuda").to(torch.bfloat16)
    off = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
    out = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
    kernel(ops, out)  # makes the workspace, outside any recording or capture
    with kernel.record("split", [a, off, out], [b.data, b.scale, b.global_scale]) as rec:
        kernel(ops, out)
    assert rec.replay is not None, rec.why
    for shift in range(1, 4):
        off.copy_(torch.roll(torch.tensor(sizes), shift * 3).cumsum(0).to(torch.int32))
        fresh = torch.full_like(out, float("nan"))
        assert rec.replay([a, off, fresh])
        torch.cuda.synchronize()
        check(kernel, ops, fresh)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(ops, out)
    off.copy_(torch.tensor([0] * 8 + [1] * 8, dtype=torch.int32).cumsum(0).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(kernel, ops, out)
    assert len(kernel._scratch) == 1  # one T: one workspace, recorded and captured alike


def run_interpreted(script: str, cases: object) -> dict:
    """Run `script` (given ``json.dumps(cases)`` as argv[1]) under TRITON_INTERPRET=1.

    In a subprocess: interpreter mode must be set before triton is imported, and other
    tests import the kernel modules in-process. Returns the JSON on its last stdout line.
    """
    return _interpreted_outputs(script, [cases])[0]


def run_interpreted_split(script: str, cases: list, parts: int = 2) -> list:
    """`run_interpreted` for a `script` that prints one JSON list for a list of cases:
    the cases dealt into `parts` subprocesses that run at once (CI has two cores), their
    lists joined (every part's results in its own order, the parts one after another)."""
    chunks = [cases[i::parts] for i in range(parts)]
    return [r for out in _interpreted_outputs(script, [c for c in chunks if c]) for r in out]


def _interpreted_outputs(script: str, argvs: list) -> list:
    """One TRITON_INTERPRET=1 subprocess of `script` per argv (JSON), all at once; each
    must exit 0. The JSON on each one's last stdout line, in argv order."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    procs = [subprocess.Popen([sys.executable, "-c", script, json.dumps(a)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argvs]  # fmt: skip
    try:
        done = [(proc, *proc.communicate(timeout=600)) for proc in procs]  # all ended first
    finally:  # a timeout (or any error) leaves no subprocess running, as subprocess.run
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, _, stderr in done:
        assert proc.returncode == 0, stderr[-3000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in done]


def sm90_compile_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a `TARGET_ONLY` compile subprocess: its own Triton cache in
    `tmp_path`, not the interpreter, and Triton's own ptxas (importing FlashInfer points
    Triton's sm_90+ compiles at the system's ptxas, which spills where Triton's does not)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    for var in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        env.pop(var, None)
    return env


def source_root() -> Path | None:
    """The repository (benchmarks/ is not in the wheel): FP4_DISPATCH_SOURCE_ROOT in CI."""
    for root in (os.environ.get("FP4_DISPATCH_SOURCE_ROOT"), Path(__file__).parents[1]):
        if root and (Path(root) / "benchmarks" / "__main__.py").exists():
            return Path(root)
    return None


def bench_module(name: str, monkeypatch: pytest.MonkeyPatch):
    """``benchmarks.<name>`` imported from the source tree (benchmarks/ is not in the
    wheel), the tree on ``sys.path`` for the test; skipped where the tree is not around."""
    root = source_root()
    if root is None:
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    monkeypatch.syspath_prepend(str(root))
    return importlib.import_module(f"benchmarks.{name}")


def run_bench_smoke(tmp_path: Path, suite: str, *args: str) -> list[dict]:
    """Run ``python -m benchmarks <suite> --smoke --out tmp_path`` (CPU, interpreter;
    `args` after it) from the source tree; it must exit 0. Returns the rows it wrote
    (``<suite>.jsonl``, `benchmarks.results.Row` as dicts); skipped where Triton or the
    source tree is not around."""
    pytest.importorskip("triton")
    root = source_root()
    if root is None:
        pytest.skip("benchmarks/ not found (set FP4_DISPATCH_SOURCE_ROOT)")
    cmd = [sys.executable, "-m", "benchmarks", suite, "--smoke", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    text = (tmp_path / f"{suite}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


GOOD_PLUGIN = """
    from typing import Literal
    import fp4_dispatch
    from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic

    class T(ReferenceTactic):
        backend: Literal["{name}"] = "{name}"

    class B(ReferenceBackend):
        name = "{name}"
        family = "{family}"
        tactic_type = T
        def tactics(self, problem, device):
            for t in super().tactics(problem, device):
                yield T(**{{**t.model_dump(), "backend": "{name}"}})

    @fp4_dispatch.hookimpl
    def fp4_dispatch_register_backends(register):
        register(B())
"""


def check_w4a16_kernel_on_gpu(build, cases) -> None:
    """Run ``build(knobs)`` (a W4A16 kernel object) on each case ``(M, N, K, knobs,
    activation dtype, bias, column-major out)`` of stress operands (every e2m1 code, NaN
    in the padded scales) on an sm90 GPU, twice (the second call reuses the
    self-resetting split-K counters), against float64 ``alpha * x @ dequant(W).T``
    (+ bias): relative error <= 1e-2, the output poisoned with NaN first."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    import math

    from fp4_dispatch.autotune.harness import stress_nvfp4
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
    from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize

    dev = torch.device("cuda")
    for m, n, k, knobs, dtype, with_bias, colmajor in cases:
        gen = torch.Generator(device=dev)
        gen.manual_seed(m + n + k)
        x = torch.randn((m, k), generator=gen, device=dev).to(getattr(torch, dtype))
        wd, wsc = stress_nvfp4(n, k, dev, gen)
        alpha = torch.tensor([1.0 / (8 * math.sqrt(k))], device=dev)
        bias = torch.randn(n, generator=gen, device=dev).to(x.dtype) if with_bias else None
        ops = w4.W4A16Operands(x, wd, wsc, alpha, bias=bias)
        one = torch.ones((), device=dev)
        w64 = dequantize(Nvfp4Tensor(wd, wsc, one, "swizzled", (n, k))).double()
        ref = (x.double() @ w64.T) * float(alpha)
        if bias is not None:
            ref += bias.double()
        shape = (n, m) if colmajor else (m, n)
        out = torch.full(shape, float("nan"), dtype=x.dtype, device=dev)
        out = out.t() if colmajor else out
        kernel = build(knobs)
        for _ in range(2):
            out.fill_(float("nan"))
            kernel(ops, out)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err <= 1e-2, (m, n, k, knobs, err)


def w4a16_plan(d, m: int, n: int, k: int):
    """The dispatcher's warm W4A16 plan of this exact problem (bfloat16 out)."""
    plan = d.cached_plan(m, n, k, "bfloat16", "w4a16")
    assert plan is not None and plan.warm, (m, n, k)
    return plan


def run_plan(plan, layer, x: torch.Tensor) -> torch.Tensor:
    """`plan` run eagerly on an `Nvfp4Linear`'s natural operands and a 2-D `x`
    (bfloat16 out, the bias in the epilogue as the layer passes it)."""
    out = torch.empty(x.shape[0], layer.out_features, device=x.device, dtype=torch.bfloat16)
    bias = None if layer.bias is None else layer.bias.to(torch.bfloat16)
    alpha = layer.weight_global_scale.reshape(1)
    plan(x, layer.weight_data, layer.weight_scale, alpha, out, bias, None)
    return out


def inductor_stated_plan(d, m: int, n: int, k: int):
    """The plan whose kernel Inductor launches for a compiled W4A16 call of this problem
    (default mode, after the first compiled call): the pick where its kernel states its
    launches, else its side plan (`fp4_dispatch.engine.inductor`)."""
    from fp4_dispatch.engine import inductor

    plan = w4a16_plan(d, m, n, k)
    if inductor._states_launches(plan):
        return plan
    side = inductor._side_plans[d][plan.key]
    assert side is not None and inductor._states_launches(side), plan
    return side


def good_plugin(name: str, family: str = "thirdparty") -> str:
    return GOOD_PLUGIN.format(name=name, family=family)


@pytest.fixture
def operands():
    """Random quantized operands on CPU: ``operands(m, n, k) -> (qa, qb)``."""
    from fp4_dispatch import quantize_nvfp4

    def make(m: int, n: int, k: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return (
            quantize_nvfp4(torch.randn(m, k, generator=g)),
            quantize_nvfp4(torch.randn(n, k, generator=g)),
        )

    return make


#: the on-disk caches compiled kernels go to, each redirected for the session (unless the
#: caller set it) so that no test writes into the user's own cache folders
KERNEL_CACHE_VARS = ("FP4_DISPATCH_KERNEL_CACHE", "TRITON_CACHE_DIR", "XDG_CACHE_HOME")
_session_caches: list[str] = []


def _private_caches() -> None:
    """Give this test process caches of its own, in one temporary folder for the session.

    Every unset kernel-cache variable points into the folder, and so does the tuning cache
    (``FP4_DISPATCH_CACHE``) when unset. Under pytest-xdist every worker is its own process
    and so gets its own folder (a value that points into the controller's folder, which
    the workers inherit, counts as unset); a tuning cache the caller set (scripts/test.sh
    sets one) becomes one file a worker beside it (``tuning-cache.gw0.json``). So no two
    workers ever write one file, and no test reads another worker's winners or kernels.
    """
    import tempfile

    inherited = os.environ.get(_BASE_VAR)
    base = tempfile.mkdtemp(prefix="fp4-test-caches-")
    _session_caches.append(base)
    os.environ[_BASE_VAR] = base

    def ours(value: str | None) -> bool:
        return not value or bool(inherited and value.startswith(inherited + os.sep))

    for var in KERNEL_CACHE_VARS:
        if ours(os.environ.get(var)):
            os.environ[var] = os.path.join(base, var.lower())
    tuning = os.environ.get("FP4_DISPATCH_CACHE")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if ours(tuning):
        os.environ["FP4_DISPATCH_CACHE"] = os.path.join(base, "tuning.json")
    elif worker:
        path = Path(tuning)
        os.environ["FP4_DISPATCH_CACHE"] = str(path.with_name(f"{path.stem}.{worker}{path.suffix}"))


#: the session folder of `_private_caches`, for the processes this one starts
_BASE_VAR = "FP4_TEST_SESSION_CACHES"


def _private_example_database() -> None:
    """Under pytest-xdist, Hypothesis keeps each worker's examples in a folder of its own
    (``.hypothesis/examples-gw0``), not in the one folder every worker would write."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    try:
        from hypothesis import settings
        from hypothesis.database import DirectoryBasedExampleDatabase
    except ImportError:  # the test extra is not installed: no property tests to run
        return
    db = DirectoryBasedExampleDatabase(os.path.join(".hypothesis", f"examples-{worker}"))
    settings.register_profile("xdist-worker", database=db)
    settings.load_profile("xdist-worker")


def pytest_unconfigure(config):
    import shutil

    for base in _session_caches:
        shutil.rmtree(base, ignore_errors=True)


def pytest_configure(config):
    """Markers live here: the tests run from a copy outside the source tree (no pyproject)."""
    _private_caches()
    _private_example_database()
    config.addinivalue_line("markers", "slow: longer tests (still run in CI)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # Third-party deprecation chatter (CuTe-DSL's own internals, torch.jit) buries real output.
    for module in ("cutlass", "nvidia_cutlass_dsl", "torch.jit"):
        config.addinivalue_line("filterwarnings", f"ignore::DeprecationWarning:{module}.*")
