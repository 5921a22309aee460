"""The public object: load backends, rank their tactics, run the winner.

``Dispatcher().gemm(qa, qb)`` checks its arguments, looks up the plan for the problem
(the tuned winner of its bucket, else the memoized heuristic pick), builds the kernel
once, and runs it. Nothing is written to ``out`` unless every check has passed.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from . import checks, registry
from .backend import Backend, GemmOperands, Kernel
from .device import DeviceInfo, resolve
from .nvfp4 import Nvfp4Tensor
from .ranking import Candidate, Ranker, Shortlist, m_bucket
from .tactics import Problem

log = logging.getLogger(__name__)

Status = Literal["available", "unsupported", "failed", "disabled"]


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``list-backends``: a backend, or a plugin that failed to give one."""

    name: str
    family: str
    origin: str
    version: str
    status: Status
    reason: str
    plugin: str
    error: registry.LoadError | None = None

    def to_json(self) -> dict:
        row = asdict(self)
        row["error"] = None if self.error is None else asdict(self.error)
        return row


def launch(
    candidate: Candidate, kernel: Kernel, operands: GemmOperands, out: torch.Tensor
) -> torch.Tensor:
    """Call `kernel`, realising ``swap_ab`` by exchanging operands and writing ``out.T``."""
    if candidate.tactic.swap_ab:
        kernel(operands.swapped(), out.t())
    else:
        kernel(operands, out)
    return out


