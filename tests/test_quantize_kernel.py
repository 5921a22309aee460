"""The fused Triton quantize kernel against the torch reference, byte for byte.

The kernel runs under TRITON_INTERPRET=1 in subprocesses (`run_interpreted`; the cases
split over two at once by `run_interpreted_split`); the reference is `quantize_nvfp4` on
the CPU (the torch path: `quantize_blocks` + `swizzle_scales`), which tests/test_nvfp4.py
checks against an independent slow reference. Every case is run twice: with the default
tile size and with a tiny one (`_TILE_ELEMS = _AMAX_ELEMS = 256`) so that small inputs
still exercise many programs, several K tiles, the partial-amax kernel and the swizzled
row/column padding of the last tiles.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import run_interpreted, run_interpreted_split

from fp4_dispatch.backends.triton_launch import specialization_key

SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.backends import quantize as kq
from fp4_dispatch.format.nvfp4 import quantize_nvfp4

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MID = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def near_ties(m, k, g, gen):
    # Blocks whose first element fixes a random e4m3 scale s (d = s * g in float32),
    # the other 15 the float32 values 0..2 ulps around t * d for the midpoints t: the
    # quotients straddle every rounding boundary of round_to_e2m1.
    x = torch.zeros(m, k)
    sbytes = torch.randint(0x08, 0x7F, (m, k // 16), generator=gen, dtype=torch.uint8)
    s = sbytes.view(torch.float8_e4m3fn).to(torch.float32)
    x[:, 0::16] = 6.0 * s * g
    ref = quantize_nvfp4(x, g, "linear").scale.to(torch.float32)
    d = (ref * torch.tensor(g, dtype=torch.float32)).repeat_interleave(16, 1)
    t = torch.tensor(MID)[torch.arange(k) % 7]
    v = t * d
    steps = torch.randint(-2, 3, (m, k), generator=gen)
    for _ in range(2):
        v = torch.where(steps > 0, torch.nextafter(v, torch.tensor(float("inf"))), v)
        v = torch.where(steps < 0, torch.nextafter(v, torch.tensor(0.0)), v)
        steps = steps - steps.sign()
    sign = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    keep = torch.arange(k) % 16 == 0
    return torch.where(keep, x, sign * v)


def at_midpoint(x, q):
    # how many quotients x / d are exactly an e2m1 midpoint or one float32 from one
    lin = q.with_layout("linear")
    d = (lin.scale.to(torch.float32) * lin.global_scale).repeat_interleave(16, 1)
    y = (x.to(torch.float32) / d).abs()
    n = 0
    for t in MID:
        t = torch.tensor(t)
        for v in (torch.nextafter(t, torch.tensor(0.0)), t, torch.nextafter(t, t * 2)):
            n += int((y == v).sum())
    return n


def make(c):
    m, k, kind = c["m"], c["k"], c["kind"]
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(m, k, generator=gen) * torch.exp(2 * torch.randn(m, k, generator=gen))
    if kind == "ties":  # a 6 pins the block scale to 1 (g = 1); then every midpoint, +-
        row = ([6.0] + MID + [-v for v in MID] + [1.0]) * (k // 16)
        x = torch.tensor(row[:k]).repeat(m, 1)
        x[:, 1::7] *= 1.0 + 2.0**-22  # just above a tie
    elif kind == "huge":
        x = x.sign() * 3.0e38 * torch.rand(m, k, generator=gen).clamp(min=0.5)
        x[:, :16] = 1.0e6  # > 448 * 6 * g for g = 1: scale and codes saturate
    elif kind == "tiny":
        x = x * 2.0**-14  # subnormal e4m3 block scales for g = 1
        x[:, :16] = 1.0e-40  # float32 subnormals: the scale underflows to 0 -> codes 0
    elif kind == "zeros":
        x[:, 16:48] = 0.0
        x[0] = 0.0
    elif kind == "allzero":
        x = torch.zeros(m, k)
    elif kind == "negzero":
        x[:, :16] = -0.0
        x[:, 16:32] = torch.tensor([-0.0, 0.0] * 8)
        x[:, 32:48] = torch.tensor([-0.0, 1e-30] * 8)
    elif kind == "nonfinite":
        r = min(1, m - 1)
        x[r, 3] = float("nan")
        x[r, min(20, k - 1)] = float("inf")
        x[r, k - 1] = float("-inf")
    elif kind == "neartie":  # |x| / d within 2 ulps of every e2m1 midpoint, any d
        x = near_ties(m, k, float(c["g"]), gen)
    elif kind == "neartie16":  # the same in bf16: 0..2 bf16 ulps around each midpoint
        x = near_ties(m, k, float(c["g"]), gen).to(torch.bfloat16)
        steps = torch.randint(-2, 3, (m, k), generator=gen)
        steps[:, 0::16] = 0
        for _ in range(2):
            up = torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype))
            down = torch.nextafter(x, torch.tensor(0.0, dtype=x.dtype))
            x = torch.where(steps > 0, up, torch.where(steps < 0, down, x))
            steps = steps - steps.sign()
    x = x.to(DT[c["dtype"]])
    if c.get("strided"):
        wide = torch.zeros(m, k + 48, dtype=x.dtype)
        wide[:, 16 : 16 + k] = x
        x = wide[:, 16 : 16 + k]
    return x


out = []
# (tile, pairs): the default tile, a tiny one, and the bf16 inputs once more through the
# one-element-an-operation path (the bf16 pair path off)
for tile, pairs in ((None, True), (256, True), (None, False)):
    kq._TILE_ELEMS = kq._AMAX_ELEMS = tile or 4096
    kq._PAIRS = pairs
    kq._plans.clear()
    for c in json.loads(sys.argv[1]):
        if not pairs and c["dtype"] != "bf16":
            continue
        x = make(c)
        gs = c["g"]
        if isinstance(gs, str):
            gs = torch.tensor(float(gs))
        d, s, g = kq.quantize_triton(x, gs, c["layout"])
        q = quantize_nvfp4(x, gs, c["layout"])
        out.append(
            {
                "case": c,
                "tile": tile,
                "pairs": pairs,
                "data": torch.equal(d, q.data),
                "scale": torch.equal(s.view(torch.uint8), q.scale.view(torch.uint8)),
                "shape": list(s.shape) == list(q.scale.shape),
                "g": torch.equal(g, q.global_scale),
                "nan_blocks": int((q.scale.view(torch.uint8) == 0x7F).sum()),
                "at_midpoint": at_midpoint(x, q),
            }
        )
print(json.dumps(out))
"""


