"""Every ```python block of README.md runs as written, on CPU, against the installed package.

README.md is not in the wheel: it is read from ``FP4_DISPATCH_SOURCE_ROOT`` (scripts/test.sh
exports it). A block preceded by ``<!-- skip-ci: reason -->`` is skipped, visibly, with
that reason. Each block runs in a fresh subprocess (as a newcomer pastes it into a fresh
interpreter), with the tuning cache in a temporary folder and built-in plugins only
(``FP4_DISPATCH_PLUGINS=""``: what a newcomer has; the test environment also installs the
example plugins, which would change what the snippets select).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.environ.get("FP4_DISPATCH_SOURCE_ROOT")
_BLOCK = re.compile(
    r"(?:<!--\s*skip-ci:\s*(?P<skip>.*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```\n"
    r"(?P<expect>(?:<!-- ci-expect: .*? -->\n)*)",
    re.S,
)
_EXPECT = re.compile(r"<!-- ci-expect: (.*?) -->")


def readme_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of each ```python block."""
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("skip"))
        for m in _BLOCK.finditer(text)
    ]


def readme_expectations(text: str) -> dict[int, list[str]]:
    """Block line -> the regular expressions its output must match: the
    ``<!-- ci-expect: REGEX -->`` lines right after the block (hidden when rendered)."""
    return {
        text.count("\n", 0, m.start("code")) + 1: _EXPECT.findall(m.group("expect"))
        for m in _BLOCK.finditer(text)
    }


def _blocks() -> list:
    if not ROOT:
        return [pytest.param(None, id="no-source-root")]
    text = (Path(ROOT) / "README.md").read_text(encoding="utf-8")
    expect = readme_expectations(text)
    return [pytest.param((*b, expect[b[0]]), id=f"line{b[0]}") for b in readme_blocks(text)]


def test_block_parser_finds_code_and_skip_marks():
    text = "x\n```python\na = 1\n```\n<!-- skip-ci: needs a GPU -->\n```python\nb = 2\n```\n"
    assert readme_blocks(text) == [(3, "a = 1\n", None), (7, "b = 2\n", "needs a GPU")]
    text = "```python\nprint(1)\n```\n<!-- ci-expect: ^1$ -->\n<!-- ci-expect: x -->\n"
    assert readme_expectations(text) == {2: ["^1$", "x"]}


@pytest.mark.parametrize("block", _blocks())
def test_readme_python_block_runs(block, tmp_path):
    if block is None:
        pytest.skip("FP4_DISPATCH_SOURCE_ROOT is not set (scripts/test.sh sets it)")
    line, code, skip, expect = block
    if skip:
        pytest.skip(f"README.md line {line}: skip-ci: {skip}")
    env = {
        **os.environ,
        "FP4_DISPATCH_CACHE": str(tmp_path / "tuning.json"),
        "FP4_DISPATCH_PROGRESS": "0",
        "FP4_DISPATCH_PLUGINS": "",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"README.md line {line} failed:\n{proc.stdout}\n{proc.stderr}"
    # what the block shows, not only that it ran: each block states its output
    assert expect, f"README.md line {line}: add <!-- ci-expect: REGEX --> lines after the block"
    for pattern in expect:
        assert re.search(pattern, proc.stdout, re.M), (
            f"README.md line {line}: output does not match {pattern!r}:\n{proc.stdout}"
        )
    assert "Traceback" not in proc.stderr, proc.stderr
