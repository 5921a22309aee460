"""The ``serving`` suite: what a user pays per call and per process, beyond the kernel.

    python -m benchmarks serving                  # every routine (H200: a few minutes)
    python -m benchmarks serving --cases layer --m 1 16 [--tune]
    python -m benchmarks serving --cases compiled
    python -m benchmarks serving --cases load --load-device cpu --layers 4

- ``layer``: per shape, eager wall and GPU time (CUDA graph, cold L2) of every call a
  user makes - `quantize_nvfp4`, `Dispatcher.gemm` W4A4 and W4A16 (output allocated by
  the call), `Nvfp4Linear` (2-D and 3-D ``[M, 1, K]`` inputs) - with
  the dispatcher's replays (a warm plan relaunching its recorded kernels through the
  driver) and without (``replay=False``: Triton's launcher), beside bf16 ``nn.Linear``
  and FP8 ``_scaled_mm`` from the same run; the layer's error against float64; ratios
  to ``nn.Linear bf16``. ``--tune`` tunes each bucket first.
- ``compiled``: per shape, `Nvfp4Linear` (no bias), its bf16 ``nn.Linear`` and ``x + 1``
  (the floor: a compiled call around one trivial kernel), each under ``torch.compile``
  in default mode compiled alone (`benchmarks.common.compiled_alone`): eager wall per call
  (what a compiled decode step pays per linear when the host bounds it), the error, and
  in ``extra`` what Inductor's code does per call (allocations, kernel launches, extern
  calls, custom ops: `inductor_calls`). Ratios to the compiled ``nn.Linear``.
- ``graphs``: `Nvfp4Linear` (W4A4 and W4A16) captured in a CUDA graph must match the
  float64 reference and eager on fresh inputs, and change with them; capturing a shape
  never run eagerly raises `CaptureNotWarmError` and leaves the device usable;
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` matches eager; the sm90
  plugin passes the conformance kit. Each check is a row (``failure`` when it fails);
  the routine fails the run when one does.
- ``first-contact``: on a CPU, what a newcomer waits for: ``fp4-dispatch --help`` and
  ``--version`` (target <= 1 s), imports, ``fp4-dispatch compile`` from a warm kernel
  cache (<= 5 s, with the cute extra), the reference GEMM against torch's matmul (<= 3x
  the faster of bf16 and fp32), the README's tuning snippet (<= 30 s). Host clock,
  minimum of a few runs.
- ``load``: host memory of ``from_pretrained`` of a ModelOpt NVFP4 checkpoint with
  Llama-3-8B layer shapes (random codes), peak RSS above the baseline less the model's
  host bytes, against the largest shard (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from .common import (
    ROOT,
    Context,
    add_ratios,
    compiled_alone,
    on_cuda_or_smoke,
    path_rows,
    python,
    timed_rows,
)
from .kernels import baselines

GRID = ((1, 16, 256, 4096), ((4096, 4096), (8192, 8192), (13824, 5120)))
COMPILED_GRID = ((1, 16), ((4096, 4096), (14336, 4096)))
GRAPH_SHAPES = ((1, 4096, 4096), (8, 4096, 4096), (32, 14336, 4096), (128, 4096, 14336))
TOL = 1e-2


def options(args: argparse.Namespace, rest: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks serving")
    p.add_argument("--tune", action="store_true", help="layer: tune each bucket first")
    p.add_argument("--load-device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=4, help="load: decoder layers (8B shapes)")
    p.add_argument("--shard-mb", type=int, default=1000, help="load: largest shard, MB")
    p.add_argument("--skip-compile", action="store_true", help="first-contact: no CuTe compile")
    p.parse_args(rest, namespace=args)


def layer(ctx: Context) -> None:
    if not on_cuda_or_smoke(ctx, "layer"):
        return
    from fp4_dispatch import Dispatcher

    on = Dispatcher(str(ctx.device), cache=False, replay=True)
    off = Dispatcher(str(ctx.device), cache=False, replay=False)
    for m, n, k in ctx.grid(*(((1,), ((64, 128),)) if ctx.smoke else GRID)):
        ctx.emit(layer_shape(ctx, on, off, m, n, k))


def layer_shape(ctx: Context, on, off, m: int, n: int, k: int) -> list:
    """Every path of one shape (module docstring), with replays (`on`) and without."""
    from fp4_dispatch import Nvfp4Linear, quantize_nvfp4

    dev = ctx.device
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    lin = nn.Linear(k, n, bias=True).to(dev, torch.bfloat16).requires_grad_(False)
    qb = quantize_nvfp4(lin.weight.float())
    qa = quantize_nvfp4(x)
    tuned = bool(getattr(ctx.args, "tune", False) and ctx.cuda)
    for d in (on, off) if tuned else ():  # both operations: the layer's is W4A16 on sm90
        d.tune([(m, n, k)], save=False)
        d.tune([(m, n, k)], operation="w4a16", save=False)
    paths = {"quantize_nvfp4": (lambda o: quantize_nvfp4(x), None, "quantize")}
    wq = qb.dequantize().double()
    ref4, ref16 = qa.dequantize().double() @ wq.T, x.double() @ wq.T
    for name, d in (("", on), (" [no replay]", off)):
        q = Nvfp4Linear.from_linear(lin, dispatcher=d)
        op = q.operation(dev)  # "auto": W4A16 on Hopper, W4A4 on sm100+
        xa = quantize_nvfp4(x).dequantize() if op == "w4a4" else x
        ref = xa.double() @ q.dequantized_weight().double().T + lin.bias.double()
        # as users call it: the output allocated by the call
        paths[f"Dispatcher.gemm w4a4{name}"] = (lambda o, d=d: d.gemm(qa, qb), ref4, "w4a4")
        paths[f"Dispatcher.gemm w4a16{name}"] = (lambda o, d=d: d.gemm(x, qb), ref16, "w4a16")
        paths[f"Nvfp4Linear{name}"] = (lambda o, q=q: q(x), ref, op)
        if op != "w4a4":  # the W4A4 layer too (its quantize + GEMM fast call)
            q4 = Nvfp4Linear.from_linear(lin, dispatcher=d, activations="nvfp4")
            ref_q4 = ref4 + lin.bias.double()
            paths[f"Nvfp4Linear w4a4{name}"] = (lambda o, q=q4: q(x), ref_q4, "w4a4")
    exact = x.double() @ lin.weight.double().T + lin.bias.double()  # its own reference
    paths["nn.Linear bf16"] = (lambda o: lin(x), exact, "bf16")
    # what transformers passes at decode: [batch, 1, hidden]
    x3, q3 = x.unsqueeze(1), Nvfp4Linear.from_linear(lin, dispatcher=on)
    ref3 = paths["Nvfp4Linear"][1].unsqueeze(1)  # the 2-D layer's reference
    paths["Nvfp4Linear 3-D"] = (lambda o: q3(x3), ref3, op)
    paths["nn.Linear bf16 3-D"] = (lambda o: lin(x3), exact.unsqueeze(1), "bf16")
    fp8 = baselines(x, qb, dense=True)["_scaled_mm fp8"]
    paths["_scaled_mm fp8"] = (fp8, None, "fp8")
    rows = []
    with torch.inference_mode():
        for name, (fn, r, op) in paths.items():
            out = torch.empty(m, k if op == "quantize" else n, dtype=torch.bfloat16,
                              device=dev)  # fmt: skip
            rows += path_rows(ctx, "layer", fn, out, r, ctx.args.clocks, backend=name,
                              operation=op, m=m, n=n, k=k)  # fmt: skip
    add_ratios(rows, {"nn.Linear": "nn.Linear bf16", "fp8": "_scaled_mm fp8",
                      "nn.Linear 3-D": "nn.Linear bf16 3-D"})  # fmt: skip
    for r in rows:
        r.extra["tuned"] = tuned
    return rows


def compiled(ctx: Context) -> None:
    if not on_cuda_or_smoke(ctx, "compiled"):
        return
    for m, n, k in ctx.grid(*(((1,), ((64, 128),)) if ctx.smoke else COMPILED_GRID)):
        ctx.emit(compiled_shape(ctx, m, n, k))


class _PlusOne(nn.Module):
    """``x + 1``: what a compiled call costs around one trivial kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def compiled_shape(ctx: Context, m: int, n: int, k: int) -> list:
    """One shape of ``compiled`` (module docstring): each path compiled alone, its first
    call's Inductor code counted (`inductor_calls`) into every row's ``extra``."""
    from torch._inductor.utils import run_and_get_code

    from fp4_dispatch import Nvfp4Linear

    dev = ctx.device
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    lin = nn.Linear(k, n, bias=False).to(dev, torch.bfloat16).requires_grad_(False)
    q = Nvfp4Linear.from_linear(lin)
    paths = {
        "Nvfp4Linear": (q, x.double() @ q.dequantized_weight().double().T, q.operation(dev)),
        "nn.Linear bf16": (lin, x.double() @ lin.weight.double().T, "bf16"),
        "x + 1": (_PlusOne(), x.double() + 1, "add"),
    }
    rows = []
    with torch.inference_mode():
        for name, (module, ref, op) in paths.items():
            fn = compiled_alone({name: module})[name]
            _, code = run_and_get_code(fn, x)  # the compile, and Inductor's code of the call
            out = torch.empty(m, k if op == "add" else n, dtype=torch.bfloat16, device=dev)
            got = path_rows(ctx, "compiled", lambda o, fn=fn: fn(x), out, ref, ("eager",),
                            backend=f"{name} compiled", operation=op, m=m, n=n, k=k)  # fmt: skip
            for r in got:
                r.extra.update(inductor_calls(code))
            rows += got
    add_ratios(rows, {"nn.Linear": "nn.Linear bf16 compiled"})
    return rows


