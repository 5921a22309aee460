"""Plugin module: ``triton-sm90-grouped-mma``, the grouped W4A16 GEMM for up to 16 rows
per expert on Hopper (`fp4_dispatch.backends.sm90.gemm_grouped_mma`; docs/grouped.md).

The dense decode kernel of ``triton-sm90-mma`` (registers and ``mma.sync`` only, no
shared memory in the loop) run per (expert, token tile) from the offsets on the device:
each weight value is expanded once for up to 8 or 16 of its expert's rows. Serves
``grouped_w4a16`` (dense rows) where the balanced rows per expert (`grouped.
rows_per_expert`) are at most 16: decode and short prefill of a many-expert layer, the
regime ``triton-sm90-grouped`` reaches with one-row tiles that expand each weight once a
row.

Tactics: the dense kernel's measured-best variants (`mma.MMA_VARIANTS`: 8-token tiles)
and the same three CTA shapes with 16-token tiles (from ``mma.MMA_SPACE``: their
registers are known), the token tile the smallest that holds the balanced rows;
``split_k`` 1-4 while every K range of every split has a step and the kept partials stay
within `grouped.SPLIT_WORKSPACE_MAX`.

The estimate is ``triton-sm90-mma``'s fitted one (`mma._estimate_mma`) of the
equivalent dense problem (`dense_view`: the touched experts' weight rows stacked, the
balanced rows as tokens: the same CTAs, the same loop), plus `LOOKUP_US` for each CTA's
look-up of its expert. That term is a guess, not fitted (`UNFITTED`).

Not offered under ``TRITON_INTERPRET=1``: Gluon kernels have no interpreter. CI compiles
them for sm_90 (tests/test_grouped_mma.py); the numerics are checked on a GPU.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Iterator
from typing import ClassVar, Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import _gluon_support, mma
from fp4_dispatch.plugins.sm90 import grouped as gp
from fp4_dispatch.support.sources import SourceVersion

#: said in `explain` and the docs: `LOOKUP_US` is not fitted
UNFITTED = True
#: (tile_m, tile_n, num_warps, prefetch, unroll) offered: the dense kernel's offered
#: 8-token variants and the same CTA shapes with 16-token tiles
GROUPED_MMA_VARIANTS = mma.MMA_VARIANTS + tuple((16, *v[1:]) for v in mma.MMA_VARIANTS)
#: the most balanced rows per expert served (the largest token tile)
MAX_ROWS_PER_EXPERT = 16
#: µs a CTA's expert look-up adds to the dense estimate: E offsets read from L2 and a
#: running sum before the first weight load (one L2 round trip and a scan; a guess, not
#: fitted)
LOOKUP_US = 1.0


class TritonSm90GroupedMmaTactic(mma.TritonSm90MmaTactic):
    """One variant of the grouped mma kernel (the dense mma tactic's knobs)."""

    backend: Literal["triton-sm90-grouped-mma"] = "triton-sm90-grouped-mma"  # type: ignore[assignment]


def token_tile(problem: Problem) -> int:
    """The token tile that holds the balanced rows per expert: 8, else 16."""
    return 8 if gp.rows_per_expert(problem) <= 8 else 16


def dense_view(problem: Problem) -> Problem:
    """The dense problem of the same CTAs: the touched experts' weight rows stacked
    (``touched x N``), the balanced rows per expert as tokens."""
    return Problem(m=gp.rows_per_expert(problem), n=problem.touched_groups * problem.n,
                   k=problem.k, out_dtype=problem.out_dtype)  # fmt: skip


def why_invalid(t: TritonSm90GroupedMmaTactic, problem: Problem) -> str | None:
    """Why `t` is not offered for `problem`, else None (module docstring)."""
    if problem.operation != "grouped_w4a16":
        return f"operation {problem.operation!r}: grouped_w4a16 (dense rows) only"
    if problem.k % 32:
        return f"K={problem.k}: the kernel needs K % 32 == 0"
    rows = gp.rows_per_expert(problem)
    if rows > MAX_ROWS_PER_EXPERT:
        return f"{rows} balanced rows per expert > {MAX_ROWS_PER_EXPERT} (the token tile)"
    if t.tile_m != token_tile(problem):
        return f"tile_m={t.tile_m}: {rows} rows per expert run {token_tile(problem)}-token tiles"
    if mma.variant(t) not in GROUPED_MMA_VARIANTS:
        return (f"(tile_m, tile_n, num_warps, prefetch, unroll) = {mma.variant(t)}: one of "
                f"{GROUPED_MMA_VARIANTS}")  # fmt: skip
    steps = -(-problem.k // mma.MMA_TILE_K)
    if t.split_k > 1 and t.split_k * t.k_groups > steps:
        return (f"split_k x K ranges = {t.split_k * t.k_groups} > {steps} K steps: "
                "a split whose warps have no work")  # fmt: skip
    ws = gp.split_workspace_bytes(t, problem) if t.split_k > 1 else 0  # the same grid
    if ws > gp.SPLIT_WORKSPACE_MAX:
        return f"split_k={t.split_k}: {ws} workspace bytes > {gp.SPLIT_WORKSPACE_MAX}"
    return None


class PerExpertBackend(Backend):
    """What the grouped backends that run a dense Gluon kernel per expert share (this
    one and ``triton-sm90-grouped-rs``): Gluon's support rule, dense rows only,
    validation by the subclass's `why_invalid`, one kernel object per
    tactic from `kernel_module`'s ``build``, the precompile of dense rows and its key."""

    family = "sm90"
    operations: ClassVar[tuple[str, ...]] = ("grouped_w4a16",)
    #: the backend module whose ``build(config)`` makes the kernel object
    kernel_module: ClassVar[str]
    #: ``why_invalid(tactic, problem) -> str | None`` of the subclass's tactics
    why_invalid: ClassVar = staticmethod(lambda tactic, problem: "no rule")

    def supports(self, device: DeviceInfo) -> Support:
        return _gluon_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Tactic]:
        for t in self.space():
            if self.why_invalid(t, problem) is None:
                yield t

    def space(self) -> Iterator[Tactic]:
        """Every tactic the backend may offer (`tactics` filters by `why_invalid`)."""
        raise NotImplementedError

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        return self.why_invalid(self.tactic_type.model_validate(tactic.model_dump()), problem)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, self.tactic_type)
        return _kernel_for(tactic, self.kernel_module)

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (``warmup``, no launch) what a grouped call of `problem` runs: rows in
        the output dtype, a contiguous output."""
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        p = problem
        kernel = self.build(tactic, p, device)
        return kernel.precompile(p.m, p.n, p.k, p.groups, getattr(torch, p.out_dtype), False)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on T (``do_not_specialize``): the tactic, N, K, E and dtype."""
        p = problem
        return (tactic, p.n, p.k, p.groups, p.out_dtype)