def _cases() -> list[dict]:
    cases = []
    # random data, every input dtype, both layouts, given (float / tensor) and dynamic g
    for dtype, layout, g in itertools.product(
        ("fp32", "fp16", "bf16"), ("swizzled", "linear"), (None, 0.003, "0.02")
    ):
        cases.append({"kind": "random", "m": 3, "k": 80, "dtype": dtype, "layout": layout, "g": g})
    # shapes: rows not a multiple of 128, K not a multiple of 64, strided rows
    # K=1040: 65 scale columns (column padding) over several K tiles at both tile sizes
    shapes = ((1, 16, False), (130, 48, True), (2, 256, True), (129, 80, False), (5, 1040, True))
    for m, k, strided in shapes:
        for layout in ("swizzled", "linear"):
            for g in (None, "0.5"):
                cases.append(
                    {"kind": "random", "m": m, "k": k, "dtype": "bf16", "layout": layout, "g": g,
                     "strided": strided}
                )  # fmt: skip
    # adversarial values
    for kind, g in (
        ("ties", 1.0),
        ("ties", "1.0"),
        ("huge", 1.0),
        ("huge", None),
        ("tiny", 1.0),
        ("tiny", None),
        ("zeros", None),
        ("allzero", None),
        ("allzero", 1.0),
        ("negzero", 1.0),
        ("negzero", None),
        ("nonfinite", None),
        ("nonfinite", "0.25"),
        ("neartie", 1.0),
        ("neartie", "0.37"),
        ("neartie", 3.1e-5),
    ):
        for layout in ("swizzled", "linear"):
            cases.append({"kind": kind, "m": 3, "k": 64, "dtype": "fp32", "layout": layout, "g": g})
    # the same adversarial values in bf16 (the pair path: two elements an operation)
    for kind, g in (("ties", 1.0), ("huge", None), ("tiny", 1.0), ("zeros", None),
                    ("negzero", "1.0"), ("nonfinite", None), ("neartie16", 0.37),
                    ("neartie16", "3.1e-5"), ("neartie16", 1.0)):  # fmt: skip
        cases.append({"kind": kind, "m": 5, "k": 128, "dtype": "bf16", "layout": "swizzled",
                      "g": g})  # fmt: skip
    for g, m, layout in ((0.37, 33, "linear"), ("2.9e-3", 33, "linear"), (1.0, 32, "swizzled")):
        # M = 32: whole tiles (the kernel's unmasked EVEN variant)
        cases.append({"kind": "neartie", "m": m, "k": 512, "dtype": "fp32",
                      "layout": layout, "g": g})  # fmt: skip
    cases.append({"kind": "nonfinite", "m": 5, "k": 48, "dtype": "bf16", "layout": "swizzled",
                  "g": None, "strided": True})  # fmt: skip
    for i, c in enumerate(cases):
        c["seed"] = i
    return cases


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_interpreted_split(SCRIPT, _cases())