#: what one call of Inductor's generated ``call`` does, by the pattern of its line
_CALL_PARTS = {
    "allocations": re.compile(r"\bempty_strided\w*\("),
    "launches": re.compile(r"\b\w+\.run\("),
    "extern_calls": re.compile(r"\bextern_kernels\.\w+\("),
    "custom_ops": re.compile(r"\btorch\.ops\.\w+\.\w+(?:\.\w+)?\("),
}


def inductor_calls(code: list[str]) -> dict[str, int]:
    """Counts of `_CALL_PARTS` in the ``call`` functions of Inductor's generated modules
    (kernel sources and comments left out): the host work of one compiled call."""
    counts = dict.fromkeys(_CALL_PARTS, 0)
    for module in code:
        for body in re.findall(r"\n    def call\(self, args\):\n(.*?)\n        return ", module,
                               flags=re.S):  # fmt: skip
            lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("#")]
            for part, pattern in _CALL_PARTS.items():
                counts[part] += sum(len(pattern.findall(ln)) for ln in lines)
    return counts


def _check(ctx: Context, name: str, ok: bool, detail: str, **fields) -> bool:
    ctx.emit([ctx.row("graphs", backend=name, failure=None if ok else detail,
                      extra={"detail": detail}, **{"clock": "graph", **fields})])  # fmt: skip
    return ok


