"""Adding a family is a folder plus an entry point: no edit of the core.

A throwaway "sm120-like" family is written into a temporary folder as an installed
distribution (dist-info with an ``fp4_dispatch`` entry point). It declares its own part
(`DeviceProfile` alias ``sm120x``, compute capability 12.0, which no built-in family
knows), its tactic spec with a family-specific CTA geometry, and its own cost model.
The console script, run as a user would, must then list it, rank it and explain it on
that simulated part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from test_cli import EXE

FAMILY = """
from typing import Literal

import fp4_dispatch
from fp4_dispatch import Backend, Support, Tactic
from fp4_dispatch.contracts.device import DeviceInfo, DeviceProfile

PART = DeviceProfile(
    "sm120x",
    DeviceInfo(
        name="simulated sm120-like part",
        kind="simulated",
        compute_capability=(12, 0),
        sm_count=84,
        l2_bytes=64 * 2**20,
        mem_bw_gbps=1800.0,
        bf16_tflops=200.0,
        fp8_tflops=400.0,
        fp4_tflops=800.0,
        note="a made-up part for the test",
    ),
)


class Sm120Tactic(Tactic):
    backend: Literal["toy-sm120"] = "toy-sm120"
    tile_m: Literal[64, 128]
    tile_n: Literal[64, 128, 256]
    pair: bool = False  # a two-SM tile, like a 2-CTA MMA

    @property
    def ctas_per_tile(self) -> int:
        return 2 if self.pair else 1


class Sm120Backend(Backend):
    name, family, version = "toy-sm120", "sm120", "0.0.1"
    tactic_type = Sm120Tactic
    diversity_axes = ("swap_ab", "pair")
    device_profiles = (PART,)

    def supports(self, device):
        ok = device.cc == 120
        return Support(ok, "cc 12.0 part" if ok else f"needs cc 12.0, got {device.name}")

    def tactics(self, problem, device):
        for tm in (64, 128):
            for tn in (64, 128, 256):
                for swap in (False, True):
                    for pair in (False, True):
                        yield Sm120Tactic(tile_m=tm, tile_n=tn, swap_ab=swap, pair=pair)

    def build(self, tactic, problem, device):
        raise RuntimeError("compile-only toy family")


@fp4_dispatch.hookimpl
def fp4_dispatch_register_backends(register):
    register(Sm120Backend())
"""


def _install(tmp_path) -> dict[str, str]:
    info = tmp_path / "toy_sm120-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-sm120\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[fp4_dispatch]\nsm120 = toy_sm120\n")
    (tmp_path / "toy_sm120.py").write_text(textwrap.dedent(FAMILY))
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _cli(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_a_new_family_is_listed_ranked_and_explained_without_core_edits(tmp_path):
    env = _install(tmp_path)
    devices = _cli(env, "devices")
    assert "sm120x" in devices and "simulated sm120-like part" in devices

    rows = json.loads(_cli(env, "list-backends", "--device", "sm120x", "--json"))
    rows = rows["backends"] if isinstance(rows, dict) else rows
    toy = next(r for r in rows if r["name"] == "toy-sm120")
    assert toy["status"] == "available" and toy["family"] == "sm120"
    assert toy["origin"] == "toy-sm120" and toy["tactics"] == 24

    shown = json.loads(_cli(env, "explain", "1", "4096", "4096", "--device", "sm120x", "--json"))
    kept = [c for c in shown["candidates"] if c["family"] == "sm120"]
    assert kept, shown
    # the family's own axes are covered inside its floor, both orientations kept
    assert {c["tactic"]["swap_ab"] for c in kept} == {False, True}
    assert {c["tactic"]["pair"] for c in kept} == {False, True}
    # the shared cost model read the family's CTA geometry: two tactics that differ only
    # in `pair` (ctas_per_tile 2 vs 1) get different estimates at a compute-bound shape
    big = json.loads(_cli(env, "explain", "8192", "8192", "8192", "--device", "sm120x",
                          "--json", "--budget", "64"))  # fmt: skip
    est = {
        (c["tactic"]["tile_m"], c["tactic"]["tile_n"], c["tactic"]["swap_ab"], c["tactic"]["pair"]):
        c["est_us"] for c in big["candidates"] if c["family"] == "sm120"
    }  # fmt: skip
    assert est[(128, 256, False, True)] != est[(128, 256, False, False)]

    table = _cli(env, "explain", "1", "4096", "4096", "--device", "sm120x")
    assert "toy-sm120" in table and "sm120" in table


def test_a_real_gpu_of_the_new_capability_takes_the_family_rates(tmp_path):
    """A detected cc 12.0 GPU is rated from the family's profile, scaled per SM."""
    env = _install(tmp_path)
    code = textwrap.dedent("""
        import json
        from fp4_dispatch.contracts.device import DeviceInfo
        from fp4_dispatch.loading.profiles import rated
        real = DeviceInfo(name="gpu", kind="cuda", compute_capability=(12, 0), sm_count=42)
        print(json.dumps(rated(real).model_dump(mode="json")))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    dev = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(dev["fp4_tflops"] - 400.0) < 1e-6  # 800 TF at 84 SMs -> 400 at 42
    assert "simulated sm120-like part" in dev["note"]