def test_every_case_ran_at_both_tile_sizes(results: list[dict]) -> None:
    n_bf16 = sum(c["dtype"] == "bf16" for c in _cases())
    assert n_bf16 >= 20
    assert len(results) == 2 * len(_cases()) + n_bf16
    assert sum(not r["pairs"] for r in results) == n_bf16


def test_kernel_bytes_equal_reference(results: list[dict]) -> None:
    bad = [r for r in results if not (r["data"] and r["scale"] and r["shape"] and r["g"])]
    assert not bad, bad[:5]


def test_non_finite_cases_hit_the_nan_block_rule(results: list[dict]) -> None:
    """The non-finite rows really produced 0x7F blocks (so byte equality covered them)."""
    nonfinite = [r for r in results if r["case"]["kind"] == "nonfinite"]
    assert nonfinite and all(r["nan_blocks"] >= 2 for r in nonfinite)
    assert all(r["nan_blocks"] == 0 for r in results if r["case"]["kind"] != "nonfinite")


def test_near_tie_cases_straddle_the_midpoints(results: list[dict]) -> None:
    """The near-tie inputs really put quotients on and next to every rounding boundary
    (so byte equality covered the kernel's division-free threshold comparisons)."""
    near = [r for r in results if r["case"]["kind"] == "neartie"]
    assert near and all(r["at_midpoint"] >= 7 for r in near)
    big = [r for r in near if r["case"]["m"] >= 32]
    assert big and all(r["at_midpoint"] >= 1000 for r in big)