def graphs(ctx: Context) -> None:
    """The capture and compile checks (module docstring); raises when one fails."""
    from fp4_dispatch import Dispatcher, Nvfp4Linear, quantize_nvfp4
    from fp4_dispatch.autotune import harness
    from fp4_dispatch.engine import torch_ops

    if ctx.smoke:  # on a CPU: the layer against float64 (no capture)
        d = Dispatcher("cpu", cache=False)
        lin = nn.Linear(128, 64).to(torch.bfloat16).requires_grad_(False)
        q, x = Nvfp4Linear.from_linear(lin, dispatcher=d), torch.randn(5, 128).bfloat16()
        xa = quantize_nvfp4(x).dequantize() if q.operation(x.device) == "w4a4" else x
        ref = xa.double() @ q.dequantized_weight().double().T + lin.bias.double()
        err = harness.relative_error(q(x), ref)
        assert _check(ctx, "Nvfp4Linear eager (cpu)", err < TOL, f"rel err {err:.2e}",
                      error=err, clock="eager")  # fmt: skip
        return
    if not on_cuda_or_smoke(ctx, "graphs"):
        return
    d, dev, ok = Dispatcher(cache=False), ctx.device, True
    shapes = ctx.args.shapes or GRAPH_SHAPES
    torch_ops.warmup(d, shapes, show_progress=False)
    for m, n, k in shapes[:2] if not ctx.args.shapes else shapes:
        for acts in ("nvfp4", "bf16"):
            lin = nn.Linear(k, n).to(dev, torch.bfloat16).requires_grad_(False)
            q = Nvfp4Linear.from_linear(lin, dispatcher=d, activations=acts)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                graph, y = harness.capture(lambda q=q, x=x: q(x))
                worst, why, prev = 0.0, "", None
                for trial in range(3):
                    x.copy_(torch.randn(m, k, device=dev, dtype=torch.bfloat16) * (1 + trial))
                    graph.replay()
                    torch.cuda.synchronize()
                    got = y.clone()
                    xa = quantize_nvfp4(x).dequantize() if acts == "nvfp4" else x
                    ref = xa.double() @ q.dequantized_weight().double().T + lin.bias.double()
                    err = harness.relative_error(got, ref)
                    worst = max(worst, err)
                    if not (err < TOL and torch.equal(got, q(x))) or (
                            prev is not None and torch.equal(got, prev)):  # fmt: skip
                        why = f"trial {trial}: rel err {err:.2e}, not equal to eager or unchanged"
                    prev = got
                ok &= _check(ctx, f"Nvfp4Linear({acts}) capture", not why,
                             why or f"3 replays match float64 and eager (max {worst:.2e})",
                             m=m, n=n, k=k, error=worst)  # fmt: skip
                ctx.emit(timed_rows(ctx, "graphs", lambda q=q, x=x: q(x), ctx.args.clocks,
                                    backend=f"Nvfp4Linear({acts})", m=m, n=n, k=k))  # fmt: skip
    ok &= _not_warm(ctx, d, *shapes[0][1:])
    ok &= _compile(ctx, d)
    from fp4_dispatch.testing import check_plugin

    report = check_plugin("sm90", device=d.device.torch_device, samples=2)
    ok &= _check(ctx, "conformance check_plugin('sm90')", report.ok,
                 f"{len(report.passed)} passed, {len(report.failures)} failed")  # fmt: skip
    assert ok, "a graph/compile check failed (rows with a failure above)"


