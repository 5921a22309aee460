"""Blackwell/Rubin families (sm100, sm103, sm107) on NVIDIA's CuTe-DSL NVFP4 GEMMs.

No Blackwell GPU here: kernels are compiled for their target and the compiled cubin's
arch is checked; nothing is run on hardware. Tests that need ``nvidia-cutlass-dsl`` skip
(with the reason) when the ``cute`` extra is not installed; CI installs it. The "never
absent" behaviour is tested in subprocesses whose import of ``cutlass`` is blocked.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from fp4_dispatch.backends import cute as cb
from fp4_dispatch.contracts.backend import GemmOperands
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm100 import Sm100Backend, Sm100Tactic
from fp4_dispatch.plugins.sm103 import Sm103Backend, Sm103Tactic
from fp4_dispatch.plugins.sm107 import Sm107Backend, Sm107Tactic

HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(
    not HAVE_CUTE, reason=f"CuTe-DSL extra not installed ({cb.INSTALL_HINT})"
)
HINT = "pip install '.[cute]' in the fp4-dispatch checkout"
FAMILIES = {"sm100": Sm100Backend, "sm103": Sm103Backend, "sm107": Sm107Backend}

# ---- never absent: the extra missing or broken, in a subprocess ----------------------

BLOCKER = """
import importlib.abc, json, sys
MODE = {mode!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cutlass" or name.startswith("cutlass."):
            if MODE == "broken":
                raise ImportError("libcuda.so.1: cannot open shared object file (test)")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)  # not installed
        return None

sys.meta_path.insert(0, Block())
import contextlib, io
from fp4_dispatch.cli import main
rows = {{}}
for dev in ("sm100", "sm103", "sm107"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["list-backends", "--device", dev, "--json"])
    rows[dev] = [r for r in json.loads(buf.getvalue()) if r["name"].startswith("cute-")]
