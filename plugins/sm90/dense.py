"""Plugin module: ``triton-sm90-dense``, W4A4 on Hopper through the W4A16 kernel (decode).

Both operands NVFP4, as ``triton-sm90``, but computed by the W4A16 direct kernel with its
activation tile expanded in-kernel (`fp4_dispatch.backends.sm90.gemm_w4a4_dense`): the
weight (``b``, N rows) on the MMA's wide side with the bf16 dequantizer, the tokens (``a``,
M <= `DENSE_MAX_M`) on the narrow side. The tactics are the W4A16 direct path's
(`plugins.sm90.w4a16`: tile_n 64/128 weight rows, tile_m 16 tokens, split_k) under its
rules, with tile_k, stages and warps at the measured `DENSE_TILE_K`, `DENSE_STAGES`,
`DENSE_WARPS`; ``swap_ab`` is always False (the kernel has its own orientation).

The estimate is the W4A16 direct model with the activation's expansion added
(`w4a16._estimate_direct` with ``nvfp4_activations``): a latency-bound chain in whole
rounds of CTAs, as long per step as the values a thread expands, scaled by
``dense_step_scale`` and the total by ``dense_time_scale`` (the "w4a16" part of
``cost_model.json``; fitted by ``benchmarks/fit_w4a16_model.py --dense`` on the H200
decode sweep of ``bench_w4a4_decode.py``, now ``benchmarks kernels --cases w4a4-decode``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import _sm90_support
from fp4_dispatch.plugins.sm90 import w4a16 as w4
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_w4a16 import W4A16Config

#: the most tokens offered: decode and small batches. At M = 64 this kernel and
#: ``triton-sm90`` measured within 2% of each other on the H200 (RESULTS.md, "Hopper
#: W4A16" run 5), and the estimate is fitted at M <= 16 only
DENSE_MAX_M = 16
#: the knobs offered: those the H200 sweep measured (tile_k 128, 4 stages, 4 warps: the
#: W4A16 kernel's best decode knobs); both weight-tile heights and every split width
DENSE_TILE_K = (128,)
DENSE_STAGES = (4,)
DENSE_WARPS = (4,)


class TritonSm90DenseTactic(w4.TritonSm90W4A16Tactic):
    """A W4A16 direct-path tactic run on NVFP4 activations (same knobs, direct only)."""

    backend: Literal["triton-sm90-dense"] = "triton-sm90-dense"  # type: ignore[assignment]
    path: Literal["direct"] = "direct"  # type: ignore[assignment]


def why_invalid(t: TritonSm90DenseTactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem` (M tokens of ``a``, N weight rows of ``b``),
    else None: M <= `DENSE_MAX_M`, then the W4A16 direct path's rules."""
    if problem.m > DENSE_MAX_M:
        return f"M={problem.m} > {DENSE_MAX_M}: decode shapes only (triton-sm90 serves more)"
    if (t.tile_k not in DENSE_TILE_K or t.num_stages not in DENSE_STAGES
            or t.num_warps not in DENSE_WARPS):  # fmt: skip
        return (f"tile_k, num_stages, num_warps: expected one of {DENSE_TILE_K}, {DENSE_STAGES}, "
                f"{DENSE_WARPS} (the measured knobs), got {t.tile_k}, {t.num_stages}, "
                f"{t.num_warps}")  # fmt: skip
    return w4.why_invalid(t, problem, device)


class TritonSm90DenseBackend(Backend):
    """Hopper W4A4 at decode: the W4A16 kernel with the activations expanded in-kernel."""

    name = "triton-sm90-dense"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_w4a4_dense", plugin=__name__)
    tactic_type = TritonSm90DenseTactic
    diversity_axes = ("tile_n", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90DenseTactic]:
        if problem.m > DENSE_MAX_M:
            return
        for tn, tk, split, warps, stages in itertools.product(
            w4.TILE_N, DENSE_TILE_K, w4.SPLIT_K, DENSE_WARPS, DENSE_STAGES
        ):
            t = _tactic(tn, tk, split, warps, stages)
            if why_invalid(t, problem, device) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90DenseTactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds: the W4A16 direct model with the activations' expansion (module
        docstring), on the microsecond scale ``triton-sm90`` estimates on."""
        assert isinstance(tactic, TritonSm90DenseTactic)
        return w4._estimate_direct(tactic, problem, device, nvfp4_activations=True)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90DenseTactic)
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what `gemm` on a contiguous ``out`` of
        the output dtype runs for `problem`."""
        assert isinstance(tactic, TritonSm90DenseTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        kernel = self.build(tactic, problem, device)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.out_dtype]
        p = problem
        return kernel.precompile(p.m, p.n, p.k, dtype, (p.n, 1))  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """No specialization on M (``do_not_specialize``; the activation scales' row
        block depends on K only): the tactic, N (the output's row stride), K, dtype."""
        return (tactic, problem.n, problem.k, problem.out_dtype, problem.operation)


@functools.cache
def _tactic(tn: int, tk: int, split: int, warps: int, stages: int) -> TritonSm90DenseTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return TritonSm90DenseTactic(
        tile_m=16, tile_n=tn, tile_k=tk, split_k=split, num_warps=warps, num_stages=stages
    )


@functools.cache
def _kernel_for(cfg: W4A16Config) -> Kernel:
    """One kernel object per config: shapes share compiled code and the split-K workspace."""
    from fp4_dispatch.backends.sm90 import gemm_w4a4_dense  # noqa: PLC0415 - optional: Triton

    return gemm_w4a4_dense.build(cfg)
