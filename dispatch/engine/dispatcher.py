"""`Dispatcher`: the public face of the engine, whose calls check, then run or emit an op.

``Dispatcher().gemm(qa, qb)`` checks its arguments once, then eagerly runs the plan of
the problem through the engine (`fp4_dispatch.engine.runner.Runner.run_checked`); under
torch.compile it emits the custom op (`fp4_dispatch.engine.torch_ops`), whose
implementation calls the same engine method. Either way the call goes down: this
module -> the ops -> the engine -> plans and kernels. Nothing is written to ``out``
unless every check has passed.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch

from fp4_dispatch.engine import torch_ops
from fp4_dispatch.engine.op_fast import FastCalls, public_gemm_key
from fp4_dispatch.engine.plans import PlanKey
from fp4_dispatch.engine.runner import Runner
from fp4_dispatch.format import checks
from fp4_dispatch.format.grouped import Nvfp4Experts, check_offsets
from fp4_dispatch.format.nvfp4 import Nvfp4Tensor
from fp4_dispatch.loading.status import BackendStatus
from fp4_dispatch.support import alloc

__all__ = ["BackendStatus", "Dispatcher"]


class Dispatcher(Runner):
    """Picks and runs NVFP4 GEMM kernels for one device.

    ``device``: None/"auto" (detect), "cpu", "cuda[:N]", a `DeviceInfo`, or a simulated
    family ("sm90", "sm100", "sm103", "sm107") for inspecting dispatch without the
    hardware (simulated devices rank and compile but run nothing). ``strict`` (default
    ``FP4_DISPATCH_STRICT``) turns any plugin or backend failure into an exception.
    ``budget`` is how many tactics a shortlist keeps. ``cache``: the tuning cache file
    (None = `fp4_dispatch.store.cache.default_path()`, i.e. ``FP4_DISPATCH_CACHE`` or the user
    cache dir; a path; a `TuningCache`; False = keep tuned winners in memory only).
    ``verify_cache`` (default ``FP4_DISPATCH_VERIFY_CACHE``, on): run each cached winner
    once on its first use in this process and ignore it (one warning) if its output is
    not the reference's (`fp4_dispatch.store.winners`). ``replay`` (default
    ``FP4_DISPATCH_REPLAY``, on): a warm plan relaunches its recorded kernels through the
    CUDA driver with a kept argument buffer (`fp4_dispatch.engine.plans`), the eager fast path.
    ``precision``: ``"exact"`` (default) never runs a lossy candidate; ``"fp8"`` lets
    dense (W4A16) calls also run as W4A8, activations and weights rounded to FP8 E4M3
    for the FP8 tensor cores, whenever that ranks (or tunes) faster: the problem is then
    ``operation="w4a8"`` everywhere (plans, ranking, tuning, cache), its candidates
    ``w4a16`` or ``w4a8`` (docs/PRECISION.md).

    ``verify_plugins`` (default ``FP4_DISPATCH_VERIFY_PLUGINS``, on): the first run of each
    (backend, tactic, shape bucket) of a plugin that is not built in is compared with the
    float64 reference on a sample of its output, once per process; a wrong kernel is
    marked broken and the call falls back (`fp4_dispatch.engine.firstuse`).
    """

    @functools.cached_property
    def _public_fast(self) -> FastCalls:
        """`gemm`'s kept calls (`_kept_gemm`), by `public_gemm_key` (made on first use;
        later reads are an instance-dict hit)."""
        return FastCalls()

    def gemm(
        self,
        qa: Nvfp4Tensor | torch.Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[M, N] = A @ dequant(qb).T`` (B held as [N, K], like a Linear weight).

        ``qa`` an `Nvfp4Tensor`: W4A4 (both operands NVFP4; ``out_dtype`` default bfloat16).
        ``qa`` a dense bfloat16/float16 ``[M, K]`` tensor: W4A16, weight-only (activations
        stay as they are; ``out_dtype`` default ``qa.dtype``). Arguments are checked here,
        once; under torch.compile the GEMM is a custom op (no graph break, plan made at
        run time); eagerly the plan runs directly; inside a CUDA-graph capture only an
        already-run plan launches. Eagerly, a call without ``out`` like an earlier one
        (the activation's layout, the same weight fields) skips the checks and runs the
        plan's replay (`_kept_gemm`).
        """
        key = None
        if out is None and not torch.compiler.is_compiling():
            key = public_gemm_key(qa, qb, out_dtype)
            y = None if key is None else self._kept_gemm(key, qa, qb, out_dtype)
            if y is not None:
                return y
        qb = checks.nvfp4_operand("qb", qb)
        if isinstance(qa, torch.Tensor):
            return self._gemm_dense(qa, qb, out_dtype, out, key)
        qa = checks.nvfp4_operand("qa", qa)
        out_dtype = checks.default_out_dtype(qa, out_dtype)
        dtype = checks.out_dtype_name(out_dtype)
        checks.k_dims(qa.k, qb.k)
        device = self.check_device("qa", qa.data)
        checks.same_device(device, qb=qb.data)
        # backends read natural data order (an "sm90-prepared" weight is restored here)
        qa, qb = qa.with_layout("swizzled").natural(), qb.with_layout("swizzled").natural()
        if out is not None:
            out = checks.out_tensor(out, qa.rows, qb.rows, out_dtype, device)
        if torch.compiler.is_compiling():
            alpha = (qa.global_scale * qb.global_scale).reshape(1)
            return torch_ops.run(self, qa.data, qa.scale, qb.data, qb.scale, alpha, out_dtype, out)
        if out is None:  # eagerly: straight to the plan (checked here, once)
            out = torch.empty((qa.rows, qb.rows), dtype=out_dtype, device=device)
        # the global scales as alpha's two factors: the kernel multiplies them (or the plan)
        self.run_checked(qa.data, qa.scale, qb.data, qb.scale, qa.global_scale, out, dtype,
                         qb.global_scale)  # fmt: skip
        if key is not None and out.numel():  # run as given: keep its replay, if it has one
            args = (qa.data, qa.scale, qb.data, qb.scale, qa.global_scale, out, qb.global_scale)
            self._keep_public(key, self.w4a4_plan_key(qa.data, qb.data, dtype), args,
                              [qa.data, qa.scale, qa.global_scale, out])  # fmt: skip
        return out

    def _keep_public(self, key: Hashable, plan_key: PlanKey, args: tuple,
                     per_call: list[torch.Tensor]) -> None:  # fmt: skip
        """After an ordinary `gemm` of `key` that ran its operands as given: keep the
        plan's replay for `_kept_gemm`, from the key's second call (the first may be the
        plan's first, which records nothing: `FastCalls.seen_before`)."""
        fast = self._public_fast
        if fast.seen_before(key):
            fast.keep(key, self, plan_key, args, per_call)

    def _kept_gemm(self, key: Hashable, qa: torch.Tensor | Nvfp4Tensor, qb: Nvfp4Tensor,
                   out_dtype: torch.dtype | None) -> torch.Tensor | None:  # fmt: skip
        """`gemm` without ``out`` through the call kept for `key`
        (`fp4_dispatch.engine.op_fast.public_gemm_key`): the output's allocation and the
        plan's replay, no checks (an earlier call of the same key passed them). None,
        having launched nothing, where none is kept or it declines (plans changed, an
        autotuning block, a capture, an unaligned address): the ordinary path runs."""
        fast = self._public_fast.get(key)
        if fast is None:
            return None
        n, dtype = qb.data.shape[0], checks.default_out_dtype(qa, out_dtype)
        if type(qa) is torch.Tensor:
            out = alloc.empty((qa.shape[0], n), (n, 1), dtype, qa.device)
            per_call = [qa, out]
        else:
            a = qa.data
            out = alloc.empty((a.shape[0], n), (n, 1), dtype, a.device)
            per_call = [a, qa.scale, qa.global_scale, out]
        return out if fast(per_call) else None

    def _gemm_dense(
        self,
        a: torch.Tensor,
        qb: Nvfp4Tensor,
        out_dtype: torch.dtype | None,
        out: torch.Tensor | None,
        key: Hashable | None = None,
    ) -> torch.Tensor:
        a = checks.dense_activation("qa", a)
        out_dtype = checks.default_out_dtype(a, out_dtype)
        dtype = checks.out_dtype_name(out_dtype)
        checks.k_dims(a.shape[1], qb.k)
        device = self.check_device("qa", a)
        checks.same_device(device, qb=qb.data)
        qb = qb.with_layout("swizzled").natural()  # backends read natural data order
        if out is not None:
            out = checks.out_tensor(out, a.shape[0], qb.rows, out_dtype, device)
        alpha = qb.global_scale.reshape(1)  # a view: no kernel launch
        if torch.compiler.is_compiling():
            return torch_ops.run_w4a16(self, a, qb.data, qb.scale, alpha, out_dtype, out)
        if out is None:
            out = torch.empty((a.shape[0], qb.rows), dtype=out_dtype, device=device)
        self.run_dense(a, qb.data, qb.scale, alpha, out, dtype)
        if key is not None and out.numel():  # `gemm`'s kept call (see `_kept_gemm`)
            self._keep_public(key, self.dense_plan_key(a, qb.data, dtype),
                              (a, qb.data, qb.scale, alpha, out, None, None), [a, out])  # fmt: skip
        return out

    def grouped_gemm(
        self,
        a: torch.Tensor | Nvfp4Tensor,
        b: Nvfp4Experts,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The grouped (mixture-of-experts) GEMM, torch's ``_grouped_mm`` convention:
        ``out[r] = A[r] @ dequant(b[e]).T`` for the rows ``r`` of each expert ``e``
        (docs/grouped.md).

        ``a``: ``[T, K]`` rows sorted by expert: dense bfloat16/float16 (grouped W4A16;
        ``out_dtype`` default ``a.dtype``) or an `Nvfp4Tensor` (grouped W4A4; default
        bfloat16). ``b``: the stacked expert weights, an `Nvfp4Experts` ``[E, N, K]``.
        ``offsets``: int32 ``[E]`` on the same device, cumulative row ends (empty experts
        allowed; the last must be T). Its values are never read here (no host sync), so
        the call is capturable in a CUDA graph once its plan is warm. ``out``: optional
        ``[T, N]`` output."""
        if not isinstance(b, Nvfp4Experts):
            raise TypeError(f"b: expected an Nvfp4Experts [E, N, K] (quantize_experts), "
                            f"got {type(b).__name__}")  # fmt: skip
        e, n, k = b.shape
        if isinstance(a, Nvfp4Tensor):
            qa = a.with_layout("swizzled").natural()
            checks.k_dims(qa.k, k, ("a", "b"))
            out_dtype = checks.default_out_dtype(qa, out_dtype)
            device = self.check_device("a", qa.data)
            x, a_scale, t = qa.data, qa.scale, qa.rows
        else:
            x = checks.dense_activation("a", a)
            checks.k_dims(x.shape[1], k, ("a", "b"))
            out_dtype = checks.default_out_dtype(x, out_dtype)
            if out_dtype != x.dtype:  # the problem's out dtype is then a's: families know it
                raise ValueError(f"out_dtype: a grouped W4A16 call writes a's dtype "
                                 f"({x.dtype}), got {out_dtype}")  # fmt: skip
            device = self.check_device("a", x)
            a_scale, t = None, x.shape[0]
        dtype = checks.out_dtype_name(out_dtype)
        checks.same_device(device, b=b.data, offsets=offsets)
        check_offsets(offsets, e)
        out = checks.out_tensor(out, t, n, out_dtype, device)
        # per-expert alpha: the weights' scales (a view), times A's for W4A4 (one launch)
        alpha = b.global_scale if a_scale is None else b.global_scale * qa.global_scale
        if torch.compiler.is_compiling():
            return torch_ops.run_grouped(self, x, a_scale, b.data, b.scale, alpha, offsets,
                                         out_dtype, out)  # fmt: skip
        if out is None:
            out = torch.empty((t, n), dtype=out_dtype, device=device)
        self.run_grouped(x, a_scale, b.data, b.scale, alpha, offsets, out, dtype)
        return out

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
        checks.out_dtype_name(out_dtype)
        if not a.is_contiguous():
            raise ValueError(f"a: expected a contiguous [M, K/2] tensor, got strides {a.stride()}")
        if not b.t().is_contiguous():
            raise ValueError(
                "b: expected the [K/2, N] transposed view of a contiguous [N, K/2] tensor "
                f"(strides (1, K/2)), got strides {b.stride()}"
            )
        m, n = a.shape[0], b.shape[1]
        k = checks.k_dims(a.shape[1] * 2, b.shape[0] * 2, ("a", "b"))
        a_scale = checks.swizzled_scale("a_descale", a_descale, m, k)  # types before devices
        b_scale = checks.swizzled_scale("b_descale", b_descale, n, k)
        device = self.check_device("a", a)
        checks.same_device(device, b=b, a_descale=a_descale, b_descale=b_descale)
        alpha = checks.alpha_tensor(alpha, device)
        out = checks.out_tensor(out, m, n, out_dtype, device)
        return torch_ops.run(self, a, a_scale, b.t(), b_scale, alpha, out_dtype, out)


torch_ops.set_default_factory(
    lambda device, precision: Dispatcher(device=device, precision=precision)
)
