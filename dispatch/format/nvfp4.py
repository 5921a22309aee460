"""The NVFP4 number format: quantize, dequantize, scale swizzle and a reference GEMM.

Format:

- Values are e2m1 (fp4): 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit. Codes
  0-7 are the magnitudes ``E2M1_VALUES`` = (0, 0.5, 1, 1.5, 2, 3, 4, 6); codes 8-15 are
  their negatives. Two codes share a byte, the LOW nibble holding the even column, so a
  data tensor is ``uint8 [R, K/2]`` (``torch.float4_e2m1fn_x2`` is accepted and viewed
  as uint8).
- Every 16 consecutive elements of a row share one ``float8_e4m3fn`` block scale.
- One float32 *global* scale per tensor is the DECODE multiplier::

      dequant[r, k] = e2m1[r, k] * scale[r, k // 16] * global_scale

  FlashInfer's quantizer takes the inverse (``448 * 6 / amax``); here that convention
  is accepted only through the keyword ``encode_scale``.
- Block scales come in two layouts. ``linear`` is ``[R, K/16]``. ``swizzled`` is the
  128x4 layout cuBLASLt, FlashInfer and torch ``_scaled_mm`` consume: a tensor shaped
  ``[ceil128(R), ceil4(K/16)]`` (zero padding included) whose flat storage holds entry
  (m, kb) at ``(m // 128) * numKTiles * 512 + (kb // 4) * 512 + (m % 32) * 16 +
  ((m % 128) // 32) * 4 + (kb % 4)`` with ``numKTiles = ceil(K / 16 / 4)``.

Exactness: an e2m1 value times an e4m3 scale is exact in fp16 and bf16 (and in
float32), so kernels may dequantize to a 16-bit type and apply the global scale in
float32 at the end. The default global scale ``amax / (6 * 448)`` is not exact in
float32, so quantize -> dequantize round trips of representable values are exact only
with a power-of-two global scale.

Non-finite values. NVFP4 has no NaN/inf code, and a non-finite input must damage only
its own row of a GEMM output (as a bf16 ``nn.Linear`` would), never the whole tensor:

- the dynamic global scale is ``amax / (6 * 448)`` over the FINITE values only (1.0
  when that is 0, or when the division underflows to 0);
- a 16-element block holding any NaN or ±inf gets the e4m3 NaN scale byte ``0x7F`` and
  codes 0, so it dequantizes to NaN and a GEMM row reading it comes out NaN;
- every other block is quantized exactly as if the row had no non-finite value.

Checking for non-finite inputs needs a host synchronisation, so `quantize_nvfp4` does
it only with ``check_finite=True`` (then NaN/inf raise ValueError).

Quantization accepts ``K % 16 == 0``; the GEMM backends additionally require
``K % 32 == 0`` (whole bytes per 16-element block pair, the kernels' K tiling). That rule
is checked by the backends, not by this module.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from fp4_dispatch.support.optional import OptionalCode

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCK_SIZE",
    "DATA_LAYOUTS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "DataLayout",
    "Layout",
    "Nvfp4Tensor",
    "as_uint8_data",
    "dequantize",
    "e2m1_to_float",
    "pack_e2m1",
    "quantize_fields",
    "quantize_nvfp4",
    "reference_gemm",
    "round_to_e2m1",
    "sm90_prepare_data",
    "sm90_unprepare_data",
    "swizzle_scales",
    "swizzled_scale_shape",
    "unpack_e2m1",
    "unswizzle_scales",
]

Layout = Literal["swizzled", "linear"]
LAYOUTS: tuple[str, ...] = ("swizzled", "linear")
#: Byte order of ``data`` (`sm90_prepare_data` says what "sm90-prepared" is).
DataLayout = Literal["natural", "sm90-prepared"]
DATA_LAYOUTS: tuple[str, ...] = ("natural", "sm90-prepared")

#: Elements per block scale.
BLOCK_SIZE = 16
#: Largest finite e4m3fn value (block scales saturate here).
E4M3_MAX = 448.0
#: Largest e2m1 magnitude (values saturate here).
E2M1_MAX = 6.0
#: The 8 non-negative e2m1 magnitudes, indexed by code 0-7.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between neighbouring magnitudes. At a tie, round-to-nearest-even picks the
# code whose index is even (0, 2, 4, 6 -> 0, 1, 2, 4): for midpoint i (between codes i
# and i+1) ties go down when i is even and up when i is odd.
_MIDPOINTS: tuple[float, ...] = tuple(
    (E2M1_VALUES[i] + E2M1_VALUES[i + 1]) / 2 for i in range(len(E2M1_VALUES) - 1)
)

_FLOAT4_DTYPE: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)
_SCALE_DTYPE = torch.float8_e4m3fn
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def swizzled_scale_shape(rows: int, k: int) -> tuple[int, int]:
    """Shape of the swizzled scale tensor for an ``[rows, k]`` operand (padding included)."""
    if k % BLOCK_SIZE:
        raise ValueError(f"k must be a multiple of {BLOCK_SIZE}, got {k}")
    return _ceil_to(rows, 128), _ceil_to(k // BLOCK_SIZE, 4)


def as_uint8_data(t: torch.Tensor) -> torch.Tensor:
    """View packed e2m1 data as uint8; ``float4_e2m1fn_x2`` holds the same bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"data: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.uint8:
        return t
    if _FLOAT4_DTYPE is not None and t.dtype == _FLOAT4_DTYPE:
        return t.view(torch.uint8)
    raise TypeError(f"data: expected dtype torch.uint8 or torch.float4_e2m1fn_x2, got {t.dtype}")