PATHS_SCRIPT = r"""
import json, sys
import torch
from fp4_dispatch.backends import quantize as kq
from fp4_dispatch.format.nvfp4 import quantize_nvfp4


def same(x, layout):
    d, s, g = kq.quantize_triton(x, None, layout)
    q = quantize_nvfp4(x, None, layout)
    return (torch.equal(d, q.data) and torch.equal(g, q.global_scale)
            and torch.equal(s.view(torch.uint8), q.scale.view(torch.uint8)))


gen = torch.Generator().manual_seed(7)
out = {"auto_modes": {}, "barrier": [], "workspace_zero": [], "forced_multi": None}
# the choice under the interpreter with the default knobs: never the barrier
for m, k in ((16, 8192), (256, 4096), (3, 80)):
    out["auto_modes"][f"{m}x{k}"] = kq._make_plan(m, k, True, "dynamic").g_mode
# the barrier path forced, on one-program grids (the only ones that can run here)
kq._COOPERATIVE, kq._FUSED_ELEMS = True, 0
kq._plans.clear()
for m, k, kind in ((3, 80, "random"), (1, 16, "random"), (5, 48, "nonfinite"),
                   (4, 64, "allzero"), (2, 128, "tiny"), (3, 80, "random")):
    x = torch.randn(m, k, generator=gen) * torch.exp(2 * torch.randn(m, k, generator=gen))
    if kind == "nonfinite":
        x[1, 3], x[2, 20], x[4, k - 1] = float("nan"), float("inf"), float("-inf")
    elif kind == "allzero":
        x.zero_()
    elif kind == "tiny":
        x = x * 2.0**-130
    for layout in ("swizzled", "linear"):
        plan = kq._make_plan(m, k, layout == "swizzled", "dynamic")
        ok = same(x.to(torch.bfloat16) if m == 1 else x, layout)
        ws = kq._plans[(m, k, layout, "dynamic")].workspaces[x.device]
        out["barrier"].append({"m": m, "k": k, "kind": kind, "layout": layout,
                               "g_mode": plan.g_mode, "grid": list(plan.grid), "equal": ok})
        out["workspace_zero"].append(ws.tolist())
# forced, but a grid of several programs: the two-launch path all the same
out["forced_multi"] = kq._make_plan(16, 8192, True, "dynamic").g_mode
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def paths() -> dict:
    return run_interpreted(PATHS_SCRIPT, [])


def test_interpreter_never_picks_the_grid_barrier_for_several_programs(paths: dict) -> None:
    """Programs run one after another under TRITON_INTERPRET=1, so a spin-wait would
    hang: multi-program dynamic grids take the partial-amax + quantize launches there,
    even when the barrier is forced (`_COOPERATIVE = True`)."""
    from fp4_dispatch.backends import quantize as kq

    modes = paths["auto_modes"]
    assert modes["16x8192"] == kq._G_PARTIALS and modes["256x4096"] == kq._G_PARTIALS
    assert modes["3x80"] == kq._G_FUSED
    assert paths["forced_multi"] == kq._G_PARTIALS


def test_grid_barrier_path_equals_reference_and_resets_its_workspace(paths: dict) -> None:
    """The one-launch dynamic scale (`_grid_amax`) on one-program grids: bytes equal to
    the reference, and the barrier words are zero again after every launch (the next
    call and graph replays need no memset)."""
    from fp4_dispatch.backends import quantize as kq

    runs = paths["barrier"]
    assert len(runs) == 12
    assert all(r["g_mode"] == kq._G_BARRIER and r["grid"] == [1, 1] for r in runs), runs
    assert all(r["equal"] for r in runs), [r for r in runs if not r["equal"]]
    assert paths["workspace_zero"] == [[0, 0]] * len(runs)


def test_ptx_paths_only_on_sm90_and_later(monkeypatch) -> None:
    """``max.u16x2`` needs sm_90 (the e4m3 conversion sm_89): older GPUs, the
    interpreter and CPU-only hosts get the integer twins."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends import quantize as kq

    monkeypatch.setattr(kq, "_INTERPRETING", False)
    monkeypatch.setattr(kq.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kq.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kq, "_capabilities", {0: (9, 0)})
    assert kq._asm_ok()
    monkeypatch.setattr(kq, "_capabilities", {0: (8, 9)})
    assert not kq._asm_ok()
    monkeypatch.setattr(kq, "_capabilities", {0: (10, 0)})
    assert kq._asm_ok()
    monkeypatch.setattr(kq, "_INTERPRETING", True)
    assert not kq._asm_ok()
    monkeypatch.setattr(kq, "_INTERPRETING", False)
    monkeypatch.setattr(kq.torch.cuda, "is_available", lambda: False)
    assert not kq._asm_ok()


