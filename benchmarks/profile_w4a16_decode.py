"""H200: one W4A16 kernel (decode, or the rs GEMM), run a few times, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:w4a16 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 benchmarks/profile_w4a16_decode.py --kernel mma --m 16 --tile-m 16

Why a script of its own: the sweeps (bench_w4a16_mma.py) launch hundreds of kernels, and
Nsight Compute replays each one it profiles many times; this runs one tactic on one
shape (stress operands, checked against float64 first, so a profile of a wrong kernel is
never read) and nothing else on the GPU after the check. ``--kernel mma`` is
``triton-sm90-mma`` (`gemm_w4a16_mma.MmaConfig` knobs), ``--kernel direct`` the direct
kernel of ``triton-sm90-w4a16`` (`gemm_w4a16.W4A16Config` knobs: 16 tokens, 64 rows),
``--kernel rs`` the specialized ``triton-sm90-rs`` kernel (`gemm_w4a16_rs.RsConfig`:
``--tile-m`` tokens, ``--stages``, ``--ctas-per-sm``); its calls after the check launch
the GEMM alone on activations already in the dot's order (profile ``regex:rs_ws``).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from bench_w4a16_decode import TOL, Shape, rel_err

from fp4_dispatch.backends.sm90 import gemm_w4a16 as w4
from fp4_dispatch.backends.sm90 import gemm_w4a16_mma as mm


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=("mma", "direct", "rs"), default="mma")
    p.add_argument("--m", type=int, default=16, help="tokens")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--tile-m", type=int, default=16, help="tokens a CTA")
    p.add_argument("--tile-n", type=int, default=16, help="mma: rows a warp; direct: a CTA")
    p.add_argument("--warps", type=int, default=4, help="mma: K ranges a CTA")
    p.add_argument("--split-k", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=2, help="mma: L2 prefetch steps ahead")
    p.add_argument("--unroll", type=int, default=2, help="mma: steps whose loads go together")
    p.add_argument("--stages", type=int, default=4, help="direct, rs: pipeline stages")
    p.add_argument("--ctas-per-sm", type=int, default=1, help="rs: CTAs an SM")
    p.add_argument("--calls", type=int, default=4, help="launches after the check")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """The kernel object of the chosen tactic."""
    if args.kernel == "rs":
        from fp4_dispatch.backends.sm90 import gemm_w4a16_rs as rs

        return rs.build(rs.RsConfig(block_m=args.tile_m, split_k=args.split_k,
                                    stages=args.stages, specialized=True,
                                    ctas_per_sm=args.ctas_per_sm))  # fmt: skip
    if args.kernel == "mma":
        return mm.build(mm.MmaConfig(block_m=args.tile_m, block_n=args.tile_n, warps=args.warps,
                                     split_k=args.split_k, prefetch=args.prefetch,
                                     unroll=args.unroll))  # fmt: skip
    return w4.build(w4.W4A16Config(block_m=args.tile_m, block_n=args.tile_n,
                                   split_k=args.split_k, num_stages=args.stages))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    s = Shape(args.m, args.n, args.k, torch.device("cuda"), torch.bfloat16)
    kernel = build(args)
    s.out.fill_(math.nan)
    kernel(s.ops, s.out)
    err = rel_err(s.out, s.ref)
    print(f"{args.kernel} {args.m}x{args.n}x{args.k}: rel err {err:.2e}", flush=True)
    if not err <= TOL:
        return 1
    if args.kernel == "rs":
        x = kernel.permute_activations(s.x).clone()
        run = lambda: kernel.launch(x, s.ops, s.out)  # noqa: E731
    else:
        run = lambda: kernel(s.ops, s.out)  # noqa: E731
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
