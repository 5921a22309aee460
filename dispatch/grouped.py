"""Grouped (mixture-of-experts) NVFP4 values: the stacked expert weight, offsets, reference.

An MoE layer multiplies each token's rows by the weights of the experts the router
chose. Rows are sorted by expert, so one call covers all experts (docs/grouped.md):

    out[r] = A[r] @ dequant(W[e]).T     for r in [offsets[e-1], offsets[e])

- `Nvfp4Experts`: the E expert weights ``[E, N, K]`` as one object, a global scale per
  expert (real checkpoints quantize each expert on its own); `quantize_experts` and
  `Nvfp4Experts.stack` build one.
- offsets: int32 ``[E]`` cumulative row ends on the device (torch ``_grouped_mm``'s
  convention). `check_offsets` checks what can be checked without reading it;
  `check_offset_values` reads it (a host synchronisation: tests, references, opt-in).
- `grouped_reference` / `reference_output`: the exact float64 product, per expert, on
  the CPU: the ground truth every grouped kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .nvfp4 import (
    BLOCK_SIZE,
    Nvfp4Tensor,
    as_uint8_data,
    e2m1_to_float,
    quantize_nvfp4,
    swizzled_scale_shape,
    unpack_e2m1,
    unswizzle_scales,
)
from .tactics import GROUPED_OPERATIONS

__all__ = [
    "Nvfp4Experts",
    "balanced_offsets",
    "check_groups",
    "check_offset_values",
    "check_offsets",
    "check_stack",
    "grouped_reference",
    "quantize_experts",
    "reference_output",
]


def _readable(t: torch.Tensor) -> bool:
    """Whether `t`'s values may be read now (not while tracing or capturing a graph)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class Nvfp4Experts:
    """E NVFP4 expert weights ``[E, N, K]`` stacked: what a grouped GEMM multiplies.

    - ``data``: uint8 ``[E, N, K/2]`` contiguous, each expert's rows as `Nvfp4Tensor`
      data (two e2m1 codes per byte, low nibble = even column).
    - ``scale``: float8_e4m3fn ``[E, ceil128(N), ceil4(K/16)]`` contiguous: each expert's
      block scales in the 128x4 swizzled order (`fp4_dispatch.nvfp4`), padding included.
      Why per-expert slabs rather than one swizzled ``[E*N, K/16]`` tensor: an expert's
      scales then are exactly a dense weight's, so dense kernels, checks and the
      checkpoint loaders apply to ``expert(e)`` unchanged, and N need not be a multiple
      of 128.
    - ``global_scale``: float32 ``[E]``, each expert's decode multiplier.
    - ``shape``: ``(E, N, K)``; ``K % 16 == 0`` (the GEMMs need ``K % 32 == 0``).

    A separate type rather than a 3-D `Nvfp4Tensor`: everything that takes an
    `Nvfp4Tensor` reads it as one ``[R, K]`` matrix with one global scale; an expert
    stack handed there by mistake is then a type error, not a silently wrong product.
    The constructor checks shapes, dtypes and devices, and the scales' values when they
    can be read (a host sync on CUDA; skipped while tracing or capturing).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", as_uint8_data(self.data))
        shape = tuple(self.shape)
        if len(shape) != 3 or not all(type(s) is int and s >= 1 for s in shape):
            raise ValueError(f"shape: expected (E, N, K) of three ints >= 1, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        e, n, k = shape
        if k % BLOCK_SIZE:
            raise ValueError(f"shape: K must be a multiple of {BLOCK_SIZE}, got K={k}")
        _expect(self.data, "data", (e, n, k // 2), torch.uint8)
        _expect(self.scale, "scale", (e, *swizzled_scale_shape(n, k)), torch.float8_e4m3fn)
        _expect(self.global_scale, "global_scale", (e,), torch.float32)
        devices = {self.data.device, self.scale.device, self.global_scale.device}
        if len(devices) != 1:
            raise ValueError(
                f"data, scale and global_scale must be on one device, got "
                f"{self.data.device}, {self.scale.device}, {self.global_scale.device}"
            )
        g = self.global_scale
        if _readable(g) and not bool(torch.isfinite(g).all() & (g > 0).all()):
            raise ValueError(f"global_scale: expected finite values > 0, got {g.tolist()}")

    @classmethod
    def _trusted(
        cls, data: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, shape: tuple[int, ...]
    ) -> Nvfp4Experts:
        """Build from fields already known valid (no checks, no host sync)."""
        obj = object.__new__(cls)
        obj.__dict__.update(data=data, scale=scale, global_scale=g, shape=tuple(shape))
        return obj

    @classmethod
    def stack(cls, experts: list[Nvfp4Tensor] | tuple[Nvfp4Tensor, ...]) -> Nvfp4Experts:
        """One stack from E `Nvfp4Tensor` weights of equal shape ``[N, K]`` (any layouts,
        one device); each keeps its own global scale."""
        if not experts or not all(isinstance(q, Nvfp4Tensor) for q in experts):
            got = [type(q).__name__ for q in experts][:4] if experts else "nothing"
            raise TypeError(f"experts: expected a non-empty list of Nvfp4Tensor, got {got}")
        shapes = {q.shape for q in experts}
        if len(shapes) != 1:
            raise ValueError(f"experts: expected one shape [N, K] for all, got {sorted(shapes)}")
        n, k = experts[0].shape
        swz = [q.with_layout("swizzled").natural() for q in experts]
        data = torch.stack([q.data for q in swz]).contiguous()
        scale = torch.stack([q.scale for q in swz]).contiguous()
        g = torch.stack([q.global_scale.reshape(()) for q in swz]).to(torch.float32)
        return cls._trusted(data, scale, g, (len(experts), n, k))

    def __repr__(self) -> str:
        return f"Nvfp4Experts(shape={self.shape}, device={self.device})"

    @property
    def experts(self) -> int:
        """E."""
        return self.shape[0]

    @property
    def n(self) -> int:
        return self.shape[1]

    @property
    def k(self) -> int:
        return self.shape[2]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def expert(self, e: int) -> Nvfp4Tensor:
        """Expert `e`'s weight as an `Nvfp4Tensor` ``[N, K]`` (views, no copy)."""
        if type(e) is not int or not 0 <= e < self.experts:
            raise IndexError(f"e: expected an int in [0, {self.experts}), got {e!r}")
        return Nvfp4Tensor._trusted(
            self.data[e], self.scale[e], self.global_scale[e], "swizzled", (self.n, self.k)
        )

    def to(self, device: torch.device | str) -> Nvfp4Experts:
        """A copy on `device` (the same object when already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return Nvfp4Experts._trusted(
            self.data.to(device), self.scale.to(device), self.global_scale.to(device), self.shape
        )

    def dequantize(self) -> torch.Tensor:
        """float32 ``[E, N, K]``: ``e2m1 * block scale * global scale`` per expert."""
        e, n, k = self.shape
        vals = e2m1_to_float(unpack_e2m1(self.data.reshape(e * n, k // 2)))
        vals = vals.reshape(e, n, k // BLOCK_SIZE, BLOCK_SIZE)
        lin = torch.stack([unswizzle_scales(self.scale[i], n, k) for i in range(e)])
        out = vals * lin.to(torch.float32).unsqueeze(-1)
        return out.reshape(e, n, k) * self.global_scale.reshape(e, 1, 1)


def _expect(t: object, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def quantize_experts(
    w: torch.Tensor | list[torch.Tensor], global_scale: torch.Tensor | None = None
) -> Nvfp4Experts:
    """Quantize E dense weights (``[E, N, K]``, or a list of ``[N, K]``) to one stack.

    Each expert gets its own global scale: the dynamic ``amax / (6 * 448)`` of that
    expert (what ModelOpt and compressed-tensors checkpoints store), or
    ``global_scale[e]`` when a float32 ``[E]`` tensor is given. Same arithmetic as
    `quantize_nvfp4`, expert by expert.
    """
    weights = list(w) if isinstance(w, (list, tuple)) else None
    if weights is None:
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"w: expected a [E, N, K] tensor or a list of [N, K], got {got}")
        weights = list(w.unbind(0))
    if global_scale is not None and tuple(global_scale.shape) != (len(weights),):
        raise ValueError(
            f"global_scale: expected shape ({len(weights)},), got {tuple(global_scale.shape)}"
        )
    qs = [
        quantize_nvfp4(x, None if global_scale is None else global_scale[i])
        for i, x in enumerate(weights)
    ]
    return Nvfp4Experts.stack(qs)


def check_groups(operation: object, groups: object) -> int | None:
    """`groups` when it fits `operation`: a positive int E for a grouped operation, None
    for any other; ValueError naming what was expected otherwise."""
    grouped = operation in GROUPED_OPERATIONS
    if grouped and (type(groups) is not int or groups < 1):
        raise ValueError(f"groups: operation {operation!r} needs the expert count E "
                         f"(a positive int), got {groups!r}")  # fmt: skip
    if not grouped and groups is not None:
        raise ValueError(
            f"groups: only the grouped operations {sorted(GROUPED_OPERATIONS)} take an "
            f"expert count, got groups={groups!r} for {operation!r}"
        )
    return groups


def check_stack(b_data: object, b_scale: object, alpha: object, k: int) -> tuple[int, int]:
    """(E, N) of raw expert-stack operands (`fp4_dispatch.backend.GroupedOperands`) after
    checking their types, shapes and contiguity against A's `k`; reads no value."""
    if not isinstance(b_data, torch.Tensor) or b_data.dim() != 3:
        got = tuple(b_data.shape) if isinstance(b_data, torch.Tensor) else type(b_data).__name__
        raise ValueError(f"b_data: expected a uint8 [E, N, K/2] tensor, got {got}")
    e, n = b_data.shape[0], b_data.shape[1]
    _expect(b_data, "b_data", (e, n, k // 2), torch.uint8)
    _expect(b_scale, "b_scale", (e, *swizzled_scale_shape(n, k)), torch.float8_e4m3fn)
    _expect(alpha, "alpha", (e,), torch.float32)
    return e, n


def check_offsets(offsets: object, groups: int, device: torch.device | None = None):
    """`offsets` if it is an int32 ``[groups]`` tensor (on `device` when given); reads no
    value (no host sync): ValueError/TypeError naming what was expected otherwise."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets: expected an int32 torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected dtype torch.int32, got {offsets.dtype}")
    if tuple(offsets.shape) != (groups,):
        raise ValueError(
            f"offsets: expected shape ({groups},) (one row end per expert), "
            f"got {tuple(offsets.shape)}"
        )
    if not offsets.is_contiguous():
        raise ValueError(f"offsets: expected a contiguous tensor, got strides {offsets.stride()}")
    if device is not None and offsets.device != device:
        raise ValueError(f"offsets: expected a tensor on {device}, got {offsets.device}")
    return offsets


def check_offset_values(offsets: torch.Tensor, total: int) -> list[int]:
    """The offsets as a list after checking their values (a host sync): non-decreasing,
    ``>= 0``, and the last equal to `total` (every row belongs to an expert)."""
    ends = [int(x) for x in offsets.cpu().tolist()]
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(f"offsets: expected non-decreasing row ends >= 0, got {ends}")
        prev = end
        if e == len(ends) - 1 and end != total:
            raise ValueError(f"offsets: expected the last row end to be {total} (rows of a), "
                             f"got {end}")  # fmt: skip
    return ends


def balanced_offsets(total: int, groups: int, device: torch.device | str = "cpu"):
    """int32 offsets spreading `total` rows as evenly as the balanced-routing assumption
    of the bucket says (docs/grouped.md): ``ends[e] = (e + 1) * total // groups``, so
    with fewer rows than experts each row has its own expert (``min(total, groups)``
    touched). What tuning and benchmarks time a grouped bucket with."""
    ends = [(e + 1) * total // groups for e in range(groups)]
    return torch.tensor(ends, dtype=torch.int32, device=device)


def grouped_reference(
    a: torch.Tensor | Nvfp4Tensor, b: Nvfp4Experts, offsets: torch.Tensor
) -> torch.Tensor:
    """float64 ``[T, N]`` on the CPU: each expert's rows times its dequantized weight.

    Exact up to the float64 sums: the e2m1 x e4m3 values are exact in float64, and the
    global scales are applied in float64 after the product (``alpha[e] = g_a * g_b[e]``
    in float64, not rounded to float32). ``a`` dense ``[T, K]`` or an `Nvfp4Tensor`;
    rows of no expert come out 0. Reads the offsets (a host sync)."""
    if isinstance(a, Nvfp4Tensor):
        qa = a.to("cpu").with_layout("linear").natural()
        x = _unscaled(qa.data, qa.scale, qa.k)
        g_a = float(qa.global_scale)
    else:
        if not isinstance(a, torch.Tensor) or a.dim() != 2:
            raise ValueError(f"a: expected a [T, K] tensor or an Nvfp4Tensor, got {a!r:.80}")
        x, g_a = a.detach().to("cpu", torch.float64), 1.0
    if x.shape[1] != b.k:
        raise ValueError(f"a and b: K must match, got {x.shape[1]} and {b.k}")
    check_offsets(offsets, b.experts)
    bc = b.to("cpu")
    alpha = bc.global_scale.to(torch.float64) * g_a
    rows = torch.arange(x.shape[0])
    return _per_expert(x, rows, x.shape[0], bc.data, bc.scale, alpha, offsets)


def reference_output(
    ops: object, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 ``[len(rows), len(cols)]`` on the CPU of raw grouped operands
    (`fp4_dispatch.backend.GroupedOperands`; all rows / columns when not given, `rows`
    ascending): what a kernel given `ops` must write (rows of no expert 0; ``alpha`` as
    given, float32). What tuning and the first-use check compare with. Only the
    selected rows and columns are read and multiplied, expert by expert (a full float64
    reference of a 256-expert prefill would take minutes on a CPU)."""
    t, k = ops.a.shape[0], ops.b_data.shape[2] * 2
    rows = torch.arange(t) if rows is None else rows.cpu()
    picked = ops.a.index_select(0, rows.to(ops.a.device)).cpu()
    if ops.a_scale is not None:
        sc = unswizzle_scales(ops.a_scale.cpu(), t, k).index_select(0, rows)
        x = _unscaled(picked, sc, k)
    else:
        x = picked.to(torch.float64)
    alpha = ops.alpha.detach().cpu().to(torch.float64)
    return _per_expert(x, rows, t, ops.b_data, ops.b_scale, alpha, ops.offsets, cols)


def _unscaled(data: torch.Tensor, linear_scale: torch.Tensor, k: int) -> torch.Tensor:
    """float64 ``e2m1 * block scale`` ``[R, K]`` of packed rows and their LINEAR block
    scales ``[R, K/16]`` (no global scale)."""
    rows = data.shape[0]
    vals = e2m1_to_float(unpack_e2m1(data)).to(torch.float64)
    sc = linear_scale.to(torch.float64)
    return (vals.view(rows, k // BLOCK_SIZE, BLOCK_SIZE) * sc.unsqueeze(-1)).view(rows, k)


def _per_expert(
    x: torch.Tensor,
    rows: torch.Tensor,
    total: int,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor,
    offsets: torch.Tensor,
    cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = alpha[e] * x[i] @ w_e.T`` float64 on the CPU, where ``x[i]`` is row
    ``rows[i]`` (ascending, of `total`) and ``e`` its expert; `cols` of the output only
    (all when None). Weights are read expert by expert from their device (selected
    columns only), only for experts that own a selected row."""
    n, k = b_data.shape[1], b_data.shape[2] * 2
    cols = torch.arange(n) if cols is None else cols.cpu()
    out = torch.zeros(len(rows), len(cols), dtype=torch.float64)
    ends = offsets.cpu().tolist()
    if len(ends) != b_data.shape[0]:
        raise ValueError(f"offsets: expected {b_data.shape[0]} row ends, got {len(ends)}")
    start = 0
    for e, end in enumerate(ends):
        end = max(start, min(int(end), total))
        mine = ((rows >= start) & (rows < end)).nonzero().flatten()
        start = end
        if not len(mine):
            continue
        data = b_data[e].index_select(0, cols.to(b_data.device)).cpu()
        sc = unswizzle_scales(b_scale[e].cpu(), n, k).index_select(0, cols)
        w = _unscaled(data, sc, k)
        out[mine] = (x.index_select(0, mine) @ w.T) * alpha[e]
    return out
