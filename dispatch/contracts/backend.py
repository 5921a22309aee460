"""The backend contract every plugin implements (docs/ARCHITECTURE.md, "Adding a family").

A backend is an object: a plugin constructs it and hands it to `register`. The
dispatcher checks `isinstance(obj, Backend)`; anything else is recorded as a
failed registration.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from fp4_dispatch.contracts.buckets import m_bucket
from fp4_dispatch.contracts.tactics import Problem, Tactic

if TYPE_CHECKING:
    import torch

    from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile


@dataclass(frozen=True)
class Support:
    """Whether a backend can run on a device, and the reason shown to users."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True, slots=True)
class GemmOperands:
    """Operands as every kernel receives them, already in the orientation to compute.

    The kernel computes ``out = alpha * dequant(a) @ dequant(b).T`` (no global scales
    inside the data; ``alpha`` carries their product).

    - ``a_data``: uint8 ``[M, K/2]`` contiguous, e2m1 pairs, low nibble first.
    - ``a_scale``: float8_e4m3fn ``[ceil128(M), ceil4(K/16)]`` in the 128x4 swizzled
      storage order (padding included, never unpadded).
    - ``b_data``: uint8 ``[N, K/2]`` contiguous; ``b_scale`` like ``a_scale``.
    - ``alpha``: float32 tensor with one element, on the operands' device.
    - ``alpha_b``: None, or a second one-element float32 factor: the kernel then computes
      with ``alpha * alpha_b`` (float32 product). Only kernels whose class sets
      ``alpha_factors = True`` ever receive it; for every other kernel the dispatcher
      multiplies first (`fp4_dispatch.engine.plans.Plan`). Why: the two global scales of an
      eager ``gemm`` arrive separately, and their product is one more kernel launch
      (~8 µs of host time on the H200 host) when the GEMM kernel can multiply two loads.

    When a tactic sets ``swap_ab`` the dispatcher passes (b, a) here and the
    transposed view of ``out``: kernels must honour ``out``'s strides.
    """

    a_data: torch.Tensor
    a_scale: torch.Tensor
    b_data: torch.Tensor
    b_scale: torch.Tensor
    alpha: torch.Tensor
    alpha_b: torch.Tensor | None = None

    @property
    def m(self) -> int:
        return self.a_data.shape[0]

    @property
    def n(self) -> int:
        return self.b_data.shape[0]

    @property
    def k(self) -> int:
        return self.a_data.shape[1] * 2

    def swapped(self) -> GemmOperands:
        return GemmOperands(
            self.b_data, self.b_scale, self.a_data, self.a_scale, self.alpha, self.alpha_b
        )


@dataclass(frozen=True, slots=True)
class DenseOperands:
    """Operands of a W4A16 kernel: dense activations times an NVFP4 weight.

    The kernel computes ``out = alpha * a @ dequant(b).T``.

    - ``a``: bfloat16 or float16 ``[M, K]`` with unit stride along K (rows may be strided).
    - ``b_data``, ``b_scale``: the weight as in `GemmOperands` (``[N, K/2]`` uint8, e4m3
      128x4-swizzled scales).
    - ``alpha``: float32 tensor with one element (the weight's global scale).
    - ``bias`` (keyword only): None, or a ``[N]`` float tensor added to every output row
      before the single rounding to ``out``'s dtype. Only kernels whose class sets
      ``bias_epilogue = True`` ever receive it; for every other kernel the dispatcher
      adds it after the kernel (`fp4_dispatch.engine.plans.DensePlan`). Why: a separate bias
      add is one more launch per layer (~8 µs of host time eagerly, a few µs of GPU
      time in a graph at decode) and one more rounding.

    - ``b_prepared`` (keyword only): None, or the same weight bytes in the
      ``"sm90-prepared"`` order (`fp4_dispatch.format.nvfp4.sm90_prepare_data`), which Hopper
      kernels dequantize in fewer instructions (`Nvfp4Linear` keeps both on sm90). A
      kernel may read either; ``b_data`` stays natural, so kernels that never look at
      this field are unaffected.

    The dispatcher never swaps these (``swap_ab`` is always False for W4A16 tactics): a
    kernel that wants the weight on the MMA's M side does it inside.
    """

    a: torch.Tensor
    b_data: torch.Tensor
    b_scale: torch.Tensor
    alpha: torch.Tensor
    bias: torch.Tensor | None = field(default=None, kw_only=True)
    b_prepared: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def n(self) -> int:
        return self.b_data.shape[0]

    @property
    def k(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True, slots=True)