def _not_warm(ctx: Context, d, n: int, k: int) -> bool:
    from fp4_dispatch import quantize_nvfp4
    from fp4_dispatch.autotune import harness
    from fp4_dispatch.engine import torch_ops
    from fp4_dispatch.engine.torch_ops import CaptureNotWarmError

    gen = torch.Generator().manual_seed(99)
    qa, qb = (quantize_nvfp4(torch.randn(r, k, generator=gen).to(ctx.device)) for r in (3, n))
    raised = None
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch_ops.gemm(d, qa, qb)
    except CaptureNotWarmError as exc:
        raised = exc
    capturing = torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    ref = qa.dequantize().double() @ qb.dequantize().double().T
    err = harness.relative_error(torch_ops.gemm(d, qa, qb), ref)
    return _check(ctx, "capture of a shape never run", raised is not None and not capturing
                  and err < TOL, f"raised {type(raised).__name__}; eager after: {err:.2e}",
                  m=3, n=n, k=k)  # fmt: skip


def _compile(ctx: Context, d) -> bool:
    from fp4_dispatch import Nvfp4Linear
    from fp4_dispatch.autotune import harness

    n, k, dev = 1024, 2048, ctx.device
    model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, k)).to(dev, torch.bfloat16)
    for i in (0, 2):
        model[i] = Nvfp4Linear.from_linear(model[i], dispatcher=d)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    worst = 0.0
    with torch.no_grad():
        for _ in range(4):  # cudagraph trees: warm-up run(s), record, then replays
            x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
            worst = max(worst, harness.relative_error(compiled(x).clone(), model(x)))
        ctx.emit(timed_rows(ctx, "graphs", lambda: compiled(x), ["compile"], m=8, n=n, k=k,
                            backend="torch.compile reduce-overhead MLP"))  # fmt: skip
    return _check(
        ctx,
        "torch.compile reduce-overhead",
        worst < 1e-3,
        f"max rel diff to eager {worst:.2e}",
        clock="compile",
        m=8,
        n=n,
        k=k,
    )


