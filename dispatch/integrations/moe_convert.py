"""Which transformers MoE blocks become `fp4_dispatch.moe.Nvfp4MoE`, and how.

transformers 5 holds a sparse MoE block's experts as fused 3-D parameters
(``experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and ``experts.down_proj``
``[E, H, I]``; ``is_transposed`` models store ``[E, H, 2I]`` and ``[E, I, H]``) and its
router as a small module with a ``weight`` ``[E, H]``. The routing rule is not in the
tensors, so the routers are named here with their rule (`ROUTERS`): Mixtral's softmax,
top-k, renormalised; Qwen3-MoE's the same with the renormalisation its config's
``norm_topk_prob``. Anything else in the block (a shared expert, a router bias or
correction term, another activation) would change the output, so such a block is left
as it is, with the reason in the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.integrations.moe import Nvfp4MoE
from fp4_dispatch.integrations.nn import Activations

__all__ = ["ROUTERS", "MoeBlock", "inspect_block", "to_nvfp4_moe"]

_K_MULTIPLE = 32  # the GEMMs' K rule (whole bytes per pair of 16-element blocks)

#: router class name -> whether it renormalises the top-k probabilities (None: the
#: router's own ``norm_topk_prob`` attribute says)
ROUTERS: dict[str, bool | None] = {
    "MixtralTopKRouter": True,
    "Qwen3MoeTopKRouter": None,
}


@dataclass
class MoeBlock:
    """A convertible block: its router weight, dense experts in ``[E, 2I, H]`` /
    ``[E, H, I]`` orientation (views, no copy), top-k and its normalisation."""

    router_weight: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    norm_topk_prob: bool


def _looks_like_moe(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and hasattr(experts, "gate_up_proj")


def _is_silu(act: object) -> bool:
    """Whether `act` computes SiLU (transformers' ``ACT2FN["silu"]`` is its own class):
    checked on a probe of values, not by type."""
    if not callable(act):
        return False
    probe = torch.linspace(-8, 8, 33)
    try:
        return bool(torch.equal(act(probe), torch.nn.functional.silu(probe)))
    except (TypeError, RuntimeError):  # not an elementwise activation: not SiLU
        return False


def _routing(router: nn.Module) -> tuple[int, bool] | str:
    """(top_k, norm_topk_prob) of a known router, or why it is not one."""
    kind = type(router).__name__
    if kind not in ROUTERS:
        return f"router {kind} is not one whose rule is known ({', '.join(ROUTERS)})"
    if set(dict(router.named_parameters())) != {"weight"} or list(router.children()):
        return f"router {kind} has tensors beyond its weight"
    norm = ROUTERS[kind]
    norm = bool(router.norm_topk_prob) if norm is None else norm
    return int(router.top_k), norm


def inspect_block(module: nn.Module) -> MoeBlock | str | None:
    """A `MoeBlock` when `module` converts, the reason when it looks like an MoE block
    that does not, None when it is no MoE block."""
    if not _looks_like_moe(module):
        return None
    kind = type(module).__name__
    extra = sorted(set(dict(module.named_children())) - {"gate", "experts"})
    if extra or list(module.named_parameters(recurse=False)):
        return f"{kind} has more than a router and experts ({', '.join(extra) or 'parameters'})"
    routing = _routing(module.gate)
    if isinstance(routing, str):
        return routing
    ex = module.experts
    act = getattr(ex, "act_fn", None)
    if not _is_silu(act) or getattr(ex, "has_bias", False):
        return f"{kind}: experts are not bias-free SiLU-gated ({type(act).__name__})"
    if not getattr(ex, "has_gate", True) or not getattr(ex, "is_concatenated", True):
        return f"{kind}: experts' gate and up rows are not concatenated"
    if set(dict(ex.named_parameters())) != {"gate_up_proj", "down_proj"}:
        return f"{kind}: experts hold tensors beyond gate_up_proj and down_proj"
    gate_up, down = ex.gate_up_proj, ex.down_proj
    if getattr(ex, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    h, i = gate_up.shape[2], gate_up.shape[1] // 2
    if h % _K_MULTIPLE or i % _K_MULTIPLE:
        return (
            f"{kind}: hidden {h} or expert intermediate {i} is not a multiple of "
            f"{_K_MULTIPLE} (the NVFP4 GEMM's K rule)"
        )
    return MoeBlock(module.gate.weight, gate_up, down, *routing)


def to_nvfp4_moe(
    block: MoeBlock,
    activations: Activations,
    dispatcher: Dispatcher | None,
    precision: str | None,
) -> Nvfp4MoE:
    """The `Nvfp4MoE` of one block (`Nvfp4MoE.from_experts`)."""
    return Nvfp4MoE.from_experts(
        block.router_weight,
        block.gate_up,
        block.down,
        block.top_k,
        norm_topk_prob=block.norm_topk_prob,
        dispatcher=dispatcher,
        activations=activations,
        precision=precision,
    )