print("ROWS=" + json.dumps(rows))
"""


def _blocked_rows(mode: str) -> dict[str, list[dict]]:
    code = textwrap.dedent(BLOCKER.format(mode=mode))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS="))
    return json.loads(line[5:])


def test_families_listed_unsupported_with_hint_when_extra_missing():
    rows = _blocked_rows("missing")
    for dev, own in (("sm100", "cute-sm100"), ("sm103", "cute-sm103"), ("sm107", "cute-sm107")):
        by_name = {r["name"]: r for r in rows[dev]}
        assert set(by_name) == {"cute-sm100", "cute-sm103", "cute-sm107"}, rows[dev]
        assert by_name[own]["status"] == "unsupported"
        assert HINT in by_name[own]["reason"]
        assert "nvidia-cutlass-dsl[cu13] not installed" in by_name[own]["reason"]


def test_families_listed_failed_with_exception_when_extra_broken():
    rows = _blocked_rows("broken")
    by_name = {r["name"]: r for r in rows["sm107"]}
    assert set(by_name) == {"cute-sm100", "cute-sm103", "cute-sm107"}
    for name in ("cute-sm100", "cute-sm107"):
        assert by_name[name]["status"] == "failed", by_name[name]
        assert "libcuda.so.1: cannot open shared object file (test)" in by_name[name]["reason"]
        assert HINT in by_name[name]["reason"]


# ---- tactic specs: narrow types, kernel rules, JSON ---------------------------------


SM107_OK = dict(tile_m=256, tile_n=128, inst_m=256, b_reuse=False, cluster_m=2, cluster_n=2,
                fallback_cluster_m=2, fallback_cluster_n=1)  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cluster_n": 1}, "differ from the preferred"),
        ({"inst_m": 128, "tile_m": 128, "cluster_m": 1, "fallback_cluster_m": 2}, "divide"),
        ({"tile_m": 128}, "tile_m must be inst_m"),
        ({"b_reuse": True}, "tile_m must be inst_m"),
        ({"cluster_m": 1, "fallback_cluster_m": 1}, "2-CTA"),
        (
            {"cluster_m": 4, "cluster_n": 1, "fallback_cluster_m": 1, "fallback_cluster_n": 1},
            "2-CTA",
        ),
        ({"fallback_cluster_n": 2}, "must be one of"),
        ({"fallback_cluster_m": 1, "fallback_cluster_n": 2}, "2-CTA"),
        ({"cluster_m": 3}, "cluster_m"),
        ({"tile_n": 192}, "tile_n"),
        ({"prefetch": 2}, "prefetch"),
    ],
)
def test_sm107_impossible_tactic_is_a_validation_error(change, message):
    Sm107Tactic(**SM107_OK)  # the base is valid: each change alone makes it impossible
    with pytest.raises(ValidationError, match=message):
        Sm107Tactic(**{**SM107_OK, **change})


@pytest.mark.parametrize(
    "fields", [{"tile_n": 256}, {"cluster_m": 1}, {"tile_m": 512}, {"backend": "cute-sm107"}]
)
def test_sm100_impossible_tactic_is_a_validation_error(fields):
    with pytest.raises(ValidationError):
        Sm100Tactic(**{"tile_m": 256, "tile_n": 128, "cluster_m": 2, "cluster_n": 1, **fields})


def test_tactics_round_trip_json():
    for t in (
        Sm100Tactic(tile_m=256, tile_n=192, cluster_m=4, cluster_n=2, swap_ab=True),
        Sm103Tactic(tile_m=128, tile_n=64, cluster_m=2, cluster_n=4),
        Sm107Tactic(**{**SM107_OK, "tile_m": 512, "b_reuse": True}),
    ):
        assert type(t).model_validate_json(t.model_dump_json()) == t
        assert json.loads(t.canonical_json())["backend"] == t.backend


# ---- the launcher's own logic, on CPU (the kernel itself is replaced) --------------


def _operands(m, n, k, alpha=0.37, pad=True):
    from fp4_dispatch import quantize_nvfp4
    from fp4_dispatch.format.nvfp4 import reference_gemm

    g = torch.Generator().manual_seed(1)
    qa = quantize_nvfp4(torch.randn(m, k, generator=g)).with_layout("swizzled")
    qb = quantize_nvfp4(torch.randn(n, k, generator=g)).with_layout("swizzled")
    ref = reference_gemm(qa, qb) / (qa.global_scale.double() * qb.global_scale.double())
    a_scale = qa.scale if pad else qa.scale.reshape(-1)[: m * (k // 16)]
    ops = GemmOperands(qa.data, a_scale, qb.data, qb.scale, torch.tensor([alpha]))
    return ops, ref  # ref: unscaled product (no global scales, no alpha), float64


class FakeLaunch:
    """Stands in for the compiled operator: writes the exact unscaled product."""

    def __init__(self, ref):
        self.ref, self.calls = ref, []

    def __call__(self, kernel, operands, dst):
        assert cb.major_of(dst) == kernel.major
        self.calls.append(dst.dtype)
        dst.copy_(self.ref if operands.m == self.ref.shape[0] else self.ref.t())


def _kernel(out_dtype, major):
    design = cb.Design("sm100", 128, 64, 2, 1, 2, 1, 128, False)
    entry = cb.OperatorEntry(design, "fake", None, lambda *args: True)
    compiled = cb.CompiledKernel(entry, None, "100a", 148, 100, 0.0, "memory", None)
    return cb.CuteKernel(compiled, out_dtype, major)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swap", [False, True])
def test_launcher_applies_alpha_and_honours_out_strides(monkeypatch, out_dtype, swap):
    m, n, k = 48, 40, 64
    ops, ref = _operands(m, n, k)
    fake = FakeLaunch(ref)
    monkeypatch.setattr(cb.CuteKernel, "launch", lambda self, o, dst: fake(self, o, dst))
    name = "bfloat16" if out_dtype == torch.bfloat16 else "float16"
    kernel = _kernel(name, "m" if swap else "n")
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    if swap:  # what the dispatcher does for swap_ab
        kernel(ops.swapped(), out.t())
    else:
        kernel(ops, out)
    want = (ref * 0.37).to(out_dtype)
    # bf16 path: the kernel writes bf16, alpha is applied after (one extra rounding step)
    tol = 0 if out_dtype == torch.float16 else 2**-7
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol * ref.abs().max())
    assert fake.calls == [torch.bfloat16 if name == "bfloat16" else torch.float32]


def test_launcher_refuses_unpadded_scales(monkeypatch):
    ops, ref = _operands(48, 40, 64, pad=False)
    fake = FakeLaunch(ref)
    monkeypatch.setattr(cb.CuteKernel, "launch", lambda self, o, dst: fake(self, o, dst))
    with pytest.raises(ValueError, match="128x4 swizzled, padded"):
        _kernel("bfloat16", "n")(ops, torch.empty(48, 40, dtype=torch.bfloat16))


def test_cubin_sm_reads_blackwell_and_older_e_flags():
    def elf(abi: int, flags: int) -> bytes:
        head = bytearray(64)
        head[:4], head[8] = b"\x7fELF", abi
        head[18:20] = (190).to_bytes(2, "little")
        head[48:52] = flags.to_bytes(4, "little")
        return bytes(head)

    assert cb.cubin_sm(b"host" + elf(8, 0x6006B02)) == 107
    assert cb.cubin_sm(b"host" + elf(7, 0x5A0A5A)) == 0x5A
    with pytest.raises(ValueError, match="no CUDA cubin"):
        cb.cubin_sm(b"host object without a cubin")


# ---- with the extra installed (CI) ---------------------------------------------------


@needs_cute
@pytest.mark.parametrize("family", ["sm100", "sm103", "sm107"])
def test_list_backends_shows_family_available_on_its_device(capsys, family):
    from fp4_dispatch.cli import main

    assert main(["list-backends", "--device", family, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows[f"cute-{family}"]
    assert row["status"] == "available", row
    assert isinstance(row["tactics"], int) and row["tactics"] > 0
    if family == "sm107":  # the SM100 design competes on the SM107 part
        assert rows["cute-sm100"]["status"] == "available"
        assert rows["cute-sm100"]["tactics"] > 0


@needs_cute
def test_sm107_shortlist_has_both_families_and_both_orientations():
    from fp4_dispatch import Dispatcher

    sl = Dispatcher(device="sm107").candidates(32768, 4096, 8192)
    fams = {c.family for c in sl.candidates}
    assert {"sm100", "sm107"} <= fams
    for fam in ("sm100", "sm107"):
        swaps = {c.tactic.swap_ab for c in sl.candidates if c.family == fam}
        assert swaps == {False, True}, (fam, swaps)


@needs_cute
def test_spec_space_equals_library_design_space():
    """Every valid spec is a library operator and every operator is a valid spec."""
    grid107 = itertools.product(
        (128, 256, 512), (64, 128, 256), (128, 256), (False, True),
        (1, 2, 4), (1, 2, 4), (1, 2), (1, 2),
    )  # fmt: skip
    specs107 = set()
    for tm, tn, im, br, cm, cn, fm, fn in grid107:
        try:
            t = Sm107Tactic(tile_m=tm, tile_n=tn, inst_m=im, b_reuse=br, cluster_m=cm,
                            cluster_n=cn, fallback_cluster_m=fm, fallback_cluster_n=fn)  # fmt: skip
        except ValidationError:
            continue
        specs107.add(cb.Design(**t.design_fields()))
    lib107 = set(cb.designs("107a", "sm107"))
    assert specs107 == lib107 and len(lib107) == 138

    specs100 = {
        cb.Design(**Sm100Tactic(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn).design_fields())
        for tm, tn, cm, cn in itertools.product((128, 256), (64, 128, 192), (2, 4), (1, 2, 4))
    }
    for target in ("100a", "103a", "107a"):
        assert set(cb.designs(target, "sm100")) == specs100 and len(specs100) == 36


def _library_args(m, n, k, major):
    from cutlass import operators as ops

    fp4 = torch.float4_e2m1fn_x2
    a = torch.empty(m, k // 2, dtype=fp4)
    b = torch.empty(n, k // 2, dtype=fp4).t()
    sa = torch.empty(cb.padded_scale_numel(m, k), dtype=torch.float8_e4m3fn)
    sb = torch.empty(cb.padded_scale_numel(n, k), dtype=torch.float8_e4m3fn)
    out = (torch.empty(m, n, dtype=torch.bfloat16) if major == "n"
           else torch.empty(n, m, dtype=torch.bfloat16).t())  # fmt: skip
    mode, swz = ops.ScaleMode.Blockwise1x16, ops.ScaleSwizzleMode.Swizzle32x4x4
    a_op, b_op = ops.ScaledOperand(a, sa, mode, swz), ops.ScaledOperand(b, sb, mode, swz)
    return ops.GemmArguments(a_op, b_op, out, accumulator_type=torch.float32)


@needs_cute
def test_validity_agrees_with_library_supports_on_sample_shapes():
    """Our rule (the kernel's can_implement) vs the library's Operator.supports.

    They must agree, except that the SM107 operator's supports() does not check its
    kernel's "problem >= one preferred cluster tile" rule: there, and only there, the
    kernel rejects what supports() accepts.
    """
    shapes = [(1, 64, 64), (8, 200, 96), (100, 256, 256), (256, 520, 128), (512, 1024, 64),
              (130, 132, 80), (384, 96, 32), (64, 48, 128)]  # fmt: skip
    entries = list(cb.discover("107a"))
    checked = disagreements = 0
    for (m, n, k), major in itertools.product(shapes, ("n", "m")):
        args = _library_args(m, n, k, major)
        for entry in entries[::3]:
            d = entry.design
            ours = entry.can_implement(m, n, k, "bfloat16", major)
            op = cb.operator_for(d, "107a", "bfloat16", major).operator
            lib = bool(op.supports(args, target_sm="107a"))
            checked += 1
            if ours != lib:
                tile_m = d.tile_m // (2 if d.inst_m == 256 else 1) * d.cluster_m
                small = m < tile_m or n < d.tile_n * d.cluster_n
                assert d.kind == "sm107" and lib and not ours and small, (entry.name, m, n, k)
                disagreements += 1
    assert checked > 400 and disagreements > 0


@needs_cute
def test_tactics_and_validate_agree():
    for family, dev_name, problem in (
        ("sm100", "sm100", Problem(m=100, n=4104, k=256)),
        ("sm107", "sm107", Problem(m=200, n=384, k=512)),
        ("sm107", "sm107", Problem(m=32, n=4096, k=7168)),
    ):
        backend, dev = FAMILIES[family](), simulated(dev_name)
        offered = set(backend.tactics(problem, dev))
        for design in cb.designs(cb.target_of(dev.cc), backend.kind):
            for swap in (False, True):
                t = backend._tactic_of(design, swap)
                assert (backend.validate(t, problem, dev) is None) == (t in offered), t


@needs_cute
def test_misaligned_problems_get_no_tactic():
    # K % 32 and the output's contiguous dimension (N) % 8 are the kernels' alignment rules
    dev = simulated("sm107")
    for problem in (Problem(m=256, n=256, k=48), Problem(m=256, n=260, k=256)):
        for backend in (Sm100Backend(), Sm107Backend()):
            assert list(backend.tactics(problem, dev)) == []


@needs_cute
@pytest.mark.slow
@pytest.mark.parametrize("family", ["sm100", "sm103", "sm107"])
def test_one_tactic_per_family_compiles_for_its_target(tmp_path, monkeypatch, family):
    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))
    backend, dev = FAMILIES[family](), simulated(family)
    problem = Problem(m=4096, n=4096, k=4096)
    tactic = min(backend.tactics(problem, dev), key=lambda t: t.canonical_json())
    kernel = backend.build(tactic, problem, dev)
    c = kernel.compiled
    assert c.source == "compiled" and c.cubin_sm == dev.cc, c
    assert str(c.artifact.compiled_for) == f"{dev.cc}a"
    obj = (tmp_path / f"{c.path.rsplit('/', 1)[1]}").read_bytes()
    assert cb.cubin_sm(obj) == dev.cc  # the target is read from the binary, not assumed
    cb._memory.clear()
    again = backend.build(tactic, problem, dev).compiled
    assert again.source == "disk" and again.cubin_sm == dev.cc
    other = backend.build(tactic, problem, dev.with_sm_count(dev.sm_count - 16)).compiled
    assert other.path != c.path  # the SM count is baked in: another artifact


@needs_cute
@pytest.mark.slow
def test_cli_compile_reports_per_family(tmp_path, monkeypatch, capsys):
    from fp4_dispatch.cli import main

    monkeypatch.setenv(cb.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("FP4_DISPATCH_DISABLE", "flashinfer")  # the CuTe-DSL families only
    rc = main(["compile", "512", "512", "256", "--device", "sm107", "--budget", "2",
               "--jobs", "2", "--no-progress", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert set(report["families"]) == {"sm100", "sm107"}
    assert all(r["ok"] and r["cubin_sm"] == 107 for r in report["results"])