def test_cooperative_choice_on_a_gpu_follows_the_sm_count(monkeypatch) -> None:
    """Outside the interpreter (auto): the barrier while the grid has at most one
    program per SM; never when turned off or when Triton lacks the cooperative launch
    option; any grid when forced."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends import quantize as kq

    monkeypatch.setattr(kq, "_INTERPRETING", False)
    monkeypatch.setattr(kq.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kq.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kq, "_sm_counts", {0: 132})
    monkeypatch.setattr(kq, "_COOPERATIVE", None)
    assert kq._cooperative_ok(132) and not kq._cooperative_ok(133)
    monkeypatch.setattr(kq, "_COOPERATIVE", False)
    assert not kq._cooperative_ok(1)
    monkeypatch.setattr(kq, "_COOPERATIVE", True)
    assert kq._cooperative_ok(4096)
    # a Triton without the cooperative launch option: never
    monkeypatch.setattr(kq, "_triton_launches_cooperative", lambda: False)
    assert not kq._cooperative_ok(1)


def test_specialization_key_separates_what_triton_specializes_on() -> None:
    base = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned = base[:16], base[1:17]
    assert specialization_key([aligned]) != specialization_key([misaligned])
    assert specialization_key([aligned]) != specialization_key([aligned.half()])
    assert specialization_key([1]) != specialization_key([2])
    assert specialization_key([16]) != specialization_key([17])
    assert specialization_key([17]) == specialization_key([19])
    assert specialization_key([2**31 + 16]) != specialization_key([2**31 - 16])
    assert specialization_key([1.0, None]) == specialization_key([2.5, None])
    with pytest.raises(TypeError, match="args: unsupported kernel argument type"):
        specialization_key(["x"])


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: ``compiled[grid](*all_params)``."""

    def __init__(self, calls: list, fail: bool) -> None:
        self.calls, self.fail = calls, fail

    def __getitem__(self, grid):
        def runner(*args):
            if self.fail:
                raise TypeError("launcher takes 2 arguments")
            self.calls.append(("direct", grid, args))

        return runner


class _FakeKernel:
    """Stands in for a JITFunction: ``kernel[grid](*args, **constexprs, num_warps=)``."""

    arg_names = ("x", "BM", "n", "NB")

    def __init__(self, fail_direct: bool = False) -> None:
        self.calls: list = []
        self.fail_direct = fail_direct

    def __getitem__(self, grid):
        def run(*args, num_warps, **constexprs):
            self.calls.append(("slow", grid, args, constexprs, num_warps))
            return _FakeCompiled(self.calls, self.fail_direct)

        return run


def _fast_launcher(kernel: _FakeKernel, monkeypatch) -> object:
    from fp4_dispatch.backends import triton_launch

    monkeypatch.setattr(triton_launch, "_interpreting", lambda: False)
    monkeypatch.setattr(triton_launch, "_passes_all_params", lambda: True)
    return triton_launch.CachedLauncher(kernel)


def test_cached_launcher_compiles_once_then_launches_directly(monkeypatch) -> None:
    kernel = _FakeKernel()
    bound = _fast_launcher(kernel, monkeypatch).bind({"BM": 8, "NB": 4}, num_warps=8)
    x = torch.zeros(32)
    bound((2, 1), (x, 17))  # compiles through kernel[grid]
    bound((2, 1), (x, 17))  # direct: every parameter, in declaration order
    bound((3, 1), (x, 18))  # same specialization, new grid: still direct
    bound((3, 1), (x, 16))  # 16 is divisible by 16: a new specialization compiles
    kinds = [c[0] for c in kernel.calls]
    assert kinds == ["slow", "direct", "direct", "slow"]
    assert kernel.calls[0][2:] == ((x, 17), {"BM": 8, "NB": 4}, 8)
    # the compiled runner indexes grid[0..2]: the launcher pads the grid to three dims
    assert kernel.calls[1][1] == (2, 1, 1) and kernel.calls[1][2] == (x, 8, 17, 4)
    assert kernel.calls[2][1] == (3, 1, 1) and kernel.calls[2][2][2] == 18