class GroupedOperands:
    """Operands of a grouped (mixture-of-experts) kernel: each expert's rows of A times
    that expert's NVFP4 weight (docs/grouped.md).

    The kernel computes, for every expert ``e`` and every row ``r`` in
    ``[offsets[e-1], offsets[e])`` (``offsets[-1]`` read as 0)::

        out[r, :] = alpha[e] * A[r, :] @ dequant(b[e]).T

    - ``a``: ``grouped_w4a16``: bfloat16/float16 ``[T, K]`` with unit stride along K,
      rows sorted by expert. ``grouped_w4a4``: the NVFP4 data, uint8 ``[T, K/2]``
      contiguous, with ``a_scale`` set.
    - ``b_data``: uint8 ``[E, N, K/2]`` contiguous (each expert's weight as in
      `GemmOperands`, natural byte order).
    - ``b_scale``: float8_e4m3fn ``[E, ceil128(N), ceil4(K/16)]`` contiguous: each
      expert's block scales in the 128x4 swizzled order of `GemmOperands`, padding
      included; expert ``e``'s slab starts at element ``e * ceil128(N) * ceil4(K/16)``.
    - ``alpha``: float32 ``[E]``: expert ``e``'s weight global scale, times A's global
      scale for ``grouped_w4a4`` (real checkpoints have one scale per expert).
    - ``offsets``: int32 ``[E]`` on the device: cumulative row ends, non-decreasing,
      ``offsets[E-1] == T`` (torch's ``_grouped_mm`` convention). Empty experts
      (equal neighbours) are allowed. Kernels read it on the device: nobody on the
      host may (no synchronisation; CUDA graphs replay with new routing).
    - ``a_scale`` (keyword only): ``grouped_w4a4`` only: A's e4m3 block scales,
      ``[ceil128(T), ceil4(K/16)]`` swizzled as one tensor (indexed by the global row;
      a kernel that wants per-expert 128-row-aligned scales repacks on the device).

    Rows at or past ``offsets[E-1]`` belong to no expert: kernels leave them unwritten.
    Never swapped (``swap_ab`` is refused for grouped problems).
    """

    a: torch.Tensor
    b_data: torch.Tensor
    b_scale: torch.Tensor
    alpha: torch.Tensor
    offsets: torch.Tensor
    a_scale: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def m(self) -> int:
        """Total rows T (all experts)."""
        return self.a.shape[0]

    @property
    def n(self) -> int:
        return self.b_data.shape[1]

    @property
    def k(self) -> int:
        return self.b_data.shape[2] * 2

    @property
    def groups(self) -> int:
        """The expert count E."""
        return self.b_data.shape[0]


Kernel = Callable[[GemmOperands, "torch.Tensor"], None]
"""A built kernel: ``kernel(operands, out)`` writes ``out`` (shape [M, N]) in place.
Operands are `GemmOperands` for W4A4 problems, `DenseOperands` for W4A16 ones and
`GroupedOperands` for the grouped operations."""


class NotTraceable(RuntimeError):
    """A kernel cannot state a call as launches torch.compile can trace (a kept device
    buffer among its arguments, a launch option Inductor cannot express).

    A kernel may offer ``kernel.trace``: a context manager inside which its calls on
    traced (fake) operands are emitted as ``torch.library.wrap_triton`` launches, so
    Inductor launches the kernels itself (`fp4_dispatch.engine.inductor`). A call it
    cannot emit raises this; the engine then keeps its opaque custom op."""