# ---- first contact and loading (host clock) ----------------------------------------------


def _host(ctx: Context, case: str, what: str, us: float, target_s: float | None = None,
          **fields) -> None:  # fmt: skip
    """One host-clock row; a missed target (seconds) is its failure."""
    missed = target_s is not None and us > target_s * 1e6
    ctx.emit([ctx.row(case, backend=what, clock="host", median_us=us,
                      failure=f"target <= {target_s:g} s missed" if missed else None,
                      extra={"target_s": target_s} if target_s else {}, **fields)])  # fmt: skip


def first_contact(ctx: Context) -> None:
    from fp4_dispatch.autotune import harness

    exe = shutil.which("fp4-dispatch") or str(Path(sys.executable).parent / "fp4-dispatch")
    env = {**os.environ, "FP4_DISPATCH_PROGRESS": "0", "FP4_DISPATCH_PLUGINS": ""}

    def wall(cmd: list[str], runs: int = 3, **kw) -> float:
        run = lambda: subprocess.run(cmd, check=True, capture_output=True, env={**env, **kw})  # noqa: E731
        return harness.call_wall_us(run, runs, best=True)

    py = sys.executable
    _host(ctx, "first-contact", "fp4-dispatch --help", wall([exe, "--help"]), 1.0)
    _host(ctx, "first-contact", "fp4-dispatch --version", wall([exe, "--version"]), 1.0)
    for code in ("import fp4_dispatch", "import torch",
                 "from fp4_dispatch import Dispatcher, quantize_nvfp4"):  # fmt: skip
        _host(ctx, "first-contact", f"python -c '{code}'", wall([py, "-c", code]))
    if not (ctx.smoke or getattr(ctx.args, "skip_compile", False)):
        cmd = [exe, "compile", "128", "4096", "4096", "--device", "sm100", "--budget", "8"]
        try:  # needs the cute extra: without it a row says so, the rest goes on
            first = wall(cmd, runs=1)
        except subprocess.CalledProcessError as exc:
            ctx.emit(
                [
                    ctx.row(
                        "first-contact",
                        backend="compile sm100",
                        clock="host",
                        failure=f"fp4-dispatch compile failed: {exc.stderr[-300:]!r}",
                    )
                ]
            )
        else:
            _host(ctx, "first-contact", "compile sm100 (first run)", first)
            _host(ctx, "first-contact", "compile sm100 (warm kernel cache)", wall(cmd, 2), 5.0)
    if not ctx.smoke:
        text = (ROOT / "README.md").read_text(encoding="utf-8")
        code = re.search(r"```python\n(.*?)```", text[text.index("## Tuning") :], re.S).group(1)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "t.py").write_text(code, encoding="utf-8")
            us = wall([py, f"{tmp}/t.py"], runs=1, FP4_DISPATCH_CACHE=f"{tmp}/t.json")
            _host(ctx, "first-contact", "README tuning snippet", us, 30.0)
    shapes = ctx.args.shapes or ([(1, 256, 512)] if ctx.smoke
                                 else [(1, 8192, 8192), (1024, 4096, 4096)])  # fmt: skip
    for m, n, k in shapes:
        out = python(GEMM_CHILD % (m, n, k), {"FP4_DISPATCH_PLUGINS": ""})
        got = json.loads(out.strip().splitlines()[-1])
        best = min(got["bf16"], got["fp32"])
        for what in ("first", "steady", "bf16", "fp32"):
            target = 3.0 * best / 1e6 if what == "steady" else None
            _host(ctx, "first-contact", f"reference gemm {what}" if what in ("first", "steady")
                  else f"torch matmul {what}", got[what], target, m=m, n=n, k=k)  # fmt: skip


GEMM_CHILD = """
import json, torch
from fp4_dispatch import Dispatcher, harness, quantize_nvfp4
d = Dispatcher(device="cpu", cache=False)
m, n, k = %d, %d, %d
x, w = torch.randn(m, k), torch.randn(n, k)
qa, qb = quantize_nvfp4(x), quantize_nvfp4(w)
best = lambda fn, runs: harness.call_wall_us(fn, runs, best=True)
runs = 5 if m == 1 else 3
xb, wb = x.bfloat16(), w.bfloat16()
got = {"first": best(lambda: d.gemm(qa, qb), 1), "steady": best(lambda: d.gemm(qa, qb), runs),
       "bf16": best(lambda: xb @ wb.T, runs), "fp32": best(lambda: x @ w.T, runs)}
print(json.dumps(got))
"""


