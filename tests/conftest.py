"""Shared fixtures: fake plugin distributions on sys.path, quantized operands."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Install a fake distribution with entry points by putting a dist-info on sys.path.

    ``plugin_dist("my-dist", {"ep_name": "module source"})`` writes each module and the
    ``entry_points.txt`` so that importlib.metadata (and so the registry) finds them.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(dist: str, plugins: dict[str, str], version: str = "1.2.3") -> Path:
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[fp4_dispatch]"]
        for ep, source in plugins.items():
            module = f"fakeplug_{ep}"
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{ep} = {module}")
            made.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return info

    yield make
    for module in made:
        sys.modules.pop(module, None)


GOOD_PLUGIN = """
    from typing import Literal
    import fp4_dispatch
    from fp4_dispatch.plugins.reference import ReferenceBackend, ReferenceTactic

    class T(ReferenceTactic):
        backend: Literal["{name}"] = "{name}"

    class B(ReferenceBackend):
        name = "{name}"
        family = "{family}"
        tactic_type = T
        def tactics(self, problem, device):
            for t in super().tactics(problem, device):
                yield T(**{{**t.model_dump(), "backend": "{name}"}})

    @fp4_dispatch.hookimpl
    def fp4_dispatch_register_backends(register):
        register(B())
"""


def good_plugin(name: str, family: str = "thirdparty") -> str:
    return GOOD_PLUGIN.format(name=name, family=family)


@pytest.fixture
def operands():
    """Random quantized operands on CPU: ``operands(m, n, k) -> (qa, qb)``."""
    from fp4_dispatch import quantize_nvfp4

    def make(m: int, n: int, k: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return (
            quantize_nvfp4(torch.randn(m, k, generator=g)),
            quantize_nvfp4(torch.randn(n, k, generator=g)),
        )

    return make


def pytest_configure(config):
    """Markers live here: the tests run from a copy outside the source tree (no pyproject)."""
    config.addinivalue_line("markers", "slow: longer tests (still run in CI)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # Third-party deprecation chatter (CuTe-DSL's own internals, torch.jit) buries real output.
    for module in ("cutlass", "nvidia_cutlass_dsl", "torch.jit"):
        config.addinivalue_line("filterwarnings", f"ignore::DeprecationWarning:{module}.*")
