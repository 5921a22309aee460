"""One measurement harness: how this project times GPU work and checks a result.

Why one: the tuner, the benchmarks and the CLI must report numbers that compare. Users
run two ways, so there are two clocks:

- `gpu_time_us`: GPU time per call with a COLD L2, measured in CUDA-graph replays (no
  launch gaps). Each call in the graph is preceded by an L2 flush (a write over twice the
  L2 size); a second graph with the flushes alone is timed too and subtracted, so the
  flush itself is not counted. Median over ``replays`` replays.
- `eager_wall_us`: host wall time per call when calls are issued back to back and the
  device is synchronised once at the end - what a Python serving loop without CUDA graphs
  pays, launch overhead included (a fast kernel behind 50 µs of Python is slow).

Each has a ``*_samples`` form (one sample per replay / per block of calls: the spread is
the noise band) and a ``*_clock`` form (set up once, one sample per call, so two
kernels can be sampled alternately). The tuner measures through these two clocks - its
``measure="graph"`` policy is `gpu_clock`, ``measure="eager"`` is `eager_clock`
(`fp4_dispatch.tuning`) - so a tuned time and a benchmark time of the same kernel
compare.

And one numerics rule: `relative_error` is ``||out - ref||_F / ||ref||_F`` in float64,
infinite when ``out`` holds NaN/inf (an unwritten output poisoned with NaN is caught).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

#: GPU time samples (graph replays) per measurement
REPLAYS = 5
#: L2 flush buffer size as a multiple of the L2 size (write-allocate evicts everything)
FLUSH_FACTOR = 2


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
