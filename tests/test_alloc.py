"""`fp4_dispatch.support.alloc`: the fast paths' allocation (Inductor's CUDA allocator
where it serves, ``torch.empty_strided`` elsewhere)."""

from __future__ import annotations

import pytest
import torch

from fp4_dispatch.support import alloc


@pytest.mark.parametrize("shape", [(), (7,), (1, 2048), (3, 0), (0, 5), (2, 1, 4096)])
def test_contiguous_strides_are_torch_emptys(shape):
    assert alloc.contiguous_strides(shape) == torch.empty(shape).stride()


def _spoof_cuda(monkeypatch, current: int) -> list:
    """Make `alloc` believe CUDA device `current` is current and record its allocations
    (made on the CPU)."""
    made = []

    def direct(shape, stride, dtype):
        made.append((shape, stride, dtype))
        return torch.empty_strided(shape, stride, dtype=dtype)

    monkeypatch.setattr(alloc, "_DIRECT", direct)
    monkeypatch.setattr(alloc, "_CURRENT", lambda: current)
    return made


def test_the_direct_allocator_serves_the_current_cuda_device_only(monkeypatch):
    _spoof_cuda(monkeypatch, current=1)
    assert alloc.direct_allocator(torch.device("cuda", 1)) is alloc._DIRECT
    assert alloc.direct_allocator(torch.device("cuda")) is alloc._DIRECT  # no index: current
    assert alloc.direct_allocator(torch.device("cuda", 0)) is None  # it would land on 1
    assert alloc.direct_allocator(torch.device("cpu")) is None
    monkeypatch.setattr(alloc, "_DIRECT", None)  # a torch without it
    assert alloc.direct_allocator(torch.device("cuda", 1)) is None


def test_empty_falls_back_to_empty_strided_elsewhere(monkeypatch):
    made = _spoof_cuda(monkeypatch, current=0)
    t = alloc.empty((3, 5), (5, 1), torch.bfloat16, torch.device("cpu"))
    assert (t.shape, t.stride(), t.dtype, t.device.type) == ((3, 5), (5, 1), torch.bfloat16, "cpu")
    assert made == []
    alloc.empty((2, 4), (4, 1), torch.float16, torch.device("cuda", 0))
    assert made == [((2, 4), (4, 1), torch.float16)]


def test_a_kept_quantize_makes_three_direct_allocations_where_it_can(monkeypatch):
    """On the current CUDA device `KeptQuantize.outputs` allocates data, scales and the
    global scale directly (three separate tensors, no views of one buffer), each with
    the shape, stride and dtype the ordinary path gives (where the allocator does not
    serve, the packed views: tests/test_quantize_kernel.py)."""
    from fp4_dispatch.backends import quantize as kq
    from fp4_dispatch.format.nvfp4 import swizzled_scale_shape

    made = _spoof_cuda(monkeypatch, current=0)
    data_shape, scale_shape = (1, 2048), tuple(swizzled_scale_shape(1, 4096))
    seen = []
    kept = kq.KeptQuantize(lambda tensors: seen.append(tensors) or True, data_shape,
                           scale_shape, None, torch.device("cuda", 0),
                           kq.packed_layout(data_shape, scale_shape))  # fmt: skip
    assert kept.packed is not None  # small enough to pack: the direct path is preferred
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    data, scale, g = kept(x)
    assert made == [(data_shape, (2048, 1), torch.uint8),
                    (scale_shape, (scale_shape[1], 1), torch.float8_e4m3fn),
                    ((), (), torch.float32)]  # fmt: skip
    assert (data.shape, data.dtype, scale.dtype, g.shape) == (
        data_shape, torch.uint8, torch.float8_e4m3fn, ())  # fmt: skip
    assert len({t.untyped_storage().data_ptr() for t in (data, scale, g)}) == 3
    assert seen[0][1] is data and seen[0][2] is scale and seen[0][3] is g


@pytest.mark.gpu
def test_direct_allocations_behave_as_torch_empty_on_a_gpu():
    """On a GPU: `empty` takes Inductor's allocator on the current device and gives what
    ``torch.empty`` gives (device, shape, stride, dtype, an inference tensor under
    inference mode); a kept quantize's outputs are bit-equal to the ordinary path's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from fp4_dispatch import quantize_nvfp4
    from fp4_dispatch.backends import quantize as kq

    dev = torch.device("cuda", torch.cuda.current_device())
    assert alloc.direct_allocator(dev) is not None
    t = alloc.empty((16, 4096), (4096, 1), torch.bfloat16, dev)
    want = torch.empty((16, 4096), dtype=torch.bfloat16, device=dev)
    assert (t.device, t.shape, t.stride(), t.dtype) == (want.device, want.shape, want.stride(),
                                                        want.dtype)  # fmt: skip
    with torch.inference_mode():
        inner = alloc.empty((4,), (1,), torch.float32, dev)
        assert inner.is_inference() == torch.empty(4, device=dev).is_inference()
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    ordinary = [quantize_nvfp4(x) for _ in range(4)]  # the third call keeps a replay
    kept = kq.kept_quantize(x, None)
    assert kept is not None
    data, scale, g = kept(x)
    assert len({u.untyped_storage().data_ptr() for u in (data, scale, g)}) == 3
    q = ordinary[0]
    assert torch.equal(data, q.data) and torch.equal(g, q.global_scale)
    assert torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
