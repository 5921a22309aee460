"""Tactic specs and problems: the typed values that cross every boundary.

A tactic is one concrete kernel configuration. Each backend subclasses `Tactic`,
narrows `backend` to a `Literal` (the discriminator) and adds its own typed knobs.
The common geometric fields are what the shared cost model reads.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

OutDtype = Literal["bfloat16", "float16"]
#: the two operations: both operands NVFP4 (``mm_fp4``), or dense bf16/fp16 activations
#: times NVFP4 weights (weight-only, FlashInfer's ``mm_bf16_fp4``)
Operation = Literal["w4a4", "w4a16"]
OPERATIONS: tuple[str, ...] = ("w4a4", "w4a16")


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


class Problem(BaseModel):
    """One GEMM: out[M, N] = A[M, K] @ B[N, K].T with B in NVFP4 (16-element blocks).

    ``operation`` says what A is: NVFP4 too (``w4a4``) or dense bf16/fp16 (``w4a16``).
    Families compete only within one operation.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    m: PositiveInt
    n: PositiveInt
    k: PositiveInt
    out_dtype: OutDtype = "bfloat16"
    operation: Operation = "w4a4"

    def swapped(self) -> Problem:
        """The problem the kernel sees when a tactic sets swap_ab."""
        return self.model_copy(update={"m": self.n, "n": self.m})

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> float:
        """Fewest bytes moved: fp4 operands with e4m3 scales (1 per 16 values: 0.5625
        bytes per value), a dense 2-byte A for w4a16, and the 2-byte output."""
        fp4 = 0.5 + 1.0 / 16
        a_bytes = 2.0 if self.operation == "w4a16" else fp4
        return self.m * self.k * a_bytes + self.n * self.k * fp4 + 2.0 * self.m * self.n
