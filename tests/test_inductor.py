"""torch.compile launching the plans' Triton kernels itself (`fp4_dispatch.engine.inductor`).

On a CPU: a launch under `triton_launch.tracing` is stated by name with its launch
options (PDL dropped, options Inductor lacks refused), a kept buffer is refused, scratch
is kept nowhere (one pair per traced graph under functionalization, else one per call,
and Inductor's re-inplacing runs a graph's launches on its one pair without a clone),
a plan without a tracing kernel refuses, the CPU
keeps the opaque op; and the source Inductor copies of each tracing W4A16 kernel (its
transitive closure) compiles for sm_90. On an sm90 GPU (``-m gpu``): a compiled
`Nvfp4Linear` (default and reduce-overhead) computes the eager bits, and its generated
code launches the plan's kernel and never calls the op (the default); two split-K layers
compiled together share one scratch pair (one zero-fill, nothing cloned); with
``FP4_DISPATCH_INDUCTOR=0`` the op stays.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import subprocess
import sys
import types
from typing import Literal

import pytest
import torch
from conftest import TARGET_ONLY, inductor_stated_plan, run_plan, sm90_compile_env, w4a16_plan

from fp4_dispatch.backends import triton_launch as tlaunch
from fp4_dispatch.backends.workspace import Scratch, one_like
from fp4_dispatch.contracts.backend import NotTraceable


class _Kernel:
    """Stands in for a ``@triton.jit`` function: parameter names only."""

    arg_names = ("x_ptr", "out_ptr", "n", "BLOCK", "EVEN")
    __name__ = "stand_in_kernel"


class _Wrap:
    """Stands in for ``torch.library.wrap_triton``: records each stated launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[object, tuple, dict]] = []

    def __call__(self, kernel: object) -> _Wrap:
        self._kernel = kernel
        return self

    def __getitem__(self, grid: tuple) -> object:
        def launch(**kwargs: object) -> None:
            self.launches.append((self._kernel, grid, kwargs))

        return launch