class _TrailingKernel(_FakeKernel):
    """Constexprs after every runtime parameter, like the project's kernels."""

    arg_names = ("x", "n", "BM", "NB")


def test_launch_keyed_reuses_the_runner_of_its_key(monkeypatch) -> None:
    kernel = _TrailingKernel()
    bound = _fast_launcher(kernel, monkeypatch).bind({"BM": 8, "NB": 4})
    x = torch.zeros(32)
    bound.launch_keyed("a", (2,), (x, 17))  # compiles through kernel[grid]
    bound.launch_keyed("a", (2,), (x, 17))  # ordinary direct path, runner remembered
    bound.launch_keyed("a", (2,), (x, 18))  # the key's runner: no specialization key
    bound.launch_keyed("b", (2,), (x, 16))  # a new key (16 % 16 == 0): compiles
    bound.launch_keyed("a", (3,), (x, 17))  # same key, new grid: its own runner
    kinds = [c[0] for c in kernel.calls]
    assert kinds == ["slow", "direct", "direct", "slow", "direct"]
    # trailing constexprs are appended as they are (runtime args first)
    assert kernel.calls[2][1] == (2, 1, 1) and kernel.calls[2][2] == (x, 18, 8, 4)
    assert kernel.calls[4][1] == (3, 1, 1)
    assert {k[:2] for k in bound._keyed} == {("a", (2,)), ("a", (3,))}


def test_a_recorded_keyed_launch_names_the_kernel_that_ran(monkeypatch) -> None:
    """A keyed launch served by the runner of an earlier call whose `specialization_key`
    differs only in a value the caller's key leaves out (here ``n`` 1 against 0, as a
    ``do_not_specialize`` flag such as ``has_bias`` or M = 1) is noted with that runner's
    compiled kernel, not with None ("Triton's uncached path"): the replay of a layer
    whose weight had first been multiplied without a bias was refused that way."""
    from fp4_dispatch.backends import triton_launch

    kernel = _TrailingKernel()
    bound = _fast_launcher(kernel, monkeypatch).bind({"BM": 8, "NB": 4})
    x = torch.zeros(32)
    bound.launch_keyed("a", (2,), (x, 0))  # compiles, n = 0
    bound.launch_keyed("a", (2,), (x, 0))  # the key's runner remembered
    with triton_launch.recording() as notes:
        bound.launch_keyed("a", (2,), (x, 1))  # same key, n == 1: another specialization key
    assert specialization_key([x, 1]) != specialization_key([x, 0])
    assert [c[0] for c in kernel.calls] == ["slow", "direct", "direct"]
    assert len(notes) == 1 and isinstance(notes[0][0], _FakeCompiled), notes


class _RunCompiled(_FakeCompiled):
    """A compiled kernel with the pieces of Triton's runner: ``run`` (the CUDA
    launcher), ``function`` and ``packed_metadata``."""

    function, packed_metadata = "fn-handle", "meta"

    def run(self, *args):
        self.calls.append(("run", args[:9], args[9:]))


def test_direct_runner_calls_the_cuda_launcher_unless_a_launch_hook_is_set(monkeypatch):
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no knobs: the direct runner is not used")
    from fp4_dispatch.backends import triton_launch

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d, raising=False)
    calls: list = []
    compiled = _RunCompiled(calls, fail=False)
    runner = triton_launch._direct_runner(compiled, (4, 2, 1), 3, compiled[(4, 2, 1)])
    runner("x", 17)
    # grid, the current raw stream of the runner's device, handle, metadata, no hooks
    assert calls == [("run", (4, 2, 1, 1003, "fn-handle", "meta", None, None, None), ("x", 17))]
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", None)
    runner("w", 16)  # no hooks at all (Triton < 3.5): still the CUDA launcher
    assert calls[-1][0] == "run"
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    runner("y", 18)  # a profiler's hook needs Triton's own runner (launch metadata)
    assert calls[-1] == ("direct", (4, 2, 1), ("y", 18))
    # a compiled kernel without the pieces: no direct runner
    assert triton_launch._direct_runner(_FakeCompiled([], False), (1, 1, 1), 0, None) is None


