"""The W4A16 op's kept fast calls (`fp4_dispatch.engine.op_fast`): what the key holds,
when a kept call declines, and that the op keeps one only for a replayable warm plan.
The replays themselves run on the GPU (tests/test_driver_launch.py, marked gpu)."""

from __future__ import annotations

import torch

from fp4_dispatch.engine import op_fast


class _Runner:
    """What `OpFastCall` and `FastCalls.keep` read of a `Runner`."""

    dense_operation = "w4a16"

    def __init__(self, replay=None) -> None:
        self.plan_epoch = 0
        self._autotune_depth = 0
        self._replay = replay
        self.asked: list[tuple] = []

    def replay_of(self, key, args):
        self.asked.append(key)
        return self._replay


def _operands(m=2, k=64, n=8):
    a = torch.zeros(m, k, dtype=torch.bfloat16)
    return a, torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(128, 4), torch.ones(1)


def test_the_key_changes_with_every_fact_the_replay_depends_on():
    a, b, sb, alpha = _operands()
    base = op_fast.w4a16_key(-1, a, b, sb, alpha, torch.bfloat16, None, None)
    assert base == op_fast.w4a16_key(-1, a.clone(), b, sb, alpha, torch.bfloat16, None, None)
    variants = [
        op_fast.w4a16_key(0, a, b, sb, alpha, torch.bfloat16, None, None),
        op_fast.w4a16_key(
            -1, torch.zeros(3, 64, dtype=torch.bfloat16), b, sb, alpha, torch.bfloat16, None, None
        ),
        op_fast.w4a16_key(-1, a.half(), b, sb, alpha, torch.bfloat16, None, None),
        op_fast.w4a16_key(
            -1,
            torch.zeros(64, 2, dtype=torch.bfloat16).t(),
            b,
            sb,
            alpha,
            torch.bfloat16,
            None,
            None,
        ),
        op_fast.w4a16_key(-1, a, b, sb, alpha, torch.float16, None, None),
        op_fast.w4a16_key(-1, a, b.clone(), sb, alpha, torch.bfloat16, None, None),
        op_fast.w4a16_key(-1, a, b, sb.clone(), alpha, torch.bfloat16, None, None),
        op_fast.w4a16_key(-1, a, b, sb, alpha.clone(), torch.bfloat16, None, None),
        op_fast.w4a16_key(-1, a, b, sb, alpha, torch.bfloat16, torch.zeros(8), None),
        op_fast.w4a16_key(-1, a, b, sb, alpha, torch.bfloat16, None, b.clone()),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_a_kept_call_declines_when_plans_tuning_or_alignment_changed():
    seen = []
    d = _Runner()
    fast = op_fast.OpFastCall(d, lambda tensors: seen.append(tensors) or True)
    a, out = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 8)
    assert fast([a, out]) and seen[-1][0] is a and seen[-1][1] is out
    d._autotune_depth = 1
    assert not fast([a, out])
    d._autotune_depth = 0
    odd = torch.zeros(1, 80, dtype=torch.bfloat16)[:, 1:65]  # 2 bytes past an aligned start
    assert not fast([odd, out])
    assert not fast([a, out, odd])  # any per-call tensor: a W4A4 call patches four
    d.plan_epoch += 1  # the plans were replaced (tuning, a fault): the replay may be stale
    assert not fast([a, out])
    assert len(seen) == 1


PLAN = (2, 8, 64, "bfloat16", "w4a16")


