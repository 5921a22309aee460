"""``fp4-dispatch devices``: the real device found here and the simulated ones."""

from __future__ import annotations

import argparse

from fp4_dispatch.cli.common import add_command, add_json_arg, emit_json, format_table


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "devices",
        help="the detected device and the simulated ones",
        description="The device found here (a CUDA GPU, else the CPU) and the simulated "
        "parts --device accepts, with the peak rates the cost model uses.",
        examples="fp4-dispatch devices\nfp4-dispatch devices --json",
    )
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fp4_dispatch.loading.profiles import profiles, resolve  # noqa: PLC0415 - lazy: start-up time

    found = resolve("auto")
    devices = {"detected": found, **{a: p.device for a, p in sorted(profiles().items())}}
    if args.json:
        emit_json({key: dev.model_dump(mode="json") for key, dev in devices.items()})
        return 0
    rows = [
        (key, d.name, d.kind, "-" if d.cc is None else d.cc, d.sm_count,
         f"{d.mem_bw_gbps:.0f}", "-" if d.fp4_tflops is None else f"{d.fp4_tflops:.0f}",
         f"{d.bf16_tflops:.0f}", d.note)
        for key, d in devices.items()
    ]  # fmt: skip
    headers = ("--device", "name", "kind", "cc", "SMs", "GB/s", "fp4 TF", "bf16 TF", "note")
    print(format_table(rows, headers))
    return 0
