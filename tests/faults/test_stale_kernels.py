"""Backend versions carry a digest of their kernels' source (`fp4_dispatch.support.sources`): an
edited kernel is a tuning-cache miss, never a stale winner."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Dispatcher
from fp4_dispatch.support import sources
from fp4_dispatch.support.sources import SourceVersion, source_digest

FILES = {
    "__init__.py": "",
    "kern.py": "from kpkg.helper import scale\nfrom . import shared\n\ndef kernel():\n"
    "    return scale(2)\n",
    "helper.py": "def scale(x):\n    return x * 2\n",
    "shared.py": "BLOCK = 16\n",
    "unrelated.py": "OTHER = 1\n",
}


@pytest.fixture
def kpkg(tmp_path, monkeypatch):
    """A kernel package `kpkg` on sys.path; `edit(name, text)` changes one file."""
    root = tmp_path / "kpkg"
    root.mkdir()
    for name, text in FILES.items():
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))

    def edit(name: str, text: str) -> None:
        (root / name).write_text(text)
        source_digest.cache_clear()
        sources._module.cache_clear()

    source_digest.cache_clear()
    sources._module.cache_clear()
    yield edit
    source_digest.cache_clear()
    sources._module.cache_clear()
    for name in [m for m in sys.modules if m == "kpkg" or m.startswith("kpkg.")]:
        del sys.modules[name]


def _digest() -> str:
    return source_digest("kpkg.kern", follow=("kpkg",))


@pytest.mark.parametrize(
    ("name", "changes"),
    [("kern.py", True), ("helper.py", True), ("shared.py", True), ("unrelated.py", False)],
)
def test_one_byte_in_a_kernel_or_what_it_imports_changes_the_digest(kpkg, name, changes):
    before = _digest()
    text = FILES[name] or "\n"
    kpkg(name, text.replace("2", "3") if "2" in text else text + "# edited\n")
    assert (_digest() != before) is changes


def test_the_digest_is_stable_and_imports_nothing(kpkg):
    assert _digest() == _digest() and len(_digest()) == sources.DIGITS
    assert "kpkg.kern" not in sys.modules and "kpkg.helper" not in sys.modules


def test_builtin_backends_know_their_source_without_importing_triton():
    script = textwrap.dedent(
        """
        import json, sys
        from fp4_dispatch import registry
        reg = registry.load(strict=False)
        print(json.dumps({"versions": {n: b.version for n, b in reg.backends.items()
                                       if reg.plugin_of[n].builtin},
                          "triton": "triton" in sys.modules}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    versions = got["versions"]
    assert not got["triton"]
    assert all("+src." in v for v in versions.values()), versions
    sm90 = [versions[n] for n in versions if n.startswith("triton-sm90")]
    assert len(sm90) >= 6 and len(set(sm90)) == len(sm90), sm90  # one digest per kernel


def test_an_edited_kernel_is_a_cache_miss_not_a_stale_winner(kpkg, tmp_path, monkeypatch, caplog):
    from test_cache_faults import FaultA, K, M, N, _registry, _timer

    class Versioned(FaultA):
        version = SourceVersion("1", "kpkg.kern")

    def registry():
        reg = _registry()
        reg.backends["fault-a"] = Versioned()
        return reg

    source_digest.cache_clear()
    monkeypatch.setattr(sources, "FOLLOW", ("kpkg",))
    monkeypatch.setattr(registry_mod, "load", lambda strict=None: registry())
    path = tmp_path / "tuning.json"
    d = Dispatcher(device="cpu", cache=path)
    d.tune([(M, N, K)], timer=_timer, progress=False)
    assert Dispatcher(device="cpu", cache=path).select(M, N, K).reason.startswith("tuned")
    kpkg("helper.py", "def scale(x):\n    return x * 3\n")  # the kernel's helper is edited
    with caplog.at_level(logging.WARNING):
        pick = Dispatcher(device="cpu", cache=path).select(M, N, K)
    assert not pick.reason.startswith("tuned")
    assert "stale" in caplog.text and "version" in caplog.text
