"""Programmatic dependent launch on the two-launch sm90 paths (`fp4_dispatch.backends.pdl`).

On a CPU: the switch (off under the interpreter and with ``FP4_DISPATCH_PDL=0``), and what
the sm_90 compiles hold - the GEMM that follows a kernel of its own call launches with
PDL and waits only after it has fetched what does not depend on that kernel (the mma
kernel: L2 prefetches of weight bytes, no load; the rs kernels: the ring's weight and
scale TMA loads, not the activations'); the first kernels let it launch; a W4A16 mma call
(one launch) is unchanged. On an H200 (``-m gpu``): PDL launches are exact in eager calls
and in CUDA-graph replays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TARGET_ONLY, sm90_compile_env

_SWITCH = r"""
import json
from fp4_dispatch.backends import pdl
print(json.dumps([pdl.ENABLED, pdl.launch_options(True), pdl.launch_options(False)]))
"""


@pytest.mark.parametrize(
    ("env", "enabled"),
    [({}, True), ({"FP4_DISPATCH_PDL": "0"}, False), ({"TRITON_INTERPRET": "1"}, False)],
)
def test_the_switch(env, enabled):
    """On by default (this Triton has grid dependency control); off with
    FP4_DISPATCH_PDL=0 and under the interpreter, where no launch gets the option."""
    pytest.importorskip("triton")
    base = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FP4_DISPATCH_PDL")
    }
    proc = subprocess.run([sys.executable, "-c", _SWITCH], capture_output=True, text=True,
                          env=base | env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    options = {"launch_pdl": True} if enabled else {}
    assert got == [enabled, options, {}], got


_COMPILE = (
    TARGET_ONLY
    + r"""
from fp4_dispatch.backends.sm90 import expand_rows
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs


def parts(compiled):
    ptx = compiled.asm["ptx"]
    head, wait, tail = ptx.partition("griddepcontrol.wait")
    return {"pdl": bool(compiled.metadata.launch_pdl), "waits": ptx.count("griddepcontrol.wait"),
            "releases": ptx.count("griddepcontrol.launch_dependents"),
            "head_prefetch": head.count("prefetch.global.L2"),
            "head_loads": head.count("ld.global"), "head_tma": head.count("cp.async.bulk.tensor"),
            "tail_tma": tail.count("cp.async.bulk.tensor") if wait else None}


out = {}
bf16 = torch.bfloat16
for name, cfg in (("mma", mm.MmaConfig()), ("mma-pf2-u2", mm.MmaConfig(prefetch=2, unroll=2))):
    out["w4a4-" + name] = parts(mm.build_w4a4(cfg).precompile(1, 4096, 4096, bf16))
    out["w4a16-" + name] = parts(mm.build(cfg).precompile(1, 4096, 4096, bf16))
out["expand"] = parts(expand_rows.precompile(4096, bf16))
out["pass"] = parts(rs._pass_binding().warmup((4, 32), (bf16, bf16, 64, 4096, 4096)))
for spec in (False, True):
    cfg = rs.RsConfig(block_m=64, split_k=2, stages=4, specialized=spec)
    out[f"rs-specialized={spec}"] = parts(rs.build(cfg).precompile(64, 4096, 4096, bf16))
