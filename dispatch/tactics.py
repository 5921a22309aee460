"""Tactic specs and problems: the typed values that cross every boundary.

A tactic is one concrete kernel configuration. Each backend subclasses `Tactic`,
narrows `backend` to a `Literal` (the discriminator) and adds its own typed knobs.
The common geometric fields are what the shared cost model reads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

OutDtype = Literal["bfloat16", "float16"]


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
        import json

        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


class Problem(BaseModel):
    """One GEMM: out[M, N] = A[M, K] @ B[N, K].T, in NVFP4 with 16-element blocks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    m: PositiveInt
    n: PositiveInt
    k: PositiveInt
    out_dtype: OutDtype = "bfloat16"

    def swapped(self) -> Problem:
        """The problem the kernel sees when a tactic sets swap_ab."""
        return self.model_copy(update={"m": self.n, "n": self.m})

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> float:
        """Fewest bytes moved: fp4 operands, e4m3 scales (1 per 16), 2-byte output."""
        operands = (self.m + self.n) * self.k * (0.5 + 1.0 / 16)
        return operands + 2.0 * self.m * self.n
