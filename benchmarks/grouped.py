"""The kernels suite's ``grouped`` routine: the grouped NVFP4 GEMM of a mixture-of-experts
layer (docs/grouped.md) against bf16 ``torch._grouped_mm`` on the same routing and against
a loop of dense ``Dispatcher.gemm`` calls, one per expert (the issue 35 targets).

    python -m benchmarks kernels --cases grouped                 # GPU, every config
    python -m benchmarks kernels --cases grouped --tune --top 8  # tune each bucket first
    python -m benchmarks kernels --cases grouped --configs deepseek-v3 --m 1 4096

Configs (per layer, both projections of an expert MLP; ``--configs`` picks):

- ``qwen3-30b-a3b``: E = 128 experts, top-8, hidden 2048, expert intermediate 768:
  gate_up N=1536 K=2048, down N=2048 K=768;
- ``deepseek-v3``: E = 256, top-8, hidden 7168, intermediate 2048: gate_up N=4096
  K=7168, down N=7168 K=2048.

Tokens (``--m`` replaces them) 1, 16, 64 (decode: tokens x top-k rows) and 4096 (prefill);
``--nk`` replaces the two projections. Routing: each token picks top-k distinct experts
uniformly at random (seeded), rows sorted by expert, int32 offsets on the device (empty
experts included, as real decode routing has). Paths of each case (row M = the rows):

- ``dispatcher``: `Dispatcher.grouped_gemm` with bf16 rows (operation ``grouped_w4a16``),
  its untuned pick named as the tactic; with ``--tune`` the bucket is tuned first
  (`Dispatcher.tune`, the ``--top`` tactics the dispatcher's budget, 0: the shortlist);
- ``torch._grouped_mm bf16``: the dequantized weights (exact in bf16) ``[E, N, K]``;
- ``dense loop``: `Dispatcher.gemm` (W4A16) once per touched expert on its row slice
  (slices fixed outside the timing: a real loop would also read the offsets).

Every path: GPU time (``graph``, L2 flushed before each call) and eager wall per call
through `common.path_rows`; the relative error of its NaN-poisoned output against the
float64 per-expert reference (`grouped.reference_output`, on `harness.check_indices`'
sampled rows and columns; above `harness.CHECK_RTOL` the row fails); ``ratios``: ``bf16``
and ``loop`` = that path's time over this one (> 1: this one is faster). ``extra``: config,
projection, tokens, experts, experts touched, dense GEMMs of the loop. Targets (issue 35,
H200): ``dispatcher`` x bf16 >= 2.0 at decode (<= 64 tokens), >= 1.0 at 4096; x loop
>= 5 at decode. Weights are random NVFP4 bytes with power-of-two scales
(`harness.random_experts`: quantizing 256 x 4096 x 7168 normals would take longer than
the measurement); the weight values do not change a GEMM's time.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .common import Context, add_ratios, on_cuda_or_smoke, path_rows

#: name -> (experts E, top-k, hidden, expert intermediate)
CONFIGS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v3": (256, 8, 7168, 2048)}
TOKENS = (1, 16, 64, 4096)
SMOKE_CONFIGS = {"tiny": (8, 2, 64, 32)}
SMOKE_TOKENS = (1, 4)
GROUPED = "grouped_w4a16"
PATHS = {"bf16": "torch._grouped_mm bf16", "loop": "dense loop"}


@dataclass(frozen=True)
class Case:
    """One grouped GEMM: a config's projection at a token count."""

    config: str
    proj: str
    tokens: int
    experts: int
    top_k: int
    n: int
    k: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def seed(self) -> int:  # stable across processes (hash() is salted)
        return zlib.crc32(f"{self.config} {self.proj} {self.tokens}".encode())


