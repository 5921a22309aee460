"""One measurement harness: how this project times GPU work and checks a result.

Why one: the tuner, the benchmarks and the CLI must report numbers that compare. Users
run two ways, so there are two clocks, plus one for the host's cold paths:

- `gpu_time_us`: GPU time per call with a COLD L2, measured in CUDA-graph replays (no
  launch gaps). Each call in the graph is preceded by an L2 flush (a write over twice the
  L2 size); a second graph with the flushes alone is timed too and subtracted, so the
  flush itself is not counted. Median over ``replays`` replays.
- `eager_wall_us`: host wall time per call when calls are issued back to back and the
  device is synchronised once at the end - what a Python serving loop without CUDA graphs
  pays, launch overhead included (a fast kernel behind 50 µs of Python is slow).
- `call_wall_us`: host wall time of single calls, each timed on its own after an untimed
  reset - first-sight costs (a cold memo, a subprocess) that a loop would average away.

Each of the first two has a ``*_samples`` form (one sample per replay / per block of
calls: the spread is the noise band) and a ``*_clock`` form (set up once, one sample per
call, so two kernels can be sampled alternately). The tuner measures through these two
clocks - its ``measure="graph"`` policy is `gpu_clock`, ``measure="eager"`` is
`eager_clock` (`fp4_dispatch.tuning`) - so a tuned time and a benchmark time of the same
kernel compare.

`time_us` picks between them by device (`gpu_time_us` on CUDA, wall time elsewhere), so
a benchmark's ``--smoke``/``--device cpu`` mode runs the same code path on a CPU.

And one numerics rule, written once here for the tuner, the conformance kit and the
benchmarks: random NVFP4 operands (`make_inputs`, `random_operands`, `stress_operands`),
their float64 reference (`reference_output`, `dequant`), and the comparison
(`relative_error` = ``||out - ref||_F / ||ref||_F`` in float64, infinite when ``out``
holds NaN/inf, so an unwritten output poisoned with NaN is caught; `check_output` and
`compare` give the reason a result is wrong).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from . import grouped
from .backend import DenseOperands, GemmOperands, GroupedOperands
from .checks import TORCH_DTYPES
from .device import DeviceInfo
from .nvfp4 import (
    BLOCK_SIZE,
    E2M1_VALUES,
    check_swizzled_scales,
    e2m1_to_float,
    quantize_nvfp4,
    reference_gemm,
    swizzled_scale_shape,
    unpack_e2m1,
    unswizzle_scales,
)
from .tactics import Problem, is_lossy

log = logging.getLogger(__name__)
T = TypeVar("T")

#: GPU time samples (graph replays) per measurement
REPLAYS = 5
#: L2 flush buffer size as a multiple of the L2 size (write-allocate evicts everything)
FLUSH_FACTOR = 2

#: ``Problem.out_dtype`` name -> torch dtype (the one map lives in `fp4_dispatch.checks`)
OUT_DTYPES = TORCH_DTYPES

#: Relative Frobenius error ``||out - ref|| / ||ref||`` a correct kernel stays under.
#: Why 1e-2: rounding the output to bf16 costs up to 2^-9 relative per element (RMS
#: about 1.1e-3; fp16 8x less), and float32 accumulation in another order or split-K
#: adds ~1e-6 sqrt(K). 1e-2 leaves ~9x headroom for that, yet every fault the check is
#: for (zeros, NaN, a transposed or half-written output, wrong scales) gives ~1.
CHECK_RTOL = 1e-2
#: The same check for a lossy operation's candidates (``w4a8``: activations and weights
#: rounded to FP8 E4M3). Why 6e-2: E4M3 keeps 4 significant bits, so each operand's
#: rounding costs ~2-2.6% relative RMS and W4A8 measured 2.9-3.5% against the exact
#: product on random-normal and outlier-channel data (README, "Precision"); 6e-2 leaves
#: ~1.7x headroom and still fails every fault the check is for (errors of ~1).
CHECK_RTOL_LOSSY = 6e-2


def check_rtol(operation: str) -> float:
    """The tolerance of `check_output` for a candidate computing `operation`."""
    return CHECK_RTOL_LOSSY if is_lossy(operation) else CHECK_RTOL


#: problems up to this many multiply-adds (M*N*K) are checked in full; larger ones on
#: a sample of rows and columns (`check_indices`): float64 on the device, ~2 GFLOP max
CHECK_FULL_MACS = 1 << 31
#: rows (and columns) a sampled check always covers at each end: the first tile and
#: the last (tail) tiles, whatever the tile size (every tactic's tile is <= 256)
CHECK_HEAD, CHECK_TAIL, CHECK_INTERIOR = 128, 256, 128
#: most launches one timed replay cycles through (so at most this many + 1 input copies)
MAX_REPEAT = 100
#: total bytes of rotating input copies per problem
COPY_MEMORY_CAP = 4 << 30
#: rows quantized from random data; taller operands repeat these rows (a multiple of 128)
_BASE_ROWS = 1024


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64 on the CPU); inf for NaN/inf in out."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    denom = float(r.norm())
    return float((o - r).norm()) / denom if denom > 0 else float((o - r).norm())


def eager_clock(
    fn: Callable[[], object], calls: int = 200, warmup: int = 20
) -> Callable[[], float]:
    """A clock for `fn`'s eager wall time: each call of the returned function is one
    sample, µs per call of ``calls`` back-to-back calls synchronised once at the end.

    `fn` is warmed up (``warmup`` calls) once, here. Samples from two clocks can be
    taken alternately (a paired measurement, `fp4_dispatch.tuning`)."""
    for _ in range(warmup):
        fn()
    _sync()

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        return (time.perf_counter() - t0) / calls * 1e6

    return sample


def eager_wall_samples(
    fn: Callable[[], object], calls: int = 200, warmup: int = 20, replays: int = REPLAYS
) -> list[float]:
    """``replays`` samples of `eager_wall_us` (one warm-up): the spread is the noise."""
    clock = eager_clock(fn, calls, warmup)
    return [clock() for _ in range(replays)]


def eager_wall_us(fn: Callable[[], object], calls: int = 200, warmup: int = 20) -> float:
    """Host wall time per call, back to back, synchronised once at the end (module doc)."""
    return eager_wall_samples(fn, calls, warmup, replays=1)[0]


def call_wall_us(
    fn: Callable[[], object],
    runs: int = 3,
    before: Callable[[], object] | None = None,
    best: bool = False,
) -> float:
    """Host wall microseconds of one call of `fn`, each of `runs` calls timed on its own
    after ``before()`` (untimed; e.g. clearing a memo, so every call is a first sight);
    the median, or the minimum with ``best`` (a shared machine only ever adds time).

    For first-contact and cold-path costs (a subprocess, a cold ranking) that
    `eager_wall_us`'s back-to-back loop would average away. The device is synchronised
    after each call, so GPU work `fn` queued is counted.
    """
    samples = []
    for _ in range(max(1, runs)):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        _sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return min(samples) if best else statistics.median(samples)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _l2_bytes(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def _capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`body` captured into a graph on a side stream, after one warm-up run there.

    Not ``with torch.cuda.graph(...)``: on entry that context synchronizes and empties
    the allocator cache (older torch versions also ran ``gc.collect()``), a cost the tuner
    would pay again per tactic. A body that fails during capture raises (the capture is
    ended first, so the stream is usable again)."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=current.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        body()  # warm-up on the capture stream (allocator, lazy init)
        side.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        except Exception:
            try:
                graph.capture_end()
            except RuntimeError as end_exc:  # the capture was invalidated: expected
                log.debug("capture_end after a failed capture: %r", end_exc)
            raise
        graph.capture_end()
    current.wait_stream(side)
    return graph


def capture(body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`body` run once on a side stream (allocator, lazy init), then captured into a CUDA
    graph; (the graph, what the captured call returned: its static output).

    Captures with ``torch.cuda.graph`` on purpose - the way a user captures, so the checks
    that use it (benchmarks/cuda_graph_check.py) see what users get; the timing clocks use
    `_capture`, which skips that context's per-capture synchronize and cache flush."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # one untimed replay: page in the graph's memory
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def gpu_clock(
    fn: Callable[[], object],
    calls: int = 20,
    cold_l2: bool = True,
    device: torch.device | None = None,
) -> Callable[[], float]:
    """A clock for `fn`'s GPU time per call (the `gpu_time_us` method): captures the
    graphs once; each call of the returned function replays them and is one sample.

    Samples from two clocks can be taken alternately (a paired measurement,
    `fp4_dispatch.tuning`). `fn` must be capturable (see `gpu_time_us`); a capture
    that fails raises here, before any sample."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    flush = torch.empty(FLUSH_FACTOR * _l2_bytes(device) // 4, dtype=torch.float32, device=device)

    def with_fn() -> None:
        for _ in range(calls):
            if cold_l2:
                flush.fill_(1.0)
            fn()

    def flushes_only() -> None:
        for _ in range(calls):
            flush.fill_(1.0)

    g_fn = _capture(with_fn)
    g_flush = _capture(flushes_only) if cold_l2 else None

    def sample() -> float:
        t = _replay_us(g_fn)
        if g_flush is not None:
            t -= _replay_us(g_flush)
        return max(t, 0.0) / calls

    return sample