class TritonSm90GroupedMmaBackend(PerExpertBackend):
    """Hopper grouped W4A16 at up to 16 rows per expert (Gluon, ``mma.sync``)."""

    name = "triton-sm90-grouped-mma"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_grouped_mma", plugin=__name__)
    tactic_type = TritonSm90GroupedMmaTactic
    kernel_module = "fp4_dispatch.backends.sm90.gemm_grouped_mma"
    why_invalid = staticmethod(why_invalid)
    diversity_axes = ("tile_n", "num_warps", "split_k")

    def space(self) -> Iterator[TritonSm90GroupedMmaTactic]:
        for v, split in itertools.product(GROUPED_MMA_VARIANTS, mma.MMA_SPLIT_K):
            yield _tactic(*v, split)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float:
        """Microseconds: the dense mma estimate of `dense_view` plus `LOOKUP_US`."""
        assert isinstance(tactic, TritonSm90GroupedMmaTactic)
        return mma._estimate_mma(tactic, dense_view(problem), device) + LOOKUP_US


@functools.cache
def _tactic(tm: int, tn: int, nw: int, pf: int, un: int, split: int) -> TritonSm90GroupedMmaTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90GroupedMmaTactic(tile_m=tm, tile_n=tn, num_warps=nw, prefetch=pf,
                                      unroll=un, split_k=split)  # fmt: skip


@functools.cache
def _kernel_for(tactic: Tactic, module: str) -> Kernel:
    """One kernel object per tactic (shapes share compiled code and kept workspaces):
    `module`'s ``build`` of the tactic's config (imported here: optional, Triton)."""
    return importlib.import_module(module).build(tactic.kernel_config())  # type: ignore[attr-defined]
