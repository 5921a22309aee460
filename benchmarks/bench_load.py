"""Host memory of loading an NVFP4 checkpoint: peak against the largest shard (issue 31).

Writes a ModelOpt NVFP4 checkpoint with Llama-3-8B layer shapes (hidden 4096,
intermediate 14336, 32 query and 8 KV heads, vocabulary 128256; ``--layers`` decoder
layers, default 4; random codes and scales: loading does not look at the values), cut
into safetensors shards of at most ``--shard-mb`` MB with their index, then loads it in
a fresh process with ``fp4_dispatch.from_pretrained(dir, device=...)`` and reads the
process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after
the imports) against its resident set before the call.

The figure: the peak above the baseline, less the loaded model's tensor bytes on the
host, against the largest shard (target <= 1.5x). With ``--device cuda`` the model ends
on the GPU (nothing to subtract but a few buffers): the whole peak is what loading costs
the host. With ``--device cpu`` (default) the model itself ends in host memory (its own
copy: nothing stays mapped from the shard files), and what is left is the loader's
transient.

Run: ``python benchmarks/bench_load.py [--device cpu|cuda] [--layers N]``; ``--smoke``
is a tiny config (seconds, for CI). Prints a table; writes ``bench_load.json`` to
``$OUT`` when set. Figures go to benchmarks/RESULTS.md, "Loading checkpoints". Exit
status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import markdown_table, write_json

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)  # fmt: skip
SMOKE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024)  # fmt: skip
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection of one Llama decoder layer."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    outs = (h, kv, kv, h, i, i, h)
    ins = (h, h, h, h, h, h, i)
    return {p: (n, k) for p, n, k in zip(PROJ, outs, ins, strict=True)}


def layer_tensors(prefix: str, shape: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = shape["hidden_size"]
    norms = ("input_layernorm", "post_attention_layernorm")
    out = {f"{prefix}.{n}.weight": torch.ones(h, dtype=torch.bfloat16) for n in norms}
    for proj, (n, k) in linear_shapes(shape).items():
        p = f"{prefix}.{proj}"
        out[f"{p}.weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        # e4m3 bytes 0x30-0x4f: normal scales around 1 (any finite bytes load the same way)
        sb = torch.randint(0x30, 0x50, (n, k // 16), dtype=torch.uint8, generator=gen)
        out[f"{p}.weight_scale"] = sb.view(torch.float8_e4m3fn)
        out[f"{p}.weight_scale_2"] = torch.tensor(1e-3)
        out[f"{p}.input_scale"] = torch.tensor(1e-2)
    return out


def write_checkpoint(path: Path, shape: dict, layers: int, shard_mb: int) -> list[int]:
    """Write the checkpoint; returns each shard's size in bytes."""
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
    h, v = shape["hidden_size"], shape["vocab_size"]
    groups = [{"model.embed_tokens.weight": torch.randn(v, h, generator=gen).bfloat16()}]
    groups += [layer_tensors(f"model.layers.{i}", shape, gen) for i in range(layers)]
    groups.append({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                   "lm_head.weight": torch.randn(v, h, generator=gen).bfloat16()})  # fmt: skip
    shards: list[dict[str, torch.Tensor]] = [{}]
    limit = shard_mb * 2**20
    for group in groups:  # HF style: whole tensors, a new shard when the limit would pass
        for name, t in group.items():
            size = sum(x.numel() * x.element_size() for x in shards[-1].values())
            if shards[-1] and size + t.numel() * t.element_size() > limit:
                shards.append({})
            shards[-1][name] = t
    weight_map, sizes = {}, []
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        sizes.append((path / file).stat().st_size)
        weight_map.update(dict.fromkeys(shard, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


CHILD = r"""
import json, sys, torch, transformers, safetensors
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
model = from_pretrained(sys.argv[1], device=sys.argv[2])
peak = status("VmHWM:")
tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
on_host = sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type == "cpu")
print(json.dumps({"base": base, "peak": peak, "model_host_bytes": on_host}))
"""


def measure(path: Path, device: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), device],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"loading failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (8B shapes)")
    ap.add_argument("--shard-mb", type=int, default=1000, help="largest shard size, MB")
    ap.add_argument("--smoke", action="store_true", help="a tiny config (CI)")
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temp folder)")
    args = ap.parse_args(argv)
    shape, layers, shard_mb = (SMOKE, 2, 1) if args.smoke else (LLAMA3_8B, args.layers,
                                                                args.shard_mb)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sizes = write_checkpoint(Path(tmp), shape, layers, shard_mb)
        got = measure(Path(tmp), args.device)
    above = got["peak"] - got["base"]
    transient = above - got["model_host_bytes"]
    largest = max(sizes)
    result = {
        "date": datetime.date.today().isoformat(), "device": args.device,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "shape": "smoke" if args.smoke else "Llama-3-8B", "layers": layers,
        "shards": len(sizes), "largest_shard_bytes": largest, "total_bytes": sum(sizes),
        **got, "peak_above_base_bytes": above, "transient_bytes": transient,
        "ratio_to_largest_shard": transient / largest,
    }  # fmt: skip
    mib = 2**20
    table = markdown_table(
        ["shape", "layers", "device", "shards", "largest shard MiB", "checkpoint MiB",
         "host peak above base MiB", "model on host MiB", "transient MiB",
         "transient / largest shard"],
        [[result["shape"], str(layers), args.device, str(len(sizes)), f"{largest / mib:.0f}",
          f"{sum(sizes) / mib:.0f}", f"{above / mib:.0f}",
          f"{got['model_host_bytes'] / mib:.0f}", f"{transient / mib:.0f}",
          f"{transient / largest:.2f}x"]],
    )  # fmt: skip
    print(table)
    write_json("bench_load.json", result)
    return 0 if transient <= 1.5 * largest or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