# ---------------------------------------------------------------------------------------
# e2m1 codes
# ---------------------------------------------------------------------------------------


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 codes (uint8, 0-15, one per element) to float32.

    Arithmetic rather than a table lookup: a table would be a host-to-device copy on
    every call, which a CUDA-graph capture cannot contain.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    c = (codes & 0xF).to(torch.int32)
    exp = (c >> 1) & 3
    half_mant = (c & 1).to(torch.float32) * 0.5
    normal = torch.exp2((exp - 1).to(torch.float32)) * (1.0 + half_mant)
    mag = torch.where(exp == 0, half_mant, normal)
    return mag * (1 - 2 * ((c >> 3) & 1)).to(torch.float32)


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values to e2m1 codes: nearest, ties to even, saturating at ±6.

    A zero magnitude always gets code 0 (never the negative zero code 8).
    """
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, t in enumerate(_MIDPOINTS):  # 7 thresholds, each a vectorised compare
        above = a >= t if i % 2 else a > t
        mag += above.to(torch.uint8)
    sign = ((y < 0) & (mag != 0)).to(torch.uint8) << 3
    return mag | sign


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``uint8 [R, K]`` codes into ``uint8 [R, K/2]``, even column in the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(
            f"codes: expected a 2-D tensor with even K, got shape {tuple(codes.shape)}"
        )
    low = codes[:, 0::2] & 0xF
    high = codes[:, 1::2] & 0xF
    return (low | (high << 4)).contiguous()


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Unpack ``[R, K/2]`` bytes (uint8 or float4_e2m1fn_x2) into ``uint8 [R, K]`` codes."""
    data = as_uint8_data(data)
    if data.dim() != 2:
        raise ValueError(f"data: expected a 2-D tensor, got shape {tuple(data.shape)}")
    low = data & 0xF
    high = data >> 4
    return torch.stack([low, high], dim=-1).reshape(data.shape[0], data.shape[1] * 2)


# ---------------------------------------------------------------------------------------
# Scale layouts
# ---------------------------------------------------------------------------------------


