"""`backends.sm90.epilogue_gluon`: the tile raster, split-K step ranges and the split-K
epilogue the sm90 Gluon kernels share (`gemm_w4a16_ws`, `gemm_w4a16_mma`,
`gemm_w4a16_rs`).

Gluon has no interpreter: on the CPU a small kernel that calls all three compiles for
sm_90 (Triton's ptxas, no launch) and its SASS is read - the two atomics of the counter
protocol are there and nothing goes to local memory (the split-K sum once spilled ~810
instructions' worth in the accumulator's layout, RESULTS.md "Hopper W4A16" run 11). The
numerics run through the three kernels on an sm90 GPU (their ``-m gpu`` tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TARGET_ONLY, sm90_compile_env

_COMPILE = (
    TARGET_ONLY
    + r"""
import pathlib, re, subprocess
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from fp4_dispatch.backends.sm90.epilogue_gluon import split_steps, store_tile, tile_origin


@gluon.jit
def epilogue(alpha_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, k_steps, stride_om,
             stride_on, BN: gl.constexpr, BM: gl.constexpr, SPLIT_K: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    tile_id, pid_k, pid_n, n0, m0 = tile_origin(N, BN, BM)
    kt0, steps = split_steps(k_steps, pid_k, SPLIT_K)
    acc = gl.full([BN, BM], 1.0, gl.float32, L) * (kt0 + steps).to(gl.float32)
    store_tile(acc, n0, m0, alpha_ptr, bias_ptr, 1, out_ptr, ws_ptr, cnt_ptr, M, N,
               stride_om, stride_on, tile_id, pid_k, SPLIT_K)


nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
out = {}
for bn, bm, split_k in json.loads(sys.argv[1]):
    f32 = torch.empty(1, dtype=torch.float32)
    bf16 = torch.empty(1, dtype=torch.bfloat16)
    cnt = torch.empty(1, dtype=torch.int32)
    compiled = epilogue.warmup(f32, bf16, bf16, f32, cnt, 256, 4096, 64, 4096, 1, BN=bn,
                               BM=bm, SPLIT_K=split_k, grid=(1,), num_warps=8)
    path = pathlib.Path(os.environ["TRITON_CACHE_DIR"]) / f"epi{bn}x{bm}s{split_k}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True,
                          text=True).stdout
    out[f"{bn}x{bm}/{split_k}"] = {
        "spills": len(re.findall(r"\b(STL|LDL)(\.\w+)*\b", sass)),
        "atomics": len(re.findall(r"\b(ATOMG|ATOM|RED)\b", sass)),
        "stores": len(re.findall(r"\bSTG\b", sass)),
    }
print(json.dumps(out))
"""
)

#: (weight rows, tokens, split-K) of an 8-warp CTA, as the rs kernel's two warpgroups
CASES = [(128, 64, 1), (128, 128, 2)]


def test_compiles_for_sm90_with_the_counter_protocol_and_no_spills(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "epilogue_compile.py"  # a jitted function's source must be a file
    script.write_text(_COMPILE)
    proc = subprocess.run([sys.executable, str(script), json.dumps(CASES)],
                          capture_output=True, text=True, env=sm90_compile_env(tmp_path),
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (bn, bm, split_k), row in zip(CASES, got.values(), strict=True):
        assert row["stores"] > 0 and row["spills"] == 0, (bn, bm, split_k, row)
        # one split stores directly; split-K bumps the counter and resets it (two atomics)
        assert (row["atomics"] >= 2) == (split_k > 1), (bn, bm, split_k, row)
