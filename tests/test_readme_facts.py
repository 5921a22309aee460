"""README.md states facts the code can check: the test script's default extras, every
built-in backend in the sample ``list-backends`` output, install commands that work from a
checkout, and how to get the CPU build of torch.

README.md and scripts/ are not in the wheel: read from ``FP4_DISPATCH_SOURCE_ROOT``
(scripts/test.sh exports it), skipped visibly without it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = os.environ.get("FP4_DISPATCH_SOURCE_ROOT")
pytestmark = pytest.mark.skipif(
    not ROOT, reason="FP4_DISPATCH_SOURCE_ROOT is not set (scripts/test.sh sets it)"
)


def _readme() -> str:
    return (Path(ROOT) / "README.md").read_text(encoding="utf-8")


def test_test_script_default_extras_match_the_readme():
    script = (Path(ROOT) / "scripts" / "test.sh").read_text(encoding="utf-8")
    (extras,) = re.findall(r"extras=\$\{FP4_TEST_EXTRAS:-([^}]+)\}", script)
    (said,) = re.findall(r"`FP4_TEST_EXTRAS` the extras \(default `([^`]+)`\)", _readme())
    assert said == extras


def test_sample_list_backends_output_shows_every_builtin_backend():
    from fp4_dispatch.loading import registry

    text = _readme()
    start = text.index("sample shape for the tactic count")
    sample = text[start : text.index("```", start)]
    shown = {line.split()[0] for line in sample.splitlines()[3:] if line.strip()}
    reg = registry.load(strict=False)
    builtin = {n for n, rep in reg.plugin_of.items() if rep.builtin}
    assert builtin <= shown, sorted(builtin - shown)
    assert "load+hooks s" in sample


def test_install_commands_work_from_a_checkout():
    """The package is not on PyPI: no command may install it by name from an index."""
    text = _readme()
    assert "not on PyPI" in text
    by_name = re.findall(r"pip install '?fp4-dispatch[\[\s'\n]", text)
    assert not by_name, by_name


def test_readme_says_how_to_get_the_cpu_build_of_torch():
    install = _readme().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    assert install.index("whl/cpu") < install.index("pip install .  ")


def test_install_hints_name_the_checkout_extra():
    from fp4_dispatch.backends import cute, flashinfer
    from fp4_dispatch.plugins import sm90

    for hint in (cute.INSTALL_HINT, flashinfer.INSTALL_HINT, sm90.INSTALL_HINT):
        assert re.fullmatch(r"pip install '\.\[\w+\]' in the fp4-dispatch checkout", hint), hint
