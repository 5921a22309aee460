"""Kept kernel scratch (backends/workspace.py): made once, outside the caller's thread."""

from __future__ import annotations

import threading

import torch

from fp4_dispatch.backends import workspace


def test_scratch_is_made_once_per_size_zeroed_and_kept(monkeypatch):
    made_on: list[str] = []
    real = workspace._make

    def spy(device, floats, counters):
        made_on.append(threading.current_thread().name)
        return real(device, floats, counters)

    monkeypatch.setattr(workspace, "_make", spy)
    s = workspace.Scratch()
    cpu = torch.device("cpu")
    ws, cnt = s.get(cpu, 64, 4)
    assert ws.dtype == torch.float32 and ws.numel() == 64
    assert cnt.dtype == torch.int32 and cnt.numel() == 4 and not cnt.any()
    cnt[0] = 7  # a kernel that did not reset its counter would leave this behind
    again = s.get(cpu, 64, 4)
    assert again[0] is ws and again[1] is cnt and int(again[1][0]) == 7  # never re-zeroed
    other = s.get(cpu, 128, 8)
    assert other[0] is not ws and len(s) == 2
    # made off the calling thread: a CUDA-graph pool routes only the caller's thread
    assert made_on and all(name.startswith("fp4-scratch") for name in made_on)
    assert threading.current_thread().name not in made_on
