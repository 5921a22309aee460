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
    assert fast(a, out) and seen[-1][0] is a and seen[-1][1] is out
    d._autotune_depth = 1
    assert not fast(a, out)
    d._autotune_depth = 0
    odd = torch.zeros(1, 80, dtype=torch.bfloat16)[:, 1:65]  # 2 bytes past an aligned start
    assert not fast(odd, out)
    d.plan_epoch += 1  # the plans were replaced (tuning, a fault): the replay may be stale
    assert not fast(a, out)
    assert len(seen) == 1


def test_keep_asks_the_plan_of_the_call_and_keeps_only_a_replay():
    a, b, sb, alpha = _operands()
    out = torch.zeros(2, 8, dtype=torch.bfloat16)
    calls = op_fast.FastCalls()
    none = _Runner(replay=None)
    calls.keep("k", none, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
    assert none.asked == [(2, 8, 64, "bfloat16", "w4a16")] and calls.get("k") is None
    calls.keep("k", none, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
    assert len(none.asked) == 1  # no replay at this plan epoch: not asked again
    none.plan_epoch += 1
    calls.keep("k", none, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
    assert len(none.asked) == 2 and calls.get("k") is None  # the plans changed: asked anew
    none._autotune_depth = 1  # an autotuning block may leave the replay unrecorded
    calls.keep("t", none, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
    calls.keep("t", none, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
    assert len(none.asked) == 4
    d = _Runner(replay=lambda tensors: True)
    calls.keep("k", d, 2, 8, 64, "bfloat16", (a, b, sb, alpha, out, None, None))
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