def _check_scale_dtype(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _SCALE_DTYPE:
        raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn, got {t.dtype}")


def swizzle_scales(
    linear: torch.Tensor, rows: int | None = None, k: int | None = None
) -> torch.Tensor:
    """Linear ``[R, K/16]`` e4m3 scales -> swizzled ``[ceil128(R), ceil4(K/16)]``.

    ``rows``/``k`` are optional and, when given, checked against ``linear``'s shape.
    Padding entries are zero. The reshuffle runs on the uint8 bit patterns (a pure
    permutation), so it works wherever uint8 indexing works.
    """
    _check_scale_dtype(linear, "linear")
    if linear.dim() != 2:
        raise ValueError(f"linear: expected a 2-D tensor, got shape {tuple(linear.shape)}")
    r, kb = linear.shape
    if rows is not None and rows != r:
        raise ValueError(f"linear: expected {rows} rows, got {r}")
    if k is not None and k != kb * BLOCK_SIZE:
        raise ValueError(f"linear: expected {k // BLOCK_SIZE} scale columns (k={k}), got {kb}")
    rp, kp = _ceil_to(r, 128), _ceil_to(kb, 4)
    bits = linear.view(torch.uint8)
    padded = torch.zeros((rp, kp), dtype=torch.uint8, device=linear.device)
    padded[:r, :kb] = bits
    # m = r128 * 128 + i4 * 32 + i32 ; kb = kt * 4 + j4  ->  order (r128, kt, i32, i4, j4)
    tiled = padded.view(rp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiled.contiguous().view(rp, kp).view(_SCALE_DTYPE)


def check_swizzled_scales(swizzled: torch.Tensor, rows: int, k: int) -> None:
    """Raise unless `swizzled` is an e4m3 tensor of the swizzled size of an ``[rows, k]``
    operand (`swizzled_scale_shape`)."""
    _check_scale_dtype(swizzled, "swizzled")
    rp, kp = swizzled_scale_shape(rows, k)
    if swizzled.numel() != rp * kp:
        raise ValueError(
            f"swizzled: expected {rp * kp} elements ([{rp}, {kp}] for rows={rows}, k={k}), "
            f"got shape {tuple(swizzled.shape)}"
        )


def unswizzle_scales(swizzled: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Swizzled scales of an ``[rows, k]`` operand -> linear ``[rows, k/16]``."""
    check_swizzled_scales(swizzled, rows, k)
    rp, kp = swizzled_scale_shape(rows, k)
    bits = swizzled.contiguous().view(torch.uint8).reshape(rp // 128, kp // 4, 32, 4, 4)
    # order (r128, kt, i32, i4, j4) -> (r128, i4, i32, kt, j4) = row-major (m, kb)
    linear = bits.permute(0, 3, 2, 1, 4).reshape(rp, kp)
    return linear[:rows, : k // BLOCK_SIZE].contiguous().view(_SCALE_DTYPE)


# ---------------------------------------------------------------------------------------
# Data layouts
# ---------------------------------------------------------------------------------------

#: bytes per permutation group of the sm90-prepared layout (64 K elements, 4 scale blocks)
SM90_GROUP = 32


def _check_prepare_input(data: torch.Tensor, name: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"{name}: expected a uint8 tensor [N, K/2], got {got}")
    if data.dim() != 2 or data.shape[1] % SM90_GROUP:
        raise ValueError(
            f"{name}: expected [N, K/2] with K % 64 == 0, got shape {tuple(data.shape)}"
        )


def rotate_high_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Natural bytes -> bytes whose HIGH nibble is rotated: sign to bit 4, magnitude to 5-7.

    Natural byte ``s1 m1 | s0 m0`` (bit 7 sign of the odd element, bits 4-6 its magnitude,
    bit 3 sign of the even element, bits 0-2 its magnitude) becomes ``m1 s1 | s0 m0``: step
    2 of `sm90_prepare_data` (why: the Hopper W4A16 kernel's bf16 dequantizer).
    """
    return (b & 0x0F) | ((b & 0x70) << 1) | ((b & 0x80) >> 3)


def unrotate_high_nibbles(b: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate_high_nibbles`."""
    return (b & 0x0F) | ((b & 0xE0) >> 1) | ((b & 0x10) << 3)


def sm90_prepare_data(data: torch.Tensor) -> torch.Tensor:
    """Natural packed e2m1 ``uint8 [N, K/2]`` -> the ``"sm90-prepared"`` byte layout.

    The Hopper W4A16 kernel (`fp4_dispatch.backends.sm90.gemm_w4a16`) dequantizes this
    layout with fewer instructions; it is produced once at load time. Two reversible steps
    on each row (K % 64 == 0; scales are unchanged):

    1. a byte permutation matched to the MMA operand fragment: within every group of 32
       bytes (64 K elements, four scale blocks), natural byte ``8q + 4c + 2h + e``
       (q in 0..3 the scale block, c, h, e in 0..1) moves to position
       ``16c + 4q + 2h + e``. Each 4-byte word then holds exactly the bytes one MMA lane
       needs (no byte repacking), and over two 16-byte MMA steps that lane sees one whole
       scale block per row (one scale conversion per 16 values instead of per 4);
    2. inside each byte the high nibble (the odd K element) is rotated: its sign moves
       from bit 7 to bit 4 and its magnitude from bits 4-6 to bits 5-7; the low nibble
       stays as is (both bf16 value pairs then take 3 instructions, not 4).

    `sm90_unprepare_data` is the exact inverse.
    """
    _check_prepare_input(data, "data")
    n, kb = data.shape
    grouped = data.reshape(n, kb // SM90_GROUP, 4, 2, 2, 2)  # natural (q, c, h, e)
    b = grouped.permute(0, 1, 3, 2, 4, 5).contiguous().reshape(n, kb)  # memory (c, q, h, e)
    return rotate_high_nibbles(b)


def sm90_unprepare_data(data: torch.Tensor) -> torch.Tensor:
    """The inverse of `sm90_prepare_data`: prepared bytes -> natural packed e2m1."""
    _check_prepare_input(data, "data")
    n, kb = data.shape
    b = unrotate_high_nibbles(data)
    grouped = b.reshape(n, kb // SM90_GROUP, 2, 4, 2, 2)  # memory (c, q, h, e)
    return grouped.permute(0, 1, 3, 2, 4, 5).contiguous().reshape(n, kb)  # natural order


# ---------------------------------------------------------------------------------------
# The tensor
# ---------------------------------------------------------------------------------------


def _value_unreadable(t: torch.Tensor) -> bool:
    """True while torch.compile traces or ``t``'s device is capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class Nvfp4Tensor:
    """An NVFP4-quantized ``[R, K]`` matrix.

    - ``data``: uint8 ``[R, K/2]``, two e2m1 codes per byte, low nibble = even column
      (a ``float4_e2m1fn_x2`` tensor is accepted and stored as its uint8 view).
    - ``scale``: float8_e4m3fn; ``[ceil128(R), ceil4(K/16)]`` in swizzled storage order
      when ``layout == "swizzled"``, ``[R, K/16]`` when ``layout == "linear"``.
    - ``global_scale``: float32 0-dim tensor, the decode multiplier.
    - ``shape``: ``(R, K)``; ``K % 16 == 0`` (GEMM backends also need ``K % 32 == 0``).
    - ``data_layout``: ``"natural"`` (the format above, what every backend reads) or
      ``"sm90-prepared"`` (`sm90_prepare_data`: the same bytes reordered for the Hopper
      W4A16 kernel, made once at load time; needs ``K % 64 == 0``). `dequantize`,
      `reference_gemm`, `to`, `with_layout` understand both; `natural` and
      `with_data_layout` convert.

    The constructor checks every field, including that the global scale is finite and
    > 0 (a host sync for a CUDA tensor; skipped under torch.compile tracing and CUDA
    graph capture, where a value cannot be read). `quantize_nvfp4` builds through an
    internal path that skips the checks.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    layout: Layout
    shape: tuple[int, int]
    data_layout: DataLayout = "natural"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", as_uint8_data(self.data))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.data_layout not in DATA_LAYOUTS:
            raise ValueError(
                f"data_layout: expected one of {DATA_LAYOUTS}, got {self.data_layout!r}"
            )
        if self.data_layout == "sm90-prepared" and self.shape[1] % (2 * SM90_GROUP):
            raise ValueError(
                f"data_layout 'sm90-prepared': expected K % 64 == 0, got shape {self.shape}"
            )
        shape = tuple(self.shape)
        if len(shape) != 2 or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"shape: expected a tuple (R, K) of two ints >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        r, k = shape
        if k % BLOCK_SIZE:
            raise ValueError(f"shape: K must be a multiple of {BLOCK_SIZE}, got K={k}")
        if tuple(self.data.shape) != (r, k // 2):
            raise ValueError(
                f"data: expected shape {(r, k // 2)} for shape {shape}, "
                f"got {tuple(self.data.shape)}"
            )
        _check_scale_dtype(self.scale, "scale")
        want = swizzled_scale_shape(r, k) if self.layout == "swizzled" else (r, k // BLOCK_SIZE)
        if tuple(self.scale.shape) != want:
            raise ValueError(
                f"scale: expected shape {want} for layout {self.layout!r} and shape {shape}, "
                f"got {tuple(self.scale.shape)}"
            )
        if self.layout == "swizzled" and not self.scale.is_contiguous():
            raise ValueError(
                "scale: a swizzled scale tensor must be contiguous (its storage "
                "order is the layout), got a non-contiguous view"
            )
        g = self.global_scale
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"global_scale: expected a float32 0-dim torch.Tensor, got {type(g).__name__}"
            )
        if g.dtype != torch.float32 or g.dim() != 0:
            raise TypeError(
                f"global_scale: expected a float32 0-dim tensor, "
                f"got dtype {g.dtype} with shape {tuple(g.shape)}"
            )
        devices = {self.data.device, self.scale.device, g.device}
        if len(devices) != 1:
            raise ValueError(
                f"data, scale and global_scale must be on one device, got "
                f"{self.data.device}, {self.scale.device}, {g.device}"
            )
        # A host sync on CUDA; acceptable: tensors are built by users off the hot path
        # (quantize_nvfp4 and the library's own copies use `_trusted`). Skipped where a
        # value cannot be read: while torch.compile traces, or inside a CUDA graph capture.
        if not _value_unreadable(g):
            v = float(g)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"global_scale: expected a finite value > 0, got {v}")

    @classmethod
    def _trusted(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        layout: Layout,
        shape: tuple[int, int],
        data_layout: DataLayout = "natural",
    ) -> Nvfp4Tensor:
        """Build from fields already known valid (no checks, no host sync): the hot path."""
        obj = object.__new__(cls)
        obj.__dict__.update(  # bypasses the frozen __setattr__, as dataclasses do
            data=data,
            scale=scale,
            global_scale=global_scale,
            layout=layout,
            shape=shape,
            data_layout=data_layout,
        )
        return obj

    def __repr__(self) -> str:
        # No values: printing a CUDA tensor's contents would synchronise.
        extra = "" if self.data_layout == "natural" else f", data_layout={self.data_layout!r}"
        return (
            f"Nvfp4Tensor(shape={self.shape}, layout={self.layout!r}{extra}, device={self.device})"
        )

    def natural_data(self) -> torch.Tensor:
        """``data`` in the natural byte order (a copy when the tensor is prepared)."""
        if self.data_layout == "natural":
            return self.data
        return sm90_unprepare_data(self.data)

    def natural(self) -> Nvfp4Tensor:
        """The same values with ``data`` in natural order (self when it already is)."""
        return self.with_data_layout("natural")

    def with_data_layout(self, data_layout: DataLayout) -> Nvfp4Tensor:
        """The same values with ``data`` in ``data_layout`` (self when already there)."""
        if data_layout not in DATA_LAYOUTS:
            raise ValueError(f"data_layout: expected one of {DATA_LAYOUTS}, got {data_layout!r}")
        if data_layout == self.data_layout:
            return self
        if data_layout == "sm90-prepared" and self.k % (2 * SM90_GROUP):
            raise ValueError(f"data_layout 'sm90-prepared': expected K % 64 == 0, got K={self.k}")
        natural = self.natural_data()
        data = natural if data_layout == "natural" else sm90_prepare_data(natural)
        return Nvfp4Tensor._trusted(
            data, self.scale, self.global_scale, self.layout, self.shape, data_layout
        )

    def dequantize(self) -> torch.Tensor:
        """float32 ``[R, K]``: ``e2m1 * scale * global_scale`` (same as `dequantize`)."""
        return dequantize(self)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> Nvfp4Tensor:
        """A copy on ``device`` (the same object when already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return Nvfp4Tensor._trusted(
            self.data.to(device),
            self.scale.to(device),
            self.global_scale.to(device),
            self.layout,
            self.shape,
            self.data_layout,
        )

    def linear_scale(self) -> torch.Tensor:
        """Block scales as ``[R, K/16]`` whatever the stored layout."""
        if self.layout == "linear":
            return self.scale
        return unswizzle_scales(self.scale, self.rows, self.k)

    def with_layout(self, layout: Layout) -> Nvfp4Tensor:
        """The same values with the block scales in ``layout``."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if layout == self.layout:
            return self
        lin = self.linear_scale()
        scale = lin if layout == "linear" else swizzle_scales(lin)
        return Nvfp4Tensor._trusted(
            self.data, scale, self.global_scale, layout, self.shape, self.data_layout
        )


# ---------------------------------------------------------------------------------------
# Quantize / dequantize
# ---------------------------------------------------------------------------------------


def _f32(v: float) -> float:
    """``v`` rounded to float32 (nearest even; ±inf past the float32 range), as a float."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _usable(v: float, name: str) -> None:
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a finite value > 0, got {v}")


def _scale_tensor(value: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A one-element tensor as a float32 0-dim tensor on ``device`` (no host sync).

    One that already is (a calibrated scale buffer, the common case) is returned as it
    is: the three conversions cost ~5 µs of host time per eager call on the H200 host.
    The quantizer never writes it (its global-scale output is a new tensor)."""
    if (value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad
            and value.device == device):  # fmt: skip
        return value
    if value.numel() != 1:
        raise ValueError(f"{name}: expected one element, got shape {tuple(value.shape)}")
    return value.detach().reshape(()).to(device=device, dtype=torch.float32)


def _global_scale_arg(
    global_scale: float | torch.Tensor | None,
    encode_scale: float | torch.Tensor | None,
    device: torch.device,
    check: bool,
) -> float | torch.Tensor | None:
    """The decode scale as None (dynamic), a float32-rounded Python float or a device tensor.

    Python floats are validated here (free); tensors only when ``check`` (a host sync).
    """
    if global_scale is not None and encode_scale is not None:
        raise ValueError("give global_scale (decode) or encode_scale (its inverse), not both")
    name = "encode_scale" if encode_scale is not None else "global_scale"
    value = encode_scale if encode_scale is not None else global_scale
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = _scale_tensor(value, name, device)
        if encode_scale is not None:
            if check:
                _usable(float(t), name)
            t = torch.reciprocal(t)
        if check:
            v = float(t)
            if encode_scale is not None and (not math.isfinite(v) or v <= 0):
                raise ValueError(f"encode_scale: its inverse {v} is not a usable global scale")
            _usable(v, name)
        return t
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a float or a one-element tensor, got {type(value)}")
    v = _f32(float(value))
    _usable(v, name)
    if encode_scale is not None:
        v = _f32(1.0 / v)  # float32 division, correctly rounded through float64
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"encode_scale: its inverse {v} is not a usable global scale")
    return v


def _dynamic_scale(xf: torch.Tensor) -> torch.Tensor:
    """``amax / (6 * 448)`` over the finite values of ``xf``; 1.0 when that is 0."""
    if not xf.numel():
        return torch.ones((), dtype=torch.float32, device=xf.device)
    finite_abs = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), device=xf.device))
    g = finite_abs.amax() / (E2M1_MAX * E4M3_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)  # all zeros, or underflow


def quantize_blocks(xf: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic of `quantize_nvfp4`, with no checks and no host synchronisation.

    ``xf``: float32 ``[R, K]``, K % 16 == 0; ``g``: the float32 0-dim global (decode)
    scale. Returns packed data ``uint8 [R, K/2]`` and linear e4m3 scales ``[R, K/16]``.
    A block holding NaN/inf gets scale byte 0x7F and codes 0 (module docstring).
    This is the reference the Triton kernel (`fp4_dispatch.backends.quantize`) matches
    byte for byte.
    """
    r, k = xf.shape
    kb = k // BLOCK_SIZE
    blocks = xf.reshape(r, kb, BLOCK_SIZE)
    finite = torch.isfinite(blocks)
    bad = ~finite.all(dim=-1)
    zero = torch.zeros((), device=xf.device)
    block_amax = (
        torch.where(finite, blocks.abs(), zero).amax(dim=-1)
        if xf.numel()
        else xf.new_zeros((r, kb))
    )
    scale = (block_amax / E2M1_MAX / g).clamp(max=E4M3_MAX).to(_SCALE_DTYPE)
    bits = torch.where(
        bad, torch.full((), 0x7F, dtype=torch.uint8, device=xf.device), scale.view(torch.uint8)
    )
    scale = bits.view(_SCALE_DTYPE)
    denom = scale.to(torch.float32) * g
    usable = (denom > 0) & ~bad
    y = torch.where(
        usable.unsqueeze(-1),
        blocks / torch.where(usable, denom, torch.ones_like(denom)).unsqueeze(-1),
        torch.zeros_like(blocks),
    )
    return pack_e2m1(round_to_e2m1(y).reshape(r, k)), scale


def _load_quantizer() -> object:
    """The Triton kernel's entry (raises ImportError without Triton)."""
    from fp4_dispatch.backends.quantize import quantize_checked  # noqa: PLC0415 - optional: Triton

    return quantize_checked


#: the Triton kernel's entry when Triton imports, else False (looked up once)
_kernel_quantizer = OptionalCode(_load_quantizer, "Triton quantize kernel", logger)


def _load_keeper() -> object:
    """The Triton kernel's kept-replay look-up (raises ImportError without Triton)."""
    from fp4_dispatch.backends.quantize import kept_quantize  # noqa: PLC0415 - optional: Triton

    return kept_quantize


_kept_quantize = OptionalCode(_load_keeper, "Triton quantize kernel's replays", logger)


def kept_quantize(x: torch.Tensor, g: torch.Tensor | None) -> Callable | None:
    """A kept form of `quantize_fields` (swizzled) for calls like this one: ``kept(x2)``
    returns ``(data, scale, global_scale)`` of a new ``x2`` of the same signature through
    the fused kernel's recorded driver-API replay, or None (nothing launched). None when
    there is no such replay (a CPU tensor, no Triton, replays off, not recorded yet:
    the kernel records on the third call of a kind). For callers that check the
    signature themselves (`fp4_dispatch.integrations.nn`)."""
    if not x.is_cuda:
        return None
    look_up = _kept_quantize()
    return look_up(x, g) if look_up else None


def quantize_fields(
    x: torch.Tensor, g: float | torch.Tensor | None, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale, global_scale)`` of checked inputs, with no host synchronisation.

    ``g``: None (dynamic), a float32-valued Python float or a float32 0-dim tensor on
    x's device. On CUDA with Triton: the fused kernel; otherwise the torch reference.
    The returned global scale never aliases ``g``. Shared with ``fp4_dispatch::quantize``.
    """
    if x.is_cuda and x.numel():
        kernel = _kernel_quantizer()
        if kernel:
            if x.stride(1) != 1:
                x = x.contiguous()
            return kernel(x, g, layout)  # reads x's memory only: no autograd involved
    xf = x.detach().to(torch.float32)
    if g is None:
        gt = _dynamic_scale(xf)
    elif isinstance(g, torch.Tensor):
        gt = g.clone()
    else:
        gt = torch.tensor(g, dtype=torch.float32, device=xf.device)
    data, scale = quantize_blocks(xf, gt)
    if layout == "swizzled":
        scale = swizzle_scales(scale)
    return data, scale, gt


def _check_input(x: torch.Tensor, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor [R, K], got shape {tuple(x.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"x: K must be a multiple of {BLOCK_SIZE}, got K={x.shape[1]}")


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: float | torch.Tensor | None = None,
    layout: Layout = "swizzled",
    *,
    encode_scale: float | torch.Tensor | None = None,
    check_finite: bool = False,
) -> Nvfp4Tensor:
    """Quantize a 2-D float tensor ``[R, K]`` (``K % 16 == 0``) to NVFP4.

    ``global_scale`` is the decode multiplier (default ``amax(finite |x|) / (6 * 448)``,
    or 1.0 when that is 0). ``encode_scale`` is FlashInfer's inverse convention
    (``448 * 6 / amax``); give at most one of the two. Block scale =
    ``e4m3(min(block_amax / 6 / global_scale, 448))``; codes are ``x / (scale *
    global_scale)`` rounded to nearest-even on the e2m1 grid, saturating at ±6.
    Arithmetic is float32 whatever the input dtype (fp32, fp16, bf16). NaN/inf: see the
    module docstring (their block gets the NaN scale 0x7F, other rows are unaffected).

    No host synchronisation unless ``check_finite=True``, which raises ValueError for a
    non-finite ``x`` and validates a *tensor* global/encode scale (Python floats are
    always validated). On CUDA with Triton installed this is one fused kernel launch
    (two for a large dynamic scale) and can be captured in a CUDA graph.
    """
    key = kept = None
    if encode_scale is None and not check_finite and layout == "swizzled":
        key = _kept_key(x, global_scale)
        kept = _kept_calls.get(key) if key is not None else None
        if kept is not None:  # None from it: replays off or a launch hook (ordinary path)
            got = kept(x, global_scale)
            if got is not None:
                return Nvfp4Tensor._trusted(*got, "swizzled", (x.shape[0], x.shape[1]))
    _check_input(x, layout)
    r, k = x.shape
    g = _global_scale_arg(global_scale, encode_scale, x.device, check_finite)
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains NaN or inf; NVFP4 has no encoding for them")
    data, scale, gt = quantize_fields(x, g, layout)
    if key is not None and kept is None:
        kept = kept_quantize(x, g)
        if kept is not None:
            _kept_calls[key] = kept
    return Nvfp4Tensor._trusted(data, scale, gt, layout, (r, k))


#: `quantize_nvfp4`'s kept calls: the quantize kernel's recorded replay (`kept_quantize`)
#: by call signature (`_kept_key`). A call that matches one skips the checks and look-ups
#: that the first calls of its signature made (its signature implies they pass).
_kept_calls: dict[tuple, Callable] = {}


def _kept_key(x: object, g: object) -> tuple | None:
    """The signature of a swizzled call on a CUDA tensor with a dynamic scale or a
    float32 one-element scale tensor on x's device (what the kept replay depends on:
    shape, dtype, strides, 16-byte alignment and device of each); None for anything else
    (a CPU tensor, a subclass, a Python-float scale: the ordinary path)."""
    if type(x) is not torch.Tensor or not x.is_cuda:
        return None
    dev = x.get_device()
    if g is None:
        gk = None
    elif (type(g) is torch.Tensor and g.dtype is torch.float32 and g.numel() == 1
          and g.get_device() == dev):  # fmt: skip
        gk = g.data_ptr() & 15
    else:
        return None
    return (x.shape, x.dtype, x.stride(), x.data_ptr() & 15, dev, gk)


def dequantize(q: Nvfp4Tensor) -> torch.Tensor:
    """``e2m1(q) * scale * global_scale`` as float32 ``[R, K]`` (any scale or data layout)."""
    if not isinstance(q, Nvfp4Tensor):
        raise TypeError(f"q: expected an Nvfp4Tensor, got {type(q).__name__}")
    r, k = q.shape
    vals = e2m1_to_float(unpack_e2m1(q.natural_data())).reshape(r, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = q.linear_scale().to(torch.float32).unsqueeze(-1)
    return ((vals * scale) * q.global_scale).reshape(r, k)


def reference_gemm(qa: Nvfp4Tensor, qb: Nvfp4Tensor) -> torch.Tensor:
    """``dequant(qa) @ dequant(qb).T`` in float64 on the CPU: the ground truth for kernels."""
    if qa.k != qb.k:
        raise ValueError(f"qa and qb: K must match, got {qa.k} and {qb.k}")
    a = dequantize(qa.to("cpu")).to(torch.float64)
    b = dequantize(qb.to("cpu")).to(torch.float64)
    return a @ b.T
