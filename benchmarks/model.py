"""The whole-model yardstick: one step of a transformers Llama decoder, bf16 vs NVFP4 vs FP8.

What a user buys is the model's step time, not a GEMM's. This driver builds a Llama decoder
from a config with random weights (nothing is downloaded), converts it the way a user does
(`fp4_dispatch.quantize_model`, every Linear but ``lm_head``), and times one forward step
the two ways users run it, in one process and beside bf16 and FP8 twins of the same model:

- ``graph``: GPU time of a replayed CUDA graph of the step
  (`fp4_dispatch.autotune.harness.gpu_time_us`: L2 flushed before each step; the weights
  are far larger than the L2 anyway);
- ``eager``: host wall time per step of back-to-back steps, synchronised at the end
  (`harness.eager_wall_samples`). Eager walls move between H200 hosts, so the eager pass
  runs ``--rounds`` times (default 3), every variant once per round in turn, and the
  table gives the median of the rounds' medians, bf16 from the same rounds;
- ``compile`` (opt-in): ``torch.compile`` in its default mode (no CUDA graphs), each
  step compiled for its own shapes (``dynamic=False``: `benchmarks.common.compiled_alone`
  says why), eager wall as above.

Steps: decode at batch 1, 16 and 64 (one token per sequence against a static KV cache of
``--context`` positions, what a serving step does) and prefill of 1024 and 4096 tokens
(one sequence, logits of the last token only, as serving engines compute them).

Variants (`VARIANTS`): ``bf16`` (the model itself), ``w4a16`` and ``w4a4``
(`Nvfp4Linear` with ``activations="bf16"`` / ``"nvfp4"``: weight-only, or activations
quantized too), ``nvfp4-fp8`` (the NVFP4 weights under ``precision="fp8"``: per M the
dispatcher runs exact W4A16 or lossy W4A8, docs/PRECISION.md), ``fp8`` (per-tensor e4m3
weights, dynamic per-tensor activation scale in torch ops, ``torch._scaled_mm``: what a
Hopper user compares with).

The bf16 model holds the *dequantized* NVFP4 weights (the "twin"), so its step time is
bf16's and its logits isolate the kernels' numerics from the format's: each variant's
``cosine`` is the cosine similarity of its last-token logits (float64) with the twin's,
on the same inputs.

Configs (`CONFIGS`): ``8b`` (Llama-3-8B layer shapes, 8 layers by default), ``70b``
(Llama-3-70B layer shapes, 4 layers), ``tiny`` (the CPU smoke). ``--layers`` overrides.
Mixture-of-experts configs (``qwen3-moe``, ``deepseek-like``, ``tiny-moe``) and their
variants (``bf16`` with torch's grouped GEMM, ``bf16-loop``, ``w4a16`` grouped NVFP4,
``nvfp4-loop``) are in `moe_configs` (its docstring); ``--variants`` picks among each
kind's own, and a config runs all of its kind's by default.

Writes `results.Row`s (``backend`` = the variant, ``m`` = tokens per step; config,
layers, step, batch, tokens/s and cosine in ``extra``; ``ratios["bf16"]``) as JSON lines to
``$OUT/model.jsonl`` (or ``--out``), a markdown table to ``model.md``, and a PNG plot of
speedup over bf16 against batch/tokens per config and clock (``model_<config>.png``,
matplotlib). ``--smoke`` runs the tiny and tiny-moe configs on the CPU, eager only (a
script check; its times mean nothing).

Run on the H200::

    python -m benchmarks model --configs 8b 70b
    python -m benchmarks model --configs qwen3-moe deepseek-like
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from fp4_dispatch.autotune.harness import eager_wall_samples, gpu_time_samples

from .common import Context, compiled_alone
from .common import precompile as precompile_kernels
from .moe_configs import MOE_CONFIGS, MOE_VARIANTS, build_moe_variants, grouped_plans, moe_config
from .results import Row

log = logging.getLogger("benchmarks.model")

#: Llama layer shapes (hidden, intermediate, heads, kv heads, vocab, default layer count):
#: Llama-3-8B and Llama-3-70B as published in their config.json files; tiny for the CPU
CONFIGS: dict[str, dict[str, int]] = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "num_hidden_layers": 8},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 128256, "num_hidden_layers": 4},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "num_hidden_layers": 2},
}  # fmt: skip
DECODE_BATCHES = (1, 16, 64)
PREFILL_TOKENS = (1024, 4096)
SMOKE_DECODE, SMOKE_PREFILL = (1, 4), (64,)
VARIANTS = ("bf16", "w4a16", "w4a4", "nvfp4-fp8", "fp8")
#: the NVFP4 variants: (activations, precision) of `quantize_model`
NVFP4_VARIANTS = {"w4a16": ("bf16", "exact"), "w4a4": ("nvfp4", "exact"),
                  "nvfp4-fp8": ("bf16", "fp8")}  # fmt: skip
CLOCKS = ("graph", "eager")


# ---- the models ---------------------------------------------------------------------------


def llama_config(name: str, layers: int | None):
    """A transformers `LlamaConfig` of `CONFIGS`[name] (``layers`` overrides the count)."""
    from transformers import LlamaConfig

    shape = dict(CONFIGS[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False)


def build_bf16(config, device: torch.device) -> nn.Module:
    """A random-weight Llama in bf16 on `device` (transformers' own init, seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


class Fp8Linear(nn.Module):
    """``nn.Linear`` as a Hopper user's plain FP8 path: e4m3 weight with one per-tensor scale,
    the activation scaled per tensor by its amax at every call (torch ops), multiplied by
    ``torch._scaled_mm`` (cuBLASLt) into bf16."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax() / 448).clamp(min=1e-12)
        self.register_buffer("weight", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.reshape(()))
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        scale = (x2.abs().amax().float() / 448).clamp(min=1e-12)
        xq = (x2 / scale).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight.t(), scale, self.weight_scale,
                             bias=self.bias, out_dtype=torch.bfloat16)  # fmt: skip
        return y.reshape(*x.shape[:-1], self.out_features)


def to_fp8(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """A copy of `model` with every Linear but `skip` as `Fp8Linear`."""
    fp8 = copy.deepcopy(model)
    skip = set(skip)
    for mod in list(fp8.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                setattr(mod, child_name, Fp8Linear(child))
    return fp8


def build_variants(config, device: torch.device, variants: Iterable[str]) -> dict[str, nn.Module]:
    """{variant: model}: the bf16 twin (weights replaced by the dequantized NVFP4 ones) and
    the variants asked for. The NVFP4 variants are converted by `quantize_model`."""
    from fp4_dispatch import quantize_model

    base = build_bf16(config, device)
    models: dict[str, nn.Module] = {}
    twin_done = False
    for variant in variants:
        if variant not in NVFP4_VARIANTS:
            continue
        q = copy.deepcopy(base)
        acts, precision = NVFP4_VARIANTS[variant]
        report = quantize_model(q, activations=acts, precision=precision)
        log.info("%s: %d Linear layers converted, %d skipped", variant,
                 len(report.converted), len(report.skipped))  # fmt: skip
        models[variant] = q
        if not twin_done:  # the twin holds exactly the weights the NVFP4 GEMMs multiply by
            _load_dequantized(base, q)
            twin_done = True
    if not twin_done:  # no NVFP4 variant asked: quantize once for the twin's weights
        q = copy.deepcopy(base)
        quantize_model(q)
        _load_dequantized(base, q)
        del q
    models = {"bf16": base, **models}
    if "fp8" in variants:
        models["fp8"] = to_fp8(base)
    return {v: models[v] for v in ("bf16", *variants) if v in models}


def _load_dequantized(twin: nn.Module, quantized: nn.Module) -> None:
    """Copy each converted layer's dequantized weight into `twin`'s Linear of that name."""
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    linears = dict(twin.named_modules())
    with torch.no_grad():
        for name, mod in quantized.named_modules():
            if isinstance(mod, Nvfp4Linear):
                linears[name].weight.copy_(mod.dequantized_weight().to(torch.bfloat16))


# ---- the steps ----------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One forward step: ``kind`` decode (``batch`` sequences, one token each, against a
    static KV cache of ``context`` positions) or prefill (one sequence of ``tokens``)."""

    kind: str
    batch: int
    tokens: int
    context: int

    def label(self) -> str:
        return f"{self.kind} {self.batch if self.kind == 'decode' else self.tokens}"


def make_step(model: nn.Module, step: Step, device: torch.device) -> Callable[[], torch.Tensor]:
    """A no-argument callable running `step` on `model` (capturable after one eager run:
    fixed input tensors, a static cache written at the same position every call)."""
    gen = torch.Generator(device="cpu").manual_seed(step.batch * 131 + step.tokens)
    vocab = model.config.vocab_size
    if step.kind == "prefill":
        ids = torch.randint(vocab, (1, step.tokens), generator=gen).to(device)

        def prefill() -> torch.Tensor:
            return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

        return prefill
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=step.context + 1)
    ids = torch.randint(vocab, (step.batch, 1), generator=gen).to(device)
    position = torch.full((step.batch, 1), step.context, dtype=torch.long, device=device)
    cache_position = torch.tensor([step.context], dtype=torch.long, device=device)

    kwargs = {_cache_argument(model): cache, "position_ids": position,
              "cache_position": cache_position, "use_cache": True, "logits_to_keep": 1}  # fmt: skip

    def decode() -> torch.Tensor:
        return model(input_ids=ids, **kwargs).logits

    return decode