def launch(kernel: Kernel, operands: GemmOperands, out: torch.Tensor, swap_ab: bool) -> None:
    """Run `kernel` under the swap convention: for ``swap_ab`` it gets (b, a) and ``out.T``.

    Every caller that runs a kernel (plans, the tuner, the conformance kit, benchmarks)
    goes through here, so the convention is written once.
    """
    if swap_ab:
        kernel(operands.swapped(), out.t())
    else:
        kernel(operands, out)


def kernel_problem(problem: Problem, tactic: Tactic) -> Problem:
    """The problem `Backend.build` receives: M rounded up to its `bucket`, then M and N
    exchanged when the tactic swaps (the kernel's own orientation). One build serves every
    M of the bucket (`fp4_dispatch.contracts.buckets`); kernels take the real M from their
    operands."""
    bucketed = problem.model_copy(update={"m": m_bucket(problem.m)})
    return bucketed.swapped() if tactic.swap_ab else bucketed


class Backend(abc.ABC):
    """One kernel family's entry in the registry.

    Subclasses set the class attributes and implement `supports`, `tactics` and
    `build`. `estimate_us` may refine the shared cost model (return None to keep it).
    """

    name: ClassVar[str]
    family: ClassVar[str]
    version: ClassVar[str]
    tactic_type: ClassVar[type[Tactic]]
    diversity_axes: ClassVar[tuple[str, ...]] = ()
    #: True when kernels of this backend have been compiled but never run on hardware.
    compile_only_note: ClassVar[str] = ""
    #: the operations this backend serves (`fp4_dispatch.contracts.tactics.OPERATIONS`)
    operations: ClassVar[tuple[str, ...]] = ("w4a4",)
    #: whether some kernels it builds offer ``trace`` (`NotTraceable`): torch.compile
    #: builds a backend's candidates as side plans only if so, since a build may compile
    states_launches: ClassVar[bool] = False
    #: parts this family targets: ``--device <alias>`` simulates them, and a real GPU of
    #: a profile's compute capability takes its peak rates (`fp4_dispatch.loading.profiles`)
    device_profiles: ClassVar[tuple[DeviceProfile, ...]] = ()

    @abc.abstractmethod
    def supports(self, device: DeviceInfo) -> Support:
        """Can this backend run (or at least compile) for `device`? Say why not."""

    @abc.abstractmethod
    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterable[Tactic]:
        """Every valid tactic for `problem` on `device` (only valid ones)."""

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Optional refinement of the shared cost model; None keeps the shared estimate."""
        return None

    @abc.abstractmethod
    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        """Compile (or look up) the kernel for `tactic`; the dispatcher caches the result.

        `problem` is in the kernel's orientation (already swapped when `tactic.swap_ab`).
        """

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile `tactic`'s kernel for `problem` without running it; returns the kernel.

        Called in a worker process of `fp4_dispatch.autotune.precompile` before tuning, so that the
        measuring process only loads compiled kernels from the on-disk caches. `problem`
        is in the kernel's orientation, as for `build`. The default is `build` (enough
        when build compiles and caches on disk, as the ahead-of-time families do); a
        backend whose kernels compile on their first launch (Triton JIT) overrides it to
        compile now, launching nothing. Raising is fine: the failure is reported.
        """
        return self.build(tactic, problem, device)

    def precompile_key(self, tactic: Tactic, problem: Problem) -> Hashable:
        """What the compiled binary of (`tactic`, `problem`) depends on: jobs with equal
        keys are compiled once (`fp4_dispatch.autotune.precompile`). Default: the pair itself (one
        binary per bucket); a backend whose kernel does not specialize on some size
        leaves it out. `problem` is in the kernel's orientation."""
        return (tactic, problem)

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        """Why `tactic` is invalid for `problem` (None when valid).

        The default re-validates the model and checks membership in `tactics()`;
        backends with cheap rule checks should override it.
        """
        checked = self.tactic_type.model_validate(tactic.model_dump())
        if checked not in set(self.tactics(problem, device)):
            return f"{checked.canonical_json()} is not a valid tactic for {problem}"
        return None
