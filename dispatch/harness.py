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

And one numerics rule: `relative_error` is ``||out - ref||_F / ||ref||_F`` in float64,
infinite when ``out`` holds NaN/inf (an unwritten output poisoned with NaN is caught).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

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


def eager_wall_us(fn: Callable[[], object], calls: int = 200, warmup: int = 20) -> float:
    """Host wall time per call, back to back, synchronised once at the end (module doc)."""
    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - t0) / calls * 1e6


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _l2_bytes(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def _capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up on the capture stream (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        body()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # one untimed replay: page in the graph's memory
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def gpu_time_us(
    fn: Callable[[], object],
    calls: int = 20,
    replays: int = REPLAYS,
    cold_l2: bool = True,
    device: torch.device | None = None,
) -> float:
    """GPU microseconds per call of `fn` in a CUDA graph, L2 flushed before each call.

    `fn` must be capturable (warm: compiled, no host sync, no allocation it cannot make
    in a capture). ``cold_l2=False`` times back-to-back calls with a warm L2.
    """
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
    samples = []
    for _ in range(replays):
        t = _replay_us(g_fn)
        if g_flush is not None:
            t -= _replay_us(g_flush)
        samples.append(max(t, 0.0) / calls)
    del g_fn, g_flush
    return statistics.median(samples)
