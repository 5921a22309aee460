"""Argument checks for the public calls, and the one home of the output dtypes they accept.

Every check raises before anything is written, with a message naming the argument,
what was expected and what came. TypeError for wrong types/dtypes, ValueError for
wrong shapes, values and devices.
"""

from __future__ import annotations

import torch

from fp4_dispatch.format.nvfp4 import Nvfp4Tensor, swizzled_scale_shape

FP4_DATA_DTYPES = (torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
#: the one home of the output dtypes: ``Problem.out_dtype`` name -> torch dtype ...
TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: ... and back (torch dtype -> name), for checking what a caller passed
OUT_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def out_dtype_name(out_dtype: object) -> str:
    """'bfloat16' or 'float16' for a torch dtype; TypeError otherwise."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float16, got {out_dtype!r}")
    return OUT_DTYPES[out_dtype]


def default_out_dtype(a: torch.Tensor | Nvfp4Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """``out_dtype``, else the default of a GEMM of activations `a`: their own dtype for
    dense activations (W4A16), bfloat16 for NVFP4 ones (W4A4). Not checked here
    (`out_dtype_name` does)."""
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if isinstance(a, Nvfp4Tensor) else a.dtype


def nvfp4_operand(name: str, q: object) -> Nvfp4Tensor:
    if not isinstance(q, Nvfp4Tensor):
        raise TypeError(
            f"{name}: expected an Nvfp4Tensor (from quantize_nvfp4), got {type(q).__name__}"
        )
    return q


def dense_activation(name: str, t: object) -> torch.Tensor:
    """A W4A16 activation: a 2-D bfloat16/float16 tensor with unit stride along K."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name}: expected a torch.Tensor or an Nvfp4Tensor, got {type(t).__name__}"
        )
    if t.dtype not in OUT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype torch.bfloat16 or torch.float16 for a weight-only "
            f"(w4a16) GEMM, got {t.dtype} (cast it, or quantize it with quantize_nvfp4)"
        )
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, K], got shape {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: expected unit stride along K, got strides {t.stride()}")
    return t


#: K must be a multiple of this: two 16-element scale blocks, so that every packed row
#: (K/2 bytes) and every scale row (K/16, padded to 4) is whole for every backend
K_MULTIPLE = 32


def gemm_k(k: object, name: str = "K") -> int:
    """The GEMM's K rule, one function for select, candidates, explain, tune and gemm."""
    if type(k) is not int:
        raise TypeError(f"{name}: expected a positive int multiple of {K_MULTIPLE}, got {k!r}")
    if k < 1 or k % K_MULTIPLE:
        raise ValueError(
            f"{name}: K must be a positive multiple of {K_MULTIPLE} for the GEMM, got K={k}"
        )
    return k


#: the largest M, N or K a problem may have: torch's and the kernels' 32-bit sizes (an
#: explain of M = 1e20 ranked tactics at 1e22 us instead of saying the size is wrong)
MAX_DIM = 2**31 - 1


def problem_dims(m: object, n: object, k: object) -> tuple[int, int, int]:
    """(M, N, K) of a problem to rank or tune: positive ints up to `MAX_DIM`, K by
    `gemm_k`.

    ValueError for every bad value (wrong type included) so that callers parsing user
    input have one error to catch.
    """
    for name, v in (("M", m), ("N", n)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if type(k) is not int:
        raise ValueError(f"K: expected a positive int multiple of {K_MULTIPLE}, got {k!r}")
    gemm_k(k)
    for name, v in (("M", m), ("N", n), ("K", k)):
        if v > MAX_DIM:
            raise ValueError(f"{name}: expected at most {MAX_DIM} (2**31 - 1), got {v}")
    return m, n, k  # type: ignore[return-value]


def k_dims(k_a: int, k_b: int, names: tuple[str, str] = ("qa", "qb")) -> int:
    if k_a != k_b:
        raise ValueError(
            f"{names[1]}: K must match {names[0]}'s K={k_a} (out = A @ B.T with B as [N, K]), "
            f"got K={k_b}"
        )
    return gemm_k(k_a, names[0])


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device`. A CUDA device with an index is compared by
    ``get_device()`` (an int) first: ``t.device`` builds a ``torch.device`` object, a
    microsecond or two per call on the eager hot path."""
    if device.type == "cuda" and device.index is not None and t.get_device() == device.index:
        return True
    return t.device == device


def all_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data pointer is 16-byte aligned: what Triton specializes a
    pointer on, and what a recorded replay assumes of its per-call tensors. One OR per
    tensor (a hot-path check of the kept calls and keyed launches)."""
    p = 0
    for t in tensors:
        p |= t.data_ptr()
    return p % 16 == 0


def same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not on_device(t, device):
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def fp4_data(name: str, t: object, expect_rows_major: bool = True) -> torch.Tensor:
    """A packed fp4 tensor (uint8 or float4_e2m1fn_x2), 2-D; returned as uint8."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FP4_DATA_DTYPES:
        raise TypeError(
            f"{name}: expected dtype torch.uint8 or torch.float4_e2m1fn_x2 (packed e2m1), "
            f"got {t.dtype}"
        )
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    return t.view(torch.uint8)


def swizzled_scale(name: str, t: object, rows: int, k: int) -> torch.Tensor:
    """An e4m3 scale tensor in the 128x4 swizzle: 2-D padded shape or flat padded numel."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn, got {t.dtype}")
    shape = swizzled_scale_shape(rows, k)
    if tuple(t.shape) not in (shape, (shape[0] * shape[1],)):
        raise ValueError(
            f"{name}: expected the swizzled 128x4 layout of shape {shape} (or flat "
            f"{shape[0] * shape[1]}) for {rows} rows and K={k}, got {tuple(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (swizzled storage order)")
    return t.view(shape)


def alpha_tensor(alpha: object, device: torch.device) -> torch.Tensor:
    """A one-element float32 tensor on `device` (None means 1.0)."""
    if alpha is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if not isinstance(alpha, torch.Tensor):
        raise TypeError(
            f"alpha: expected a one-element float32 torch.Tensor, got {type(alpha).__name__}"
        )
    if alpha.dtype != torch.float32:
        raise TypeError(f"alpha: expected dtype torch.float32, got {alpha.dtype}")
    if alpha.numel() != 1:
        raise ValueError(f"alpha: expected one element, got shape {tuple(alpha.shape)}")
    if alpha.device != device:
        raise ValueError(f"alpha: expected a tensor on {device}, got one on {alpha.device}")
    return alpha.reshape(1)


def bias_vector(name: str, t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """A float ``[n]`` tensor on `device` (a W4A16 bias, `DenseOperands.bias`)."""
    if tuple(t.shape) != (n,) or not t.is_floating_point():
        raise ValueError(
            f"{name}: expected a float tensor of shape ({n},), got {t.dtype} "
            f"with shape {tuple(t.shape)}"
        )
    same_device(device, **{name: t})
    return t


def prepared_bytes(
    name: str, t: torch.Tensor, b_data: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """uint8 bytes of `b_data`'s shape on `device` (`DenseOperands.b_prepared`)."""
    if t.shape != b_data.shape or t.dtype != torch.uint8:
        raise ValueError(
            f"{name}: expected uint8 of b_data's shape {tuple(b_data.shape)}, "
            f"got {t.dtype} with shape {tuple(t.shape)}"
        )
    same_device(device, **{name: t})
    return t


def out_tensor(
    out: object, m: int, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Check a caller-provided output (None: the dispatcher allocates one)."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} (out_dtype), got {out.dtype}")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out: expected a tensor on {device}, got one on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    writable_out(out)
    return out


def writable_out(out: torch.Tensor) -> None:
    """Raise unless the kernels may write `out` in place here (before any kernel runs).

    A tensor that requires grad (with grad mode on) or an inference tensor outside
    ``torch.inference_mode()`` refuses in-place writes; kernels would fail on it, and
    that failure is the caller's, not the backend's.
    """
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "out: expected a tensor that does not require grad (the GEMM writes it in "
            "place, which autograd cannot track), got requires_grad=True; pass "
            "out.detach() or call under torch.no_grad()"
        )
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            "out: expected a normal tensor, got an inference tensor (made under "
            "torch.inference_mode()) outside inference mode, where it cannot be written "
            "in place; call under torch.inference_mode() or allocate out outside it"
        )


def tune_shape(shape: object) -> tuple[int, int, int]:
    """One (M, N, K) of `Dispatcher.tune`'s ``shapes``, checked; ValueError names it."""
    try:
        m, n, k = shape  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"shapes: expected (M, N, K) tuples, got {shape!r}") from None
    try:
        problem_dims(m, n, k)
    except ValueError as exc:
        raise ValueError(f"shapes: {exc} in {shape!r}") from None
    return m, n, k
