"""Built-in plugin: the Hopper (sm90) NVFP4 GEMM in Triton (backend ``triton-sm90``).

No FP4 GEMM library serves Hopper with both operands in NVFP4, so this family is our
own Triton kernel (`fp4_dispatch.backends.sm90.gemm_direct`): it reads the packed e2m1
bytes and the swizzled e4m3 scales directly, dequantizes in registers and multiplies
on the fp16 tensor cores. Triton is imported lazily: this module imports without it,
and `supports` says how to install it.

A second backend, ``triton-sm90-unpack`` (`fp4_dispatch.backends.sm90.gemm_unpack`),
serves large M: it expands each operand once to bf16 (a memory-bound Triton pass) and
hands the product to cuBLAS; the direct kernel re-expands tiles in every CTA and is
~2x slower than bf16 cuBLAS from M = 1024 on. Both are ranked by their own
``estimate_us`` on one microsecond scale, so the heuristic picks the direct kernel for
decode shapes and the unpack path for prefill.

Compute capability: 9.x (measured on an H200, cc 9.0). 8.x is not claimed: the kernel
converts e4m3 scales with Triton's ``float8e4nv`` type, which Triton rejects below
sm_89, and no 8.x part was measured.

The family is this package (registration, tactic specs, rules, cost models: no kernel
code) over `fp4_dispatch.backends.sm90` (the kernels: no ranking policy). Module by
module (plugin module -> backend -> kernel module in ``backends/sm90``; the kernel
package's docstring has the same table with each kernel's test):

- ``__init__`` (this module): ``triton-sm90`` -> ``gemm_direct``; ``triton-sm90-unpack`` ->
  ``gemm_unpack``; the family's shared rules (`smem_rule`, `split_k_rule`,
  `triton_config`), its simulated part (`PROFILE`) and the one hookimpl that registers
  every backend below;
- ``w4a16``: ``triton-sm90-w4a16`` -> ``gemm_w4a16`` (direct and unpack paths) and
  ``gemm_w4a16_decode`` (the gemv path);
- ``dense``: ``triton-sm90-dense`` -> ``gemm_w4a4_dense``;
- ``ws``: ``triton-sm90-ws`` -> ``gemm_w4a16_ws``;
- ``mma``: ``triton-sm90-mma`` -> ``gemm_w4a16_mma`` (W4A4 also through ``expand_rows``);
- ``rs``: ``triton-sm90-rs`` -> ``gemm_w4a16_rs``;
- ``w4a8``: ``triton-sm90-w4a8`` -> ``gemm_w4a8``;
- ``grouped``: ``triton-sm90-grouped`` -> ``gemm_grouped``;
- ``grouped_mma``: ``triton-sm90-grouped-mma`` -> ``gemm_grouped_mma`` (the ``mma`` loop
  per expert);
- ``grouped_rs``: ``triton-sm90-grouped-rs`` -> ``gemm_grouped_rs`` (the ``rs`` kernel per
  expert);
- ``cost_model`` (+ ``cost_model.json``): the W4A4 kernels' fitted estimate; the JSON
  holds every fitted sm90 constant.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, TypeVar

from fp4_dispatch.contracts.backend import Backend, Kernel, Support
from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile
from fp4_dispatch.contracts.hookspecs import hookimpl
from fp4_dispatch.contracts.tactics import Problem, Tactic
from fp4_dispatch.plugins.sm90 import cost_model
from fp4_dispatch.support.sources import SourceVersion

if TYPE_CHECKING:
    from fp4_dispatch.backends.sm90.gemm_direct import KernelConfig
    from fp4_dispatch.backends.sm90.gemm_unpack import UnpackGemmKernel

INSTALL_HINT = "pip install '.[triton]' in the fp4-dispatch checkout"
#: a Triton kernel's config class (gemm_direct.KernelConfig, gemm_w4a16.W4A16Config)
C = TypeVar("C")
#: shared memory one CTA may use on Hopper, bytes (227 KiB: the opt-in per-block limit
#: of compute capability 9.0); the family's one copy: `smem_rule` checks every sm90 kernel
SMEM_LIMIT = 232448

TILE_M = (16, 32, 64, 128)
TILE_N = (16, 32, 64, 128, 256)
TILE_K = (64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3, 4)
GROUP_M = (1, 8)
SPLIT_K = (1, 2, 4, 8, 16)


class TritonSm90Tactic(Tactic):
    """One variant of the Hopper Triton kernel.

    ``tile_m x tile_n`` is the output tile of one CTA, ``tile_k`` the K elements per main
    loop step (packed bytes = tile_k / 2, scales = tile_k / 16). ``group_m`` is the
    raster: that many row tiles walk the column tiles together (L2 reuse of B).
    ``split_k`` CTAs share one output tile's K range (decode shapes have fewer tiles
    than SMs); the last one to finish reduces. ``swap_ab`` is realised by the
    dispatcher; the kernel sees the swapped problem.
    """

    backend: Literal["triton-sm90"] = "triton-sm90"
    tile_m: Literal[16, 32, 64, 128]
    tile_n: Literal[16, 32, 64, 128, 256]
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    tile_k: Literal[64, 128, 256] = 128
    num_warps: Literal[4, 8] = 4
    num_stages: Literal[2, 3, 4] = 3
    group_m: Literal[1, 8] = 1
    split_k: Literal[1, 2, 4, 8, 16] = 1

    def kernel_config(self) -> KernelConfig:
        from fp4_dispatch.backends.sm90.gemm_direct import KernelConfig  # noqa: PLC0415 - optional: Triton

        return triton_config(KernelConfig, self, group_m=self.group_m)


def triton_config(config_cls: type[C], t: Tactic, **extra: int) -> C:
    """A Triton kernel's compile-time config from a tactic's fields (tile_* -> block_*,
    split_k, num_warps, num_stages; `extra` for a kernel's own): the W4A4 direct and the
    W4A16 direct kernels' configs are built the same way."""
    return config_cls(
        block_m=t.tile_m,
        block_n=t.tile_n,
        block_k=t.tile_k,
        split_k=t.split_k,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        **extra,
    )


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def smem_bytes(tile_m: int, tile_n: int, tile_k: int, stages: int) -> int:
    """Upper estimate of one CTA's shared memory (mirrors `gemm_direct.smem_estimate`).

    Pipelined raw tiles (packed bytes + scales of A and B per stage), the dequantized fp16
    operand tiles staged for the tensor cores, or the epilogue shuffle if larger.
    """
    raw = (tile_m + tile_n) * (tile_k // 2 + tile_k // 16)
    dequant = (tile_m + tile_n) * tile_k * 2
    return max(stages * raw + dequant, tile_m * tile_n * 4)


def smem_rule(smem: int) -> str | None:
    """Why a CTA needing `smem` bytes of shared memory cannot run on Hopper, else None
    (every sm90 kernel's rule: W4A4 direct and W4A16 direct)."""
    return "exceeds Hopper's 227 KiB of shared memory per CTA" if smem > SMEM_LIMIT else None


def split_k_rule(
    split_k: int, tiles: int, k_steps: int, sm_count: int, max_ctas_per_sm: int = 4
) -> str | None:
    """Why `split_k` is not offered for a grid of `tiles` output tiles and `k_steps` K
    steps, else None: split-K only while the grid is under two waves, at most
    `max_ctas_per_sm` CTAs per SM, each split keeping >= 2 K steps (the sm90 kernels'
    shared rule; the W4A16 kernel's small decode CTAs run more per SM)."""
    if split_k <= 1:
        return None
    if tiles >= 2 * sm_count:
        return f"split-K only below two waves ({tiles} tiles)"
    if tiles * split_k > max_ctas_per_sm * sm_count:
        return (f"split-K beyond {max_ctas_per_sm} CTAs per SM ({tiles} tiles x {split_k} > "
                f"{max_ctas_per_sm * sm_count})")  # fmt: skip
    if k_steps < 2 * split_k:
        return f"split_k={split_k} leaves < 2 K steps per split ({k_steps} steps)"
    return None


def _tile_choices(dim: int, options: tuple[int, ...]) -> tuple[int, ...]:
    """Tiles from the padded dimension down to 64 (or the padded dimension if smaller)."""
    top = max(16, _pow2_at_least(dim))
    low = min(64, top)
    return tuple(t for t in options if low <= t <= top)


def why_invalid(t: TritonSm90Tactic, problem: Problem, device: DeviceInfo) -> str | None:
    """Why `t` is not offered for `problem` (in the dispatcher's orientation), else None.

    The rules keep the space real but modest (about 50-200 per shape): tiles between 64
    (or the padded dimension, if smaller) and the padded dimension; tile_k 64 only for
    >= 128x128 output tiles and 256 only for <= 128x64 ones (shared memory vs bytes in
    flight); 3 stages; 8 warps only for 128x128 (either) and
    128x256 (required: 4 warps would hold 256 fp32 accumulators per thread); a group-M
    raster only with >= 16 row tiles; split-K only while the grid is under two waves,
    at most four CTAs per SM, each split keeping >= 2 K steps.
    """
    p = problem.swapped() if t.swap_ab else problem
    m, n, k = p.m, p.n, p.k
    if k % 32:
        return f"K={k} must be a multiple of 32"
    if t.tile_m not in _tile_choices(m, TILE_M):
        return f"tile_m={t.tile_m} does not fit M={m} (kernel orientation)"
    if t.tile_n not in _tile_choices(n, TILE_N):
        return f"tile_n={t.tile_n} does not fit N={n} (kernel orientation)"
    outputs = t.tile_m * t.tile_n
    if t.tile_k == 64 and outputs < 128 * 128:
        return "tile_k=64 only for tiles of >= 128x128 outputs"
    if t.tile_k == 256 and outputs > 128 * 64:
        return "tile_k=256 only for tiles of <= 128x64 outputs"
    if t.tile_k > max(64, _pow2_at_least(k)):
        return f"tile_k={t.tile_k} exceeds K={k}"
    if t.num_stages != 3:
        return "num_stages: 3 (2 and 4 measured within 2% of 3 on the H200, v1 sweep)"
    if t.num_warps == 8 and outputs < 128 * 128:
        return "8 warps only for tiles of >= 128x128 outputs"
    if t.num_warps == 4 and outputs > 128 * 128:
        return "tiles of more than 128x128 outputs need 8 warps"
    why = smem_rule(smem_bytes(t.tile_m, t.tile_n, t.tile_k, t.num_stages))
    if why:
        return why
    grid_m = -(-m // t.tile_m)
    grid_n = -(-n // t.tile_n)
    if t.group_m > 1 and (grid_m < 16 or grid_n < 2):
        return "a group-M raster only with >= 16 row tiles and >= 2 column tiles"
    return split_k_rule(t.split_k, grid_m * grid_n, -(-k // t.tile_k), device.sm_count)


# The cost model of both W4A4 backends (`estimate_us`) is `plugins/sm90/cost_model.py`;
# its constants are data (`cost_model.json`, fitted by benchmarks/fit_cost_model.py).


#: The H200 as the dispatcher sees it there: the bandwidth the driver reports (2 x memory
#: clock x bus width: 4814 GB/s, what `device.detect` reads; the device-to-device copy
#: measured 4.25 TB/s, and the cost models apply their own fraction), rates measured on
#: one H200 (2026-11-30: bf16 matmul 691 TFLOP/s, FP8 `_scaled_mm` 1263 TFLOP/s at
#: 8192^3; 132 SMs and the L2 size from `torch.cuda.get_device_properties`). Until run 6
#: this said 4250 (the copy rate): simulated and live estimates then differed. No FP4
#: tensor cores on Hopper.
PROFILE = DeviceProfile(
    "sm90",
    DeviceInfo(
        name="simulated H200 (sm90)",
        kind="simulated",
        compute_capability=(9, 0),
        sm_count=132,
        l2_bytes=50 * 2**20,
        mem_bw_gbps=4814.4,
        bf16_tflops=691.0,
        fp8_tflops=1263.0,
        note="rates measured on an H200",
    ),
)


class TritonSm90Backend(Backend):
    """The Hopper backend: Triton kernel, typed tactic space, its own time estimate."""

    name = "triton-sm90"
    device_profiles = (PROFILE,)
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_direct", plugin=__name__)
    tactic_type = TritonSm90Tactic
    diversity_axes = ("swap_ab", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[TritonSm90Tactic]:
        for swap, tm, tn, tk, warps, stages, group, split in itertools.product(
            (False, True), TILE_M, TILE_N, TILE_K, WARPS, STAGES, GROUP_M, SPLIT_K
        ):
            t = TritonSm90Tactic.model_construct(
                tile_m=tm,
                tile_n=tn,
                tile_k=tk,
                num_warps=warps,
                num_stages=stages,
                group_m=group,
                split_k=split,
                swap_ab=swap,
            )
            if why_invalid(t, problem, device) is None:
                yield TritonSm90Tactic(**t.model_dump(exclude={"backend"}))

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = TritonSm90Tactic.model_validate(tactic.model_dump())
        return why_invalid(checked, problem, device)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds: a per-SM roofline of one CTA step (latency, dequantization, MMA,
        memory) plus launch and split-K costs, times fitted per-knob efficiencies
        (`fp4_dispatch.plugins.sm90.cost_model`, constants in ``cost_model.json``)."""
        assert isinstance(tactic, TritonSm90Tactic)
        return cost_model.direct_us(problem, device, tactic)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90Tactic)
        return _kernel_for(tactic.kernel_config())

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) what `gemm` on a contiguous ``out`` runs.

        `problem` is in the kernel's orientation: unswapped, ``out`` is [M, N] with
        strides (N, 1); swapped, the kernel writes ``out.T`` of the caller's [N, M]
        output, strides (1, M).
        """
        assert isinstance(tactic, TritonSm90Tactic)
        kernel = self.build(tactic, problem, device)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        p = problem
        strides = (1, p.m) if tactic.swap_ab else (p.n, 1)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[p.out_dtype]
        return kernel.precompile(p.m, p.n, p.k, dtype, strides)  # type: ignore[attr-defined]

    def precompile_key(self, tactic: Tactic, problem: Problem) -> tuple:
        """The kernel does not specialize on its M or N (``do_not_specialize``); what is
        left is K, the output dtype and the output's row stride, the caller's N."""
        assert isinstance(tactic, TritonSm90Tactic)
        caller_n = problem.m if tactic.swap_ab else problem.n
        return (tactic, caller_n, problem.k, problem.out_dtype, problem.operation)


# ---- triton-sm90-unpack: unpack once, cuBLAS bf16 ---------------------------------------

UNPACK_BLOCK_R = (32, 64, 128)
UNPACK_BLOCK_K = (64, 128, 256)
#: below this M the direct kernel wins (the unpack pass alone costs ~as much as it)
UNPACK_MIN_M = 256
#: largest unpack tile (elements): 16 warps x 32 outputs per thread
UNPACK_MAX_TILE = 128 * 128


class Sm90UnpackTactic(Tactic):
    """One variant of the unpack + cuBLAS path.

    ``block_r x block_k`` is the tile of the memory-bound unpack pass (rows x K elements
    per CTA). ``tile_m``/``tile_n`` are nominal (cuBLAS picks its own tiles; 128x128 is
    what the shared fields report). ``swap_ab`` is always False: cuBLAS handles operand
    orientation itself, and a column-major ``out`` is served by computing ``B @ A.T``
    inside the kernel, so a swapped tactic would only duplicate every candidate.
    """

    backend: Literal["triton-sm90-unpack"] = "triton-sm90-unpack"
    tile_m: Literal[128] = 128
    tile_n: Literal[128] = 128
    cluster_m: Literal[1] = 1
    cluster_n: Literal[1] = 1
    swap_ab: Literal[False] = False
    block_r: Literal[32, 64, 128] = 64
    block_k: Literal[64, 128, 256] = 128


def why_invalid_unpack(t: Sm90UnpackTactic, problem: Problem) -> str | None:
    """Why `t` is not offered for `problem`, else None (M >= 256; tile <= 128x128 elements;
    block_k no larger than K padded to a power of two, with 64 always allowed)."""
    if problem.k % 32:
        return f"K={problem.k} must be a multiple of 32"
    if problem.m < UNPACK_MIN_M:
        return f"M={problem.m} < {UNPACK_MIN_M}: the direct kernel wins there"
    if t.block_r * t.block_k > UNPACK_MAX_TILE:
        return f"unpack tile {t.block_r}x{t.block_k} exceeds {UNPACK_MAX_TILE} elements"
    if t.block_k > max(64, _pow2_at_least(problem.k)):
        return f"block_k={t.block_k} exceeds K={problem.k}"
    return None


class TritonSm90UnpackBackend(Backend):
    """Large-M Hopper backend: unpack NVFP4 to bf16 once per operand, then cuBLAS."""

    name = "triton-sm90-unpack"
    family = "sm90"
    version = SourceVersion("1", "fp4_dispatch.backends.sm90.gemm_unpack", plugin=__name__)
    tactic_type = Sm90UnpackTactic
    diversity_axes = ("block_k",)

    def supports(self, device: DeviceInfo) -> Support:
        return _sm90_support(device)

    def tactics(self, problem: Problem, device: DeviceInfo) -> Iterator[Sm90UnpackTactic]:
        for br, bk in itertools.product(UNPACK_BLOCK_R, UNPACK_BLOCK_K):
            t = _unpack_tactic(br, bk)
            if why_invalid_unpack(t, problem) is None:
                yield t

    def validate(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> str | None:
        checked = Sm90UnpackTactic.model_validate(tactic.model_dump())
        return why_invalid_unpack(checked, problem)

    def estimate_us(self, problem: Problem, device: DeviceInfo, tactic: Tactic) -> float | None:
        """Microseconds: unpack pass + bf16 GEMM + alpha pass + launches, on the same
        microsecond scale as the direct backend's model, so the two compete fairly
        (`fp4_dispatch.plugins.sm90.cost_model`)."""
        assert isinstance(tactic, Sm90UnpackTactic)
        return cost_model.unpack_us(problem, device, tactic)

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, Sm90UnpackTactic)
        return _unpack_kernel_for(tactic.block_r, tactic.block_k)

    def precompile(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> object:
        """Compile (Triton ``warmup``, no launch) the two unpack passes of `problem` (A's M
        rows and B's N rows, bf16 out); cuBLAS needs no compile. The arguments mirror
        `gemm_unpack.unpack_nvfp4` with tensors given by their dtypes."""
        assert isinstance(tactic, Sm90UnpackTactic)
        import torch  # noqa: PLC0415 - start-up time: the plugin module imports without torch

        from fp4_dispatch.backends.sm90 import gemm_unpack as gu  # noqa: PLC0415 - optional: Triton

        br, bk, k = tactic.block_r, tactic.block_k, problem.k
        s_blk = -(-(k // 16) // 4) * 4 * 128
        for rows in dict.fromkeys((problem.m, problem.n)):
            grid = (-(-rows // br), -(-k // bk))
            gu.unpack_nvfp4_kernel.warmup(
                torch.uint8, torch.uint8, torch.bfloat16, torch.bfloat16, rows, k, s_blk,
                grid=grid, BLOCK_R=br, BLOCK_K=bk, HAS_ALPHA=False,
                num_warps=gu._num_warps(br, bk),
            )  # fmt: skip
        return self.build(tactic, problem, device)


@functools.cache
def _unpack_tactic(block_r: int, block_k: int) -> Sm90UnpackTactic:
    """Cached tactic objects (the ranking memoizes validation by identity)."""
    return Sm90UnpackTactic(block_r=block_r, block_k=block_k)


@functools.cache
def _unpack_kernel_for(block_r: int, block_k: int) -> UnpackGemmKernel:
    from fp4_dispatch.backends.sm90 import gemm_unpack  # noqa: PLC0415 - optional: Triton

    return gemm_unpack.build(block_r, block_k)


def _gluon_support(device: DeviceInfo) -> Support:
    """`_sm90_support` for a Gluon kernel's backend: never under ``TRITON_INTERPRET=1``
    (Gluon has no interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        return Support(False, "TRITON_INTERPRET=1: Gluon kernels have no interpreter")
    return _sm90_support(device)


def _sm90_support(device: DeviceInfo) -> Support:
    """Shared rule of both Hopper backends: cc 9.x (real or simulated) and Triton."""
    if device.kind == "cpu":
        return Support(
            False,
            "needs a CUDA GPU with compute capability 9.x (Triton); "
            "--device sm90 ranks its tactics without one",
        )
    cc = device.cc
    if cc is None or not 90 <= cc < 100:
        shown = "unknown" if cc is None else f"{cc // 10}.{cc % 10}"
        return Support(False, f"compute capability {shown}: this backend targets 9.x (Hopper) only")
    ok, reason = _triton_status()
    if not ok:
        return Support(False, reason)
    where = (
        "simulated: ranks; kernels compile on first call on a real"
        if (device.is_simulated)
        else "runs on this"
    )
    return Support(True, f"Triton {reason}; {where} sm90 device")


@functools.cache
def _triton_status() -> tuple[bool, str]:
    """(importable, version or the reason + install hint), imported once, on demand."""
    if importlib.util.find_spec("triton") is None:
        return False, f"triton is not installed: {INSTALL_HINT}"
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # a broken install is a reason shown to the user, not a crash
        return False, f"triton failed to import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return True, str(getattr(triton, "__version__", "?"))


@functools.cache
def _kernel_for(cfg: KernelConfig) -> Kernel:
    """One kernel object per config: buckets share compiled code and the workspace."""
    from fp4_dispatch.backends.sm90 import gemm_direct  # noqa: PLC0415 - optional: Triton

    return gemm_direct.build(cfg)


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    # the W4A16, dense, ws, mma, rs, W4A8 and grouped modules build on this one's shared rules:
    # imported after it
    from fp4_dispatch.plugins.sm90.dense import TritonSm90DenseBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.grouped import TritonSm90GroupedBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.grouped_mma import TritonSm90GroupedMmaBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.grouped_rs import TritonSm90GroupedRsBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.mma import TritonSm90MmaBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.rs import TritonSm90RsBackend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.w4a8 import TritonSm90W4A8Backend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.w4a16 import TritonSm90W4A16Backend  # noqa: PLC0415
    from fp4_dispatch.plugins.sm90.ws import TritonSm90WsBackend  # noqa: PLC0415

    register(TritonSm90Backend())
    register(TritonSm90UnpackBackend())
    register(TritonSm90W4A16Backend())
    register(TritonSm90DenseBackend())
    register(TritonSm90WsBackend())
    register(TritonSm90MmaBackend())
    register(TritonSm90RsBackend())
    register(TritonSm90W4A8Backend())
    register(TritonSm90GroupedBackend())
    register(TritonSm90GroupedMmaBackend())
    register(TritonSm90GroupedRsBackend())
