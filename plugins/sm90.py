"""Built-in plugin: the Hopper (sm90) NVFP4 GEMM in Triton (backend ``triton-sm90``).

No FP4 GEMM library serves Hopper with both operands in NVFP4, so this family is our
own Triton kernel (`fp4_dispatch.backends.triton_sm90`): it reads the packed e2m1
bytes and the swizzled e4m3 scales directly, dequantizes in registers and multiplies
on the fp16 tensor cores. Triton is imported lazily: this module imports without it,
and `supports` says how to install it.

Compute capability: 9.x (measured on an H200, cc 9.0). 8.x is not claimed: the kernel
converts e4m3 scales with Triton's ``float8e4nv`` type, which Triton rejects below
sm_89, and no 8.x part was measured.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from ..backend import Backend, Kernel, Support
from ..device import DeviceInfo
from ..hookspecs import hookimpl
from ..tactics import Problem, Tactic

if TYPE_CHECKING:
    from ..backends.triton_sm90 import KernelConfig

INSTALL_HINT = "pip install fp4-dispatch[triton]"
#: shared memory one CTA may use on Hopper (227 KiB)
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
        from ..backends.triton_sm90 import KernelConfig

        return KernelConfig(
            block_m=self.tile_m,
            block_n=self.tile_n,
            block_k=self.tile_k,
            group_m=self.group_m,
            split_k=self.split_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def smem_bytes(tile_m: int, tile_n: int, tile_k: int, stages: int) -> int:
    """Upper estimate of one CTA's shared memory (mirrors `triton_sm90.smem_estimate`).

    Pipelined raw tiles (packed bytes + scales of A and B per stage), the dequantized fp16
    operand tiles staged for the tensor cores, or the epilogue shuffle if larger.
    """
    raw = (tile_m + tile_n) * (tile_k // 2 + tile_k // 16)
    dequant = (tile_m + tile_n) * tile_k * 2
    return max(stages * raw + dequant, tile_m * tile_n * 4)


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
    if smem_bytes(t.tile_m, t.tile_n, t.tile_k, t.num_stages) > SMEM_LIMIT:
        return "exceeds Hopper's 227 KiB of shared memory per CTA"
    grid_m = -(-m // t.tile_m)
    grid_n = -(-n // t.tile_n)
    if t.group_m > 1 and (grid_m < 16 or grid_n < 2):
        return "a group-M raster only with >= 16 row tiles and >= 2 column tiles"
    if t.split_k > 1:
        tiles = grid_m * grid_n
        k_steps = -(-k // t.tile_k)
        if tiles >= 2 * device.sm_count:
            return f"split-K only below two waves ({tiles} tiles)"
        if tiles * t.split_k > 4 * device.sm_count:
            return "split-K beyond four CTAs per SM"
        if k_steps < 2 * t.split_k:
            return f"split_k={t.split_k} leaves < 2 K steps per split ({k_steps} steps)"
    return None


# Calibration of `estimate_us`: fitted to the 18-shape H200 sweep of v2 (benchmarks/
# RESULTS.md, "Hopper"), where its top-1 runs at 1.11x the measured best (geomean; 1.18x
# before the fit). The kernel is bound by the dequantization ALU work.
_DEQUANT_ELEMS_PER_SM_US = 1.6e4
#: relative cost of an A-side element (register operand of the dot: 2-byte shared loads and
#: byte repacking) against a B-side one (natural layout, staged to shared memory)
_A_SIDE_COST = 1.25
_MMA_EFF = {16: 0.30, 32: 0.40, 64: 0.60, 128: 0.75}  # by tile_m: mma.sync vs wgmma
_BW_FRACTION = 0.85
_OVERLAP = 0.0  # fraction of the smaller of dequant / MMA time that does not overlap
_LAUNCH_US = 4.0
_SPLIT_REDUCE_US = 1.0


class TritonSm90Backend(Backend):
    """The Hopper backend: Triton kernel, typed tactic space, its own time estimate."""

    name = "triton-sm90"
    family = "sm90"
    version = "1"
    tactic_type = TritonSm90Tactic
    diversity_axes = ("swap_ab", "split_k")

    def supports(self, device: DeviceInfo) -> Support:
        if device.kind == "cpu":
            return Support(
                False,
                "needs a CUDA GPU with compute capability 9.x (Triton); on CPU use the "
                "TRITON_INTERPRET=1 tests",
            )
        cc = device.cc
        if cc is None or not 90 <= cc < 100:
            shown = "unknown" if cc is None else f"{cc // 10}.{cc % 10}"
            return Support(
                False, f"compute capability {shown}: this backend targets 9.x (Hopper) only"
            )
        ok, reason = _triton_status()
        if not ok:
            return Support(False, reason)
        where = (
            "simulated: ranks; kernels compile on first call on a real"
            if (device.is_simulated)
            else "runs on this"
        )
        return Support(True, f"Triton {reason}; {where} sm90 device")

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
        """Microseconds: max(dequantize, tensor core, memory) + overlap loss + launch + split.

        - dequantize: every CTA expands (tile_m + tile_n) * K/split elements; SMs do
          ``_DEQUANT_ELEMS_PER_SM_US`` each, only ``min(CTAs, SMs)`` are busy, and a last
          partial wave costs a whole one (the measured bottleneck on the H200);
        - tensor core: padded tile FLOPs at the bf16 rate times an efficiency by tile_m
          (mma.sync for 16/32, wgmma for 64/128), same busy-SM and wave scaling;
        - memory: NVFP4 bytes + output + split-K partials (fp32 write and read) at
          ``_BW_FRACTION`` of the device bandwidth.
        Plus the shared model's swap rule (x1.05 for the non-preferred orientation
        through M = 8192), so the two models agree on orientation.
        """
        from ..ranking import SWAP_NEUTRAL_ABOVE_M, SWAP_PENALTY, preferred_swap

        assert isinstance(tactic, TritonSm90Tactic)
        p = problem.swapped() if tactic.swap_ab else problem
        m, n, k = p.m, p.n, p.k
        sms = device.sm_count
        tm, tn, split = tactic.tile_m, tactic.tile_n, tactic.split_k
        ctas = -(-m // tm) * -(-n // tn) * split
        busy = min(ctas, sms)
        imbalance = math.ceil(ctas / sms) / (ctas / sms) if ctas > sms else 1.0
        k_split = k / split
        elems = ctas * (tm * _A_SIDE_COST + tn) * k_split
        dequant = elems / (busy * _DEQUANT_ELEMS_PER_SM_US) * imbalance
        flops = 2.0 * ctas * tm * tn * k_split
        mma = flops / (device.bf16_tflops * 1e6 * _MMA_EFF[tm] * busy / sms) * imbalance
        partial = 8.0 * ctas * tm * tn if split > 1 else 0.0
        memory = (problem.min_bytes + partial) / (device.mem_bw_gbps * 1e3 * _BW_FRACTION)
        t = max(dequant, mma, memory) + _OVERLAP * min(dequant, mma) + _LAUNCH_US
        if split > 1:
            t += _SPLIT_REDUCE_US
        if problem.m <= SWAP_NEUTRAL_ABOVE_M and tactic.swap_ab != preferred_swap(problem):
            t *= SWAP_PENALTY
        return t

    def build(self, tactic: Tactic, problem: Problem, device: DeviceInfo) -> Kernel:
        assert isinstance(tactic, TritonSm90Tactic)
        return _kernel_for(tactic.kernel_config())


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
    from ..backends import triton_sm90

    return triton_sm90.build(cfg)


@hookimpl
def fp4_dispatch_register_backends(register) -> None:
    register(TritonSm90Backend())
