"""H200: the register-only W4A16 decode kernel against the direct kernel, bf16 and FP8 (M <= 16).

    python3 benchmarks/bench_w4a16_mma.py          # OUT=/dir: also $OUT/w4a16_mma.json
    python3 benchmarks/bench_w4a16_mma.py --smoke  # CPU: tiny shapes, interpreter
    python3 benchmarks/bench_w4a16_mma.py --space  # every variant of MMA_SPACE, offered
                                                   # or not; in-sample (N, K), M 1/4/8/16

Grid: `bench_w4a16_decode.shape_grid`'s decode grid (M 1, 4 and 16 x its six (N, K),
in-sample; M 2 and 8 x its three held-out (N, K), held out of the ``triton-sm90-mma`` fit
in ``fit_w4a16_model.py --mma``: fixed in run 4, before this kernel existed). Per shape,
as `bench_w4a16_ws` (whose loop this is): bf16 cuBLAS and FP8 cuBLASLt on the
dequantized weight; every offered ``triton-sm90-mma`` tactic and the
``triton-sm90-w4a16`` estimate's best 6; each output (poisoned with NaN) against float64
(relative error <= 1e-2, else failed and not timed); GPU time (CUDA graph, L2 flushed
before every call); ``Dispatcher().gemm(x, w)`` untuned: its pick, GPU time, eager wall.

Under ``--smoke`` (CPU, interpreter) the mma backend offers nothing (Gluon has no
interpreter): the run checks the script.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

from bench_w4a16_ws import main

from fp4_dispatch.plugins.sm90.mma import TritonSm90MmaBackend, space

if __name__ == "__main__":
    sys.exit(main(new=TritonSm90MmaBackend(), mid=False, doc=__doc__, space=space))