def gpu_time_samples(
    fn: Callable[[], object],
    calls: int = 20,
    replays: int = REPLAYS,
    cold_l2: bool = True,
    device: torch.device | None = None,
) -> list[float]:
    """``replays`` per-replay samples of `gpu_time_us` (µs per call): their spread is
    the noise band the tuner uses; the benchmarks report their median."""
    clock = gpu_clock(fn, calls, cold_l2, device)
    return [clock() for _ in range(replays)]


def gpu_time_us(
    fn: Callable[[], object],
    calls: int = 20,
    replays: int = REPLAYS,
    cold_l2: bool = True,
    device: torch.device | None = None,
) -> float:
    """GPU microseconds per call of `fn` in a CUDA graph, L2 flushed before each call.

    `fn` must be capturable (warm: compiled, no host sync, no allocation it cannot make
    in a capture). ``cold_l2=False`` times back-to-back calls with a warm L2. The median
    of `gpu_time_samples` (the tuner times through the same function).
    """
    return statistics.median(gpu_time_samples(fn, calls, replays, cold_l2, device))


def time_us(fn: Callable[[], object], device: torch.device | str, calls: int = 20) -> float:
    """Microseconds per call on `device`: `gpu_time_us` (cold L2) on CUDA, else
    `eager_wall_us` (a CPU or interpreter run: script checks, the figure means little)."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_time_us(fn, calls=calls, device=device)
    return eager_wall_us(fn, calls=max(1, calls // 4), warmup=1)


# ---- numerics: random operands ---------------------------------------------------------


@dataclass
class Inputs:
    """Rotating operand copies for one problem, and one output tensor.

    ``reference``: the float64 reference of ``copies[0]`` on the checked rows and
    columns, computed once (`check_output`) and shared by every candidate.
    """

    copies: list[GemmOperands] | list[DenseOperands] | list[GroupedOperands]
    out: torch.Tensor
    bytes_per_copy: int
    reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _random_operand(rows: int, k: int, device: torch.device, gen: torch.Generator):
    base_rows = min(rows, _BASE_ROWS)
    x = torch.randn(base_rows, k, generator=gen, device=device, dtype=torch.float32)
    q = quantize_nvfp4(x)
    data, scale = q.data, q.scale
    if rows > base_rows:  # repeat whole 128-row scale blocks: the swizzle is row-block major
        reps = -(-rows // base_rows)
        data = data.repeat(reps, 1)[:rows].contiguous()
        scale = scale.repeat(reps, 1)[: swizzled_scale_shape(rows, k)[0]].contiguous()
    return data, scale, q.global_scale


def n_copies(bytes_per_copy: int, l2_bytes: int, max_repeat: int = MAX_REPEAT) -> int:
    """``min(ceil(3 * L2 / bytes) + 1, max_repeat + 1)``, within `COPY_MEMORY_CAP`."""
    want = min(math.ceil(3 * l2_bytes / max(bytes_per_copy, 1)) + 1, max_repeat + 1)
    return max(1, min(want, COPY_MEMORY_CAP // max(bytes_per_copy, 1)))


def make_inputs(
    problem: Problem, device: DeviceInfo, seed: int = 0, copies: int | None = None
) -> Inputs:
    """Random non-zero NVFP4 operands for `problem` on `device`, in rotating copies
    (`n_copies` of them unless ``copies`` says how many). W4A16 problems get
    `make_dense_inputs` (as do W4A8 ones: the same call), grouped ones
    `make_grouped_inputs`."""
    if problem.grouped:
        return make_grouped_inputs(problem, device, seed, copies)
    if problem.dense:
        return make_dense_inputs(problem, device, seed, copies)
    dev = torch.device(device.torch_device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    a_data, a_scale, ga = _random_operand(problem.m, problem.k, dev, gen)
    b_data, b_scale, gb = _random_operand(problem.n, problem.k, dev, gen)
    alpha = (ga * gb).reshape(1)
    first = GemmOperands(a_data, a_scale, b_data, b_scale, alpha)
    size = sum(t.numel() * t.element_size() for t in (a_data, a_scale, b_data, b_scale))
    count = n_copies(size, device.l2_bytes) if copies is None else max(1, copies)
    rotating = [first]
    for _ in range(count - 1):
        rotating.append(
            GemmOperands(a_data.clone(), a_scale.clone(), b_data.clone(), b_scale.clone(), alpha)
        )
    out = torch.empty(problem.m, problem.n, dtype=OUT_DTYPES[problem.out_dtype], device=dev)
    return Inputs(rotating, out, size)


def make_dense_inputs(
    problem: Problem, device: DeviceInfo, seed: int = 0, copies: int | None = None
) -> Inputs:
    """W4A16 inputs: dense random-normal activations ``[M, K]`` in the output dtype (what
    `Dispatcher.gemm` defaults to) times an NVFP4 weight, in rotating copies."""
    dev = torch.device(device.torch_device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    dtype = OUT_DTYPES[problem.out_dtype]
    a = torch.randn(problem.m, problem.k, generator=gen, device=dev).to(dtype)
    b_data, b_scale, gb = _random_operand(problem.n, problem.k, dev, gen)
    alpha = gb.reshape(1).to(torch.float32)
    size = sum(t.numel() * t.element_size() for t in (a, b_data, b_scale))
    count = n_copies(size, device.l2_bytes) if copies is None else max(1, copies)
    rotating = [DenseOperands(a, b_data, b_scale, alpha)]
    for _ in range(count - 1):
        rotating.append(DenseOperands(a.clone(), b_data.clone(), b_scale.clone(), alpha))
    out = torch.empty(problem.m, problem.n, dtype=dtype, device=dev)
    return Inputs(rotating, out, size)


def random_experts(
    groups: int, n: int, k: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale, global scales) of E distinct random NVFP4 experts, made on the device
    without quantizing: random bytes (every byte is two valid e2m1 codes), block scales
    ``2**-j`` for j in 0..6 (exact in e4m3), global scales ``2**-i`` for i in 6..9, so
    each expert's weights and alpha differ and a kernel that reads the wrong expert's
    slab (or alpha) fails the check. Padding scales are 0. Quantizing E x N x K random
    normals (up to 256 x 2048 x 7168) would cost seconds per bucket."""
    data = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, device=device,
                         generator=gen)  # fmt: skip
    rp, kp = swizzled_scale_shape(n, k)
    expo = torch.randint(0, 7, (groups, rp, kp), device=device, generator=gen)
    scale = torch.exp2(-expo.to(torch.float32))
    scale[:, n:, :] = 0  # padding rows/columns, in linear order before the swizzle
    scale[:, :, k // BLOCK_SIZE :] = 0
    tiled = scale.view(groups, rp // 128, 4, 32, kp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    scale = tiled.contiguous().view(groups, rp, kp).to(torch.float8_e4m3fn)
    g_expo = torch.randint(6, 10, (groups,), device=device, generator=gen)
    return data, scale, torch.exp2(-g_expo.to(torch.float32))


def make_grouped_inputs(
    problem: Problem, device: DeviceInfo, seed: int = 0, copies: int | None = None
) -> Inputs:
    """Grouped inputs: T = M rows split over E experts by `grouped.balanced_offsets`
    (the bucket's balanced-routing assumption, docs/grouped.md), dense activations in
    the output dtype (``grouped_w4a16``) or NVFP4 ones (``grouped_w4a4``), and
    `random_experts` weights; rotating copies of the activations and weights."""
    dev = torch.device(device.torch_device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    e, m, n, k = problem.groups, problem.m, problem.n, problem.k
    dtype = OUT_DTYPES[problem.out_dtype]
    b_data, b_scale, gb = random_experts(e, n, k, dev, gen)
    offsets = grouped.balanced_offsets(m, e, dev)
    if problem.dense:
        a = torch.randn(m, k, generator=gen, device=dev).to(dtype)
        a_scale, alpha = None, gb
    else:
        a, a_scale, ga = _random_operand(m, k, dev, gen)
        alpha = gb * ga
    fields = [t for t in (a, a_scale, b_data, b_scale) if t is not None]
    size = sum(t.numel() * t.element_size() for t in fields)
    count = n_copies(size, device.l2_bytes) if copies is None else max(1, copies)

    def copy(first: bool) -> GroupedOperands:
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if first or t is None else t.clone()

        return GroupedOperands(c(a), c(b_data), c(b_scale), alpha, offsets, a_scale=c(a_scale))

    rotating = [copy(i == 0) for i in range(count)]
    out = torch.empty(m, n, dtype=dtype, device=dev)
    return Inputs(rotating, out, size)


def random_operands(
    problem: Problem, device: torch.device | str, seed: int
) -> tuple[GemmOperands | DenseOperands | GroupedOperands, torch.Tensor]:
    """Random operands of `problem` (either operation) and their float64 CPU reference.

    Activations are ``3 * randn``, weights ``0.02 * randn`` (a weight-like spread, so
    the global scales are far from 1 and a kernel that ignores ``alpha`` is caught);
    drawn on the CPU from `seed`, so every device sees the same numbers. W4A16 problems
    get dense activations in the output's 16-bit dtype (W4A8 too; the reference is
    always the exact product); grouped ones `random_grouped_operands`.
    """
    device = torch.device(device)
    if problem.grouped:
        return random_grouped_operands(problem, device, seed)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(problem.m, problem.k, generator=gen) * 3.0
    b = torch.randn(problem.n, problem.k, generator=gen) * 0.02
    qb = quantize_nvfp4(b.to(device))
    if problem.dense:
        x = a.to(device=device, dtype=OUT_DTYPES[problem.out_dtype])
        ref = x.double().cpu() @ qb.dequantize().double().cpu().T
        return DenseOperands(x, qb.data, qb.scale, qb.global_scale.reshape(1)), ref
    qa = quantize_nvfp4(a.to(device))
    alpha = (qa.global_scale * qb.global_scale).reshape(1)
    ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
    return ops, reference_gemm(qa, qb)


def random_grouped_operands(
    problem: Problem, device: torch.device, seed: int
) -> tuple[GroupedOperands, torch.Tensor]:
    """Random `GroupedOperands` of a grouped `problem` and their float64 reference.

    E experts quantized from ``0.02 * randn`` times a per-expert spread of 10**-2..10**1
    (a kernel that reads the wrong expert's weights or alpha is caught), the M rows split
    over the experts at random (seeded: some experts empty, some with many rows), rows
    ``3 * randn`` as the output dtype (``grouped_w4a16``) or NVFP4."""
    gen = torch.Generator().manual_seed(seed)
    e, m, n, k = problem.groups, problem.m, problem.n, problem.k
    spread = torch.logspace(-2, 1, e).view(e, 1, 1)
    b = grouped.quantize_experts((torch.randn(e, n, k, generator=gen) * 0.02 * spread).to(device))
    owner = torch.randint(0, e, (m,), generator=gen)
    offsets = torch.bincount(owner, minlength=e).cumsum(0).to(torch.int32).to(device)
    x = torch.randn(m, k, generator=gen) * 3.0
    if problem.dense:
        a = x.to(device=device, dtype=OUT_DTYPES[problem.out_dtype])
        ops = GroupedOperands(a, b.data, b.scale, b.global_scale, offsets)
    else:
        qa = quantize_nvfp4(x.to(device))
        alpha = b.global_scale * qa.global_scale
        ops = GroupedOperands(qa.data, b.data, b.scale, alpha, offsets, a_scale=qa.scale)
    return ops, grouped.reference_output(ops)


def stress_nvfp4(rows: int, k: int, device: torch.device, gen: torch.Generator):
    """Random packed e2m1 bytes (all 16 codes) and swizzled e4m3 scales, NaN in padding.

    Harder than quantized normal data: scales are log-uniform over [2**-9, 2**6] (e4m3
    subnormals included), so a kernel that flushed fp16 subnormals or misread the swizzle
    would be caught; padding rows and columns of the scale tensor hold e4m3 NaN (0x7F),
    which a kernel must never read.
    """
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device=device, generator=gen)
    rp, kp = swizzled_scale_shape(rows, k)
    expo = torch.rand((rp, kp), device=device, generator=gen) * 15.0 - 9.0
    lin = torch.exp2(expo).to(torch.float8_e4m3fn).view(torch.uint8)
    lin[rows:, :] = 0x7F
    lin[:, k // BLOCK_SIZE :] = 0x7F
    # swizzle the full padded [rp, kp] array (a permutation, padding included)
    tiled = lin.view(rp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    scale = tiled.contiguous().view(rp, kp).view(torch.float8_e4m3fn)
    return data, scale


def stress_operands(
    m: int, n: int, k: int, device: torch.device, gen: torch.Generator
) -> GemmOperands:
    """`stress_nvfp4` operands with an alpha that keeps outputs near 1 (fp16-safe)."""
    a_data, a_scale = stress_nvfp4(m, k, device, gen)
    b_data, b_scale = stress_nvfp4(n, k, device, gen)
    alpha = torch.tensor([1.0 / (60.0 * math.sqrt(k))], dtype=torch.float32, device=device)
    return GemmOperands(a_data, a_scale, b_data, b_scale, alpha)


# ---- numerics: the reference and the comparison ----------------------------------------


def dequant(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``e2m1 * block scale`` of one operand as `dtype` (exact in fp16/bf16/fp32/fp64)."""
    rows, k = data.shape[0], data.shape[1] * 2
    vals = e2m1_to_float(unpack_e2m1(data)).to(dtype).view(rows, k // BLOCK_SIZE, BLOCK_SIZE)
    sc = unswizzle_scales(scale, rows, k).to(dtype)
    return (vals * sc.unsqueeze(-1)).view(rows, k)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """float64 ``[256, 2]``: the (low nibble, high nibble) e2m1 values of each byte."""
    table = _TABLES.get(device)
    if table is None:
        codes = torch.arange(256)
        vals = torch.tensor(E2M1_VALUES, dtype=torch.float64)

        def decode(c: torch.Tensor) -> torch.Tensor:
            return vals[c & 7] * (1 - 2 * ((c >> 3) & 1)).to(torch.float64)

        table = _TABLES[device] = torch.stack([decode(codes & 15), decode(codes >> 4)], 1).to(
            device
        )
    return table


def dequant_rows(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, k: int):
    """float64 ``e2m1 * block scale`` of the selected `rows` of one operand (swizzled
    scales, `check_swizzled_scales`), reading only those rows' bytes
    and scales: a byte table and the swizzle's index arithmetic, so the first-use check
    (`fp4_dispatch.firstuse`) stays within its budget."""
    check_swizzled_scales(scale, data.shape[0], k)
    vals = _byte_table(data.device)[data.index_select(0, rows).int()].reshape(len(rows), k)
    rp, kp = swizzled_scale_shape(data.shape[0], k)
    # swizzled [r128, kt, i32, i4, j4] holds row r128 * 128 + i4 * 32 + i32, column kt * 4 + j4
    bits = scale.contiguous().view(torch.uint8).reshape(rp // 128, kp // 4, 32, 4, 4)
    sc = bits[rows // 128, :, rows % 32, (rows % 128) // 32, :].reshape(len(rows), kp)
    sc = sc[:, : k // BLOCK_SIZE].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    return (vals.view(len(rows), k // BLOCK_SIZE, BLOCK_SIZE) * sc.unsqueeze(-1)).view(len(rows), k)


def reference_output(
    operands: GemmOperands | DenseOperands | GroupedOperands,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * dequant(a)[rows] @ dequant(b)[cols].T`` in float64 on the operands'
    device (all rows / columns when not given); for W4A16 (`DenseOperands`) ``a`` is the
    dense activation itself; grouped operands: `grouped.reference_output`, per expert
    (computed on the CPU: the offsets are read there)."""
    k = operands.k
    dev = operands.b_data.device
    if isinstance(operands, GroupedOperands):
        ref = grouped.reference_output(operands).to(dev)
        if rows is not None:
            ref = ref.index_select(0, rows)
        return ref if cols is None else ref.index_select(1, cols)
    rows = torch.arange(operands.m, device=dev) if rows is None else rows
    cols = torch.arange(operands.n, device=dev) if cols is None else cols
    if isinstance(operands, DenseOperands):
        a = operands.a.index_select(0, rows).to(torch.float64)
    else:
        a = dequant_rows(operands.a_data, operands.a_scale, rows, k)
    b = dequant_rows(operands.b_data, operands.b_scale, cols, k)
    return (a @ b.T) * operands.alpha.to(torch.float64).reshape(())


def check_indices(m: int, n: int, k: int, device: torch.device, seed: int = 0):
    """(rows, cols) the check compares: all of them for small problems, else the first
    `CHECK_HEAD`, the last `CHECK_TAIL` and `CHECK_INTERIOR` seeded random others of each
    (so a missed tail tile or an unwritten edge is always seen)."""

    def pick(size: int, salt: int) -> torch.Tensor:
        if m * n * k <= CHECK_FULL_MACS or size <= CHECK_HEAD + CHECK_TAIL + CHECK_INTERIOR:
            return torch.arange(size, device=device)
        gen = torch.Generator().manual_seed(seed + salt)
        inner = torch.randperm(size - CHECK_HEAD - CHECK_TAIL, generator=gen)[:CHECK_INTERIOR]
        idx = torch.cat([torch.arange(CHECK_HEAD), CHECK_HEAD + inner.sort().values,
                         torch.arange(size - CHECK_TAIL, size)])  # fmt: skip
        return idx.to(device)

    return pick(m, 0), pick(n, 1)


def check_output(
    out: torch.Tensor, inputs: Inputs, seed: int = 0, rtol: float = CHECK_RTOL
) -> str | None:
    """Why `out` is not the result of ``inputs.copies[0]`` (None when it is), within the
    relative error `rtol` (`check_rtol` of the candidate's operation).

    The caller filled `out` with NaN before the launch, so an element the kernel left
    unwritten reads as NaN and fails like a computed NaN.
    """
    if inputs.reference is None:
        ops = inputs.copies[0]
        rows, cols = check_indices(ops.m, ops.n, ops.k, ops.b_data.device, seed)
        inputs.reference = (rows, cols, reference_output(ops, rows, cols))
    rows, cols, ref = inputs.reference
    got = out.index_select(0, rows).index_select(1, cols).to(torch.float64)
    bad = (~torch.isfinite(got)).sum().item()
    if bad:
        return f"{bad} of {got.numel()} checked output elements are NaN/inf (or unwritten)"
    norm = torch.linalg.vector_norm(ref).item()
    err = torch.linalg.vector_norm(got - ref).item() / (norm if norm > 0 else 1.0)
    if not err <= rtol:
        return (
            f"relative error {err:.3g} against the float64 reference exceeds {rtol:g} "
            f"(checked {got.shape[0]}x{got.shape[1]} of {out.shape[0]}x{out.shape[1]})"
        )
    return None


def compare(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> tuple[float, str]:
    """(relative error, why it fails) of a whole output against its float64 reference;
    the reason is "" when it passes. Non-finite elements (unwritten NaN poison included)
    fail with their count, and the error is NaN then. Computed in float64 on `out`'s
    device (a large GPU output is not copied to the host)."""
    got = out.detach().to(torch.float64)
    bad = int((~torch.isfinite(got)).sum())
    if bad:
        return math.nan, f"{bad} of {got.numel()} output elements not written (NaN) or non-finite"
    ref = ref.detach().to(got.device, torch.float64)
    denom = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(got - ref))
    err = diff / denom if denom > 0 else diff
    return err, "" if err < tolerance else f"relative error {err:.3g} >= {tolerance:g}"
