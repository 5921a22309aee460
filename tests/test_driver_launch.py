"""Eager launches through the CUDA driver (`fp4_dispatch.backends.driver_launch`) and the
plans' replays (`fp4_dispatch.engine.plans`).

On a CPU: the argument buffer packed from a Triton signature (read back through the
parameter pointers a fake driver receives), the parameter check against the cubin's
count and sizes, the launch attributes Triton's launcher would set, what a recording
refuses (torch operations, temporaries, TMA descriptors), the patching of per-call
addresses (offsets inside a tensor kept), the plan's replay bookkeeping and the layer's
fast call. On an H200 (``-m gpu``): replays are bit-identical to Triton's launches for
every sm90 decode path, in eager calls, CUDA-graph replays and torch.compile.
"""

from __future__ import annotations

import ctypes
import math
import struct
import types
from collections.abc import Callable

import pytest
import torch
from conftest import inductor_stated_plan, run_plan

from fp4_dispatch.backends import driver_launch as dl
from fp4_dispatch.backends import triton_launch as tlaunch
from fp4_dispatch.engine.op_fast import public_gemm_key
from fp4_dispatch.engine.plans import DensePlan, Plan


class _Enum:
    def __getattr__(self, name: str) -> str:
        return name


class FakeDriver:
    """Stands in for ``cuda.bindings.driver``: parameter sizes of one fake cubin, and
    every launch's parameter bytes read through the void* array it is handed."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.launches: list[tuple[object, list[bytes]]] = []
        self.CUlaunchAttributeID = _Enum()
        self.CUclusterSchedulingPolicy = _Enum()

    def CUfunction(self, handle):
        return ("fn", handle)

    def CUlaunchConfig(self):
        return types.SimpleNamespace()

    def CUlaunchAttribute(self):
        value = types.SimpleNamespace(clusterDim=types.SimpleNamespace())
        return types.SimpleNamespace(value=value)

    def cuFuncGetParamInfo(self, function, index):
        if index >= len(self.sizes):
            return (1, 0, 0)  # CUDA_ERROR_INVALID_VALUE
        return (0, 8 * index, self.sizes[index])

    def cuLaunchKernelEx(self, config, function, params, extra):
        ptrs = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        raw = [ctypes.string_at(ptrs[i], size) for i, size in enumerate(self.sizes)]
        self.launches.append((config, raw))
        return (0,)


def fake_compiled(signature: dict[str, str], **meta) -> object:
    base = {"name": "k", "shared": 1024, "num_warps": 4, "num_ctas": 1, "launch_pdl": False,
            "launch_cooperative_grid": False, "global_scratch_size": 0,
            "profile_scratch_size": 0}  # fmt: skip
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature),
                                 metadata=types.SimpleNamespace(**{**base, **meta}),
                                 function=0xF00)  # fmt: skip


SIGNATURE = {"x": "*bf16", "out": "*fp32", "n": "i32", "BLOCK": "constexpr", "scale": "fp32",
             "big": "i64", "flag": "i1"}  # fmt: skip
SIZES = [8, 8, 4, 4, 8, 1, 8, 8]  # the cubin: 6 parameters + Triton's two scratch pointers


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(SIZES)
    monkeypatch.setattr(dl, "_cu", fake)
    monkeypatch.setattr(dl, "_raw_stream", lambda device: 9)  # a CPU torch has none
    return fake


def test_arguments_are_packed_as_triton_declares_them(driver):
    """Pointers as 8-byte addresses, i32 4 bytes, fp32 a 4-byte float, i64 8 bytes, i1
    one byte; the constexpr is not a parameter; two null scratch pointers follow."""
    args = (0x1000, 0x2000, 77, 128, 0.5, 2**40, True)
    launch = dl.DriverLaunch.describe(fake_compiled(SIGNATURE), (3, 2), args)
    assert isinstance(launch, dl.DriverLaunch), launch
    launch.launch(stream=5)
    config, raw = driver.launches[-1]
    got = [struct.unpack(f, b)[0] for f, b in zip("QQifqbQQ", raw, strict=True)]
    assert got == [0x1000, 0x2000, 77, 0.5, 2**40, 1, 0, 0]
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
    assert (config.blockDimX, config.sharedMemBytes, config.hStream) == (128, 1024, 5)
    assert launch.pointer_slots == {0: 0, 1: 8}


def test_pdl_cooperative_and_cluster_attributes_follow_the_metadata(driver):
    compiled = fake_compiled(SIGNATURE, launch_pdl=True, launch_cooperative_grid=True, num_ctas=2)
    launch = dl.DriverLaunch.describe(compiled, (3,), (1, 2, 3, 4, 0.0, 5, False))
    ids = [a.id for a in launch.config.attrs]
    assert ids == ["CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION",
                   "CU_LAUNCH_ATTRIBUTE_COOPERATIVE", "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION",
                   "CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE"]  # fmt: skip
    assert launch.config.numAttrs == 4
    assert launch.config.gridDimX == 6  # Triton multiplies grid x by the CTAs of a cluster


@pytest.mark.parametrize(
    ("sizes", "signature", "meta", "why"),
    [
        ([*SIZES, 8], SIGNATURE, {}, "more than"),
        ([8, 8, 4, 8, 8, 1, 8, 8], SIGNATURE, {}, "the cubin says 8 bytes"),
        (SIZES, {**SIGNATURE, "x": "tensordesc<bf16[64, 64]>"}, {}, "TMA descriptors"),
        (SIZES, SIGNATURE, {"global_scratch_size": 64}, "scratch"),
        (SIZES, {**SIGNATURE, "scale": "bf16"}, {}, "has type bf16"),
    ],
)
def test_what_cannot_be_described_is_refused(monkeypatch, sizes, signature, meta, why):
    """A parameter list that disagrees with the cubin, a TMA descriptor, Triton scratch or
    an unpackable type: a reason, never a launch with a wrong buffer."""
    monkeypatch.setattr(dl, "_cu", FakeDriver(sizes))
    got = dl.DriverLaunch.describe(fake_compiled(signature, **meta), (1,),
                                   (1, 2, 3, 4, 0.5, 5, True))  # fmt: skip
    assert isinstance(got, str) and why in got, got


def _note(compiled, args, alive=None):
    frozen = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    return (compiled, (1,), frozen, alive or [None] * len(args))


def _record(per_call, fixed, notes, body: Callable[[], object] = lambda: None):
    """`record_launches` over `body`, with `notes` as what the call launched."""

    class Noted:
        def __enter__(self):
            return notes

        def __exit__(self, *exc):
            return False

    real = tlaunch.recording
    tlaunch.recording = Noted
    try:
        with dl.record_launches("test", per_call, fixed) as rec:
            body()
    finally:
        tlaunch.recording = real
    return rec


def test_per_call_addresses_are_patched_with_their_offsets(driver):
    """A replay writes each per-call tensor's new address, plus the offset the recorded
    call used inside it (a kernel may get a view 16 bytes in), into every launch."""
    x, out, w = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    args = (x[4:], out, 7, 128, 1.0, w.data_ptr(), True)  # x 16 bytes in; w as a fixed operand
    notes = [_note(fake_compiled(SIGNATURE), args, [None, None, None, None, None, None, None])]
    rec = _record([x, out], [w], notes)
    assert rec.replay is not None, rec.why
    x2, out2 = torch.zeros(64), torch.zeros(64)
    assert rec.replay([x2, out2]) is True
    config, raw = driver.launches[-1]
    assert config.hStream == 9
    assert struct.unpack("Q", raw[0])[0] == x2.data_ptr() + 16
    assert struct.unpack("Q", raw[1])[0] == out2.data_ptr()


def test_per_call_tensors_cut_from_one_block_are_patched_separately(driver):
    """Two per-call tensors that share one storage (quantize's outputs) are told apart by
    their own extents: a replay given separate blocks writes each its own address."""
    block = torch.zeros(64)
    data, scale = block[:16], block[32:48]
    args = (data, scale, 7, 128, 1.0, 0, True)
    notes = [_note(fake_compiled(SIGNATURE), args, [None] * 7)]
    rec = _record([data, scale], [], notes)
    assert rec.replay is not None, rec.why
    data2, scale2 = torch.zeros(16), torch.zeros(16)
    assert rec.replay([data2, scale2]) is True
    _, raw = driver.launches[-1]
    assert struct.unpack("Q", raw[0])[0] == data2.data_ptr()
    assert struct.unpack("Q", raw[1])[0] == scale2.data_ptr()


def test_a_recording_refuses_torch_operations_and_temporaries(driver):
    """A call that ran a torch operation (an ``add_`` a replay would skip), or passed a
    tensor that did not outlive the call (a temporary's memory is freed), is not replayed;
    views are allowed."""
    x, out = torch.zeros(8), torch.zeros(8)
    notes = [_note(fake_compiled(SIGNATURE), (x, out, 1, 128, 1.0, 2, True))]
    rec = _record([x, out], [], notes, body=lambda: out.add_(1))
    assert rec.replay is None and "add_" in rec.why
    rec = _record([x, out], [], list(notes), body=lambda: x.view(2, 4).t())
    assert rec.replay is not None, rec.why
    temp = torch.zeros(8)
    alive = [None, __import__("weakref").ref(temp)] + [None] * 5
    notes = [_note(fake_compiled(SIGNATURE), (x, temp, 1, 128, 1.0, 2, True), alive)]
    del temp
    rec = _record([x, out], [], notes)
    assert rec.replay is None and "temporary" in rec.why


def test_recording_notes_launches_without_keeping_tensors_alive():
    """`triton_launch.recording` notes a `BoundLaunch`'s arguments as addresses and weak
    references (a temporary noted there is still freed after the call)."""

    class Kernel:
        arg_names = ("x", "n", "BLOCK")
        fn = types.SimpleNamespace(__name__="k")

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    bound = tlaunch.CachedLauncher(Kernel()).bind({"BLOCK": 4})
    bound.owner.fast = False  # the uncompiled path: nothing is launched here
    x = torch.zeros(4)
    with tlaunch.recording() as notes:
        bound((1,), (x, 3))
    (compiled, grid, frozen, alive) = notes[0]
    assert (compiled, grid, frozen) == (None, (1,), (x.data_ptr(), 3, 4))
    del x
    assert alive[0]() is None
    with pytest.raises(RuntimeError, match="already active"), tlaunch.recording():
        tlaunch.recording().__enter__()


class _Kernel:
    """A plan's kernel that counts its calls and records with a fake recorder."""

    alpha_factors = True

    def __init__(self) -> None:
        self.calls = 0
        self.replayed: list = []

    def __call__(self, operands, out) -> None:
        self.calls += 1

    def record(self, name, per_call, fixed):
        kernel = self

        class Rec:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.replay = lambda tensors: kernel.replayed.append(tensors) or True
                return False

        return Rec()


def _candidate():
    tactic = types.SimpleNamespace(swap_ab=False)
    return types.SimpleNamespace(tactic=tactic, backend="b")


def test_a_warm_plan_records_once_per_weight_then_replays():
    """Cold: the kernel. Warm: the first call per fixed-operand set is recorded (and runs),
    later ones replay; another weight records again; an unaligned activation, or
    ``FP4_DISPATCH_REPLAY=0``, runs the kernel."""
    kernel = _Kernel()
    plan = DensePlan((1, 8, 32, "bfloat16", "w4a16"), _candidate(), kernel)
    a, out = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16)
    w1, w2, sb, alpha = (
        torch.zeros(8, 16, dtype=torch.uint8),
        torch.zeros(8, 16),
        torch.zeros(4),
        torch.ones(1),
    )
    plan.run((a, w1, sb, alpha, out, None, None))
    assert kernel.calls == 1 and not plan.replays
    plan.warm = True
    plan.run((a, w1, sb, alpha, out, None, None))  # recorded: runs once more
    plan.run((a, w1, sb, alpha, out, None, None))  # replayed
    assert kernel.calls == 2 and len(kernel.replayed) == 1
    plan.run((a, w2, sb, alpha, out, None, None))  # another weight: a new recording
    assert kernel.calls == 3 and len(plan.replays) == 2
    odd = torch.zeros(1, 40, dtype=torch.bfloat16)[:, 1:33]
    plan.run((odd, w1, sb, alpha, out, None, None))
    assert kernel.calls == 4 and len(kernel.replayed) == 1


def test_replays_can_be_turned_off(monkeypatch):
    """``Dispatcher(replay=False)`` and ``FP4_DISPATCH_REPLAY=0`` make plans that never
    record; a bad value names the argument."""
    from fp4_dispatch import Dispatcher

    assert Plan((1, 8, 32, "bfloat16", "w4a4"), _candidate(), _Kernel(), False).record is None
    assert Dispatcher("cpu", cache=False, replay=False).replay is False
    monkeypatch.setenv("FP4_DISPATCH_REPLAY", "0")
    assert Dispatcher("cpu", cache=False).replay is False
    monkeypatch.setenv("FP4_DISPATCH_REPLAY", "1")
    assert Dispatcher("cpu", cache=False).replay is True
    with pytest.raises(TypeError, match="replay: expected a bool"):
        Dispatcher("cpu", cache=False, replay="yes")


def test_the_layer_fast_call_checks_everything_it_was_recorded_with():
    """`_FastCall` runs only for the same input signature, weight objects and version,
    bias, plan epoch and no autotuning; else None (the ordinary path)."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear, _FastCall

    layer = Nvfp4Linear(32, 8, bias=True)
    seen = []
    d = types.SimpleNamespace(plan_epoch=0, _autotune_depth=0)
    x = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    y = torch.zeros(1, 8, dtype=torch.bfloat16)  # the GEMM's 2-D output: the call gives x's rank
    fast = _FastCall(x, y, lambda t: seen.append(t) or True, d, layer._buffers, layer.bias, None)
    bufs, bias = layer._buffers, layer.bias
    got = fast(x, bufs, bias)
    assert got is not None and got.shape == (1, 1, 8) and len(seen) == 1
    assert fast(torch.zeros(2, 1, 32, dtype=torch.bfloat16), bufs, bias) is None
    assert fast(x.float(), bufs, bias) is None
    assert fast(x, bufs, None) is None
    d.plan_epoch = 1
    assert fast(x, bufs, bias) is None
    d.plan_epoch, d._autotune_depth = 0, 1
    assert fast(x, bufs, bias) is None
    d._autotune_depth = 0
    layer.weight_data.add_(1)  # an in-place change: the version counter moves
    assert fast(x, bufs, bias) is None
    assert len(seen) == 1


def test_the_w4a4_fast_call_quantizes_then_replays_the_gemm():
    """`_FastCallW4A4`: the kept quantize's outputs go to the GEMM replay in the plan's
    per-call order (a, sa, alpha, out), the bias is added after; a quantize or replay
    that declines, another ``input_global_scale`` object or a mismatched input give None
    (the ordinary path)."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear, _FastCallW4A4

    layer = Nvfp4Linear(32, 8, bias=True, activations="nvfp4")
    layer.bias.data.fill_(0.5)
    d = types.SimpleNamespace(plan_epoch=0, _autotune_depth=0)
    x = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    y = torch.zeros(2, 8, dtype=torch.bfloat16)
    q_out = (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(128, 4), torch.ones(()))
    quantized, replayed = [], []
    answers = {"quantize": True, "replay": True}

    def quantize(t):
        quantized.append(t)
        return q_out if answers["quantize"] else None

    def replay(tensors):
        replayed.append(tensors)
        tensors[3].fill_(1.0)
        return answers["replay"]

    bufs, bias = layer._buffers, layer.bias
    fast = _FastCallW4A4(x, y, replay, d, bufs, bias, quantize, bufs["input_global_scale"])
    got = fast(x, bufs, bias)
    assert got.shape == (2, 1, 8) and torch.equal(got, torch.full_like(got, 1.5))
    assert quantized == [x] and replayed[0][:3] == q_out and replayed[0][3] is got
    answers["quantize"] = False
    assert fast(x, bufs, bias) is None and len(replayed) == 1
    answers["quantize"], answers["replay"] = True, False
    assert fast(x, bufs, bias) is None and len(replayed) == 2
    answers["replay"] = True
    layer.set_input_global_scale(0.01)  # a new buffer object: the kept replay read the old
    assert fast(x, bufs, bias) is None
    layer.set_input_global_scale(None)
    assert fast(torch.zeros(3, 1, 32, dtype=torch.bfloat16), bufs, bias) is None
    assert len(replayed) == 2


def test_kept_quantize_is_only_a_recorded_one_launch_replay(monkeypatch):
    """`kept_quantize` (the quantize kernel's kept replay) returns nothing before a replay
    is recorded, for a Python-float scale, a two-launch plan or with replays off; a kept
    one allocates the three outputs and patches (x, data, scale, g_out, g) in
    `_quantize`'s order, the given scale tensor as the last pointer (else x)."""
    from fp4_dispatch.backends import quantize as qk

    monkeypatch.setattr(qk, "_plans", {})
    monkeypatch.setattr(qk, "_replays", {})
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    g = torch.tensor(0.5)
    assert qk.kept_quantize(x, None) is None  # no plan yet
    plan = types.SimpleNamespace(amax_grid=None, scale_shape=(128, 4))
    qk._plans[(1, 64, "swizzled", "dynamic")] = plan
    qk._plans[(1, 64, "swizzled", "tensor")] = plan
    assert qk.kept_quantize(x, None) is None  # no replay recorded yet
    seen = []
    replay = lambda tensors: seen.append(tensors) or True  # noqa: E731
    pkey, key, value = qk._launch_key(x, None)
    qk._replays[(pkey, key, value, None)] = replay
    pkey, key, value = qk._launch_key(x, g)
    qk._replays[(pkey, key, value, None)] = replay
    kept = qk.kept_quantize(x, None)
    data, scale, g_out = kept(x)
    assert data.shape == (1, 32) and data.dtype == torch.uint8
    assert scale.shape == (128, 4) and scale.dtype == torch.float8_e4m3fn
    assert g_out.shape == () and g_out.dtype == torch.float32
    assert seen[-1][0] is x and seen[-1][4] is x and seen[-1][1] is data
    qk.kept_quantize(x, g)(x)
    assert seen[-1][4] is g
    monkeypatch.setenv("FP4_DISPATCH_REPLAY", "0")  # turned off after it was kept
    assert kept(x) is None and len(seen) == 2
    monkeypatch.delenv("FP4_DISPATCH_REPLAY")
    assert qk.kept_quantize(x, 0.5) is None  # a float scale is baked into its recording
    monkeypatch.setenv("FP4_DISPATCH_REPLAY", "0")
    assert qk.kept_quantize(x, None) is None
    monkeypatch.delenv("FP4_DISPATCH_REPLAY")
    plan.amax_grid = (4, 1)  # partial maxima in a temporary: never replayed
    assert qk.kept_quantize(x, None) is None
    from fp4_dispatch.format.nvfp4 import kept_quantize

    plan.amax_grid = None
    assert kept_quantize(x, None) is None  # the format layer's entry: CUDA tensors only


def test_quantize_nvfp4_keeps_a_replayed_call_per_signature(monkeypatch):
    """`quantize_nvfp4` keeps the kernel's replay (`kept_quantize`) by call signature once
    one exists and later calls of that signature take it, reading the caller's scale
    tensor; a declining replay (a launch hook, or replays turned off: the kept object's
    own rule), another layout, ``check_finite`` or ``encode_scale`` take the ordinary
    path. (On a CPU the signature is faked: CUDA tensors only have one.)"""
    from fp4_dispatch.format import nvfp4

    monkeypatch.setattr(nvfp4, "_kept_calls", {})
    monkeypatch.setattr(nvfp4, "_kept_key", lambda x, g: ("sig", tuple(x.shape)))
    x = torch.randn(2, 64)
    want = nvfp4.quantize_nvfp4(x)  # the ordinary path (no replay: nothing kept)
    assert nvfp4._kept_calls == {}
    calls, answer = [], {"ok": True}

    def kept(t, g=None):
        calls.append((t, g))
        return (want.data, want.scale, want.global_scale) if answer["ok"] else None

    monkeypatch.setattr(nvfp4, "kept_quantize", lambda t, g: kept)
    nvfp4.quantize_nvfp4(x)  # ordinary, then kept
    assert nvfp4._kept_calls == {("sig", (2, 64)): kept} and calls == []
    g = torch.tensor(0.5)
    got = nvfp4.quantize_nvfp4(x, g)
    assert calls == [(x, g)] and got.data is want.data and got.shape == (2, 64)
    answer["ok"] = False  # the replay declines (a launch hook): the ordinary path
    got = nvfp4.quantize_nvfp4(x)
    assert len(calls) == 2 and torch.equal(got.data, want.data) and got.data is not want.data
    answer["ok"] = True
    nvfp4.quantize_nvfp4(x, layout="linear")
    nvfp4.quantize_nvfp4(x, check_finite=True)
    nvfp4.quantize_nvfp4(x, encode_scale=2.0)
    assert len(calls) == 2


# ---- on the H200 --------------------------------------------------------------------------


def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")


def _graph_replays_equal(layer, xs: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Capture ``layer(static)`` (warmed on a side stream) and check that each replay with
    ``xs[i]`` copied in gives ``ref[i]`` bit for bit."""
    static = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(static)
        graph.capture_begin()
        out = layer(static)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    for x, r in zip(xs, ref, strict=True):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, r)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (8, 14336, 4096), (16, 4096, 14336)])
@pytest.mark.parametrize("operation", ["w4a16", "w4a4"])
def test_replays_are_bit_identical_to_triton_launches(m, n, k, operation):
    """The untuned pick of each decode shape, through `Dispatcher.gemm`: calls 3.. replay
    through `gemm`'s kept call (checked: the plan holds a replay and `gemm` kept it), and
    every output equals a replays-off dispatcher's bit for bit, for new activations each
    call."""
    _sm90()
    from fp4_dispatch import Dispatcher, quantize_nvfp4

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(m + n + k)
    qb = quantize_nvfp4(torch.randn(n, k, device=dev, generator=gen) / math.sqrt(k))
    off, on = Dispatcher(cache=False, replay=False), Dispatcher(cache=False, replay=True)
    for _ in range(5):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        a = x if operation == "w4a16" else quantize_nvfp4(x)
        want, got = off.gemm(a, qb), on.gemm(a, qb)
        assert torch.equal(got, want), (m, n, k, operation)
    plan = on.cached_plan(m, n, k, "bfloat16", operation)
    assert any(callable(r) for r in plan.replays.values()), (plan, plan.replays)
    assert on._public_fast.get(public_gemm_key(a, qb, None)) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_a_layer_replays_after_its_plan_ran_without_a_bias(k):
    """The serving suite's M = 1 gap: an M = 1 plan whose kernel first ran for
    `Dispatcher.gemm` (no bias) and then for a layer with a bias (a ``do_not_specialize``
    flag, another `specialization_key`) recorded the layer's call as launched through
    "Triton's uncached path" and never replayed it. The layer must keep its fast call,
    with the outputs of the replays-off layer."""
    _sm90()
    from fp4_dispatch import Dispatcher, quantize_nvfp4
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    dev = torch.device("cuda")
    lin = torch.nn.Linear(k, 4096, bias=True, device=dev, dtype=torch.bfloat16)
    lin.requires_grad_(False)
    d = Dispatcher(cache=False, replay=True)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    qb = quantize_nvfp4(lin.weight.float())
    for _ in range(3):  # the M = 1 plan warm, its keyed launch made without a bias
        d.gemm(x, qb)
    layer = Nvfp4Linear.from_linear(lin, dispatcher=d)
    plain = Nvfp4Linear.from_linear(lin, dispatcher=Dispatcher(cache=False, replay=False))
    xs = [torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    with torch.inference_mode():
        for x in xs:
            assert torch.equal(layer(x), plain(x))
        assert layer.__dict__.get("_fast") is not None


@pytest.mark.gpu
def test_the_layer_fast_call_in_eager_graphs_and_compile():
    """`Nvfp4Linear` (W4A16 on the H200) at 1x1x4096 -> 14336: the fast call is kept and
    its outputs equal the replays-off layer's, eagerly, replayed from a CUDA graph and
    under torch.compile with CUDA graphs (reduce-overhead); in default mode they equal
    the eager bits of the plan Inductor launches (at one token the Gluon pick's side
    plan: another kernel, docs/launch.md). Inductor launches it itself, so the op and
    its fast call are not called there (tests/test_inductor.py checks the code)."""
    _sm90()
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.engine.torch_ops import default_dispatcher
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 14336, device=dev, dtype=torch.bfloat16)
    layer = Nvfp4Linear.from_linear(lin)
    plain = Nvfp4Linear.from_linear(lin, dispatcher=Dispatcher(cache=False, replay=False))
    xs = [torch.randn(1, 1, 4096, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    with torch.inference_mode():
        ref = [plain(x).clone() for x in xs]
        for x, r in zip(xs, ref, strict=True):
            assert torch.equal(layer(x), r)
        assert layer.__dict__.get("_fast") is not None
        _graph_replays_equal(layer, xs, ref)
        for mode in ("default", "reduce-overhead"):
            compiled = torch.compile(layer, mode=mode)
            want = ref
            if mode == "default":  # after one compiled call the launched plan is known
                compiled(xs[0].clone())
                stated = inductor_stated_plan(default_dispatcher(dev), 1, 14336, 4096)
                want = [run_plan(stated, layer, x.reshape(1, 4096)).reshape(r.shape)
                        for x, r in zip(xs, ref, strict=True)]  # fmt: skip
            for _ in range(3):
                for x, r in zip(xs, want, strict=True):
                    assert torch.equal(compiled(x.clone()), r), mode


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("scale", ["dynamic", "tensor", "value"])
def test_quantize_replays_match_the_reference_and_capture(rows, scale):
    """`quantize_nvfp4` on the GPU: from its third call of a kind the launch is a replay
    (checked), every output equals the torch reference's bit for bit for new inputs
    each call, and a replayed quantize inside a CUDA graph gives the same bits."""
    _sm90()
    from fp4_dispatch import quantize_nvfp4
    from fp4_dispatch.backends import quantize as qk

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows)
    g = {"dynamic": None, "tensor": torch.tensor(0.01, device=dev), "value": 0.01}[scale]
    xs = [torch.randn(rows, 5120, device=dev, generator=gen).to(torch.bfloat16) for _ in range(4)]
    before = {k for k, v in qk._replays.items() if v is not None}
    for x in xs:
        got = quantize_nvfp4(x, g)
        want = quantize_nvfp4(x.cpu(), g if not isinstance(g, torch.Tensor) else g.cpu())
        assert torch.equal(got.data.cpu(), want.data), (rows, scale)
        assert torch.equal(got.scale.cpu().view(torch.uint8), want.scale.view(torch.uint8))
        assert torch.equal(got.global_scale.cpu(), want.global_scale)
    made = {k for k, v in qk._replays.items() if v is not None} - before
    plan = qk._plans[(rows, 5120, "swizzled", scale)]
    if plan.amax_grid is None:  # a two-launch dynamic plan (a temporary between) never replays
        assert made, "no quantize replay was recorded"
        if scale != "value":  # the public call kept it: calls 3 and 4 skipped the look-ups
            from fp4_dispatch.format import nvfp4

            assert nvfp4._kept_key(xs[0], g) in nvfp4._kept_calls
    static = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize_nvfp4(static, g)
    static.copy_(xs[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q.data, quantize_nvfp4(xs[1], g).data)


@pytest.mark.gpu
@pytest.mark.parametrize("static_scale", [False, True])
def test_the_w4a4_layer_fast_call_in_eager_and_graphs(static_scale):
    """`Nvfp4Linear(activations="nvfp4")` at 1x1x4096 -> 14336 with a bias, dynamic or
    static input scale: from the third call the layer keeps its W4A4 fast call (quantize
    and GEMM replays back to back), and every output equals a replays-off layer's bit
    for bit, eagerly and replayed from a CUDA graph."""
    _sm90()
    from fp4_dispatch import Dispatcher
    from fp4_dispatch.integrations.nn import Nvfp4Linear, _FastCallW4A4

    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 14336, device=dev, dtype=torch.bfloat16)
    made = [Nvfp4Linear.from_linear(lin, dispatcher=Dispatcher(cache=False, replay=r),
                                    activations="nvfp4") for r in (True, False)]  # fmt: skip
    layer, plain = made
    if static_scale:
        for q in made:
            q.set_input_global_scale(0.02)
    xs = [torch.randn(1, 1, 4096, device=dev, dtype=torch.bfloat16) for _ in range(5)]
    with torch.inference_mode():
        ref = [plain(x).clone() for x in xs]
        for x, r in zip(xs, ref, strict=True):
            assert torch.equal(layer(x), r)
        assert isinstance(layer.__dict__.get("_fast"), _FastCallW4A4)
        for x, r in zip(xs, ref, strict=True):  # the fast call's own outputs
            assert torch.equal(layer(x), r)
        _graph_replays_equal(layer, xs, ref)