def load(ctx: Context) -> None:
    """Peak host memory of ``from_pretrained`` against the largest shard (module doc)."""
    from .model import CONFIGS

    smoke = ctx.smoke
    shape = {k: v for k, v in CONFIGS["tiny" if smoke else "8b"].items()
             if k != "num_hidden_layers"}  # fmt: skip
    layers = 2 if smoke else ctx.args.layers
    device = "cpu" if smoke else ctx.args.load_device
    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_checkpoint(Path(tmp), shape, layers, 1 if smoke else ctx.args.shard_mb)
        got = json.loads(python(LOAD_CHILD, {"CKPT": tmp, "DEV": device}).splitlines()[-1])
    above = got["peak"] - got["base"]
    transient = above - got["model_host_bytes"]
    ratio = transient / max(sizes)
    mib = 2**20
    ctx.emit([ctx.row(
        "load", backend=f"from_pretrained device={device}", clock="host",
        failure=None if ratio <= 1.5 or smoke else "transient > 1.5x the largest shard",
        extra={"layers": layers, "shards": len(sizes), "largest_shard_mib": max(sizes) // mib,
               "checkpoint_mib": sum(sizes) // mib, "peak_above_base_mib": above // mib,
               "model_on_host_mib": got["model_host_bytes"] // mib,
               "transient_mib": transient // mib, "transient_over_shard": round(ratio, 2)},
    )])  # fmt: skip


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def write_checkpoint(path: Path, shape: dict, layers: int, shard_mb: int) -> list[int]:
    """A ModelOpt NVFP4 Llama checkpoint (random codes; loading does not look at values),
    in safetensors shards of at most `shard_mb` MB with their index: each shard's bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=4096,
                         tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    (path / "config.json").write_text(config.to_json_string())
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    }))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    nks = list(zip(PROJ, (h, kv, kv, h, i, i, h), (h, h, h, h, h, h, i), strict=True))
    tensors = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen).bfloat16()}
    for layer in range(layers):
        pre = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{pre}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for proj, n, k in nks:
            p = f"{pre}.{proj}"
            tensors[f"{p}.weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                                   generator=gen)  # fmt: skip
            # e4m3 bytes 0x30-0x4f: normal scales around 1 (any finite bytes load the same)
            sb = torch.randint(0x30, 0x50, (n, k // 16), dtype=torch.uint8, generator=gen)
            tensors[f"{p}.weight_scale"] = sb.view(torch.float8_e4m3fn)
            tensors[f"{p}.weight_scale_2"] = torch.tensor(1e-3)
            tensors[f"{p}.input_scale"] = torch.tensor(1e-2)
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(v, h, generator=gen).bfloat16()
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in tensors.items():  # HF style: whole tensors, a new shard at the limit
        size = sum(x.numel() * x.element_size() for x in shards[-1].values())
        if shards[-1] and size + t.numel() * t.element_size() > shard_mb * 2**20:
            shards.append({})
        shards[-1][name] = t
    weight_map, sizes = {}, []
    for j, shard in enumerate(shards):
        file = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        sizes.append((path / file).stat().st_size)
        weight_map.update(dict.fromkeys(shard, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


LOAD_CHILD = r"""
import json, os, torch, transformers, safetensors
# everything the call imports, imported before the baseline: the figure is the loading's
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from fp4_dispatch import Dispatcher, from_pretrained, load_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status("VmRSS:")
model = from_pretrained(os.environ["CKPT"], device=os.environ["DEV"])
peak = status("VmHWM:")
tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
on_host = sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type == "cpu")
print(json.dumps({"base": base, "peak": peak, "model_host_bytes": on_host}))
"""

ROUTINES = {"layer": layer, "compiled": compiled, "graphs": graphs,
            "first-contact": first_contact, "load": load}  # fmt: skip
SMOKE = ("layer", "compiled", "graphs", "first-contact", "load")
