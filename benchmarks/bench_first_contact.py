"""First-contact timings on a CPU: what a newcomer waits for (issue 15's targets).

Measures, on this machine, against the installed package:

- ``fp4-dispatch --help`` / ``--version`` wall (target <= 1 s: no torch import);
- ``import fp4_dispatch`` wall, next to ``import torch`` and ``from fp4_dispatch import
  Dispatcher, quantize_nvfp4`` (which needs torch);
- ``fp4-dispatch compile 128 4096 4096 --device sm100 --budget 8`` from a warm kernel
  cache (target <= 5 s; the first, warming run is timed too; needs the cute extra);
- the reference backend's GEMM (``Dispatcher(device="cpu").gemm``, built-in plugins only)
  against torch's matmul of the same shape in bf16 and fp32, at 1x8192x8192 and
  1024x4096x4096 (target: <= 3x the faster of the two); first call (weight not yet
  dequantized) and steady state;
- the README's tuning snippet, run as written in a fresh interpreter (target <= 30 s).

Run: ``python benchmarks/bench_first_contact.py`` (from a checkout; ``--skip-compile`` to
leave out the CuTe-DSL part). Prints a table; writes ``first_contact.json`` to ``$OUT``
when set. Times are the minimum of a few runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import markdown_table, write_json

from fp4_dispatch import harness

ROOT = Path(__file__).resolve().parent.parent
EXE = shutil.which("fp4-dispatch") or str(Path(sys.executable).parent / "fp4-dispatch")
ENV = {**os.environ, "FP4_DISPATCH_PROGRESS": "0"}


def wall(cmd: list[str], runs: int = 3, env: dict | None = None) -> float:
    """Minimum wall time (s) of `runs` runs of `cmd` (`harness.call_wall_us`); raises if
    it fails."""

    def run() -> None:
        subprocess.run(cmd, check=True, capture_output=True, env=env or ENV)

    return harness.call_wall_us(run, runs, best=True) / 1e6


def startup(rows: list) -> None:
    py = sys.executable
    rows.append(("fp4-dispatch --help", wall([EXE, "--help"]), 1.0))
    rows.append(("fp4-dispatch --version", wall([EXE, "--version"]), 1.0))
    rows.append(("python -c 'import fp4_dispatch'", wall([py, "-c", "import fp4_dispatch"]), None))
    rows.append(("python -c 'import torch'", wall([py, "-c", "import torch"]), None))
    full = "from fp4_dispatch import Dispatcher, quantize_nvfp4"
    rows.append((f"python -c '{full}'", wall([py, "-c", full]), None))


def compile_warm(rows: list) -> None:
    cmd = [EXE, "compile", "128", "4096", "4096", "--device", "sm100", "--budget", "8"]
    t0 = time.perf_counter()
    first = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    rows.append(("compile 128x4096x4096 sm100 budget 8 (first run)",
                 time.perf_counter() - t0, None))  # fmt: skip
    if first.returncode != 0:
        raise RuntimeError(f"compile failed: {first.stderr[-2000:]}")
    rows.append(("compile ... (warm kernel cache)", wall(cmd, runs=2), 5.0))


def _best_ms(fn, runs: int) -> float:
    """Minimum host wall ms of `runs` single calls (`harness.call_wall_us`)."""
    return harness.call_wall_us(fn, runs, best=True) / 1e3


def gemm_vs_matmul(rows: list) -> None:
    os.environ["FP4_DISPATCH_PLUGINS"] = ""  # built-ins only: the reference on a CPU
    import torch

    from fp4_dispatch import Dispatcher, quantize_nvfp4

    d = Dispatcher(device="cpu", cache=False)
    for m, n, k in ((1, 8192, 8192), (1024, 4096, 4096)):
        runs = 5 if m == 1 else 3
        x, w = torch.randn(m, k), torch.randn(n, k)
        qa, qb = quantize_nvfp4(x), quantize_nvfp4(w)
        first = _best_ms(lambda qa=qa, qb=qb: d.gemm(qa, qb), 1)
        steady = _best_ms(lambda qa=qa, qb=qb: d.gemm(qa, qb), runs)
        xb, wb = x.bfloat16(), w.bfloat16()
        bf16 = _best_ms(lambda xb=xb, wb=wb: xb @ wb.T, runs)
        fp32 = _best_ms(lambda x=x, w=w: x @ w.T, runs)
        best = min(bf16, fp32)
        pick = d.select(m, n, k).tactic
        shape = f"{m}x{n}x{k}"
        rows.append((f"torch matmul {shape} bf16 / fp32 (ms)", f"{bf16:.1f} / {fp32:.1f}", None))
        rows.append((f"reference gemm {shape}, first call (ms)", first, None))
        rows.append((f"reference gemm {shape}, steady, {pick.compute_dtype} (ms)", steady, None))
        rows.append((f"  ratio to the faster matmul {shape}", steady / best, 3.0))


def readme_tuning(rows: list) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Tuning") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "tuning.py"
        script.write_text(code, encoding="utf-8")
        env = {**ENV, "FP4_DISPATCH_PLUGINS": "", "FP4_DISPATCH_CACHE": f"{tmp}/t.json"}
        rows.append(("README tuning snippet (fresh interpreter)",
                     wall([sys.executable, str(script)], runs=1, env=env), 30.0))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    rows: list = []
    startup(rows)
    if not args.skip_compile:
        compile_warm(rows)
    readme_tuning(rows)
    gemm_vs_matmul(rows)
    table = [
        (name, f"{value:.2f}" if isinstance(value, float) else str(value),
         "" if target is None else f"<= {target:g} " + ("ok" if value <= target else "MISSED"))
        for name, value, target in rows
    ]  # fmt: skip
    print(markdown_table(("measurement", "value", "target"), table, "lrl"))
    write_json("first_contact.json", [{"name": n, "value": v, "target": t} for n, v, t in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
