"""Plans: what one exact GEMM shape runs, decided once and launched with no further work.

Why: a decode step calls the same few shapes thousands of times, and every microsecond of
Python per call is a microsecond the GPU waits (a bf16 ``nn.Linear`` costs ~22 µs of host
time on the H200 host; a Triton launch alone ~10-15 µs). So the dispatcher resolves an
exact (M, N, K, out dtype) once - tuned winner or heuristic pick, built kernel, swap
orientation - into a `Plan`, and a call is then a dict lookup plus `Plan.__call__`.

A plan is also the unit of the CUDA-graph rule: inside a capture only a plan that has
already run eagerly (``warm``) may launch (see `fp4_dispatch.torch_ops`). Re-tuning makes
new plan objects, so a captured shape whose pick changed is detectable: its new plan is
not warm yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import DenseOperands, GemmOperands, Kernel

if TYPE_CHECKING:
    import torch

    from .ranking import Candidate

#: (M, N, K, out dtype, operation): the exact problem a plan serves
PlanKey = tuple[int, int, int, str, str]


class Plan:
    """The built kernel of one candidate for one exact shape, with the swap applied once.

    ``plan(a, sa, b, sb, alpha, out, alpha_b=None)`` takes W4A4 operands in the caller's
    orientation (already checked by the public entry points) and writes ``out``; with
    ``alpha_b`` the scale is ``alpha * alpha_b``, handed to kernels that multiply it
    themselves (``alpha_factors``) and multiplied here for the others (`GemmOperands`).
    `DensePlan` is the W4A16 variant. Iterating a plan gives ``(candidate, kernel)``.
    """

    __slots__ = ("candidate", "factors", "kernel", "key", "swap", "warm")

    def __init__(self, key: PlanKey, candidate: Candidate, kernel: Kernel) -> None:
        self.key = key
        self.candidate = candidate
        self.kernel = kernel
        self.swap = bool(candidate.tactic.swap_ab)
        #: whether the kernel takes alpha as two factors (`GemmOperands.alpha_b`)
        self.factors = getattr(type(kernel), "alpha_factors", False) is True
        #: True once it ran outside a capture: only then may a CUDA graph record it
        self.warm = False

    def __call__(
        self,
        a: torch.Tensor,
        sa: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        alpha_b: torch.Tensor | None = None,
    ) -> None:
        if alpha_b is not None and not self.factors:
            alpha, alpha_b = (alpha * alpha_b).reshape(1), None
        if self.swap:
            self.kernel(GemmOperands(b, sb, a, sa, alpha, alpha_b), out.t())
        else:
            self.kernel(GemmOperands(a, sa, b, sb, alpha, alpha_b), out)

    def __iter__(self):
        return iter((self.candidate, self.kernel))

    def __repr__(self) -> str:
        m, n, k, dtype, op = self.key
        state = "warm" if self.warm else "cold"
        return f"Plan({op} M={m} N={n} K={k} {dtype}: {self.candidate.backend} {state})"


class DensePlan(Plan):
    """A W4A16 plan: ``plan(a, b, sb, alpha, out, bias=None, b_prepared=None)`` with
    dense ``a`` (never swapped); ``bias`` goes to kernels with a bias epilogue
    (``bias_epilogue``) and is added after the kernel for the others; ``b_prepared`` is
    handed on as it is (`DenseOperands`)."""

    __slots__ = ("fused_bias",)

    def __init__(self, key: PlanKey, candidate: Candidate, kernel: Kernel) -> None:
        super().__init__(key, candidate, kernel)
        self.fused_bias = getattr(type(kernel), "bias_epilogue", False) is True

    def __call__(  # type: ignore[override]
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        sb: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        b_prepared: torch.Tensor | None = None,
    ) -> None:
        if bias is None or self.fused_bias:
            self.kernel(DenseOperands(a, b, sb, alpha, bias=bias, b_prepared=b_prepared), out)
        else:
            self.kernel(DenseOperands(a, b, sb, alpha, b_prepared=b_prepared), out)
            out.add_(bias)


def plan_for(key: PlanKey, candidate: Candidate, kernel: Kernel) -> Plan:
    """The plan class of the key's operation."""
    return (DensePlan if key[4] == "w4a16" else Plan)(key, candidate, kernel)