print(json.dumps(out))
"""
)


def test_compiles_the_wait_after_the_weights(tmp_path):
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                          env=sm90_compile_env(tmp_path), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    from fp4_dispatch.backends.sm90.gemm_w4a16_mma import PDL_STEPS

    for name in ("mma", "mma-pf2-u2"):
        w4a4 = got["w4a4-" + name]
        # two 16-byte prefetches a thread and step (rows g and g + 8), nothing loaded
        assert w4a4["pdl"] and w4a4["waits"] == 1, w4a4
        assert w4a4["head_prefetch"] == 2 * PDL_STEPS.value and w4a4["head_loads"] == 0, w4a4
        # W4A16: one launch, no PDL, no grid dependency instruction
        assert got["w4a16-" + name] | {"head_prefetch": 0, "head_loads": 0} == {
            "pdl": False, "waits": 0, "releases": 0, "head_prefetch": 0, "head_loads": 0,
            "head_tma": 0, "tail_tma": None}, got["w4a16-" + name]  # fmt: skip
    for first in ("expand", "pass"):  # launched normally; they let the GEMM launch
        assert got[first]["releases"] == 1 and not got[first]["pdl"], got[first]
        assert got[first]["waits"] == 0, got[first]
    for spec in (False, True):
        row = got[f"rs-specialized={spec}"]
        # 4 stages: weight bytes + scale chunks of each slot before the wait, the
        # activations' two boxes a slot after it (then the steady state's four a step)
        assert row["pdl"] and row["waits"] == 1, row
        assert row["head_tma"] == 2 * 4 and row["tail_tma"] == 2 * 4 + 4, row


@pytest.mark.gpu
def test_pdl_launches_match_in_eager_calls_and_graph_replays():
    """W4A4 through the mma kernel and W4A16 through the rs kernel (64 tokens with split-K,
    256 tokens), PDL on: the eager output equals the PDL-off kernel's bit for bit, and
    a CUDA graph of three calls (new activations each, so a GEMM that read before its
    pass finished would read the previous call's) replays to the same bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    import math

    from fp4_dispatch.autotune.harness import stress_nvfp4, stress_operands
    from fp4_dispatch.backends import pdl
    from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
    from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    assert pdl.ENABLED
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    cases = []
    for m, n, k, knobs in ((1, 4096, 4096, {}), (8, 5120, 5120, {"prefetch": 2, "unroll": 2})):
        ops = [stress_operands(m, n, k, dev, gen) for _ in range(3)]
        ops = [
            o.__class__(o.a_data, o.a_scale, ops[0].b_data, ops[0].b_scale, o.alpha) for o in ops
        ]  # one weight, three activations
        cases.append((mm.build_w4a4, mm.MmaConfig(**knobs), ops, (m, n)))
    for m, n, k, knobs in ((64, 4096, 4096, {"block_m": 64, "stages": 4, "specialized": True,
                                             "split_k": 2}),
                           (256, 2048, 4096, {"block_m": 256, "stages": 3,
                                              "specialized": True})):  # fmt: skip
        wd, wsc = stress_nvfp4(n, k, dev, gen)
        alpha = torch.tensor([1.0 / (8 * math.sqrt(k))], device=dev)
        xs = [torch.randn((m, k), generator=gen, device=dev).to(torch.bfloat16) for _ in range(3)]
        ops = [w4.W4A16Operands(x, wd, wsc, alpha) for x in xs]
        cases.append((rs.build, rs.RsConfig(**knobs), ops, (m, n)))
    for build, cfg, ops, shape in cases:
        on, off = build(cfg), build(cfg)
        off.pdl = False
        assert getattr(on, "launches_with_pdl", on.pdl)
        want = []
        for o in ops:
            ref = torch.empty(shape, dtype=torch.bfloat16, device=dev)
            off(o, ref)
            want.append(ref)
        outs = [torch.full(shape, math.nan, dtype=torch.bfloat16, device=dev) for _ in ops]
        for o, out, ref in zip(ops, outs, want, strict=True):
            on(o, out)  # eager, and the first call of each shape outside capture
            assert torch.equal(out, ref), (cfg, "eager")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            for o, out in zip(ops, outs, strict=True):
                on(o, out)
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            for out in outs:
                out.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            for out, ref in zip(outs, want, strict=True):
                assert torch.equal(out, ref), (cfg, "graph")


def test_the_rs_kernel_launches_with_pdl_at_one_cta_an_sm_only():
    """Two CTAs an SM measured slower with PDL (`RsKernel.launches_with_pdl`)."""
    pytest.importorskip("triton")
    from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

    one = rs.build(rs.RsConfig(block_m=64, stages=4, specialized=True))
    two = rs.build(rs.RsConfig(block_m=64, stages=4, specialized=True, ctas_per_sm=2))
    off = rs.build(rs.RsConfig(block_m=128, specialized=True))
    off.pdl = False
    assert [one.launches_with_pdl, two.launches_with_pdl, off.launches_with_pdl] == [
        True,
        False,
        False,
    ]
