"""benchmarks/bench_limits.py on the CPU: the L2 read kernel under the interpreter, the rs
GEMM's L2 byte count and the line fit (the H200 run of RESULTS.md "Hopper W4A16" run 13
rests on all three)."""

from __future__ import annotations

from conftest import run_bench_smoke


def test_bench_limits_smoke_runs_on_the_cpu(tmp_path):
    """Every program of the L2 kernel must return the XOR of every block of the buffer;
    the fit must recover y = 1 + 2x; and 256x256x256 with 256-token tiles is 2 row tiles x
    2 K steps x (128 x 64 weight bytes + 1024 scale bytes + 256 x 128 x 2 activation
    bytes) = 299008 bytes."""
    got = run_bench_smoke(tmp_path, "bench_limits.py", "limits.json")
    assert got == {"smoke": True, "l2_correct": True, "fit": [1.0, 2.0],
                   "rs_bytes_256x256x256": 299008}, got  # fmt: skip