def cases(ctx: Context) -> list[Case]:
    """The cases of the run: configs (``--configs``) x projections (``--nk``) x tokens
    (``--m``); the tiny config with ``--smoke``."""
    chosen = getattr(ctx.args, "configs", None) or list(CONFIGS)
    configs = SMOKE_CONFIGS if ctx.smoke else {c: CONFIGS[c] for c in chosen}
    tokens = ctx.args.m or (SMOKE_TOKENS if ctx.smoke else TOKENS)
    out = []
    for name, (e, top_k, hidden, inter) in configs.items():
        projs = [("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
        if ctx.args.nk:
            projs = [(f"{n}x{k}", n, k) for n, k in ctx.args.nk]
        out += [Case(name, p, t, e, top_k, n, k) for p, n, k in projs for t in tokens]
    return out


def routing(case: Case, device: torch.device) -> torch.Tensor:
    """int32 offsets ``[E]``: each token on top-k distinct experts drawn uniformly
    (seeded), rows sorted by expert."""
    gen = torch.Generator().manual_seed(case.seed)
    picks = [torch.randperm(case.experts, generator=gen)[: case.top_k] for _ in range(case.tokens)]
    counts = torch.bincount(torch.cat(picks), minlength=case.experts)
    return counts.cumsum(0).to(torch.int32).to(device)


def experts(case: Case, device: torch.device):
    """Random `Nvfp4Experts` ``[E, N, K]`` made on the device (`harness.random_experts`)."""
    from fp4_dispatch.autotune.harness import random_experts
    from fp4_dispatch.format.grouped import Nvfp4Experts

    gen = torch.Generator(device=device).manual_seed(case.seed)
    data, scale, g = random_experts(case.experts, case.n, case.k, device, gen)
    return Nvfp4Experts(data, scale, g, (case.experts, case.n, case.k))


def bf16_weights(b) -> torch.Tensor:
    """``[E, N, K]`` bf16 of the dequantized experts (exact), one expert at a time."""
    out = torch.empty(b.shape, dtype=torch.bfloat16, device=b.device)
    for e in range(b.experts):
        out[e] = b.expert(e).dequantize().to(torch.bfloat16)
    return out


def reference(a: torch.Tensor, b, off: torch.Tensor):
    """(rows, cols, float64 reference on them): the sampled check of every path."""
    from fp4_dispatch.autotune.harness import check_indices
    from fp4_dispatch.contracts.backend import GroupedOperands
    from fp4_dispatch.format.grouped import reference_output

    rows, cols = check_indices(a.shape[0], b.n, b.k, torch.device("cpu"))
    ops = GroupedOperands(a, b.data, b.scale, b.global_scale, off)
    return rows, cols, reference_output(ops, rows, cols)


def check(fn: Callable[[torch.Tensor], object], out: torch.Tensor, ref) -> tuple[float, str]:
    """(relative error, why it fails or "") of one NaN-poisoned call of `fn` on the
    reference's sampled rows and columns."""
    from fp4_dispatch.autotune import harness

    rows, cols, want = ref
    out.fill_(math.nan)
    got = fn(out)
    got = got if isinstance(got, torch.Tensor) else out
    sub = got.index_select(0, rows.to(got.device)).index_select(1, cols.to(got.device))
    return harness.compare(sub, want, harness.CHECK_RTOL)


def paths(d, a: torch.Tensor, b, off: torch.Tensor) -> dict[str, tuple[str, Callable, dict]]:
    """name -> (operation, fn(out), extra) of the three paths of a case."""
    wt = bf16_weights(b).transpose(-2, -1)  # [E, K, N] view of [E, N, K]: torch's layout
    ends = off.cpu().tolist()
    bounds = enumerate(zip([0, *ends[:-1]], ends, strict=True))
    slices = [(s, e, b.expert(i)) for i, (s, e) in bounds if e > s]

    def loop(o: torch.Tensor) -> None:
        for s, e, w in slices:
            d.gemm(a[s:e], w, out=o[s:e])

    return {
        "dispatcher": (GROUPED, lambda o: d.grouped_gemm(a, b, off, out=o), {}),
        PATHS["bf16"]: ("bf16", lambda o: torch._grouped_mm(a, wt, offs=off), {}),
        PATHS["loop"]: ("w4a16", loop, {"gemms": len(slices)}),
    }


def run_case(ctx: Context, d, case: Case) -> list:
    """Rows of the three paths of `case`, checked, with their ratios."""
    from fp4_dispatch.contracts.tactics import tactic_label

    dev, t = ctx.device, case.rows
    b, off = experts(case, dev), routing(case, dev)
    a = torch.randn(t, case.k, generator=torch.Generator().manual_seed(case.seed))
    a = a.to(dev, torch.bfloat16)
    if ctx.args.tune:
        measure = "graph" if "graph" in ctx.args.clocks else "eager"
        d.tune([(t, case.n, case.k)], operation=GROUPED, groups=case.experts,
               measure=measure, save=False, progress=False)  # fmt: skip
    ref = reference(a, b, off)
    touched = int((torch.diff(off.cpu(), prepend=torch.zeros(1, dtype=torch.int32)) > 0).sum())
    base = {"config": case.config, "proj": case.proj, "tokens": case.tokens,
            "experts": case.experts, "touched": touched}  # fmt: skip
    rows = []
    for name, (op, fn, extra) in paths(d, a, b, off).items():
        out = torch.empty(t, case.n, dtype=torch.bfloat16, device=dev)
        got = path_rows(ctx, "grouped", fn, out, None, ctx.args.clocks, backend=name,
                        operation=op, m=t, n=case.n, k=case.k)  # fmt: skip
        err, why = (None, "") if all(r.failure for r in got) else check(fn, out, ref)
        pick = d.select(t, case.n, case.k, "bfloat16", op, case.experts) if op == GROUPED else None
        for r in got:
            r.error, r.failure = err, r.failure or why or None
            r.extra = {**base, **extra}
            r.tactic = f"{pick.backend} {tactic_label(pick.tactic)}" if pick else ""
        rows += got
    add_ratios(rows, PATHS)
    return rows


def routine(ctx: Context) -> None:
    """The ``grouped`` routine of the kernels suite (GPU, or the tiny config with
    ``--smoke``): one row per (case, path, clock), emitted case by case."""
    if not on_cuda_or_smoke(ctx, "grouped"):
        return
    from fp4_dispatch import Dispatcher

    budget = ctx.args.top or 10**6  # the tactics --tune measures per bucket
    d = Dispatcher(str(ctx.device), cache=False, budget=budget)
    for case in cases(ctx):
        ctx.emit(run_case(ctx, d, case))


# ---- the MoE layer (``--cases moe-layer``) ------------------------------------------------

#: kernels-suite config -> `moe_configs` model config of the same MoE shapes (``tiny``:
#: the ``--smoke`` CPU check)
LAYER_CONFIGS = {"qwen3-30b-a3b": "qwen3-moe", "deepseek-v3": "deepseek-like", "tiny": "tiny-moe"}
LAYER_PATHS = {"bf16": "transformers MoE block bf16 grouped_mm"}


def layer_blocks(config: str, device: torch.device) -> tuple[object, object]:
    """(transformers' bf16 MoE block with ``grouped_mm`` experts, its `Nvfp4MoE`) of a
    one-layer model of `config` (`moe_configs.build_moe_variants`: the bf16 block holds
    the dequantized NVFP4 weights, so both compute the same layer)."""
    from .moe_configs import build_moe_variants, moe_config

    models = build_moe_variants(moe_config(LAYER_CONFIGS[config], 1), device, ["w4a16"])
    return models["bf16"].model.layers[0].mlp, models["w4a16"].model.layers[0].mlp


def routing_label(block, x: torch.Tensor) -> str:
    """How `block` (an `Nvfp4MoE`) routes `x`: ``fused`` kernels or the ``torch`` path
    (its own rule: the flag, the device and the kernels' size limits)."""
    with torch.inference_mode():
        logits = block.gate(x.reshape(-1, block.hidden_size))
    return "fused" if block._kernels_for(logits) else "torch"


def layer_paths(bf16, nv, both_routings: bool) -> list[tuple]:
    """(row name, block, operation, `Nvfp4MoE` attributes to set) of each timed path:
    the bf16 block and `Nvfp4MoE` as configured by default; with ``both_routings``
    `Nvfp4MoE` with the torch routing and with the fused kernels at every size they
    fit (``fused_routing_max_pairs`` raised to the kernels' own limit), in one run, so
    the layer's bound is chosen on figures from one machine."""
    paths = [(LAYER_PATHS["bf16"], bf16, "bf16", {})]
    if not both_routings:
        return [*paths, ("Nvfp4MoE", nv, GROUPED, {})]
    from fp4_dispatch.backends.moe_route import MAX_PAIRS  # Triton: the GPU's routing

    return [*paths, ("Nvfp4MoE torch routing", nv, GROUPED, {"fused_routing": False}),
            ("Nvfp4MoE fused routing", nv, GROUPED,
             {"fused_routing": True, "fused_routing_max_pairs": MAX_PAIRS})]  # fmt: skip


def layer_rows(ctx: Context, config: str, blocks: tuple, tokens: int) -> list:
    """Rows of both MoE blocks on the same ``[tokens, 1, H]`` hidden states (a decode
    step of `tokens` sequences): the whole layer (router, top-k, sort, both grouped GEMMs,
    SiLU, combine), GPU time in a graph and eager wall, and each one's relative error
    against the bf16 block (float64 of its output)."""
    bf16, nv = blocks
    hidden = nv.hidden_size
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1, hidden, generator=gen).to(ctx.device, torch.bfloat16)

    def call(block) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(out: torch.Tensor) -> torch.Tensor:
            y = block(x)
            return (y[0] if isinstance(y, tuple) else y).reshape(tokens, hidden)

        return fn

    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=ctx.device)
    with torch.inference_mode():
        if ctx.args.tune:  # the layer's two grouped buckets at this token count, first
            from fp4_dispatch.engine.torch_ops import default_dispatcher

            with default_dispatcher(ctx.device).autotuning():
                call(nv)(out)
        ref = call(bf16)(out).double()
        rows = []
        for name, block, op, attrs in layer_paths(bf16, nv, bool(ctx.args.fused_routing)):
            for attr, value in attrs.items():
                setattr(nv, attr, value)
            got = path_rows(ctx, "moe-layer", call(block), out, ref, ctx.args.clocks,
                            backend=name, operation=op, m=tokens, n=hidden, k=hidden)  # fmt: skip
            for r in got:
                r.extra = {"config": config, "tokens": tokens, "experts": nv.num_experts,
                           "top_k": nv.top_k, "routing": routing_label(nv, x)}  # fmt: skip
            rows += got
            for attr in attrs:  # back to the class's defaults
                delattr(nv, attr)
    add_ratios(rows, LAYER_PATHS)
    return rows


def layer_routine(ctx: Context) -> None:
    """The ``moe-layer`` routine of the kernels suite (GPU, or the tiny config with
    ``--smoke``): one MoE layer, ours against transformers' bf16 block, per config
    (``--configs``) and token count (``--m``, default `TOKENS`); with ``--tune`` the
    layer's grouped buckets are tuned first (``autotuning`` on the default dispatcher,
    its budget); ``--fused-routing`` times `Nvfp4MoE` under both routings
    (`layer_paths`). M x N x K of a row is tokens x hidden x hidden."""
    if not on_cuda_or_smoke(ctx, "moe-layer"):
        return
    configs = ["tiny"] if ctx.smoke else getattr(ctx.args, "configs", None) or list(CONFIGS)
    for config in configs:
        blocks = layer_blocks(config, ctx.device)
        for tokens in ctx.args.m or (SMOKE_TOKENS if ctx.smoke else TOKENS):
            ctx.emit(layer_rows(ctx, config, blocks, tokens))
        del blocks
        if ctx.cuda:
            torch.cuda.empty_cache()
