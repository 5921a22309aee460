"""`Nvfp4MoE`: a mixture-of-experts block (Mixtral / Qwen3-MoE style) on grouped NVFP4 GEMMs.

Why one module: an MoE layer that calls a dense GEMM per expert pays one launch and one
plan look-up per expert (64-256 a layer), which loses to bf16 at decode. This layer
runs the experts' two projections as two grouped GEMMs
(`fp4_dispatch.dispatcher.Dispatcher.grouped_gemm`, docs/grouped.md), each one launch
for every expert, and keeps everything between them on the device without a host
sync, so a warmed-up forward can be captured in a CUDA graph:

1. router: ``logits = x @ gate.weight.T`` in the model's dtype (bf16): the router is
   small (``E x H``) and its top-k is sensitive to rounding, so it is never quantized;
2. top-k as transformers' Mixtral and Qwen3-MoE blocks do it: softmax over all
   experts in float32, the k largest, renormalised to sum 1 when ``norm_topk_prob``
   (Mixtral always; equal to a softmax over the k chosen logits);
3. the ``T * k`` (token, expert) pairs sorted by expert (`sort_by_expert`: a stable
   device sort; the offsets, cumulative row ends per expert, by ``searchsorted`` on
   the sorted ids, never ``.item()`` or ``bincount``, which reads the maximum on the
   host);
4. ``h = grouped_gemm(x[sorted], gate_up)`` with the fused ``[E, 2I, H]`` weight
   (gate rows first, as transformers' ``gate_up_proj``), ``act = silu(h[:, :I]) *
   h[:, I:]`` in the activation dtype, ``y = grouped_gemm(act, down)`` with ``[E, H, I]``;
5. ``out[t] = sum over t's pairs of weight * y`` in float32, the k terms of a token in
   slot order (`combine`: deterministic, no atomics), rounded once to the output dtype.

On CUDA, eagerly (not under torch.compile, which traces the torch functions), with
Triton and at most `fp4_dispatch.backends.moe_route.MAX_PAIRS` pairs and
``MAX_EXPERTS`` experts, steps 2-3 are one Triton launch (``route_sorted``) and step 5
another (``combine_rows``, reading the rows where the GEMM wrote them): two launches for
~15 small kernels. Same experts, weights to float32 rounding, same sort; where logits
tie, the kernel takes the lowest expert index first (``torch.topk`` has no documented
rule), and its k additions run in slot order (torch's sum picks its own order), so
the two paths agree to float32 rounding before the final rounding, not always bit for
bit (docs/moe.md). On by default up to `Nvfp4MoE.fused_routing_max_pairs` pairs, where
they were measured faster (docs/moe.md); ``fused_routing = False`` on a layer (or on the
class) turns them off.

Numerics under ``activations="bf16"`` (W4A16, the exact default): every expert
multiplies by exactly its dequantized NVFP4 weight, with fp32 accumulation; the only
roundings are the bf16 outputs of the two GEMMs and of ``silu(g) * u`` (as in
transformers' own bf16 block). Under ``"nvfp4"`` (W4A4) both GEMM inputs are also
rounded to NVFP4 (one dynamic global scale per call, or the static one loaded from a
checkpoint).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from fp4_dispatch.engine import torch_ops
from fp4_dispatch.engine.dispatcher import Dispatcher
from fp4_dispatch.format import checks
from fp4_dispatch.format.grouped import Nvfp4Experts
from fp4_dispatch.format.nvfp4 import (
    BLOCK_SIZE,
    Nvfp4Tensor,
    quantize_nvfp4,
    swizzle_scales,
    swizzled_scale_shape,
    unswizzle_scales,
)
from fp4_dispatch.integrations.nn import ACTIVATIONS, Activations, precision_of
from fp4_dispatch.support.optional import OptionalCode

logger = logging.getLogger(__name__)

__all__ = ["Nvfp4MoE", "combine", "route", "sort_by_expert"]

_OUT_DTYPES = tuple(checks.OUT_DTYPES)
_K_MULTIPLE = 2 * BLOCK_SIZE  # the GEMM's K rule
#: buffers whose dtype IS the format: a module-wide dtype cast must never touch them
_QUANTIZED = (
    "gate_up_data",
    "gate_up_scale",
    "gate_global_scale",
    "up_global_scale",
    "down_data",
    "down_scale",
    "down_global_scale",
    "input_scales",
)


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 ``[T, k]``, expert ids int64 ``[T, k]``) from router logits
    ``[T, E]``: softmax over all experts in float32, the ``top_k`` largest, renormalised
    to sum 1 when ``norm_topk_prob`` (transformers' Mixtral and Qwen3-MoE routers)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(
    ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T * k`` (token, slot) pairs of ``ids`` ``[T, k]`` by expert, on the
    device, without a host sync: (order int64 ``[T*k]``, the flat pair index of each
    sorted row; token int64 ``[T*k]``, the token of each sorted row; offsets int32
    ``[E]``, cumulative row ends per expert, empty experts included). The sort is
    stable, so rows of one expert keep token order."""
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return order, order // ids.shape[-1], offsets


def combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, H]``: each token's expert outputs ``y`` (rows sorted by expert, as
    `sort_by_expert` made them) weighted by ``weights`` ``[T, k]`` and summed. The rows go
    back to (token, slot) order by one ``index_copy_`` and the k terms of a token add in
    slot order: deterministic, unlike an ``index_add_`` (float atomics on a GPU)."""
    t, k = weights.shape
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    return (pairs.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1)


def _load_route_kernels() -> object:
    """`fp4_dispatch.backends.moe_route` (raises ImportError without Triton)."""
    from fp4_dispatch.backends import moe_route  # noqa: PLC0415 - optional: Triton

    return moe_route


#: `fp4_dispatch.backends.moe_route` when Triton imports, else False (looked up once)
_route_kernels = OptionalCode(_load_route_kernels, "Triton MoE routing kernels", logger)


def _check_dims(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
    for name, value, k_rule in (
        ("hidden_size", hidden_size, True),
        ("intermediate_size", intermediate_size, True),
        ("num_experts", num_experts, False),
        ("top_k", top_k, False),
    ):
        if not isinstance(value, int) or value <= 0 or (k_rule and value % _K_MULTIPLE):
            rule = f"a positive multiple of {_K_MULTIPLE}" if k_rule else "a positive int"
            raise ValueError(f"{name}: expected {rule}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k: expected at most num_experts={num_experts}, got {top_k}")


class Router(nn.Module):
    """The router's dense ``[E, H]`` weight, kept in the model's dtype (never quantized:
    it is tiny and its top-k flips on small errors). Not an ``nn.Linear``, so that
    `fp4_dispatch.quantize_model` never converts it; named ``gate.weight`` as in
    transformers' MoE blocks and their checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(num_experts, hidden_size, device=device, dtype=dtype or torch.bfloat16),
            requires_grad=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Nvfp4MoE(nn.Module):
    """A sparse MoE block: router, top-k, and SiLU-gated experts held in NVFP4.

    - ``hidden_size`` (H) and ``intermediate_size`` (I, per expert) must be multiples
      of 32 (the GEMMs' K rule); ``num_experts`` (E), ``top_k`` (k <= E).
    - ``norm_topk_prob``: renormalise the k chosen probabilities to sum 1 (Mixtral:
      always; Qwen3-MoE: its config's ``norm_topk_prob``).
    - ``activations``, ``precision``, ``dispatcher``: as in `fp4_dispatch.nn.Nvfp4Linear`
      (``"auto"``: W4A4 on GPUs with FP4 tensor cores, W4A16 elsewhere; ``"bf16"``:
      W4A16, exact weight-only).
    - Parameters and buffers (names as transformers' and the checkpoints' where they
      exist): ``gate.weight`` the router ``[E, H]`` (dense, ``dtype``, default bf16);
      ``gate_up_data`` uint8 ``[E, 2I, H/2]`` and ``gate_up_scale`` e4m3 ``[E, *swizzled(2I,
      H)]`` (gate rows, then up rows); ``gate_global_scale`` and ``up_global_scale``
      float32 ``[E]`` (the decode global scale of each expert's gate and up rows; equal
      when converted here, and in ModelOpt checkpoints); ``down_data`` ``[E, H, I/2]``,
      ``down_scale``, ``down_global_scale`` ``[E]``; ``input_scales`` float32 ``[3, E]``
      (static activation decode scales of gate, up and down per expert, from a
      checkpoint; None: dynamic per call; only W4A4 reads them, as their maximum).

    When an expert's gate and up global scales differ (a checkpoint whose exporter did
    not share them), the gate/up product runs as two grouped GEMMs on contiguous copies
    of the two halves (made at the first eager forward, outside a CUDA-graph capture):
    exact, at the cost of one more launch and a second copy of the gate/up weights.

    Inference only (no gradient through the quantized GEMMs). Dtype casts reach only the
    router; ``.to(device)`` moves everything.

    ``fused_routing`` (default True; set it on an instance or the class): on CUDA,
    eager, the routing, sort and combine run as two Triton launches (module docstring)
    for calls of at most ``fused_routing_max_pairs`` (token, expert) pairs.
    """

    #: run routing + sort and combine as the fused Triton kernels where they apply
    fused_routing: bool = True
    #: the most ``T * k`` pairs routed by the fused kernels (one program each); beyond,
    #: the torch functions. Measured on an H100 (benchmarks/RESULTS.md, "Mixture of
    #: experts" run 6, a Qwen3-30B-A3B-like layer, graph): fused 1.83x faster at 8 pairs,
    #: 1.12x at 128, 0.86x at 512; the crossover between 128 and 512 is not measured
    fused_routing_max_pairs: int = 128

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        dispatcher: Dispatcher | None = None,
        activations: Activations = "auto",
        precision: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_dims(hidden_size, intermediate_size, num_experts, top_k)
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob: expected a bool, got {type(norm_topk_prob).__name__}")
        self.precision = precision_of(precision, dispatcher)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.activations = activations
        self.dispatcher = dispatcher
        self.gate = Router(hidden_size, num_experts, device=device, dtype=dtype)
        e, h, i = num_experts, hidden_size, intermediate_size
        u8, f32, e4m3 = torch.uint8, torch.float32, torch.float8_e4m3fn
        self.register_buffer("gate_up_data", torch.zeros(e, 2 * i, h // 2, dtype=u8, device=device))
        self.register_buffer(
            "gate_up_scale",
            torch.zeros(e, *swizzled_scale_shape(2 * i, h), dtype=e4m3, device=device),
        )
        self.register_buffer("gate_global_scale", torch.ones(e, dtype=f32, device=device))
        self.register_buffer("up_global_scale", torch.ones(e, dtype=f32, device=device))
        self.register_buffer("down_data", torch.zeros(e, h, i // 2, dtype=u8, device=device))
        self.register_buffer(
            "down_scale", torch.zeros(e, *swizzled_scale_shape(h, i), dtype=e4m3, device=device)
        )
        self.register_buffer("down_global_scale", torch.ones(e, dtype=f32, device=device))
        self.register_buffer("input_scales", None)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_experts(
        cls,
        router_weight: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        dispatcher: Dispatcher | None = None,
        activations: Activations = "auto",
        precision: str | None = None,
    ) -> Nvfp4MoE:
        """Quantize dense experts (transformers' fused layout: ``gate_up_proj`` ``[E, 2I,
        H]``, gate rows first, ``down_proj`` ``[E, H, I]``) into a new layer on their
        device. Each expert's ``[2I, H]`` and ``[H, I]`` matrices are quantized by
        `fp4_dispatch.quantize_nvfp4` alone (global scale ``amax / (6 * 448)`` of that
        matrix, so gate and up share it, as ModelOpt's export does), one expert at a
        time: the scratch is one expert's matrix in float32."""
        e, two_i, h = gate_up_proj.shape
        if two_i % 2 or tuple(down_proj.shape) != (e, h, two_i // 2):
            raise ValueError(
                f"down_proj: expected shape {(e, h, two_i // 2)} for gate_up_proj of shape "
                f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}"
            )
        if tuple(router_weight.shape) != (e, h):
            raise ValueError(
                f"router_weight: expected shape {(e, h)}, got {tuple(router_weight.shape)}"
            )
        dtype = router_weight.dtype if router_weight.dtype in _OUT_DTYPES else torch.bfloat16
        mod = cls(
            h,
            two_i // 2,
            e,
            top_k,
            norm_topk_prob=norm_topk_prob,
            dispatcher=dispatcher,
            activations=activations,
            precision=precision,
            device=gate_up_proj.device,
            dtype=dtype,
        )
        with torch.no_grad():
            mod.gate.weight.copy_(router_weight.detach())
            for x in range(e):
                gu = quantize_nvfp4(gate_up_proj[x].detach())
                mod.load_expert(x, gate=gu, down=quantize_nvfp4(down_proj[x].detach()))
        return mod

    def load_expert(
        self,
        expert: int,
        *,
        gate: Nvfp4Tensor,
        up: Nvfp4Tensor | None = None,
        down: Nvfp4Tensor,
    ) -> None:
        """Take expert ``expert``'s quantized weights: ``gate`` ``[I, H]`` and ``up``
        ``[I, H]``, or ``gate`` the fused ``[2I, H]`` (gate rows first) and ``up`` None;
        ``down`` ``[H, I]``. Either scale layout; the bytes are kept as they are."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if not (isinstance(expert, int) and 0 <= expert < e):
            raise ValueError(f"expert: expected an int in [0, {e}), got {expert!r}")
        parts = [("gate", gate), ("down", down)] + ([("up", up)] if up is not None else [])
        for name, q in parts:
            if not isinstance(q, Nvfp4Tensor):
                raise TypeError(f"{name}: expected an Nvfp4Tensor, got {type(q).__name__}")
        want = {"gate": (i if up is not None else 2 * i, h), "up": (i, h), "down": (h, i)}
        for name, q in parts:
            if q.shape != want[name]:
                raise ValueError(f"{name}: expected shape {want[name]}, got {q.shape}")
        dev = self.gate_up_data.device
        rows = [gate] if up is None else [gate, up]
        with torch.no_grad():
            data = torch.cat([q.natural_data().to(dev) for q in rows])
            lin = torch.cat([q.linear_scale().to(dev) for q in rows])
            self.gate_up_data[expert].copy_(data)
            self.gate_up_scale[expert].copy_(swizzle_scales(lin))
            self.gate_global_scale[expert].copy_(gate.global_scale)
            self.up_global_scale[expert].copy_((up if up is not None else gate).global_scale)
            self.down_data[expert].copy_(down.natural_data().to(dev))
            self.down_scale[expert].copy_(down.with_layout("swizzled").scale.to(dev))
            self.down_global_scale[expert].copy_(down.global_scale)
        self._forget()

    def set_input_scales(self, scales: torch.Tensor | None) -> None:
        """Static activation decode scales ``[3, E]`` (gate, up, down per expert), or None
        for dynamic per-call scales."""
        if scales is None:
            self.input_scales = None
            return
        t = torch.as_tensor(scales, dtype=torch.float32).detach()
        if tuple(t.shape) != (3, self.num_experts):
            raise ValueError(
                f"scales: expected shape (3, {self.num_experts}), got {tuple(t.shape)}"
            )
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ValueError("scales: expected finite values > 0")
        self.input_scales = t.to(self.gate_up_data.device)

    def _forget(self) -> None:
        """Drop what was derived from the weights (the split halves, the fused flag)."""
        self.__dict__.pop("_halves", None)
        self.__dict__.pop("_fused", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Accept static ``input_scales`` even when this layer has none yet."""
        self._forget()
        if prefix + "input_scales" in state_dict and self.input_scales is None:
            self.input_scales = torch.ones(3, self.num_experts, device=self.gate_up_data.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        """Let a dtype cast reach the router only; device moves still move the buffers."""
        kept = {n: self._buffers[n] for n in _QUANTIZED if self._buffers.get(n) is not None}
        self._forget()
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    # ---- views ------------------------------------------------------------------------

    def expert_weight(self, which: str, expert: int) -> Nvfp4Tensor:
        """One expert's ``"gate_up"`` ``[2I, H]`` (global scale: the gate rows'), ``"gate"``
        or ``"up"`` ``[I, H]``, or ``"down"`` ``[H, I]`` weight, linear scales."""
        h, i = self.hidden_size, self.intermediate_size
        if which == "down":
            return Nvfp4Tensor._trusted(
                self.down_data[expert],
                self.down_scale[expert],
                self.down_global_scale[expert],
                "swizzled",
                (h, i),
            )
        if which not in ("gate_up", "gate", "up"):
            raise ValueError(f"which: expected 'gate_up', 'gate', 'up' or 'down', got {which!r}")
        lin = unswizzle_scales(self.gate_up_scale[expert], 2 * i, h)
        rows = {"gate_up": slice(0, 2 * i), "gate": slice(0, i), "up": slice(i, 2 * i)}[which]
        g = (self.up_global_scale if which == "up" else self.gate_global_scale)[expert]
        data = self.gate_up_data[expert, rows]
        return Nvfp4Tensor._trusted(data, lin[rows], g, "linear", (data.shape[0], h))

    def dequantized_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the grouped GEMMs multiply by, float32: (gate_up ``[E, 2I, H]``, each
        half with its own global scale; down ``[E, H, I]``)."""
        gu, dn = [], []
        for x in range(self.num_experts):
            gate, up = self.expert_weight("gate", x), self.expert_weight("up", x)
            gu.append(torch.cat([gate.dequantize(), up.dequantize()]))
            dn.append(self.expert_weight("down", x).dequantize())
        return torch.stack(gu), torch.stack(dn)

    def extra_repr(self) -> str:
        scale = "dynamic" if self.input_scales is None else "static"
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"norm_topk_prob={self.norm_topk_prob}, activations={self.activations}, "
            f"activation_scale={scale}, precision={self.precision}"
        )

    def operation(self, device: torch.device | str | None = None) -> str:
        """``"w4a16"`` or ``"w4a4"``: what a forward on `device` runs ("auto": W4A4 only on
        a CUDA GPU with FP4 tensor cores, compute capability >= 10; as `Nvfp4Linear`)."""
        if self.activations != "auto":
            return "w4a16" if self.activations == "bf16" else "w4a4"
        dev = torch.device(device if device is not None else self.gate_up_data.device)
        cache = self.__dict__.setdefault("_op_by_device", {})  # a device query per call costs
        op = cache.get(dev)
        if op is None:
            fp4_cores = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 10
            op = cache[dev] = "w4a4" if fp4_cores else "w4a16"
        return op

    # ---- forward ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden_size
        if x.shape[-1] != h:
            raise ValueError(f"x: expected last dimension {h}, got shape {tuple(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                "Nvfp4MoE is inference-only: no gradient flows through its quantized grouped "
                "GEMMs. Run it under torch.no_grad() or torch.inference_mode()."
            )
        if self.dispatcher is not None:
            self.dispatcher.check_device("x", x)
        out_dtype = x.dtype if x.dtype in _OUT_DTYPES else self.gate.weight.dtype
        out_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.bfloat16
        x2 = x.reshape(-1, h)
        logits = self.gate(x2)
        # torch.compile traces the torch functions (dynamo does not enter `_kernels_for`)
        kernels = False if torch.compiler.is_compiling() else self._kernels_for(logits)
        if kernels:
            weights, order, token, offsets, inv = kernels.route_sorted(
                logits, self.top_k, self.norm_topk_prob
            )
        else:
            weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            order, token, offsets = sort_by_expert(ids, self.num_experts)
        a = x2.index_select(0, token).to(out_dtype)
        dense = self.operation(x.device) == "w4a16"
        act = self._gate_up(a, offsets, out_dtype, dense)
        y = self._grouped(act, "down", offsets, out_dtype, dense)
        if kernels:
            return kernels.combine_rows(y, inv, weights, out_dtype).reshape(x.shape)
        return combine(y, order, weights).to(out_dtype).reshape(x.shape)

    def _kernels_for(self, logits: torch.Tensor) -> object:
        """The fused routing and combine kernels (`fp4_dispatch.backends.moe_route`) when
        they take this call - eager, on CUDA, Triton importable, ``T * k`` at most
        `fused_routing_max_pairs` and within one program's limits with E, float32/16-bit
        logits, `fused_routing` on - else False (the torch functions)."""
        if not (self.fused_routing and logits.is_cuda):
            return False
        if logits.shape[0] * self.top_k > self.fused_routing_max_pairs:
            return False
        kernels = _route_kernels()
        if (
            kernels
            and logits.dtype in kernels.LOGIT_DTYPES
            and kernels.fits(logits.shape[0], self.num_experts, self.top_k)
        ):
            return kernels
        return False

    def _gate_up(
        self, a: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype, dense: bool
    ) -> torch.Tensor:
        """``silu(a @ gate.T) * (a @ up.T)`` per expert, in ``out_dtype``."""
        i = self.intermediate_size
        if self._is_fused():
            hidden = self._grouped(a, "gate_up", offsets, out_dtype, dense)
            g, u = hidden[:, :i], hidden[:, i:]
        else:
            g = self._grouped(a, "gate", offsets, out_dtype, dense)
            u = self._grouped(a, "up", offsets, out_dtype, dense)
        return F.silu(g) * u

    def _is_fused(self) -> bool:
        """Whether every expert's gate and up rows share one global scale (one grouped
        GEMM for both); decided once per load (a host sync, outside any capture)."""
        fused = self.__dict__.get("_fused")
        if fused is None:
            if torch_ops.stream_capturing():
                raise RuntimeError("Nvfp4MoE: run one eager forward before capturing a graph")
            fused = self.__dict__["_fused"] = bool(
                torch.equal(self.gate_global_scale, self.up_global_scale)
            )
        return fused

    def _stacked(self, which: str) -> Nvfp4Experts:
        """The ``[E, N, K]`` weight of one grouped GEMM (views of the buffers, or for
        ``"gate"``/``"up"`` the kept contiguous halves)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if which == "gate_up":
            return Nvfp4Experts._trusted(
                self.gate_up_data, self.gate_up_scale, self.gate_global_scale, (e, 2 * i, h)
            )
        if which == "down":
            return Nvfp4Experts._trusted(
                self.down_data, self.down_scale, self.down_global_scale, (e, h, i)
            )
        halves = self.__dict__.get("_halves")
        if halves is None:
            if torch_ops.stream_capturing():
                raise RuntimeError("Nvfp4MoE: run one eager forward before capturing a graph")
            halves = self.__dict__["_halves"] = {w: self._half(w) for w in ("gate", "up")}
        return halves[which]

    def _half(self, which: str) -> Nvfp4Experts:
        """A contiguous ``[E, I, H]`` copy of the gate or up rows (split mode only)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        rows = slice(0, i) if which == "gate" else slice(i, 2 * i)
        scales = [
            swizzle_scales(unswizzle_scales(self.gate_up_scale[x], 2 * i, h)[rows])
            for x in range(e)
        ]
        g = self.gate_global_scale if which == "gate" else self.up_global_scale
        data = self.gate_up_data[:, rows].contiguous()
        return Nvfp4Experts._trusted(data, torch.stack(scales), g, (e, i, h))

    def _grouped(
        self,
        a: torch.Tensor,
        which: str,
        offsets: torch.Tensor,
        out_dtype: torch.dtype,
        dense: bool,
    ) -> torch.Tensor:
        """``a @ W[e].T`` for the rows of each expert ``e``: the grouped GEMM
        (`Dispatcher.grouped_gemm`, docs/grouped.md) on the layer's own buffers, which
        are valid by construction, so through `fp4_dispatch.torch_ops.run_grouped`
        (no per-call operand checks; the custom op under torch.compile)."""
        b = self._stacked(which)
        if dense:
            return torch_ops.run_grouped(self.dispatcher, a, None, b.data, b.scale,
                                         b.global_scale, offsets, out_dtype)  # fmt: skip
        static = None
        if self.input_scales is not None:
            static = self.input_scales[2 if which == "down" else slice(0, 2)].amax()
        qa, sa, ga = torch_ops.quantize(a, static)
        alpha = b.global_scale * ga  # per expert: the weight's scale times the activation's
        return torch_ops.run_grouped(self.dispatcher, qa, sa, b.data, b.scale, alpha, offsets,
                                     out_dtype)  # fmt: skip
