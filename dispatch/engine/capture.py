"""CUDA-graph capture state: is this stream capturing, and the error for a cold shape.

The engine asks `stream_capturing` on every eager call (inside a capture only a warm
plan may launch) and raises `not_warm`'s error otherwise; the custom ops re-export both.
"""

from __future__ import annotations

import torch

from fp4_dispatch.engine.plans import PlanKey

__all__ = ["CaptureNotWarmError", "not_warm", "stream_capturing"]


class CaptureNotWarmError(RuntimeError):
    """A GEMM shape reached a CUDA graph capture before its plan had ever run eagerly."""


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def stream_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False without CUDA).

    Calls what ``torch.cuda.is_current_stream_capturing`` calls, without its Python
    frame: this runs on every eager GEMM."""
    return _capturing is not None and torch.cuda.is_initialized() and _capturing()


def not_warm(device_name: str, key: PlanKey, why: str) -> CaptureNotWarmError:
    """The error for a shape whose plan may not launch inside a capture (names the fix)."""
    m, n, k, dtype, op = key[:5]
    what = {"w4a4": "GEMM", "w4a16": "W4A16 GEMM"}.get(op, f"{op.upper()} GEMM")
    if len(key) > 5:
        what += f" over E={key[5]} experts"
    return CaptureNotWarmError(
        f"fp4_dispatch: {what} M={m} N={n} K={k} out={dtype} on {device_name} reached a "
        f"CUDA graph capture {why}. Inside a capture nothing is ranked, built, compiled, "
        "allocated or tuned, so the kernel must have run at this exact shape beforehand. "
        "Run the model once at this shape before capturing (torch.compile "
        "mode='reduce-overhead' does), or call fp4_dispatch.engine.torch_ops.warmup(dispatcher, "
        f"[({m}, {n}, {k})]). Nothing was launched; this capture is invalid."
    )
