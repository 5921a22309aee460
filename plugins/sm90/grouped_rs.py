"""Plugin module: ``triton-sm90-grouped-rs``, the grouped W4A16 GEMM for 16 or more rows
per expert on Hopper (`fp4_dispatch.backends.sm90.gemm_grouped_rs`; docs/grouped.md).

The warp-specialized kernel of ``triton-sm90-rs`` (weights expanded into ``wgmma``'s A
registers by two warpgroups, tokens from a TMA ring) run per (expert, token tile) from the
offsets on the device. Serves ``grouped_w4a16`` (dense rows, ``K % 128 == 0``) where the
balanced rows per expert (`grouped.rows_per_expert`) are 16 or more: prefill of a
many-expert layer, where the Triton grouped kernel's ``tl.dot`` path runs at 0.37-0.68x
bf16 ``torch._grouped_mm``.

Tactics: the dense rs kernel's (`rs.RS_TILE_M` token tiles with their stages and CTAs an
SM), the token tile at most the balanced rows rounded up to a power of two (64 at
least); one split (the prefill grids fill the SMs many times over).

The estimate is ``triton-sm90-rs``'s fitted one (`rs._estimate_rs`) of the equivalent
dense problem (`grouped_mma.dense_view`) plus `grouped_mma.LOOKUP_US` (a guess, not
fitted: `UNFITTED`).

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 (tests/test_grouped_rs.py); the numerics are checked on a GPU.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Literal

from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import _pow2_at_least, rs
from fp4_dispatch.plugins.sm90 import grouped as gp
from fp4_dispatch.plugins.sm90 import grouped_mma as gm
from fp4_dispatch.support.sources import SourceVersion

#: said in `explain` and the docs: the look-up term is not fitted
UNFITTED = True
#: the fewest balanced rows per expert served (the grouped mma kernel's largest tile)
MIN_ROWS_PER_EXPERT = 16


class TritonSm90GroupedRsTactic(rs.TritonSm90RsTactic):
    """One variant of the grouped rs kernel (the dense rs tactic's knobs, one split)."""

    backend: Literal["triton-sm90-grouped-rs"] = "triton-sm90-grouped-rs"  # type: ignore[assignment]


def why_invalid(t: TritonSm90GroupedRsTactic, problem: Problem) -> str | None:
    """Why `t` is not offered for `problem`, else None (module docstring)."""
    if problem.operation != "grouped_w4a16":
        return f"operation {problem.operation!r}: grouped_w4a16 (dense rows) only"
    if problem.k % rs.RS_TILE_K:
        return f"K={problem.k} must be a multiple of {rs.RS_TILE_K}"
    rows = gp.rows_per_expert(problem)
    if rows < MIN_ROWS_PER_EXPERT:
        return f"{rows} balanced rows per expert < {MIN_ROWS_PER_EXPERT}"
    if t.tile_m > max(rs.RS_MIN_M, _pow2_at_least(rows)):
        return f"tile_m={t.tile_m} > {rows} rows per expert (padded to a power of two)"
    if t.num_stages != rs.RS_STAGES[t.tile_m]:
        return f"num_stages={t.num_stages}: tile_m={t.tile_m} runs {rs.RS_STAGES[t.tile_m]}"
    if t.ctas_per_sm not in rs.RS_CTAS_PER_SM[t.tile_m]:
        return (f"ctas_per_sm={t.ctas_per_sm}: tile_m={t.tile_m} runs "
                f"{rs.RS_CTAS_PER_SM[t.tile_m]}")  # fmt: skip
    if t.split_k != 1 or t.num_warps != 4 or t.block_r != 64:
        return f"split_k 1, 4 warps, block_r 64 (got {t.split_k}, {t.num_warps}, {t.block_r})"
    return None


class TritonSm90GroupedRsBackend(gm.PerExpertBackend):
    """Hopper grouped W4A16 from 16 rows per expert (Gluon, register-sourced ``wgmma``)."""

    name = "triton-sm90-grouped-rs"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_grouped_rs", plugin=__name__)
    tactic_type = TritonSm90GroupedRsTactic
    kernel_module = "fp4_dispatch.backends.sm90.gemm_grouped_rs"
    why_invalid = staticmethod(why_invalid)
    diversity_axes = ("tile_m", "ctas_per_sm")

    def space(self) -> Iterator[TritonSm90GroupedRsTactic]:
        for tm, ctas in itertools.product(rs.RS_TILE_M, (1, 2)):
            yield _tactic(tm, ctas)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """Microseconds: the dense rs estimate of `grouped_mma.dense_view` plus the
        look-up."""
        assert isinstance(tactic, TritonSm90GroupedRsTactic)
        return rs._estimate_rs(tactic, gm.dense_view(problem), device) + gm.LOOKUP_US


@functools.cache
def _tactic(tile_m: int, ctas: int) -> TritonSm90GroupedRsTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90GroupedRsTactic(tile_m=tile_m, num_stages=rs.RS_STAGES[tile_m],
                                     ctas_per_sm=ctas)  # fmt: skip