class Dispatcher:
    """Picks and runs NVFP4 GEMM kernels for one device.

    ``device``: None/"auto" (detect), "cpu", "cuda[:N]", a `DeviceInfo`, or a simulated
    family ("sm90", "sm100", "sm103", "sm107") for inspecting dispatch without the
    hardware (simulated devices rank and compile but run nothing). ``strict`` (default
    ``FP4_DISPATCH_STRICT``) turns any plugin or backend failure into an exception.
    ``budget`` is how many tactics a shortlist keeps.
    """

    def __init__(
        self,
        device: str | DeviceInfo | None = None,
        *,
        strict: bool | None = None,
        budget: int = 32,
        sm_count: int | None = None,
    ) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget: expected a positive int, got {budget!r}")
        self.device = resolve(device, sm_count)
        self.strict = registry.strict_default() if strict is None else strict
        self.budget = budget
        self.registry = registry.load(strict=self.strict)
        self._status = {name: self._check_support(b) for name, b in self.registry.backends.items()}
        self.available: list[Backend] = [
            b for name, b in self.registry.backends.items() if self._status[name][0] == "available"
        ]
        self.ranker = Ranker(self.available, self.device, budget)
        self._kernels: dict[tuple, Kernel] = {}
        self._plans: dict[tuple[int, int, int, str], tuple[Candidate, Kernel]] = {}

    # ---- backends -------------------------------------------------------------------

    def _check_support(self, backend: Backend) -> tuple[Status, str]:
        try:
            support = backend.supports(self.device)
        except Exception as exc:  # a backend's own check failed: a failure, shown to users
            log.warning("backend %s: supports() raised %r", backend.name, exc)
            if self.strict:
                raise
            return "failed", f"supports() raised {type(exc).__name__}: {exc}"
        return ("available" if support.ok else "unsupported"), support.reason

    def backends(self) -> list[BackendStatus]:
        """Every backend and every plugin that failed or was disabled, for ``list-backends``."""
        rows = []
        for report in self.registry.plugins:
            for name in report.backends:
                b = self.registry.backends[name]
                status, reason = self._status[name]
                rows.append(
                    BackendStatus(
                        name, b.family, report.origin, b.version, status, reason, report.name
                    )
                )
            for err in report.errors:
                rows.append(
                    BackendStatus(
                        name=f"<{report.name}>",
                        family="?",
                        origin=report.origin,
                        version=report.version,
                        status="failed",
                        reason=f"{err.stage}: {err.error_type}: {err.message}",
                        plugin=report.name,
                        error=err,
                    )
                )
            if report.status == "disabled":
                rows.append(
                    BackendStatus(
                        f"<{report.name}>", "?", report.origin, report.version,
                        "disabled", report.reason, report.name,
                    )
                )  # fmt: skip
        return rows

    # ---- ranking --------------------------------------------------------------------

    def candidates(self, m: int, n: int, k: int, out_dtype: str = "bfloat16") -> Shortlist:
        """The capped, explained shortlist for one problem."""
        return self.ranker.shortlist(Problem(m=m, n=n, k=k, out_dtype=out_dtype))

    def select(self, m: int, n: int, k: int, out_dtype: str = "bfloat16") -> Candidate:
        """The candidate a call of this shape would run."""
        return self.ranker.pick(m, n, k, out_dtype)

    # ---- running --------------------------------------------------------------------

    def kernel_for(self, candidate: Candidate, problem: Problem) -> Kernel:
        """Build (once) the kernel of `candidate` for problems of this bucket."""
        bucketed = problem.model_copy(update={"m": m_bucket(problem.m)})
        if candidate.tactic.swap_ab:
            bucketed = bucketed.swapped()
        key = (candidate.backend, candidate.tactic, bucketed)
        kernel = self._kernels.get(key)
        if kernel is None:
            backend = self.registry.backends[candidate.backend]
            log.info("building %s %s for %s", candidate.backend, candidate.tactic, bucketed)
            kernel = backend.build(candidate.tactic, bucketed, self.device)
            self._kernels[key] = kernel
        return kernel

    def _plan(self, m: int, n: int, k: int, dtype: str) -> tuple[Candidate, Kernel]:
        key = (m, n, k, dtype)
        plan = self._plans.get(key)
        if plan is None:
            candidate = self.select(m, n, k, dtype)
            plan = candidate, self.kernel_for(candidate, Problem(m=m, n=n, k=k, out_dtype=dtype))
            self._plans[key] = plan
        return plan

    def _torch_device(self, name: str, t: torch.Tensor) -> torch.device:
        if self.device.is_simulated:
            raise RuntimeError(
                f"{self.device.name} is simulated: it ranks and compiles but runs nothing; "
                "use Dispatcher() on the real device to run a GEMM"
            )
        want = torch.device(self.device.torch_device)
        if t.device != want:
            raise ValueError(
                f"{name}: expected a tensor on the dispatcher's device {want}, got {t.device}"
            )
        return want

    def run(self, operands: GemmOperands, out: torch.Tensor, dtype: str) -> torch.Tensor:
        """Run checked operands through the plan for their shape (no further checks)."""
        candidate, kernel = self._plan(operands.m, operands.n, operands.k, dtype)
        return launch(candidate, kernel, operands, out)

    def run_candidate(
        self, candidate: Candidate, operands: GemmOperands, out: torch.Tensor
    ) -> torch.Tensor:
        """Run one specific candidate (doctor, tuning), building its kernel if needed."""
        dtype = checks.out_dtype_name(out.dtype)
        problem = Problem(m=operands.m, n=operands.n, k=operands.k, out_dtype=dtype)
        return launch(candidate, self.kernel_for(candidate, problem), operands, out)

    def gemm(
        self,
        qa: Nvfp4Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[M, N] = dequant(qa) @ dequant(qb).T`` (B held as [N, K], like a Linear weight)."""
        qa, qb = checks.nvfp4_operand("qa", qa), checks.nvfp4_operand("qb", qb)
        dtype = checks.out_dtype_name(out_dtype)
        k = checks.k_dims(qa.k, qb.k)
        device = self._torch_device("qa", qa.data)
        checks.same_device(device, qb=qb.data)
        out = checks.out_tensor(out, qa.rows, qb.rows, out_dtype, device)
        qa, qb = qa.with_layout("swizzled"), qb.with_layout("swizzled")
        alpha = (qa.global_scale * qb.global_scale).reshape(1)
        if out is None:
            out = torch.empty(qa.rows, qb.rows, dtype=out_dtype, device=device)
        operands = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
        assert operands.k == k
        return self.run(operands, out, dtype)

    def mm_fp4(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        a_descale: torch.Tensor,
        b_descale: torch.Tensor,
        alpha: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FlashInfer-style call: ``a`` [M, K/2] fp4, ``b`` the [K/2, N] transposed view of an
        [N, K/2] tensor, swizzled e4m3 descales, ``alpha`` one float32 element (the
        product of the global scales)."""
        a = checks.fp4_data("a", a)
        b = checks.fp4_data("b", b)
        dtype = checks.out_dtype_name(out_dtype)
        if not a.is_contiguous():
            raise ValueError(f"a: expected a contiguous [M, K/2] tensor, got strides {a.stride()}")
        if not b.t().is_contiguous():
            raise ValueError(
                "b: expected the [K/2, N] transposed view of a contiguous [N, K/2] tensor "
                f"(strides (1, K/2)), got strides {b.stride()}"
            )
        m, n = a.shape[0], b.shape[1]
        k = checks.k_dims(a.shape[1] * 2, b.shape[0] * 2, ("a", "b"))
        device = self._torch_device("a", a)
        checks.same_device(device, b=b, a_descale=a_descale, b_descale=b_descale)
        a_scale = checks.swizzled_scale("a_descale", a_descale, m, k)
        b_scale = checks.swizzled_scale("b_descale", b_descale, n, k)
        alpha = checks.alpha_tensor(alpha, device)
        out = checks.out_tensor(out, m, n, out_dtype, device)
        if out is None:
            out = torch.empty(m, n, dtype=out_dtype, device=device)
        return self.run(GemmOperands(a, a_scale, b.t(), b_scale, alpha), out, dtype)
