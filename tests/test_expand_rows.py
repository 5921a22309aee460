"""`backends.sm90.expand_rows`: NVFP4 rows to bf16/fp16 before a W4A16 kernel (W4A4 at
decode through ``triton-sm90-mma``). Plain Triton, so the numerics run under the
interpreter here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TARGET_ONLY, run_interpreted, sm90_compile_env

_EXPAND = r"""
import json, sys
import torch
from fp4_dispatch.backends.sm90.expand_rows import expand
from fp4_dispatch.autotune.harness import stress_nvfp4
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, dequantize

res = {}
for m, k, dtype in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(m + k)
    data, scale = stress_nvfp4(m, k, torch.device("cpu"), gen)
    ref = dequantize(Nvfp4Tensor(data, scale, torch.ones(()), "swizzled", (m, k))).double()
    out = torch.full((m + 3, k), float("nan"), dtype=getattr(torch, dtype))
    alphas = (torch.tensor([0.5]), torch.tensor([3.0]), torch.zeros(1))
    expand(data, scale, out, alphas)
    res[f"{m}x{k}/{dtype}"] = {"exact": torch.equal(out[:m].double(), ref),
                               "rest_untouched": bool(out[m:].isnan().all()),
                               "alpha": float(alphas[2])}
try:
    expand(data, scale, torch.empty((m, k + 32), dtype=torch.bfloat16), alphas)
except ValueError as exc:
    res["bad_out"] = str(exc)
print(json.dumps(res))
"""


def test_expands_every_code_exactly_and_multiplies_the_global_scales():
    """Every e2m1 code (stress operands) times log-uniform e4m3 scales, NaN in the scale
    padding (K = 1056: 66 blocks padded to 68; 130 rows: a second 128-row block), bf16
    and fp16: bit-exact against `nvfp4.dequantize`; rows past M untouched; ``alpha *
    alpha_b`` stored; an output of the wrong width named."""
    cases = [[3, 256, "bfloat16"], [5, 1056, "float16"], [130, 512, "bfloat16"]]
    got = run_interpreted(_EXPAND, cases)
    for m, k, dtype in cases:
        row = got[f"{m}x{k}/{dtype}"]
        assert row == {"exact": True, "rest_untouched": True, "alpha": 1.5}, (m, k, row)
    bad = "out: expected >= 130 rows of 512 contiguous values, got shape (130, 544)"
    assert bad in got["bad_out"], got["bad_out"]


def test_precompile_compiles_without_launching(tmp_path):
    """The precompile entry names the variant `expand` launches (sm_90, no GPU)."""
    pytest.importorskip("triton")
    script = TARGET_ONLY + (
        "from fp4_dispatch.backends.sm90 import expand_rows\n"
        "c = expand_rows.precompile(4096, torch.bfloat16)\n"
        "print(json.dumps(len(c.asm['cubin'])))\n"
    )
    env = sm90_compile_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) > 1000
