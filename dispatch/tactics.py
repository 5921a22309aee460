"""Tactic specs and problems: the typed values that cross every boundary (and their labels).

A tactic is one concrete kernel configuration. Each backend subclasses `Tactic`,
narrows `backend` to a `Literal` (the discriminator) and adds its own typed knobs.
The common geometric fields are what the shared cost model reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

OutDtype = Literal["bfloat16", "float16"]
#: the operations: both operands NVFP4 (``mm_fp4``); dense bf16/fp16 activations times
#: NVFP4 weights (weight-only, FlashInfer's ``mm_bf16_fp4``); and ``w4a8``, dense
#: activations rounded to FP8 E4M3 per token and the weights to FP8 inside the GEMM (FP8
#: tensor cores: lossy, only under ``precision="fp8"``, docs/PRECISION.md). The grouped
#: operations (mixture-of-experts, docs/grouped.md) are the same products per expert:
#: ``grouped_w4a16`` (dense activations) and ``grouped_w4a4`` (NVFP4 activations), over
#: a stack of E expert weights; there is no grouped W4A8
Operation = Literal["w4a4", "w4a16", "w4a8", "grouped_w4a16", "grouped_w4a4"]
OPERATIONS: tuple[str, ...] = ("w4a4", "w4a16", "w4a8", "grouped_w4a16", "grouped_w4a4")
#: operations over E expert weights (`Problem.groups` set): `fp4_dispatch.backend.
#: GroupedOperands`; a family serves them only when its ``Backend.operations`` lists them
GROUPED_OPERATIONS: frozenset[str] = frozenset({"grouped_w4a16", "grouped_w4a4"})
#: operations whose result rounds an operand the caller handed over exactly (the dense
#: activations): never chosen unless the user's precision policy allows it
LOSSY_OPERATIONS: frozenset[str] = frozenset({"w4a8"})
#: operations that take dense activations (`fp4_dispatch.backend.DenseOperands`)
DENSE_OPERATIONS: frozenset[str] = frozenset({"w4a16", "w4a8"})
#: the precision policies: ``exact`` (default) never rounds what the caller passed beyond
#: the output's rounding; ``fp8`` also lets dense calls run as ``w4a8``
Precision = Literal["exact", "fp8"]
PRECISIONS: tuple[str, ...] = ("exact", "fp8")
#: a problem's operation -> the operations its candidates may compute it with, in order.
#: A dense call under ``fp8`` is the problem ``w4a8``: its W4A16 (exact) and W4A8 (lossy)
#: candidates are ranked, tuned and cached together
_COMPUTED_AS: dict[str, tuple[str, ...]] = {
    "w4a4": ("w4a4",),
    "w4a16": ("w4a16",),
    "w4a8": ("w4a16", "w4a8"),
    "grouped_w4a16": ("grouped_w4a16",),
    "grouped_w4a4": ("grouped_w4a4",),
}


def check_precision(precision: object) -> str:
    """`precision` when it names a policy; a ValueError naming the choices otherwise."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    return precision


def problem_operation(call: str, precision: str) -> str:
    """The operation a call is ranked as under `precision`: a dense (``w4a16``) call under
    ``"fp8"`` becomes ``w4a8`` (W4A16 and W4A8 candidates together); anything else is
    unchanged (an NVFP4 ``w4a4`` call rounds nothing more under either policy, and the
    grouped operations have no FP8 variant: a grouped call is exact under both)."""
    check_precision(precision)
    if call not in OPERATIONS:
        raise ValueError(f"operation: expected one of {OPERATIONS}, got {call!r}")
    if call == "w4a8" and precision != "fp8":
        raise ValueError(
            "operation: 'w4a8' rounds the activations to FP8 (lossy); it needs "
            "precision='fp8', got precision='exact'"
        )
    return "w4a8" if call == "w4a16" and precision == "fp8" else call


