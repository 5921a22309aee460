"""The W4A8 rs kernel (`backends/sm90/gemm_w4a8_rs.py`, issue 34): its K order, the pass
under the interpreter, the sm_90 compile on the CPU, the plugin's ``rs`` path, and the GPU
check (marked gpu). Its two PTX blocks (the byte table and the lookup) run on the CPU's
PTX model in tests/test_inline_ptx.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import SASS_LOOP, TARGET_ONLY, run_interpreted, sm90_compile_env

from fp4_dispatch.backends.reference import w4a8 as ref
from fp4_dispatch.contracts.backend import DenseOperands
from fp4_dispatch.contracts.tactics import Problem
from fp4_dispatch.loading.profiles import simulated
from fp4_dispatch.plugins.sm90.w4a8 import (
    RS_MIN_M,
    TritonSm90W4A8Backend,
    TritonSm90W4A8Tactic,
    why_invalid,
)

pytest.importorskip("triton")
SM90 = simulated("sm90")


def _stress(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from fp4_dispatch.autotune.harness import stress_nvfp4

    return stress_nvfp4(n, k, torch.device("cpu"), torch.Generator().manual_seed(seed))


def test_rs_order_is_a_permutation_of_each_128_block():
    from fp4_dispatch.backends.sm90.gemm_w4a8_rs import rs_order

    order = rs_order(384)
    for b in range(3):
        block = order[128 * b : 128 * (b + 1)]
        assert sorted(block.tolist()) == list(range(128 * b, 128 * (b + 1)))
    # a register of four codes (positions 4j..4j+3) holds four consecutive natural K
    quads = order.view(-1, 4)
    assert torch.equal(quads - quads[:, :1], torch.arange(4).expand_as(quads))


_PASS = r"""
import json, sys
import torch
from fp4_dispatch.autotune.harness import stress_nvfp4
from fp4_dispatch.backends.reference import w4a8 as ref
from fp4_dispatch.backends.sm90 import gemm_w4a8_rs as rs

out = {}
for m, n, k, dtype in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(m + n)
    x = (torch.randn(m, k + 128, generator=gen) * 3)[:, :k].to(getattr(torch, dtype))
    wd, ws = stress_nvfp4(n, k, torch.device("cpu"), gen)
    q, sa, sw = rs.quantize_pass(x, ws, n)
    rq, rsa = ref.quantize_activations(x)
    _, rsw = ref.weight_to_fp8(wd, ws)
    out[f"{m}x{n}x{k}"] = [
        torch.equal(q.view(torch.uint8), rq.view(torch.uint8)[:, rs.rs_order(k)]),
        torch.equal(sa, rsa), torch.equal(sw, rsw)]
print(json.dumps(out))
"""


def test_pass_quantizes_in_rs_order_and_finds_channel_scales():
    """The one-launch pass (interpreter): token codes and scales equal the emulation's,
    the codes stored in `rs_order`, and every weight row's channel scale, for a strided
    input, a token count below and above one program, rows past a channel program."""
    cases = [(1, 40, 256, "bfloat16"), (19, 17, 128, "float16"), (3, 130, 384, "float32")]
    got = run_interpreted(_PASS, cases)
    assert got == {f"{m}x{n}x{k}": [True, True, True] for m, n, k, _ in cases}, got


def test_config_and_inputs_name_what_is_wrong():
    from fp4_dispatch.backends.sm90 import gemm_w4a8_rs as rs

    with pytest.raises(ValueError, match=r"block_m: expected one of \(64, 128\), got 256"):
        rs.W4A8RsConfig(block_m=256)
    with pytest.raises(ValueError, match="split_k: expected >= 1, got 0"):
        rs.W4A8RsConfig(split_k=0)
    wd, ws = _stress(8, 128, 0)
    alpha = torch.ones(1)
    odd = DenseOperands(torch.zeros(4, 96, dtype=torch.bfloat16), wd[:, :48], ws, alpha)
    with pytest.raises(ValueError, match="a: expected K % 128 == 0, got K=96"):
        rs.build(rs.W4A8RsConfig())(odd, torch.empty(4, 8, dtype=torch.bfloat16))
    ops = DenseOperands(torch.zeros(128, 4, dtype=torch.bfloat16).t(), wd, ws, alpha)
    assert "unit stride along K" in rs.why_unsupported(ops)
    ops = DenseOperands(torch.zeros(4, 128, dtype=torch.int8), wd, ws, alpha)
    assert "got torch.int8" in rs.why_unsupported(ops)


_COMPILE = r"""
import collections
from fp4_dispatch.backends.sm90 import gemm_w4a8_rs as rs


def consumer_loops(sass):
    # the two innermost loops that hold a wgmma (the consumers' K loops; the larger ones
    # are wait-retry branches around whole partitions): length and opcode counts
    loops = [body for body in sass_loops(sass) if any(op.startswith("QGMMA") for op in body)]
    counts = (("qgmma", "QGMMA"), ("prmt", "PRMT"), ("cvt", "F2FP.SATFINITE.E4M3"),
              ("fadd", "FADD"))
    return [{"n": len(body), **{k: sum(op.startswith(p) for op in body) for k, p in counts}}
            for body in sorted(loops, key=len)[:2]]


