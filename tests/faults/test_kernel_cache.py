"""The on-disk kernel cache: only its own regular files, one warning when read-only, and the
test session never writes into the user's own cache folders."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from fp4_dispatch.backends import cute

KEY = ("op", "sm_100a", 148, [[1, 148]], "dsl", "ops")


def _paths(folder: Path) -> tuple[Path, Path]:
    return folder / "fp4k_x.o", folder / "fp4k_x.json"


def test_read_only_kernel_cache_warns_once_for_many_kernels(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"  # mkdir fails for root too (permission bits would not)
    blocker.write_text("")
    cute._store_warned.clear()
    with caplog.at_level(logging.WARNING):
        for i in range(32):
            obj, meta = blocker / f"k{i}.o", blocker / f"k{i}.json"
            assert cute._store(b"\x7fELF", obj, meta, KEY, 100) is None
    lines = [r for r in caplog.records if "could not store compiled kernels" in r.getMessage()]
    assert len(lines) == 1 and str(blocker) in lines[0].getMessage()


def test_store_writes_regular_files(tmp_path):
    obj, meta = _paths(tmp_path)
    assert cute._store(b"\x7fELF-object", obj, meta, KEY, 100) == str(obj)
    assert obj.read_bytes() == b"\x7fELF-object" and '"cubin_sm": 100' in meta.read_text()


def test_store_never_replaces_a_planted_symlink_or_fifo(tmp_path, caplog):
    cute._store_warned.clear()
    precious = tmp_path / "precious"
    precious.write_bytes(b"system file")
    obj, meta = _paths(tmp_path)
    obj.symlink_to(precious)
    os.mkfifo(meta)
    with caplog.at_level(logging.WARNING):
        assert cute._store(b"\x7fELF", obj, meta, KEY, 100) is None
    assert obj.is_symlink() and precious.read_bytes() == b"system file"
    assert "symlink" in caplog.text


def test_load_never_opens_a_planted_symlink(tmp_path, caplog):
    obj, meta = _paths(tmp_path)
    elsewhere = tmp_path / "elsewhere.o"
    elsewhere.write_bytes(b"\x7fELF")
    obj.symlink_to(elsewhere)
    meta.write_text("{}")
    with caplog.at_level(logging.WARNING):
        assert cute._load(None, "sm_100a", KEY, "fp4k_x", obj, meta) is None
    assert "symlink" in caplog.text and "unusable" in caplog.text


def test_session_kernel_caches_are_temporary():
    """Compiled kernels (CuTe-DSL, Triton, FlashInfer's XDG cache) land in a temp folder."""
    tmp = Path(tempfile.gettempdir()).resolve()
    for path in (cute.cache_dir(), Path(os.environ["TRITON_CACHE_DIR"]),
                 Path(os.environ["XDG_CACHE_HOME"])):  # fmt: skip
        assert tmp in path.resolve().parents, path
        assert Path.home().resolve() not in path.resolve().parents, path