def computed_as(operation: str) -> tuple[str, ...]:
    """The operations a problem of `operation` may be computed with (its own included)."""
    return _COMPUTED_AS[operation]


def is_lossy(operation: str) -> bool:
    """Whether `operation` rounds an operand the caller passed (`LOSSY_OPERATIONS`)."""
    return operation in LOSSY_OPERATIONS


class Tactic(BaseModel):
    """Base of every backend's tactic: frozen, no unknown fields, exact JSON round trip."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = Field(description="name of the backend this tactic belongs to (discriminator)")
    tile_m: PositiveInt = Field(description="output tile rows per CTA (or per CTA pair)")
    tile_n: PositiveInt = Field(description="output tile columns per CTA")
    cluster_m: PositiveInt = 1
    cluster_n: PositiveInt = 1
    swap_ab: bool = Field(
        default=False,
        description="compute out.T = B @ A.T: the dispatcher exchanges the operands",
    )

    @property
    def ctas_per_tile(self) -> int:
        """SMs one output tile occupies (the shared cost model's wave count reads it).

        1 for most kernels; a family whose MMA spans several SMs (Blackwell's 2-CTA
        instructions) overrides it. Hardware facts belong to the family, not the core.
        """
        return 1

    def canonical_json(self) -> str:
        """Stable text form used for tie-breaking and cache keys (sorted keys)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


#: the fields every tactic has; `tactic_knobs` lists the others (the family's own)
COMMON_FIELDS = ("backend", "tile_m", "tile_n", "cluster_m", "cluster_n", "swap_ab")


def _fields_of(tactic: Tactic | Mapping[str, Any], changed_only: bool) -> dict[str, Any]:
    """JSON field values of a tactic (or of its stored JSON, whose defaults are unknown:
    every field counts as changed), the common ones left out."""
    if isinstance(tactic, Mapping):
        return {k: v for k, v in tactic.items() if k not in COMMON_FIELDS}
    defaults = type(tactic).model_fields
    fields = {}
    for key, value in tactic.model_dump(mode="json").items():
        spec = defaults.get(key)
        if key in COMMON_FIELDS or (changed_only and spec is not None and spec.default == value):
            continue
        fields[key] = value
    return fields


def tactic_knobs(tactic: Tactic | Mapping[str, Any], changed_only: bool = False) -> str:
    """A tactic's family-specific fields as ``name=value`` words ("" when none).

    Bools read ``on``/``off``; an ``x_m``/``x_n`` pair reads ``x=MxN``. ``changed_only``:
    only the fields whose value differs from the model's default. `tactic` may be the
    JSON a cache entry stores. The one home of how a tactic is written in a table cell
    (explain, tune, cache show, the benchmarks' tables).
    """
    fields = _fields_of(tactic, changed_only)
    parts = []
    for key, value in fields.items():
        if key.endswith("_n") and f"{key[:-2]}_m" in fields:
            continue  # shown with its _m partner
        if key.endswith("_m") and f"{key[:-2]}_n" in fields:
            parts.append(f"{key[:-2]}={value}x{fields[key[:-2] + '_n']}")
            continue
        if isinstance(value, bool):
            value = "on" if value else "off"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def tactic_label(tactic: Tactic | Mapping[str, Any]) -> str:
    """One short cell for a tactic (or its stored JSON): ``TILE_MxTILE_N``,
    ``cluster=MxN`` when not 1x1, ``swap`` when swapped, then the knobs that differ from
    their defaults (all of them for stored JSON)."""
    get = tactic.get if isinstance(tactic, Mapping) else lambda k, d=None: getattr(tactic, k, d)
    words = [f"{get('tile_m', '?')}x{get('tile_n', '?')}"]
    cluster = (get("cluster_m", 1), get("cluster_n", 1))
    if cluster != (1, 1):
        words.append(f"cluster={cluster[0]}x{cluster[1]}")
    if get("swap_ab", False) is True:
        words.append("swap")
    knobs = tactic_knobs(tactic, changed_only=True)
    return " ".join([*words, knobs] if knobs else words)


class Problem(BaseModel):
    """One GEMM: out[M, N] = A[M, K] @ B[N, K].T with B in NVFP4 (16-element blocks).

    ``operation`` says what A is: NVFP4 too (``w4a4``) or dense bf16/fp16 (``w4a16``);
    ``w4a8`` is a dense call under the ``fp8`` precision policy, whose candidates compute
    it as ``w4a16`` or ``w4a8`` (`computed_as`). A backend always receives the problem in
    the operation its tactic computes (`as_operation`). Families compete only within one
    problem operation.

    Grouped problems (``grouped_w4a16``/``grouped_w4a4``, docs/grouped.md): ``groups``
    is the number of experts E (set for, and only for, these operations), ``m`` the
    total rows of A over all experts (tokens x top-k), ``n``/``k`` one expert's weight
    shape. Which rows go to which expert lives on the device and is never read here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    m: PositiveInt
    n: PositiveInt
    k: PositiveInt
    out_dtype: OutDtype = "bfloat16"
    operation: Operation = "w4a4"
    groups: PositiveInt | None = None

    @model_validator(mode="after")
    def _groups_match_operation(self) -> Problem:
        grouped = self.operation in GROUPED_OPERATIONS
        if grouped and self.groups is None:
            raise ValueError(f"groups: operation {self.operation!r} needs the expert count E")
        if not grouped and self.groups is not None:
            raise ValueError(
                f"groups: only grouped operations {sorted(GROUPED_OPERATIONS)} take groups, "
                f"got groups={self.groups} for operation {self.operation!r}"
            )
        return self

    @property
    def dense(self) -> bool:
        """Whether A is dense bf16/fp16 activations (`DENSE_OPERATIONS`, ``grouped_w4a16``)."""
        return self.operation in DENSE_OPERATIONS or self.operation == "grouped_w4a16"

    @property
    def grouped(self) -> bool:
        """Whether this is a grouped (per-expert) problem (`GROUPED_OPERATIONS`)."""
        return self.groups is not None

    @property
    def touched_groups(self) -> int:
        """Experts whose weights a grouped problem reads, under the balanced-routing
        assumption of docs/grouped.md: ``min(E, M)`` (each of the M rows lands on a
        different expert until all are used). 1 for a plain GEMM."""
        return 1 if self.groups is None else min(self.groups, self.m)

    def as_operation(self, operation: str) -> Problem:
        """This problem as a backend computing it with `operation` sees it (self if same)."""
        if operation == self.operation:
            return self
        return self.model_copy(update={"operation": operation})

    def swapped(self) -> Problem:
        """The problem the kernel sees when a tactic sets swap_ab (never grouped: the
        ranking refuses swapped tactics for dense and grouped problems)."""
        return self.model_copy(update={"m": self.n, "n": self.m})

    @property
    def flops(self) -> float:
        """2 M N K: grouped too (each of the M rows meets one expert's N x K weight)."""
        return 2.0 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> float:
        """Fewest bytes moved: fp4 operands with e4m3 scales (1 per 16 values: 0.5625
        bytes per value), a dense 2-byte A for w4a16 and w4a8, and the 2-byte output.

        Grouped: the weights of `touched_groups` experts (all E once M >= E; at decode,
        with tokens x top-k < E, only the experts the rows touch under balanced routing),
        plus the int32 offsets and float32 alphas (8 bytes per expert)."""
        fp4 = 0.5 + 1.0 / 16
        a_bytes = 2.0 if self.dense else fp4
        weights = self.touched_groups * self.n * self.k * fp4
        per_group = 0.0 if self.groups is None else 8.0 * self.groups
        return self.m * self.k * a_bytes + weights + 2.0 * self.m * self.n + per_group