out = {}
for bm, split in ((64, 1), (128, 2)):
    c = rs.build(rs.W4A8RsConfig(block_m=bm, split_k=split)).precompile(
        1024, 5120, 5120, torch.bfloat16)
    sass = loop_stats(c, f"w4a8rs_{bm}")["sass"]
    out[str(bm)] = {"loops": consumer_loops(sass),
                    "spills": len(re.findall(r"\b(STL|LDL)\b", sass))}
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_a_short_conversion(tmp_path):
    """Both token tiles compile for sm_90 on the CPU (Triton's ptxas) without spills; each
    consumer warpgroup's K step is four FP8 wgmma (``QGMMA``) with the table conversion:
    32 ``prmt`` (four a word of 8 weights), 16 E4M3 ``cvt`` (four a scale block), and at
    most 240 SASS instructions (208 at 64 tokens, 235 at 128, Triton 3.9; the fused
    kernel of `gemm_w4a8` spends 570-1,051 per step): the figures the plugin's estimate
    (`RS_LOOP_INSTR`) uses."""
    proc = subprocess.run([sys.executable, "-c", TARGET_ONLY + SASS_LOOP + _COMPILE],
                          capture_output=True, text=True, env=sm90_compile_env(tmp_path),
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for bm, row in got.items():
        assert row["spills"] == 0 and len(row["loops"]) == 2, (bm, row)
        for loop in row["loops"]:
            assert loop["qgmma"] == 4 and loop["prmt"] == 32 and loop["cvt"] == 16, (bm, loop)
            assert loop["n"] <= 240, (bm, loop)
            # the promoted sum: one fp32 addition an accumulator register (bm / 2)
            assert loop["fadd"] >= int(bm) // 2, (bm, loop)


# ---- the plugin ----------------------------------------------------------------------------


def test_rs_tactics_and_rules():
    b = TritonSm90W4A8Backend()

    def paths(m, k=5120):
        return {t.path for t in b.tactics(Problem(m=m, n=5120, k=k, operation="w4a8"), SM90)}

    assert "rs" not in paths(RS_MIN_M) and "rs" in paths(RS_MIN_M + 1)
    assert "rs" in paths(4096) and "rs" not in paths(4096, k=5120 + 32)
    t = TritonSm90W4A8Tactic(path="rs", tile_m=128, tile_n=128, tile_k=128)
    p = Problem(m=256, n=5120, k=5120, operation="w4a8")
    assert why_invalid(t, p, SM90) is None
    assert b.estimate_us(p, SM90, t) > 0
    assert "multiple of 128" in why_invalid(t, Problem(m=256, n=64, k=160), SM90)
    assert "tile_m: expected one of (64, 128)" in why_invalid(t.model_copy(update={"tile_m": 32}),
                                                              p, SM90)  # fmt: skip
    assert "nominal" in why_invalid(t.model_copy(update={"num_warps": 8}), p, SM90)
    assert "exceeds M" in why_invalid(t, Problem(m=40, n=5120, k=5120), SM90)
    cfg = t.rs_config()
    assert (cfg.block_m, cfg.split_k, cfg.stages) == (128, 1, 3)


# ---- on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_rs_kernel_on_gpu_matches_the_emulation():
    """Against the emulation (fp32 accumulation order and the output's rounding only):
    stress weights (every code, scales over 2**-9..2**6), M and N tails, split-K (twice:
    the self-resetting counters), a bias, fp16 output, a column-major output."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from fp4_dispatch.autotune.harness import stress_nvfp4
    from fp4_dispatch.backends.sm90 import gemm_w4a8_rs as rs

    dev = torch.device("cuda")
    cases = [(64, 5120, 5120, 64, 1, torch.bfloat16, False, False),
             (300, 3584, 4096, 128, 1, torch.bfloat16, True, False),
             (77, 200, 1024, 64, 3, torch.float16, True, True),
             (1024, 4096, 4096, 128, 2, torch.bfloat16, False, True)]  # fmt: skip
    for m, n, k, bm, split, dtype, bias, colmajor in cases:
        gen = torch.Generator(device=dev).manual_seed(m + n)
        x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
        wd, ws = stress_nvfp4(n, k, dev, gen)
        b = torch.randn(n, generator=gen, device=dev).to(dtype) if bias else None
        ops = DenseOperands(x, wd, ws, torch.tensor([1.0 / k], device=dev), bias=b)
        want = torch.empty(m, n, dtype=dtype, device=dev)
        ref.gemm_w4a8(ops, want)
        kern = rs.build(rs.W4A8RsConfig(block_m=bm, split_k=split))
        for _ in range(2):
            out = torch.full((n, m) if colmajor else (m, n), float("nan"), dtype=dtype,
                             device=dev)  # fmt: skip
            out = out.t() if colmajor else out
            kern(ops, out)
            rel = float((out.double() - want.double()).norm() / want.double().norm())
            assert rel < 4e-3, (m, n, k, bm, split, rel)
        # the scales the GEMM used: one pass's channel scales equal the emulation's
        _, _, sw = rs.quantize_pass(x, ws, n)
        _, rsw = ref.weight_to_fp8(wd.cpu(), ws.cpu())
        assert torch.equal(sw.cpu(), rsw)