def _cache_argument(model: nn.Module) -> str:
    """The forward's KV-cache keyword: ``cache`` in newer transformers (which deprecate
    ``past_key_values``), ``past_key_values`` before."""
    forward = getattr(model, "_orig_mod", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def step_m(step: Step) -> int:
    """The GEMM M of a step: tokens through every Linear at once."""
    return step.batch if step.kind == "decode" else step.tokens


def precompile(models: dict[str, nn.Module], steps: list[Step], device: torch.device):
    """Compile every NVFP4 GEMM kernel the steps will run, in parallel worker processes
    (`fp4_dispatch.autotune.precompile`, through `common.precompile`), so the first eager
    run of a step loads kernels instead of compiling them one after another."""
    from fp4_dispatch.contracts.tactics import Problem
    from fp4_dispatch.engine.torch_ops import default_dispatcher
    from fp4_dispatch.integrations.nn import Nvfp4Linear

    planned = []
    for model in models.values():
        shapes = {(mod.out_features, mod.in_features, mod.operation(device), mod.precision)
                  for mod in model.modules() if isinstance(mod, Nvfp4Linear)}  # fmt: skip
        for n, k, op, precision in sorted(shapes):
            d = default_dispatcher(device, precision)
            for m in sorted({step_m(s) for s in steps}):
                c = d.select(m, n, k, "bfloat16", op)
                problem = Problem(m=m, n=n, k=k, out_dtype="bfloat16", operation=c.operation)
                planned.append((d.registry.backends[c.backend], c.tactic, problem))
    planned += grouped_plans(models, [step_m(s) for s in steps], device)
    return precompile_kernels(planned, d.device, workers=min(16, os.cpu_count() or 1))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two logit tensors, flattened, in float64."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


# ---- measuring ------------------------------------------------------------------------------


def calls_for(step_us: float) -> int:
    """Calls per sample: about 20 ms of work per sample, between 2 and 50 calls."""
    return int(min(50, max(2, 20_000 / max(step_us, 1.0))))


def eager_samples(fn: Callable[[], object], smoke: bool) -> list[float]:
    """Eager wall µs per step: 5 samples of back-to-back calls, synchronised at the end."""
    probe = statistics.median(eager_wall_samples(fn, calls=2, warmup=2, replays=3))
    calls = 2 if smoke else calls_for(probe)
    return eager_wall_samples(fn, calls=calls, warmup=2 if smoke else 5, replays=3 if smoke else 5)


def graph_samples(fn: Callable[[], object], device: torch.device) -> list[float]:
    """GPU µs per step in a replayed CUDA graph, L2 flushed before each step."""
    probe = statistics.median(eager_wall_samples(fn, calls=2, warmup=2, replays=3))
    return gpu_time_samples(fn, calls=calls_for(probe), replays=5, device=device)


def _try(what: str, fn: Callable[[], list[float]]) -> tuple[list[float] | None, str | None]:
    """``(samples, None)``, or ``(None, the error)`` when `what` cannot run (a row with a
    gap, logged; the other measurements go on)."""
    try:
        return fn(), None
    except Exception as exc:  # a variant that does not run here is a recorded gap
        log.warning("%s: %s: %s", what, type(exc).__name__, exc)
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def measure_config(name: str, args: argparse.Namespace, device: torch.device, ctx: Context
                   ) -> list[Row]:  # fmt: skip
    """Every (variant, step, clock) of one config: rows with ratios to bf16."""
    args = variants_of(name, args)
    moe = name in MOE_CONFIGS
    config = moe_config(name, args.layers) if moe else llama_config(name, args.layers)
    steps = [Step("decode", b, b, args.context) for b in args.decode] + [
        Step("prefill", 1, t, 0) for t in args.prefill
    ]
    t0 = time.perf_counter()
    models = (build_moe_variants if moe else build_variants)(config, device, args.variants)
    log.info("%s: built %s in %.1f s", name, list(models), time.perf_counter() - t0)
    if device.type == "cuda":
        t0 = time.perf_counter()
        report = precompile(models, steps, device)
        log.info("%s: precompiled %d kernels in %.1f s (%d failed)", name, len(report.outcomes),
                 time.perf_counter() - t0, len(report.failed))  # fmt: skip
    results: dict[tuple[str, str, str], Measured] = {}
    cosines: dict[tuple[str, str], float] = {}
    with torch.inference_mode():
        for step in steps:
            fns = {v: make_step(m, step, device) for v, m in models.items()}
            warm = first_runs(f"{name} {step.label()}", fns)
            for v, logits in warm.items():  # the twin is bf16 itself: no cosine of its own
                if (
                    v != "bf16"
                    and isinstance(logits, torch.Tensor)
                    and isinstance(warm.get("bf16"), torch.Tensor)
                ):
                    cosines[(v, step.label())] = cosine(logits, warm["bf16"])
            for clock in args.clocks:
                if clock == "graph":
                    got = {v: _failed(warm[v]) or _no_graph(models[v])
                           or _try(f"{name} {v} {step.label()} graph",
                                   lambda fn=fn: graph_samples(fn, device))
                           for v, fn in fns.items()}  # fmt: skip
                else:
                    run = fns if clock == "eager" else _compiled(models, step, device)
                    got = eager_rounds(f"{name} {step.label()} {clock}", run, warm, args)
                results.update({(v, step.label(), clock): r for v, r in got.items()})
    return _rows(name, config.num_hidden_layers, steps, args, results, cosines, ctx)


def variants_of(name: str, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with ``variants`` those of `name`'s kind (dense or MoE): the ones asked
    for that the kind has, all of the kind's by default."""
    own = MOE_VARIANTS if name in MOE_CONFIGS else VARIANTS
    asked = own if args.variants is None else [v for v in args.variants if v in own]
    if args.smoke:
        asked = [v for v in asked if v != "fp8"]  # no FP8 GEMM on a CPU
    return argparse.Namespace(**{**vars(args), "variants": list(asked)})


#: samples (µs), or None and the error that stopped the measurement
Measured = tuple[list[float] | None, str | None]


def first_runs(what: str, fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, object]:
    """One eager run of each variant (plans, compiles, caches): {variant: its last-token
    logits as float32, or the error text when it cannot run here}."""
    warm: dict[str, object] = {}
    for v, fn in fns.items():
        out, err = _try(f"{what} {v} first run", lambda fn=fn: [fn()])
        warm[v] = out[0].float() if out is not None else err
    return warm


def _no_graph(model: nn.Module) -> Measured | None:
    """The "measurement" of a model that cannot be captured (its ``no_graph`` reason:
    the MoE loop variants, `moe_configs`), else None."""
    why = getattr(model, "no_graph", None)
    return (None, why) if why else None


def _failed(warm: object) -> Measured | None:
    """The measurement of a variant whose first run failed (its error), else None."""
    return (None, warm) if isinstance(warm, str) else None


def eager_rounds(what: str, run: dict[str, Callable[[], object]], warm: dict[str, object],
                 args: argparse.Namespace) -> dict[str, Measured]:  # fmt: skip
    """Eager (or compiled) walls: ``args.rounds`` rounds, every variant once per round in
    turn (host drift hits all alike); each variant's samples are its rounds' medians."""
    rounds: dict[str, list[float]] = {v: [] for v in run}
    errors: dict[str, str] = {v: w for v, w in warm.items() if isinstance(w, str) and v in run}
    for _ in range(args.rounds):
        for v, fn in run.items():
            if v in errors:
                continue
            samples, err = _try(f"{what} {v}", lambda fn=fn: eager_samples(fn, args.smoke))
            if err or not samples:
                errors[v] = err or "no samples"
            else:
                rounds[v].append(statistics.median(samples))
    return {v: (None, errors[v]) if v in errors else (rounds[v], None) for v in run}


def _compiled(models: dict[str, nn.Module], step: Step, device: torch.device) -> dict:
    """`make_step` of each model under ``torch.compile`` (default mode), compiled for this
    step's shapes alone (`benchmarks.common.compiled_alone` says why)."""
    return {v: make_step(c, step, device) for v, c in compiled_alone(models).items()}


def _rows(name, layers, steps, args, results, cosines, ctx) -> list[Row]:
    rows = []
    for step in steps:
        for clock in args.clocks:
            base = results.get(("bf16", step.label(), clock), (None, None))[0]
            base_us = statistics.median(base) if base else None
            for v in ("bf16", *[v for v in args.variants if v != "bf16"]):
                samples, err = results.get((v, step.label(), clock), (None, "not measured"))
                med = statistics.median(samples) if samples else None
                cos = cosines.get((v, step.label()))
                rows.append(ctx.row(
                    f"{name} {step.label()}", backend=v, m=step.tokens,
                    clock=clock, median_us=med,
                    spread_us=(min(samples), max(samples)) if samples else None,
                    ratios={"bf16": base_us / med} if (med and base_us) else {},
                    failure=err, extra={
                        "config": name, "layers": layers, "step": step.kind,
                        "batch": step.batch, "tokens": step.tokens,
                        "tokens_per_s": (step.tokens / med * 1e6) if med else None,
                        "cosine": cos if isinstance(cos, float) else None},
                ))  # fmt: skip
    return rows


# ---- output -----------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    """Markdown: one line per (config, step, clock), a column per variant (µs and ratio)."""
    variants = list(dict.fromkeys(r.backend for r in rows))
    head = ["config", "step", "clock", *[f"{v} µs (x bf16)" for v in variants],
            *[f"cos {v}" for v in variants if v != "bf16"]]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r.extra["config"], r.case, r.clock) for r in rows))
    for config, case, clock in keys:
        by_v = {r.backend: r for r in rows if (r.extra["config"], r.case, r.clock)
                == (config, case, clock)}  # fmt: skip
        cells = [config, case.split(" ", 1)[1], clock]
        for v in variants:
            r = by_v.get(v)
            if r is None or r.median_us is None:
                cells.append("n/a" if r is None else f"error: {(r.failure or '')[:40]}")
            else:
                vs = r.ratios.get("bf16")
                ratio = "" if vs is None else f" ({vs:.2f}x)"
                cells.append(f"{r.median_us:.0f}{ratio}")
        for v in variants:
            if v != "bf16":
                r = by_v.get(v)
                cos = None if r is None else r.extra.get("cosine")
                cells.append("n/a" if cos is None else f"{cos:.5f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], folder: Path) -> list[Path]:
    """One PNG per config: speedup over bf16 (y) per step (x), a line per variant, a panel
    per clock. Skipped (logged) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log.warning("no plot: %s", exc)
        return []
    paths = []
    for config in dict.fromkeys(r.extra["config"] for r in rows):
        mine = [r for r in rows if r.extra["config"] == config and r.backend != "bf16"]
        clocks = list(dict.fromkeys(r.clock for r in mine))
        fig, axes = plt.subplots(1, len(clocks), figsize=(6 * len(clocks), 4), squeeze=False)
        for ax, clock in zip(axes[0], clocks, strict=True):
            cases = list(dict.fromkeys(r.case.split(" ", 1)[1] for r in mine if r.clock == clock))
            for v in dict.fromkeys(r.backend for r in mine):
                ys = []
                for case in cases:
                    hit = [r for r in mine if r.backend == v and r.clock == clock
                           and r.case.endswith(" " + case)]  # fmt: skip
                    ys.append(hit[0].ratios.get("bf16", math.nan) if hit else math.nan)
                ax.plot(range(len(cases)), ys, marker="o", label=v)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(range(len(cases)), cases, rotation=30)
            ax.set_ylabel("speed over bf16 (x)")
            ax.set_title(f"{config}, {clock}")
            ax.legend()
        fig.suptitle(f"{config}: step speed over bf16 ({rows[0].device}, {rows[0].date})")
        fig.tight_layout()
        path = folder / f"model_{config}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def options(args: argparse.Namespace, argv: list[str]) -> None:
    """The suite's own options (after the runner's common ones), parsed into `args`."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks model")
    ap.add_argument("--configs", nargs="+", default=["8b", "70b"],
                    choices=sorted([*CONFIGS, *MOE_CONFIGS]))  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: config's)")
    ap.add_argument("--variants", nargs="+", default=None,
                    choices=list(dict.fromkeys([*VARIANTS, *MOE_VARIANTS])),
                    help="default: every variant of each config's kind")  # fmt: skip
    ap.add_argument("--decode", type=int, nargs="*", default=list(DECODE_BATCHES),
                    help="decode batch sizes")  # fmt: skip
    ap.add_argument("--prefill", type=int, nargs="*", default=list(PREFILL_TOKENS),
                    help="prefill lengths (tokens)")  # fmt: skip
    ap.add_argument("--context", type=int, default=1024, help="KV-cache positions at decode")
    ap.add_argument("--rounds", type=int, default=3, help="eager rounds (median reported)")
    ap.parse_args(argv, namespace=args)
    if args.smoke:
        args.configs, args.clocks, args.context = ["tiny", "tiny-moe"], ["eager"], 16
        args.rounds = 1
        args.decode, args.prefill = [*SMOKE_DECODE], [*SMOKE_PREFILL]


def step(ctx: Context) -> None:
    """Every (config, variant, step, clock) of ``--configs``; a table and plots after."""
    args, device = ctx.args, ctx.device
    if not ctx.smoke and not ctx.cuda:
        raise RuntimeError("needs a CUDA GPU: run with --smoke on a CPU")
    for name in args.configs:
        ctx.emit(measure_config(name, args, device, ctx))  # after each config: nothing lost
        torch.cuda.empty_cache() if device.type == "cuda" else None
    plot(ctx.rows, ctx.out.parent)


def render(rows: list[Row]) -> str:
    return table(rows)


ROUTINES = {"step": step}
SMOKE = ("step",)