def _fake_operands(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(n), torch.empty(n)


def _bound(**options: object) -> tlaunch.BoundLaunch:
    constexprs = {"BLOCK": 128, "EVEN": True, "num_stages": 3}
    return tlaunch.CachedLauncher(_Kernel()).bind(constexprs, 8, **options)


@pytest.mark.parametrize("entry", ["call", "keyed", "aligned"])
def test_a_traced_launch_is_stated_by_name_with_its_options(entry):
    x, out = _fake_operands()
    bound, wrap = _bound(launch_pdl=True), _Wrap()
    with tlaunch.tracing(wrap):
        assert tlaunch.tracing_active()
        if entry == "call":
            bound((4, 2), (x, out, 64))
        elif entry == "keyed":
            bound.launch_keyed(("k",), (4, 2), (x, out, 64))
        else:
            tlaunch.launch_aligned(bound, ("k",), (4, 2), (x, out, 64), (x, out))
    assert not tlaunch.tracing_active()
    ((kernel, grid, kwargs),) = wrap.launches
    assert isinstance(kernel, _Kernel) and grid == (4, 2)
    assert kwargs == {"x_ptr": x, "out_ptr": out, "n": 64, "BLOCK": 128, "EVEN": True,
                      "num_warps": 8, "num_stages": 3}  # fmt: skip


def test_a_launch_option_inductor_lacks_or_a_kept_buffer_is_refused():
    x, out = _fake_operands()
    wrap = _Wrap()
    with tlaunch.tracing(wrap):
        with pytest.raises(NotTraceable, match="launch option maxnreg=128"):
            _bound(maxnreg=128)((1,), (x, out, 64))
        with pytest.raises(NotTraceable, match="argument 'out_ptr' is a device buffer"):
            _bound()((1,), (x, torch.empty(64), 64))
        with pytest.raises(RuntimeError, match="already active"), tlaunch.tracing(wrap):
            pass
    assert wrap.launches == []


def test_scratch_under_tracing_is_made_per_call_and_kept_nowhere():
    scratch = Scratch()
    with tlaunch.tracing(_Wrap()):
        ws1, cnt1 = scratch.get(torch.device("cpu"), 32, 4)
        ws2, _ = scratch.get(torch.device("cpu"), 32, 4)
        one = one_like(ws1)
    assert len(scratch) == 0 and ws1.data_ptr() != ws2.data_ptr()
    assert ws1.shape == (32,) and ws1.dtype == torch.float32
    assert torch.equal(cnt1, torch.zeros(4, dtype=torch.int32))
    assert torch.equal(one, torch.ones(1)) and one is not one_like(ws1)
    kept = scratch.get(torch.device("cpu"), 32, 4)
    assert len(scratch) == 1 and scratch.get(torch.device("cpu"), 32, 4)[0] is kept[0]


def test_under_functionalization_one_scratch_pair_serves_the_whole_traced_graph():
    """What torch.compile's trace sees: every launch of one graph shares one pair (its
    counters zeroed once, at least `TRACED_COUNTERS_MIN`), remade larger only for a launch
    that needs more; another graph (another functionalization mode) gets its own, and a
    graph's pair is dropped with its trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    from fp4_dispatch.backends import workspace

    scratch, cpu = Scratch(), torch.device("cpu")
    with FakeTensorMode(), tlaunch.tracing(_Wrap()):
        with FunctionalTensorMode():
            ws, cnt = scratch.get(cpu, 32, 4)
            assert isinstance(ws, FunctionalTensor) and isinstance(cnt, FunctionalTensor)
            assert cnt.shape == (workspace.TRACED_COUNTERS_MIN,) and cnt.dtype == torch.int32
            assert ws.shape == (32,) and ws.dtype == torch.float32
            again = scratch.get(cpu, 16, 2)
            assert again[0] is ws and again[1] is cnt
            one = one_like(ws)
            assert one is one_like(ws) and one.shape == (1,)
            bigger, same_cnt = scratch.get(cpu, 64, 4)
            assert bigger is not ws and bigger.shape == (64,) and same_cnt is cnt
            more_cnt = scratch.get(cpu, 64, workspace.TRACED_COUNTERS_MIN + 1)[1]
            assert more_cnt is not cnt and more_cnt.shape == (workspace.TRACED_COUNTERS_MIN + 1,)
            last = scratch.get(cpu, 64, 4)
            assert last[0] is bigger and last[1] is more_cnt
        with FunctionalTensorMode():
            other = scratch.get(cpu, 32, 4)
            assert other[0] is not ws and other[1] is not cnt and one_like(ws) is not one
    gc.collect()
    assert len(scratch) == 0 and len(workspace._graph_scratch) == 0  # gone with the graphs


_REINPLACE = r"""
import triton.language as tl
from functorch.compile import aot_function
from torch._inductor.fx_passes import reinplace

from fp4_dispatch.backends import triton_launch as tlaunch
from fp4_dispatch.backends.workspace import Scratch


@triton.jit
def _two_buffers(x_ptr, out_ptr, ws_ptr, cnt_ptr, n, BLOCK: tl.constexpr):
    # a split-K kernel's use of its pair: partials written, a counter bumped and reset
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(ws_ptr + offs, v, mask=offs < n)
    arrived = tl.atomic_add(cnt_ptr, 1)
    tl.store(out_ptr + offs, v + arrived.to(tl.float32), mask=offs < n)
    tl.atomic_xchg(cnt_ptr, 0)


bound = tlaunch.CachedLauncher(_two_buffers).bind({"BLOCK": 64}, 4)
scratch = Scratch()


def layer(x):
    out = torch.empty_like(x)
    ws, cnt = scratch.get(x.device, 64, 16)
    bound((1,), (x, out, ws, cnt, x.numel()))
    return out


def step(x):
    with tlaunch.tracing():
        return layer(layer(layer(x)))


res = {}


def compiler(gm, example_inputs):
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    res["zeros"] = sum("zeros" in str(n.target) for n in calls)
    res["empty"] = sum(str(n.target) == "aten.empty.memory_format" for n in calls)
    reinplace.reinplace_inplaceable_ops_core(gm.graph)
    kernels = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
    res["clones"] = [list(n.kwargs["tensors_to_clone"]) for n in kernels]
    res["pairs"] = len({(n.kwargs["kwargs"]["ws_ptr"].name, n.kwargs["kwargs"]["cnt_ptr"].name)
                        for n in kernels})
    print(json.dumps(res))
    sys.exit(0)  # the graph is never run: nothing can launch here


aot_function(step, fw_compiler=compiler)(torch.randn(64))
"""


def test_inductor_runs_every_launch_of_a_graph_on_its_one_scratch_pair_in_place(tmp_path):
    """What Inductor makes of the shared pair, on the CPU (sm_90 target, nothing runs):
    three chained launches of a kernel that writes its partials and bumps and resets a
    counter, traced by AOTAutograd as torch.compile does, give one counters zero-fill and
    one partials allocation; after Inductor's re-inplacing pass no launch clones anything
    and all three use the one pair (before the pair was shared, each launch made and
    zeroed its own)."""
    script = tmp_path / "reinplace.py"  # a file: @triton.jit reads its kernel's source
    script.write_text(TARGET_ONLY + _REINPLACE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=sm90_compile_env(tmp_path), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"zeros": 1, "empty": 1, "clones": [[], [], []], "pairs": 1}, got


def test_a_plan_whose_kernel_states_no_launches_refuses():
    from fp4_dispatch.engine.plans import DensePlan

    cand = types.SimpleNamespace(backend="stand-in", tactic=types.SimpleNamespace(swap_ab=False))
    plan = DensePlan((1, 8, 32, "bfloat16", "w4a16"), cand, lambda ops, out: None)
    with pytest.raises(NotTraceable, match="stand-in: its kernel states no launches"):
        plan.trace((None,) * 5)


@pytest.mark.parametrize("switch", ["1", None, "0"])
def test_on_the_cpu_a_compiled_layer_keeps_the_op(caplog, monkeypatch, switch):
    """The rule runs under torch.compile (aot_eager) and keeps the opaque op on a CPU
    (on by default), and everywhere with ``FP4_DISPATCH_INDUCTOR=0``; the compiled layer
    computes the eager bits."""
    if switch is None:
        monkeypatch.delenv("FP4_DISPATCH_INDUCTOR", raising=False)
    else:
        monkeypatch.setenv("FP4_DISPATCH_INDUCTOR", switch)
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.engine import inductor
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    monkeypatch.setattr(inductor, "_logged", set())  # each outcome is logged once a process
    d = Dispatcher(device="cpu")
    layer = Nvfp4Linear.from_linear(torch.nn.Linear(64, 24, dtype=torch.bfloat16),
                                    dispatcher=d, activations="bf16")  # fmt: skip
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad(), caplog.at_level(logging.INFO, "fp4_dispatch.engine.inductor"):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, eager)
    why = "FP4_DISPATCH_INDUCTOR=0" if switch == "0" else "device cpu"
    assert f"kept as a custom op: {why}" in caplog.text


# ---- side plans: a candidate that states its launches where the pick does not -------------


class _RefKernel:
    """A W4A16 kernel computing the reference (``wrong``: twice it)."""

    def __init__(self, wrong: bool) -> None:
        self.wrong = wrong

    def __call__(self, operands, out: torch.Tensor) -> None:
        from fp4_dispatch.backends.reference import gemm_dense

        gemm_dense(operands, out, "float32", 0)
        if self.wrong:
            out.mul_(2)


class _TracingKernel(_RefKernel):
    trace = staticmethod(contextlib.nullcontext)


def _w4a16_backend(name: str, est_us: float, traces: bool, wrong: bool = False,
                   declares: bool | None = None):  # fmt: skip
    """A synthetic W4A16 family of one tactic with a fixed estimate; ``declares``: its
    ``states_launches`` (default: whether its kernel traces); an undeclared family's
    build fails the test."""
    from fp4_dispatch import Backend, Support, Tactic

    tactic_type = type(
        f"Tactic_{name}", (Tactic,),
        {"__annotations__": {"backend": Literal[name]}, "backend": name})  # fmt: skip

    class _Family(Backend):
        family = name
        version = "1"
        operations = ("w4a16",)
        states_launches = traces if declares is None else declares

        def supports(self, device) -> Support:
            return Support(True, "synthetic")

        def tactics(self, problem, device):
            yield tactic_type(tile_m=64, tile_n=64)

        def estimate_us(self, problem, device, tactic) -> float:
            return est_us

        def build(self, tactic, problem, device):
            assert declares is not False, f"{name}: built though it states no launches"
            return (_TracingKernel if traces else _RefKernel)(wrong)

    _Family.name, _Family.tactic_type = name, tactic_type
    return _Family()


@pytest.fixture
def side_dispatcher(monkeypatch):
    """``side_dispatcher(*backends)``: a CPU dispatcher over these families alone (each an
    external plugin, so a kernel's first run is checked against the reference)."""
    from test_tuning import make_registry

    import fp4_dispatch.loading.registry as registry_mod
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.engine import inductor

    monkeypatch.setattr(inductor, "_logged", set())

    def make(*backends):
        monkeypatch.setattr(registry_mod, "load", lambda strict=None: make_registry(*backends))
        return Dispatcher(device="cpu", cache=False, verify_plugins=True)

    return make


SIDE_KEY = (2, 64, 128, "bfloat16", "w4a16")


@pytest.mark.parametrize(
    ("families", "side"),
    [
        # the best that states launches, if its call (GPU time, or 5 µs of host time
        # at least) beats the pick's through the op (37 µs of host time at least)
        ([("pick", 10, False), ("near", 35, True), ("far", 36, True)], "near"),
        ([("pick", 10, False), ("far", 38, True)], None),
        # GPU-bound: the op's host time is hidden, only a faster kernel would pay
        ([("pick", 60, False), ("slower", 61, True)], None),
        # a wrong first run is recorded and passed over for the next
        ([("pick", 10, False), ("wrong", 20, True, True), ("near", 33, True)], "near"),
        ([("pick", 10, False), ("wrong", 20, True, True)], None),
        # a family that does not declare `states_launches` is never built for one
        ([("pick", 10, False), ("undeclared", 20, True, False, False)], None),
    ],
)
def test_a_side_plan_is_the_best_candidate_that_states_launches_and_runs_right(
    side_dispatcher, families, side
):
    from fp4_dispatch.engine import inductor

    d = side_dispatcher(*(_w4a16_backend(*f) for f in families))
    plan = inductor._side_plan(d, SIDE_KEY, torch.bfloat16, torch.bfloat16)
    if side is None:
        assert plan is None
    else:
        assert plan.candidate.backend == side and plan.warm and plan.key == SIDE_KEY
        assert d.cached_plan(*SIDE_KEY) is not plan  # kept beside the dispatcher's plans
    assert inductor._side_plan(d, SIDE_KEY, torch.bfloat16, torch.bfloat16) is plan  # once
    wrong = [f.backend for f in d.faults if f.call == "kernel() result"]
    assert wrong == (["wrong"] if any(f[0] == "wrong" for f in families) else [])
    assert not [f for f in d.faults if f.call == "build()"], d.faults


@pytest.mark.parametrize("graphs", [False, True])
def test_the_rule_states_the_side_plan_unless_a_cuda_graph_replays_the_step(
    side_dispatcher, monkeypatch, graphs
):
    """Past `_why_opaque` (which a CPU never passes): the dispatcher's warm pick, whose
    kernel states no launches, is stated by its side plan in the default mode and kept
    (as the opaque op) under ``mode="reduce-overhead"``."""
    from torch._inductor import config

    from fp4_dispatch.engine import inductor
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    d = side_dispatcher(_w4a16_backend("pick", 10, False), _w4a16_backend("near", 35, True))
    monkeypatch.setattr(inductor, "_why_opaque", lambda a, b: None)
    m, n, k = SIDE_KEY[:3]
    a, qb = torch.randn(m, k, dtype=torch.bfloat16), quantize_nvfp4(torch.randn(n, k))
    with config.patch({"triton.cudagraphs": graphs}):
        plan = inductor._traceable_plan(a, qb.data, torch.bfloat16, -1, lambda did, dev: d)
    assert plan.candidate.backend == ("pick" if graphs else "near") and plan.warm
    assert d.cached_plan(*SIDE_KEY).candidate.backend == "pick"


_CLOSURE = (
    TARGET_ONLY
    + r"""
import types
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as closure,
)
from fp4_dispatch.backends.triton_launch import CachedLauncher
from fp4_dispatch.backends.sm90 import gemm_w4a16 as w, gemm_w4a16_decode as dec
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mma
from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs, gemm_w4a16_ws as ws


def copied(kernel):
    # what Inductor compiles: the kernel's source and its dependencies, in a new module;
    # torch 2.11 embeds it in a triple-quoted string unescaped: no backslash may be in it
    text = closure(kernel)
    assert "\\" not in text, [line for line in text.splitlines() if "\\" in line][:3]
    src = "import triton\nimport triton.language as tl\n@triton.jit\n" + text
    mod = types.ModuleType("inductor_copy_" + kernel.__name__)
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], mod.__name__ + ".py")
    with open(path, "w") as f:
        f.write(src)
    mod.__file__ = path
    sys.modules[mod.__name__] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return getattr(mod, kernel.__name__)


def rebind(kobj):
    # the kernel's bindings, on Inductor's copy (launch_pdl dropped, as a traced launch)
    original = kobj._binding

    def bind(*args):
        b = original(*args)
        options = {k: v for k, v in b.options.items() if k != "launch_pdl"}
        return CachedLauncher(copied(b.owner.kernel)).bind(b.constexprs, b.num_warps, **options)

    kobj._binding = bind


out = {}
kernels = {
    "gemv": dec.build_gemv(dec.W4A16GemvConfig()),
    "gemv-splitk": dec.build_gemv(dec.W4A16GemvConfig(split_k=4)),
    "direct-splitk": w.build(w.W4A16Config(block_n=64, block_m=16, split_k=2)),
}
assert mma.build(mma.MmaConfig()).trace is None  # Gluon: Inductor copies it as @triton.jit
for name, kobj in kernels.items():
    assert kobj.trace is not None, name
    rebind(kobj)
    compiled = kobj.precompile(1, 4096, 4096, torch.bfloat16)
    out[name] = len(compiled.asm["cubin"])
assert rs.RsKernel.trace is None and ws.W4A16WsKernel.trace is None  # TMA, maxnreg

# what functionalization clones per call: the tensors the kernel's TTIR writes
from torch._higher_order_ops import triton_kernel_wrap as tkw
from triton.compiler import ASTSource


def triton_type(dtype):
    return {torch.bfloat16: "bf16", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
            torch.float32: "fp32", torch.int32: "i32"}[dtype]  # fmt: skip

from fp4_dispatch.backends import triton_launch
from fp4_dispatch.format.nvfp4 import swizzled_scale_shape


class Wrap:
    def __init__(self):
        self.seen = []

    def __call__(self, kernel):
        self.kernel = kernel
        return self

    def __getitem__(self, grid):
        return lambda **kw: self.seen.append((self.kernel, kw))


m, n, k = 16, 4096, 4096
ops = w.W4A16Operands(torch.empty(m, k, dtype=torch.bfloat16),
                      torch.empty(n, k // 2, dtype=torch.uint8),
                      torch.empty(swizzled_scale_shape(n, k), dtype=torch.float8_e4m3fn),
                      torch.ones(1), bias=torch.empty(n, dtype=torch.bfloat16))
triton_launch._is_traced = lambda t: True  # plain CPU tensors stand in for traced ones
writes = {}
for name in ("gemv-splitk", "direct-splitk"):
    wrap = Wrap()
    with triton_launch.tracing(wrap):
        kernels[name](ops, torch.empty(m, n, dtype=torch.bfloat16))
    (kernel, kw), = wrap.seen
    kw = {key: v for key, v in kw.items() if key not in ("num_warps", "num_stages")}
    find = getattr(tkw, "identify_accessed_tensors", None)
    if find is not None:
        found = [d.name for d in find(kernel, kw, {}).read_writes.writes]
    else:
        found = tkw.identify_mutated_tensors(kernel, kw, {})
    writes[name] = sorted(found)
    # torch 2.11's analysis compiles the kernel with every non-tensor argument as a
    # constant: the kernel must compile that way too (else it assumes all inputs written)
    names = list(kernel.arg_names)
    signature = {a: (f"*{triton_type(kw[a].dtype)}" if isinstance(kw[a], torch.Tensor)
                     else "constexpr") for a in names}  # fmt: skip
    constants = {(i,): kw[a] for i, a in enumerate(names) if signature[a] == "constexpr"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.compiler.make_backend(target)
    options = backend.parse_options({})
    context = triton._C.libtriton.ir.context()
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options),
                   backend.get_module_map(), context)  # fmt: skip
out["writes"] = writes
print(json.dumps(out))
"""
)


def test_inductors_copy_of_each_tracing_w4a16_kernel_compiles_for_sm90(tmp_path):
    """Inductor compiles a user kernel from a copy of its source and dependencies (only
    ``@triton.jit`` functions and constants named without a module prefix come along):
    the copy of every W4A16 kernel that states its launches compiles for sm_90 on a CPU
    (Triton's ptxas, no launch) with the bindings a decode call uses; and a stated launch
    writes only the output and the split-K scratch (what functionalization clones), found
    with every integer argument taken as a constant as torch 2.11 does; the copy holds no
    backslash (torch 2.11 pastes it into its module unescaped)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _CLOSURE], capture_output=True, text=True,
                          env=sm90_compile_env(tmp_path), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    writes = got.pop("writes")
    assert set(got) == {"gemv", "gemv-splitk", "direct-splitk"}
    assert all(size > 1000 for size in got.values()), got
    # functionalization clones what a launch writes: the output and split-K scratch,
    # never the weight, its scales or the activations (a clone a call)
    for name, found in writes.items():
        assert found == ["cnt_ptr", "out_ptr", "ws_ptr"], (name, found)


# ---- on an sm90 GPU -----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_compiled_graph_caches():
    """Every compile here runs the rule: Inductor's FX-graph and AOTAutograd caches would
    serve a graph compiled earlier with another switch (their keys do not hold it)."""
    import torch._functorch.config as aot_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), aot_config.patch(enable_autograd_cache=False):
        yield


def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "bias"), [(1, False), (16, True)])
def test_a_compiled_layer_launches_the_plans_kernel_itself(m, bias, monkeypatch):
    """`Nvfp4Linear` W4A16 under torch.compile (default mode): the generated code launches
    a Triton kernel and never calls the op - the plan's own where its kernel states its
    launches (the direct kernel at 16 tokens), else its side plan's (at one token, beside
    the Gluon pick) - with that kernel's eager bits on fresh inputs; under reduce-overhead
    the pick itself (the op where it is opaque), with the eager bits."""
    _sm90()
    from torch._inductor.utils import run_and_get_code

    from fp4_dispatch import Dispatcher
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    monkeypatch.delenv("FP4_DISPATCH_INDUCTOR", raising=False)  # on by default
    dev = torch.device("cuda")
    torch.manual_seed(m)
    lin = torch.nn.Linear(4096, 4096, bias=bias, device=dev, dtype=torch.bfloat16)
    d = Dispatcher(cache=False)
    layer = Nvfp4Linear.from_linear(lin, dispatcher=d, prepare_weight=False)
    xs = [torch.randn(m, 4096, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    with torch.inference_mode():
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        y, code = run_and_get_code(compiled, xs[0])
        text = "\n".join(code)
        plan = w4a16_plan(d, m, 4096, 4096)
        stated = inductor_stated_plan(d, m, 4096, 4096)
        assert (stated is plan) is (m == 16), (plan, stated)
        assert "fp4_dispatch.gemm_w4a16" not in text, text[-3000:]
        names = {bound.owner.name for bound in stated.kernel._bound.values()}
        assert any(name in text for name in names), (names, text[-3000:])
        assert torch.equal(y, run_plan(stated, layer, xs[0]))
        for x in xs:
            assert torch.equal(compiled(x), run_plan(stated, layer, x))
        torch._dynamo.reset()
        graphed = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            for x in xs:
                assert torch.equal(graphed(x.clone()), layer(x))


@pytest.mark.gpu
def test_a_compiled_stack_of_split_k_layers_shares_one_scratch_pair(monkeypatch):
    """Two 16-token W4A16 layers whose plans split K (the direct kernel) compiled as one
    graph: its code zero-fills the split-K counters once and allocates one partials
    buffer for both launches, clones nothing (Inductor ran both kernels on the pair in
    place), and computes the eager bits call after call (each kernel leaves the counters
    zero for the next)."""
    _sm90()
    import re

    from torch._inductor.utils import run_and_get_code

    from fp4_dispatch import Dispatcher
    from fp4_dispatch.engine import inductor
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    monkeypatch.delenv("FP4_DISPATCH_INDUCTOR", raising=False)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    d = Dispatcher(cache=False)
    stack = torch.nn.Sequential(
        *(Nvfp4Linear.from_linear(torch.nn.Linear(4096, 4096, device=dev, dtype=torch.bfloat16),
                                  dispatcher=d, prepare_weight=False) for _ in range(2))
    )  # fmt: skip
    xs = [torch.randn(16, 4096, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    with torch.inference_mode():
        torch._dynamo.reset()
        compiled = torch.compile(stack, fullgraph=True)
        y, code = run_and_get_code(compiled, xs[0])
        plan = w4a16_plan(d, 16, 4096, 4096)
        split = getattr(getattr(plan.kernel, "cfg", None), "split_k", 1)
        assert inductor._states_launches(plan) and split > 1, (plan, split)
        text = "\n".join(code)
        call = text[text.index("def call(") :]
        launched = re.findall(r"^\s*(\w+)\.run\(", call, flags=re.M)
        assert sum("zeros" in name for name in launched) == 1, launched
        assert not any("clone" in name or "copy" in name for name in launched), launched
        assert len([n for n in launched if "w4a16" in n]) == 2, launched
        assert len(re.findall(r"empty_strided_cuda\(\(\d+, \), \(1, \), torch.float32", call)) == 1
        for x in xs:
            ref = run_plan(plan, stack[1], run_plan(plan, stack[0], x))
            assert torch.equal(compiled(x), ref)
        assert torch.equal(y, run_plan(plan, stack[1], run_plan(plan, stack[0], xs[0])))


@pytest.mark.gpu
def test_with_fp4_dispatch_inductor_0_the_compiled_layer_keeps_the_op(monkeypatch):
    _sm90()
    from torch._inductor.utils import run_and_get_code

    from fp4_dispatch import Dispatcher
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    monkeypatch.setenv("FP4_DISPATCH_INDUCTOR", "0")
    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 1024, device=dev, dtype=torch.bfloat16)
    layer = Nvfp4Linear.from_linear(lin, dispatcher=Dispatcher(cache=False))
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch._dynamo.reset()
        y, code = run_and_get_code(torch.compile(layer, fullgraph=True), x)
        assert "fp4_dispatch.gemm_w4a16" in "\n".join(code)
        assert torch.equal(y, layer(x))
