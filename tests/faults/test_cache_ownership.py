"""The cache touches only its own regular files, as root and as an unprivileged user.

Each hostile case plants something at the cache path, its lock or an export target - a
symlink another user owns pointing at a "system" file, a link to a file that is no
cache, a device node, a FIFO - and asserts that the planted thing and what it points to
are left exactly as they were (same bytes, same inode, same kind), that nothing was set
aside next to them, and that the GEMM still runs with its tuned winner kept in memory.

The library runs as root in CI containers (this process). The unprivileged cases fork a
child that drops to ``nobody`` with ``os.setuid`` (only root can) and drives the cache
there; run as a normal user, they run in this process instead.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import tempfile
from pathlib import Path

import pytest
from test_cache_faults import (
    _entry,
    _file_keys,
    _isolated,  # noqa: F401 - the synthetic registry, autouse
    _keys,
    _seeded,
    _tune_and_run,
)

from fp4_dispatch.store import cache as cache_mod
from fp4_dispatch.store.cache import ExportTargetError, TuningCache
from fp4_dispatch.support import safefs

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
#: a user id that is not this process's and not root (the "other user" who plants links)
OTHER_UID = 4242
NOBODY = 65534
needs_root = pytest.mark.skipif(not ROOT, reason="planting a file another user owns needs root")
SYSTEM_TEXT = b"root:x:0:0:root:/root:/bin/bash\n"  # what a planted link points at


@pytest.fixture(autouse=True)
def _fresh_warnings():
    safefs._warned.clear()
    cache_mod._warned.clear()


@pytest.fixture
def alarm():
    """Fail (instead of hanging CI) if a case blocks: a FIFO opened for reading would."""

    def fire(signum, frame):
        raise TimeoutError("blocked for 60 s (a FIFO or device was opened?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _snapshot(path: Path) -> tuple:
    st = os.lstat(path)
    body = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
    return st.st_ino, stat.S_IFMT(st.st_mode), st.st_uid, body


def _nothing_set_aside(*folders: Path) -> None:
    for folder in folders:
        assert not list(folder.glob("*.corrupt-*")), list(folder.iterdir())


def _kept_in_memory(caplog, path: Path) -> None:
    assert str(path) in caplog.text and "could not save" in caplog.text, caplog.text


# ---- a planted symlink ---------------------------------------------------------------------


@needs_root
def test_link_owned_by_another_user_is_never_followed(tmp_path, caplog):
    system = tmp_path / "etc" / "passwd"
    system.parent.mkdir()
    system.write_bytes(SYSTEM_TEXT)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    path = shared / "tuning.json"
    path.symlink_to(system)
    os.lchown(path, OTHER_UID, OTHER_UID)  # planted by another user
    before, link_before = _snapshot(system), _snapshot(path)
    _tune_and_run(path, caplog)
    assert _snapshot(system) == before and _snapshot(path) == link_before
    _nothing_set_aside(system.parent, shared)
    assert not (system.parent / "passwd.lock").exists()
    _kept_in_memory(caplog, path)
    assert "owned by another user" in caplog.text


@needs_root
def test_link_owned_by_another_user_to_a_valid_cache_is_not_written(tmp_path, caplog):
    real = tmp_path / "theirs.json"
    seeded = _seeded(real)
    before = _snapshot(real)
    path = tmp_path / "tuning.json"
    path.symlink_to(real)
    os.lchown(path, OTHER_UID, OTHER_UID)
    _tune_and_run(path, caplog)
    assert _snapshot(real) == before and _file_keys(real) == _keys(seeded)
    _kept_in_memory(caplog, path)


def test_own_link_to_a_file_that_is_no_cache_is_neither_set_aside_nor_replaced(tmp_path, caplog):
    system = tmp_path / "system.conf"
    system.write_bytes(SYSTEM_TEXT)
    path = tmp_path / "tuning.json"
    path.symlink_to(system)
    before, link_before = _snapshot(system), _snapshot(path)
    _tune_and_run(path, caplog)
    assert _snapshot(system) == before and _snapshot(path) == link_before
    _nothing_set_aside(tmp_path)
    assert "behind a symlink" in caplog.text
    _kept_in_memory(caplog, path)


# ---- not a regular file --------------------------------------------------------------------


@needs_root
def test_device_node_at_the_cache_path_is_left_a_device(tmp_path, caplog, alarm):
    path = tmp_path / "tuning.json"
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a copy of /dev/null
    before = _snapshot(path)
    _tune_and_run(path, caplog)
    assert _snapshot(path) == before
    _nothing_set_aside(tmp_path)
    assert "character device" in caplog.text
    _kept_in_memory(caplog, path)


def test_fifo_at_the_cache_path_never_blocks_and_stays(tmp_path, caplog, alarm):
    path = tmp_path / "tuning.json"
    os.mkfifo(path)
    before = _snapshot(path)
    _tune_and_run(path, caplog)
    assert _snapshot(path) == before
    _nothing_set_aside(tmp_path)
    assert "FIFO" in caplog.text
    _kept_in_memory(caplog, path)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_lock_file_that_is_not_a_regular_file_is_never_truncated(tmp_path, caplog, alarm, kind):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    lock = TuningCache(path).lock_path
    lock.unlink()
    precious = tmp_path / "precious"
    precious.write_bytes(SYSTEM_TEXT)
    if kind == "symlink":
        lock.symlink_to(precious)
    else:
        os.mkfifo(lock)
    before, lock_before = _snapshot(precious), _snapshot(lock)
    _tune_and_run(path, caplog)
    assert _snapshot(precious) == before and _snapshot(lock) == lock_before
    assert _file_keys(path) == _keys(seeded)
    _kept_in_memory(caplog, path)
    assert "lock file" in caplog.text


def test_temp_file_pattern_removes_only_regular_files(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    _seeded(path)
    precious = tmp_path / "precious"
    precious.write_bytes(SYSTEM_TEXT)
    planted = tmp_path / ".tuning.json.planted.tmp"
    planted.symlink_to(precious)
    old = 1_000_000_000
    os.utime(planted, (old, old), follow_symlinks=False)
    _tune_and_run(path, caplog)
    assert planted.is_symlink() and precious.read_bytes() == SYSTEM_TEXT


# ---- ownership, modes, shared folders ------------------------------------------------------


@needs_root
def test_root_rewriting_a_users_cache_keeps_it_theirs(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o640)
    _tune_and_run(path, caplog)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640)
    assert _keys(seeded) < _file_keys(path)


def test_world_writable_folder_is_reported_once(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    path = shared / "tuning.json"
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            TuningCache(path).put([_entry(i)])
            TuningCache(path).load()
    lines = [r.getMessage() for r in caplog.records if "world-writable" in r.getMessage()]
    assert len(lines) == 1 and str(shared) in lines[0], lines
    assert len(TuningCache(path).entries()) == 3


def test_private_folder_gets_no_world_writable_warning(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    tmp_path.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        TuningCache(path).put([_entry(0)])
    assert "world-writable" not in caplog.text


# ---- export targets ------------------------------------------------------------------------


def test_export_never_writes_through_a_symlink(tmp_path):
    src = tmp_path / "tuning.json"
    _seeded(src)
    precious = tmp_path / "precious"
    precious.write_bytes(SYSTEM_TEXT)
    dest = tmp_path / "out.json"
    dest.symlink_to(precious)
    with pytest.raises(ExportTargetError, match="symlink") as err:
        TuningCache(src).export_to(dest)
    assert err.value.filename == str(dest)
    assert precious.read_bytes() == SYSTEM_TEXT and dest.is_symlink()


def test_export_into_a_missing_folder_names_it_and_creates_nothing(tmp_path):
    src = tmp_path / "tuning.json"
    _seeded(src)
    dest = tmp_path / "no" / "such" / "out.json"
    with pytest.raises(ExportTargetError, match="does not exist") as err:
        TuningCache(src).export_to(dest)
    assert str(dest.parent) in str(err.value) and str(src) not in str(err.value)
    assert not (tmp_path / "no").exists()


def test_export_leaves_no_lock_file_beside_the_export(tmp_path):
    src = tmp_path / "tuning.json"
    seeded = _seeded(src)
    out = tmp_path / "exports"
    out.mkdir()
    assert TuningCache(src).export_to(out / "out.json") == len(seeded)
    assert sorted(p.name for p in out.iterdir()) == ["out.json"]
    assert _file_keys(out / "out.json") == _keys(seeded)


# ---- as an unprivileged user ---------------------------------------------------------------


def _as_nobody(work) -> dict:
    """Run ``work()`` (returns a JSON-able dict) as ``nobody`` in a forked child if this
    process is root, else right here (already unprivileged)."""
    if not ROOT:
        return work()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges for good, run, report, exit without cleanup
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = work()
            os.write(write, json.dumps(result).encode())
            code = 0
        except BaseException as exc:
            os.write(write, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(raw or b"{}")
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


@pytest.fixture
def sticky_folder():
    """A shared /tmp-like folder (world-writable, sticky) that ``nobody`` can reach."""
    folder = Path(tempfile.mkdtemp(prefix="fp4-shared-"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_unprivileged_user_refuses_a_link_planted_by_another_user(sticky_folder):
    victim = sticky_folder / "my-notes.txt"  # the unprivileged user's own file
    link = sticky_folder / "tuning.json"
    if ROOT:
        victim.write_bytes(SYSTEM_TEXT)
        os.chown(victim, NOBODY, NOBODY)
        link.symlink_to(victim)
        os.lchown(link, OTHER_UID, OTHER_UID)
    else:
        pytest.skip("planting a link owned by another user needs root")

    def work() -> dict:
        c = TuningCache(link)
        outcome = {"uid": os.geteuid()}
        try:
            c.put([_entry(0)])
            outcome["put"] = "written"
        except PermissionError as exc:
            outcome["put"] = str(exc)
        return outcome

    result = _as_nobody(work)
    assert result["uid"] == NOBODY
    assert "owned by another user" in result["put"]
    assert victim.read_bytes() == SYSTEM_TEXT and link.is_symlink()
    assert sorted(p.name for p in sticky_folder.iterdir()) == ["my-notes.txt", "tuning.json"]


def test_unprivileged_user_sets_aside_and_rebuilds_its_own_cache(sticky_folder):
    path = sticky_folder / "tuning.json"

    def work() -> dict:
        path.write_text("{ corrupt")
        c = TuningCache(path)
        empty = len(c.load().entries)
        c.put([_entry(1)])
        aside = [p.name for p in sticky_folder.glob("tuning.json.corrupt-*")]
        return {"uid": os.geteuid(), "empty": empty, "aside": aside,
                "entries": len(c.entries()), "owner": path.stat().st_uid}  # fmt: skip

    result = _as_nobody(work)
    me = NOBODY if ROOT else os.geteuid()
    assert (result["uid"], result["empty"], result["entries"], result["owner"]) == (me, 0, 1, me)
    assert len(result["aside"]) == 1
    assert (sticky_folder / result["aside"][0]).read_text() == "{ corrupt"


def test_unprivileged_user_never_blocks_on_a_planted_fifo(sticky_folder, alarm):
    path = sticky_folder / "tuning.json"
    os.mkfifo(path, 0o666)

    def work() -> dict:
        c = TuningCache(path)
        outcome = {}
        for name, call in (("load", c.load), ("put", lambda: c.put([_entry(2)]))):
            try:
                call()
                outcome[name] = "ok"
            except PermissionError as exc:
                outcome[name] = str(exc)
        return outcome

    result = _as_nobody(work)
    assert "FIFO" in result["load"] and "FIFO" in result["put"], result
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