def test_keep_asks_the_plan_of_the_call_and_keeps_only_a_replay():
    a, b, sb, alpha = _operands()
    out = torch.zeros(2, 8, dtype=torch.bfloat16)
    calls = op_fast.FastCalls()
    none = _Runner(replay=None)
    calls.keep("k", none, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    assert none.asked == [PLAN] and calls.get("k") is None
    calls.keep("k", none, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    assert len(none.asked) == 1  # no replay at this plan epoch: not asked again
    none.plan_epoch += 1
    calls.keep("k", none, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    assert len(none.asked) == 2 and calls.get("k") is None  # the plans changed: asked anew
    none._autotune_depth = 1  # an autotuning block may leave the replay unrecorded
    calls.keep("t", none, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    calls.keep("t", none, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    assert len(none.asked) == 4
    d = _Runner(replay=lambda tensors: True)
    calls.keep("k", d, PLAN, (a, b, sb, alpha, out, None, None), [a, out])
    assert isinstance(calls.get("k"), op_fast.OpFastCall) and len(calls) == 1
    calls.clear()
    assert calls.get("k") is None


def test_the_op_on_the_cpu_keeps_no_fast_call_and_stays_exact():
    """CPU plans have no driver-API replay: every call takes the checked path, with the
    same result as the dispatcher's own call."""
    import fp4_dispatch.engine.dispatcher  # noqa: F401 - registers the default factory
    from fp4_dispatch import quantize_nvfp4
    from fp4_dispatch.engine import torch_ops

    w = quantize_nvfp4(torch.randn(32, 64))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    args = (x, w.data, w.scale, w.global_scale.reshape(1), torch.bfloat16)
    first = torch.ops.fp4_dispatch.gemm_w4a16.default(*args)
    for _ in range(3):
        assert torch.equal(torch.ops.fp4_dispatch.gemm_w4a16.default(*args), first)
    key = op_fast.w4a16_key(-1, x, w.data, w.scale, args[3], torch.bfloat16, None, None)
    assert torch_ops._fast.get(key) is None


def _public_operands():
    from fp4_dispatch import quantize_nvfp4

    qb = quantize_nvfp4(torch.randn(32, 64))
    return torch.randn(3, 64, dtype=torch.bfloat16), quantize_nvfp4(torch.randn(3, 64)), qb


def test_the_public_key_changes_with_every_fact_the_call_depends_on():
    """`Dispatcher.gemm`'s key: the activation's layout (dense or NVFP4), the weight's
    fields by address, the output dtype; no key for operands converted per call."""
    from fp4_dispatch import quantize_nvfp4

    x, qa, qb = _public_operands()
    key = op_fast.public_gemm_key
    assert key(x, qb, None) == key(x.clone(), qb, None)
    assert key(qa, qb, None) == key(quantize_nvfp4(torch.randn(3, 64)), qb, None)
    dense = [key(x, qb, None), key(x[:2], qb, None), key(x.half(), qb, None),
             key(x, qb, torch.float16), key(x, quantize_nvfp4(torch.randn(32, 64)), None),
             key(torch.zeros(64, 3, dtype=torch.bfloat16).t(), qb, None)]  # fmt: skip
    fp4 = [key(qa, qb, None), key(qa, qb, torch.float16),
           key(quantize_nvfp4(torch.randn(5, 64)), qb, None),
           key(qa, quantize_nvfp4(torch.randn(16, 64)), None)]  # fmt: skip
    assert len(set(dense + fp4)) == len(dense) + len(fp4)
    assert key(x, qb.with_layout("linear"), None) is None
    assert key(qa.with_layout("linear"), qb, None) is None
    assert key(x.float().numpy(), qb, None) is None and key(x, x, None) is None


class _FakeReplay:
    """A recorded replay that writes a marker into the output (the last per-call tensor)."""

    def __init__(self) -> None:
        self.calls: list[list[torch.Tensor]] = []

    def __call__(self, per_call):
        self.calls.append(per_call)
        per_call[-1].fill_(7.0)
        return True


def test_dispatcher_gemm_takes_its_kept_call_and_declines_as_the_op_does():
    """After one ordinary call of a key, the next `gemm` without ``out`` allocates the
    output and runs the replay with the plan's per-call tensors in `Plan.PER_CALL` order
    (W4A16: a, out; W4A4: data, scales, global scale, out); plans changed, an ``out``
    given or another output dtype take the ordinary path (exact)."""
    from fp4_dispatch import Dispatcher

    x, qa, qb = _public_operands()
    plain = Dispatcher("cpu", cache=False)
    exact16, exact4 = plain.gemm(x, qb), plain.gemm(qa, qb)
    d = Dispatcher("cpu", cache=False)
    fake = _FakeReplay()
    d.replay_of = lambda plan_key, args: fake  # the CPU plans record none
    for _ in range(2):  # the first call makes the plan; the second is kept
        assert torch.equal(d.gemm(x, qb), exact16) and torch.equal(d.gemm(qa, qb), exact4)
    assert not fake.calls
    y16, y4 = d.gemm(x, qb), d.gemm(qa, qb)
    assert (y16 == 7).all() and y16.shape == (3, 32) and y16.dtype == torch.bfloat16
    assert (y4 == 7).all() and y4.shape == (3, 32) and y4.dtype == torch.bfloat16
    (a, out16), four = fake.calls
    assert a is x and out16 is y16
    assert all(t is u for t, u in zip(four, (qa.data, qa.scale, qa.global_scale, y4), strict=True))
    assert torch.equal(d.gemm(x, qb, out=torch.empty(3, 32, dtype=torch.bfloat16)), exact16)
    for _ in range(2):
        assert torch.equal(d.gemm(x, qb, torch.float16), plain.gemm(x, qb, torch.float16))
    d.plan_epoch += 1
    assert torch.equal(d.gemm(x, qb), exact16) and len(fake.calls) == 2


def test_dispatcher_gemm_on_the_cpu_keeps_no_call_and_asks_once_per_plan_epoch():
    from fp4_dispatch import Dispatcher

    x, _, qb = _public_operands()
    d = Dispatcher("cpu", cache=False)
    asked = []
    real = d.replay_of
    d.replay_of = lambda plan_key, args: asked.append(plan_key) or real(plan_key, args)
    first = d.gemm(x, qb)
    for _ in range(3):
        assert torch.equal(d.gemm(x, qb), first)
    # asked on the second call (the first made the plan); no replay: remembered, not re-asked
    assert asked == [(3, 32, 64, "bfloat16", "w4a16")]
    key = op_fast.public_gemm_key(x, qb, None)
    assert d._public_fast.get(key) is None
