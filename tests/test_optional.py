"""`fp4_dispatch.support.optional.OptionalCode`: optional code is loaded once, and code
that cannot import is False with one log line naming it."""

from __future__ import annotations

import logging

import pytest

from fp4_dispatch.support.optional import OptionalCode


def test_loads_once_and_keeps_the_result():
    calls = []
    code = OptionalCode(lambda: calls.append(1) or "kernel", "a kernel", logging.getLogger("t"))
    assert code() == "kernel" and code() == "kernel" and calls == [1]


def test_an_import_error_is_false_logged_once(caplog):
    calls = []

    def load():
        calls.append(1)
        raise ImportError("no module named triton")

    code = OptionalCode(load, "Triton thing", logging.getLogger("fp4_dispatch.test"))
    with caplog.at_level(logging.INFO, logger="fp4_dispatch.test"):
        assert code() is False and code() is False
    assert calls == [1]
    lines = [r for r in caplog.records if r.name == "fp4_dispatch.test"]
    assert len(lines) == 1 and "Triton thing unavailable" in lines[0].getMessage()
    assert "no module named triton" in lines[0].getMessage()


def test_other_errors_are_not_swallowed():
    def load():
        raise RuntimeError("a bug in the kernel module")

    code = OptionalCode(load, "x", logging.getLogger("t"))
    with pytest.raises(RuntimeError, match="a bug"):
        code()