def test_cached_launcher_falls_back_when_the_convention_differs(monkeypatch, caplog) -> None:
    kernel = _FakeKernel(fail_direct=True)
    launcher = _fast_launcher(kernel, monkeypatch)
    bound = launcher.bind({"BM": 8, "NB": 4})
    x = torch.zeros(32)
    for _ in range(3):
        bound((1,), (x, 5))
    assert [c[0] for c in kernel.calls] == ["slow", "slow", "slow"]  # every call launched
    assert not launcher.fast
    assert "direct launch unavailable" in caplog.text


@pytest.mark.parametrize(("arch", "g_mode"), [(90, 0), (90, 4), (100, 3)])
def test_kernel_compiles_for_hopper_and_blackwell_with_16_byte_loads(arch: int, g_mode: int):
    """Compiled (to PTX, on the CPU: no GPU needed) for sm90 and sm100; with aligned
    pointers and strides the bf16 loads are 16-byte vectors (``ld.global.v4``), the
    block scale is one ``cvt.rn.satfinite.e4m3x2.f32``, and the grid-barrier mode
    (4) synchronises through acquire/release atomics."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4_dispatch.backends import quantize as kq

    kernel = kq._nvfp4_quantize_kernel
    names = list(kernel.arg_names)
    types = {
        "x_ptr": "*bf16", "stride_xm": "i32", "data_ptr": "*u8", "scale_ptr": "*u8",
        "g_ptr": "*fp32", "g_value": "fp32", "g_out_ptr": "*fp32", "part_ptr": "*fp32",
        "n_part": "i32", "M": "i32", "K": "i32", "M_PAD": "i32", "NUM_K_TILES": "i32",
    }  # fmt: skip
    if g_mode == 4:  # the barrier words take the partials' place
        types["part_ptr"] = "*i32"
    consts = {"G_MODE": g_mode, "SWIZZLED": True, "BM": 8, "NB": 64, "PART_BLOCK": 1,
              "FM": 8, "FNB": 64, "EVEN": False, "USE_ASM": True, "PAIRS": True}  # fmt: skip
    aligned = ("x_ptr", "stride_xm", "data_ptr", "scale_ptr", "g_ptr", "g_out_ptr", "K")
    src = ASTSource(
        fn=kernel,
        signature={n: "constexpr" if n in consts else types[n] for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx
    assert "div.rn.f32" in ptx  # IEEE division, not the approximate default
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    # bf16: two elements an operation (lane masks by PRMT, lane-wise block max) and the
    # thresholds by directed conversions
    assert "prmt.b32" in ptx and "max.u16x2" in ptx
    assert "cvt.rp.f32.f64" in ptx and "cvt.rm.f32.f64" in ptx
    if g_mode == 4:
        # arrival (acq_rel add), the partial max, the spin (an acquire load of the count)
        assert "atom.global.gpu.acq_rel.add" in ptx and "gpu.relaxed.max.s32" in ptx
        assert "ld.global.gpu.acquire" in ptx


@pytest.mark.parametrize(
    ("x", "kwargs", "exc", "match"),
    [
        (torch.zeros(4, 32, dtype=torch.int32), {}, TypeError, "x: expected dtype"),
        (torch.zeros(32), {}, ValueError, "x: expected a 2-D tensor"),
        (torch.zeros(4, 24), {}, ValueError, "x: K must be a multiple of 16"),
        (torch.zeros(32, 4).t(), {}, ValueError, "x: expected unit stride along K"),
        (torch.zeros(4, 32), {"layout": "tiled"}, ValueError, "layout"),
        (torch.zeros(0, 32), {}, ValueError, "M, K > 0"),
        (torch.zeros(4, 32), {"global_scale": torch.ones((), dtype=torch.float64)}, TypeError,
         "global_scale: expected a one-element float32"),
        (torch.zeros(4, 32), {"global_scale": torch.ones(2)}, TypeError, "global_scale"),
        (torch.zeros(4, 32), {"global_scale": "1.0"}, TypeError, "global_scale"),
    ],
)  # fmt: skip
def test_quantize_triton_argument_errors(x, kwargs, exc, match) -> None:
    pytest.importorskip("triton")
    from fp4_dispatch.backends.quantize import quantize_triton

    with pytest.raises(exc, match=match):
        quantize_triton(x, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("given", [False, True])
def test_quantize_nvfp4_is_captured_in_a_cuda_graph(given: bool) -> None:
    from fp4_dispatch.format.nvfp4 import quantize_nvfp4

    pytest.importorskip("triton")
    gs = torch.tensor(0.05, device="cuda") if given else None
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        quantize_nvfp4(x, gs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize_nvfp4(x, gs)
    for i in range(3):
        x.copy_(torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16) * (i + 1))
        graph.replay()
        want = quantize_nvfp4(x.cpu(), None if gs is None else gs.cpu())
        assert torch.equal(q.data.cpu(), want.data)
        assert torch.equal(q.scale.view(torch.uint8).cpu(), want.scale.view(torch.uint8))
        assert torch.equal(q.global_scale.cpu(), want.global_scale)


def test_large_tensors_take_the_large_tile():
    """From `_LARGE_ELEMS` elements on the quantize programs are 8192-element tiles, 1024
    wide, on 4 warps (measured faster there on the H200); below, the default tile."""
    from fp4_dispatch.backends import quantize as kq

    big = kq._make_plan(4096, 8192, True, "tensor")
    assert (big.bm * big.nb * 16, big.nb * 16, big.num_warps) == (8192, 1024, 4)
    small = kq._make_plan(16, 8192, True, "tensor")
    assert small.bm * small.nb * 16 <= kq._TILE_ELEMS and small.nb * 16 <= kq._MAX_BK


@pytest.mark.parametrize(("rows", "k", "packed"), [(1, 4096, True), (16, 14336, True),
                                                   (1024, 4096, False)])  # fmt: skip
def test_kept_quantize_outputs_share_one_allocation_when_small(rows, k, packed) -> None:
    """`KeptQuantize.outputs`: a decode call's three outputs are aligned, disjoint views
    of one allocation (one ``torch.empty`` instead of three); a large call's are three
    allocations. Each has the shape and dtype `quantize_checked` returns, and the replay
    gets exactly them."""
    from fp4_dispatch.backends import quantize as kq
    from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

    data_shape, scale_shape = (rows, k // 2), tuple(swizzled_scale_shape(rows, k))
    seen = []
    kept = kq.KeptQuantize(lambda tensors: seen.append(tensors) or True, data_shape,
                           scale_shape, None, torch.device("cpu"),
                           kq.packed_layout(data_shape, scale_shape))  # fmt: skip
    assert (kept.packed is not None) is packed
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    data, scale, g = kept(x)
    assert (data.shape, data.dtype) == (data_shape, torch.uint8)
    assert (tuple(scale.shape), scale.dtype) == (scale_shape, torch.float8_e4m3fn)
    assert (g.shape, g.dtype) == ((), torch.float32)
    assert data.is_contiguous() and scale.is_contiguous()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in (data, scale, g))  # fmt: skip
    assert all(start % 16 == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    storages = {t.untyped_storage().data_ptr() for t in (data, scale, g)}
    assert len(storages) == (1 if packed else 3)
    if packed:
        assert data.untyped_storage().nbytes() <= kq.PACKED_MAX_BYTES
    assert [t is u for t, u in zip(seen[0], (x, data, scale, g, x), strict=True)] == [True] * 5
    data.fill_(7)  # writing one output leaves the others as they were
    scale.view(torch.uint8).fill_(3)
    g.fill_(0.5)
    assert bool((data == 7).all()) and bool((scale.view(torch.uint8) == 3).all())
    assert float(g) == 0.5
