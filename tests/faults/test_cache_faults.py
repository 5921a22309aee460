"""Cache faults: a broken, shared, locked or hostile tuning cache never breaks a GEMM.

Each case builds the fault around a cache file that already holds entries (`_seeded`),
then tunes and runs a GEMM through a CPU `Dispatcher` over two synthetic backends
whose kernels are the torch reference. Each asserts that the process survives (no
exception), the GEMM result is correct, the fault is reported (a warning naming the
file) and nothing that was in the file is lost (still in it, or kept byte for byte
where the cache moved or refused it).

Running as root (CI containers) makes permission bits meaningless; there the
permission faults inject the ``PermissionError`` a normal user gets from the OS.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Literal

import pytest
import torch

import fp4_dispatch.loading.registry as registry_mod
from fp4_dispatch import Backend, Dispatcher, Problem, Support, Tactic, quantize_nvfp4
from fp4_dispatch.autotune.tuning import Timing
from fp4_dispatch.format.nvfp4 import reference_gemm
from fp4_dispatch.store import cache as cache_mod
from fp4_dispatch.store.cache import FORMAT, TuningCache

M, N, K = 100, 256, 128
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


class FaultTactic(Tactic):
    backend: Literal["fault-a"] = "fault-a"
    tile_m: Literal[64, 128] = 128
    tile_n: Literal[64, 128] = 128


def _kernel(operands, out):
    from fp4_dispatch.backends.reference import gemm

    gemm(operands, out, compute_dtype="float32", k_chunk=0)


class FaultA(Backend):
    name = "fault-a"
    family = "fault"
    version = "1"
    tactic_type = FaultTactic

    def supports(self, device) -> Support:
        return Support(True, "synthetic")

    def tactics(self, problem: Problem, device):
        for tm in (64, 128):
            for tn in (64, 128):
                yield FaultTactic(tile_m=tm, tile_n=tn)

    def estimate_us(self, problem, device, tactic) -> float:
        return 100.0 - tactic.tile_n / 10 - tactic.tile_m / 100

    def build(self, tactic, problem, device):
        return _kernel


def _registry() -> registry_mod.Registry:
    reg = registry_mod.Registry()
    report = registry_mod.PluginReport("fault", "tests", "tests", "0", builtin=False)
    b = FaultA()
    reg.backends[b.name] = b
    reg.plugin_of[b.name] = report
    report.backends.append(b.name)
    reg.plugins.append(report)
    return reg


def _timer(cand, launch, best) -> Timing:
    """64x64 is the measured winner (the heuristic would pick 128x128)."""
    us = 5.0 if (cand.tactic.tile_m, cand.tactic.tile_n) == (64, 64) else 50.0
    return Timing((us, us, us), "fake")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "env-default.json"))
    monkeypatch.setattr(registry_mod, "load", lambda strict=None: _registry())
    cache_mod._warned.clear()


def _entry(i: int, device: str = "other-gpu|9.0|132") -> dict:
    """A well-formed entry of another device (the dispatcher never uses it)."""
    tactic = {"backend": "fault-a", "tile_m": 128, "tile_n": 64}
    return {"device": device, "n": 4096, "k": 4096, "m_bucket": 1 << i, "out_dtype": "bfloat16",
            "backend": "fault-a", "backend_version": "1", "family": "fault",
            "tactic": tactic, "us": 10.0 + i}  # fmt: skip


def _seeded(path: Path, count: int = 3) -> list[dict]:
    TuningCache(path).put([_entry(i) for i in range(count)])
    return [_entry(i) for i in range(count)]


def _keys(entries) -> set:
    return {cache_mod.entry_key(e) for e in entries}


def _gemm_ok(d: Dispatcher) -> None:
    """The GEMM through `d` matches the float64 reference."""
    g = torch.Generator().manual_seed(3)
    qa = quantize_nvfp4(torch.randn(M, K, generator=g))
    qb = quantize_nvfp4(torch.randn(N, K, generator=g))
    ref = reference_gemm(qa, qb)
    out = d.gemm(qa, qb)
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3


def _tune_and_run(path, caplog) -> Dispatcher:
    """Tune one bucket and run a GEMM with the cache at `path`; the tuned pick is used."""
    with caplog.at_level(logging.WARNING):
        d = Dispatcher(device="cpu", cache=path)
        (r,) = d.tune([(M, N, K)], timer=_timer, progress=False)
        assert r.winner is not None and r.winner.tactic.tile_n == 64
        assert d.select(M, N, K).reason.startswith("tuned")
        _gemm_ok(d)
    return d


def _file_keys(path: Path) -> set:
    return _keys(TuningCache(path).entries())


def _warned_about(caplog, path: Path, *words: str) -> None:
    text = caplog.text
    assert str(path) in text, text
    for w in words:
        assert w in text, text


# ---- unreadable content: moved aside (bytes kept), rebuilt ----------------------------------


BAD = {
    "corrupt-json": lambda good: "{\x00 not json",
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: "",
    "foreign-format": lambda good: json.dumps({"format": "other-tool", "entries": [1]}),
    "not-utf8": lambda good: "\udcff",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_unreadable_file_is_set_aside_byte_for_byte(tmp_path, caplog, kind):
    path = tmp_path / "tuning.json"
    _seeded(path)
    bad = BAD[kind](path.read_text())
    path.write_bytes(bad.encode("utf-8", "surrogateescape"))
    _tune_and_run(path, caplog)
    _warned_about(caplog, path, "moved it aside")
    (aside,) = tmp_path.glob("tuning.json.corrupt-*")
    assert aside.read_bytes() == bad.encode("utf-8", "surrogateescape")  # nothing lost
    assert len(TuningCache(path).entries()) == 1  # rebuilt with the new winner


def test_newer_format_is_used_read_only_never_moved_or_overwritten(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    _tune_and_run(path, caplog)  # a winner for this device...
    raw = json.loads(path.read_text())
    raw["format_version"] = 7  # ...in a file a future version wrote
    raw["future_field"] = {"x": 1}
    raw["entries"].append({"device": "z", "something": "new"})
    path.write_text(json.dumps(raw))
    before = path.read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        d = Dispatcher(device="cpu", cache=path)
        assert d.select(M, N, K).reason.startswith("tuned")  # its entries are read
        d.tune([(512, N, K)], timer=_timer, progress=False)  # a new bucket: kept in memory
        assert d.select(512, N, K).reason.startswith("tuned")
        _gemm_ok(d)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert caplog.text.count("newer fp4-dispatch") == 1
    _warned_about(caplog, path, "read-only")


@pytest.mark.parametrize(
    "bad_entry",
    [
        {"device": "x", "n": 1},  # missing fields
        {**_entry(9), "n": "4096"},  # wrong type
        {**_entry(9), "us": True},  # bool is not a number
        {**_entry(9), "tactic": "128x64"},  # tactic not an object
        "not an object",
    ],
    ids=["missing-fields", "wrong-type", "bool-us", "tactic-string", "not-object"],
)
def test_malformed_entry_is_skipped_and_kept_in_the_file(tmp_path, caplog, bad_entry):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    raw = json.loads(path.read_text())
    raw["entries"].append(bad_entry)
    path.write_text(json.dumps(raw))
    _tune_and_run(path, caplog)
    _warned_about(caplog, path, "dropped from use")
    after = json.loads(path.read_text())["entries"]
    assert bad_entry in after  # written back unchanged
    assert _keys(seeded) <= _file_keys(path) and len(_file_keys(path)) == len(seeded) + 1


# ---- the file system --------------------------------------------------------------------------


def test_read_only_file_is_replaced_keeping_its_mode(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    path.chmod(0o444)
    _tune_and_run(path, caplog)
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert _keys(seeded) < _file_keys(path)


def test_shared_mode_is_kept_and_new_files_follow_the_umask(tmp_path, caplog):
    shared = tmp_path / "shared.json"
    seeded = _seeded(shared)
    shared.chmod(0o664)
    _tune_and_run(shared, caplog)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o664
    assert _keys(seeded) < _file_keys(shared)
    old = os.umask(0o027)
    try:
        fresh = tmp_path / "fresh.json"
        TuningCache(fresh).put([_entry(0)])
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o640  # 0o666 & ~umask, not 0600


def _deny(monkeypatch, directory: Path) -> None:
    """What a non-root user gets when creating a file in a read-only `directory`."""
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        if Path(kwargs.get("dir", "")) == directory:
            raise PermissionError(13, "Permission denied", str(directory))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_read_only_directory_keeps_the_winner_in_memory(tmp_path, caplog, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "tuning.json"
    seeded = _seeded(path)
    before = path.read_bytes()
    folder.chmod(0o555)
    if ROOT:
        _deny(monkeypatch, folder)
    try:
        _tune_and_run(path, caplog)
    finally:
        folder.chmod(0o755)
    _warned_about(caplog, path, "could not save", "kept in memory")
    assert path.read_bytes() == before and _file_keys(path) == _keys(seeded)


def test_unwritable_parent_keeps_the_winner_in_memory(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    path = blocker / "sub" / "tuning.json"
    _tune_and_run(path, caplog)
    _warned_about(caplog, path, "could not save")
    assert blocker.read_text() == "a file where the cache folder should be"


def test_path_is_a_directory(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    path.mkdir()
    (path / "precious").write_text("kept")
    _tune_and_run(path, caplog)
    _warned_about(caplog, path, "unreadable", "could not save")
    assert (path / "precious").read_text() == "kept"


def test_symlink_writes_the_target_and_links_share_one_lock(tmp_path, caplog):
    real = tmp_path / "store" / "tuning.json"
    real.parent.mkdir()
    seeded = _seeded(real)
    link1, link2 = tmp_path / "link1.json", tmp_path / "link2.json"
    link1.symlink_to(real)
    link2.symlink_to(link1)  # a chain
    _tune_and_run(link2, caplog)
    assert link1.is_symlink() and link2.is_symlink()  # never replaced by a private file
    assert _keys(seeded) < _file_keys(real)
    assert (
        TuningCache(link1).lock_path
        == TuningCache(link2).lock_path
        == real.with_name("tuning.json.lock")
    )


def test_dangling_symlink_creates_its_target(tmp_path, caplog):
    target = tmp_path / "later" / "tuning.json"
    link = tmp_path / "tuning.json"
    link.symlink_to(target)
    _tune_and_run(link, caplog)
    assert link.is_symlink() and target.is_file()
    assert len(TuningCache(target).entries()) == 1


def test_temp_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    dead = tmp_path / ".tuning.json.abc123.tmp"
    dead.write_text('{"half": ')
    old = time.time() - 3600
    os.utime(dead, (old, old))
    live = tmp_path / ".tuning.json.live42.tmp"  # written just now: maybe not dead, left
    live.write_text("")
    other = tmp_path / ".other.json.zzz.tmp"  # another file's temp: not ours
    other.write_text("")
    os.utime(other, (old, old))
    _tune_and_run(path, caplog)
    assert not dead.exists() and live.exists() and other.exists()
    assert _keys(seeded) < _file_keys(path)


_KILL_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from fp4_dispatch.store.cache import TuningCache

    def die(fd):  # after the temp file is written, before it replaces the cache
        os.kill(os.getpid(), signal.SIGKILL)

    os.fsync = die
    entry = {"device": "killed|9.0|1", "n": 8, "k": 64, "m_bucket": 1, "out_dtype": "bfloat16",
             "backend": "fault-a", "backend_version": "1",
             "tactic": {"backend": "fault-a", "tile_m": 64, "tile_n": 64}, "us": 1.0}
    TuningCache(sys.argv[1]).put([entry])
    """
)


def test_sigkill_mid_write_loses_nothing(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _KILL_MID_WRITE, str(path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before  # the reader sees the old file, whole
    (leftover,) = tmp_path.glob(".tuning.json.*.tmp")
    old = time.time() - 60
    os.utime(leftover, (old, old))
    _tune_and_run(path, caplog)  # the lock died with the writer: no wait
    assert not leftover.exists()
    assert _keys(seeded) < _file_keys(path)


_WRITER = textwrap.dedent(
    """
    import sys
    from fp4_dispatch.store.cache import TuningCache

    path, worker = sys.argv[1], int(sys.argv[2])
    cache = TuningCache(path)
    for i in range(15):
        e = {"device": f"w{worker}|9.0|1", "n": 64 * (i + 1), "k": 64, "m_bucket": 1,
             "out_dtype": "bfloat16", "backend": "fault-a", "backend_version": "1",
             "tactic": {"backend": "fault-a", "tile_m": 64, "tile_n": 64}, "us": 1.0}
        cache.put([e])
    """
)


def test_concurrent_writers_through_different_links_lose_nothing(tmp_path, caplog):
    real = tmp_path / "tuning.json"
    seeded = _seeded(real)
    link = tmp_path / "via-link.json"
    link.symlink_to(real)
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(real if w % 2 else link), str(w)])
        for w in range(4)
    ]
    with caplog.at_level(logging.WARNING):
        d = Dispatcher(device="cpu", cache=link)
        d.tune([(M, N, K)], timer=_timer, progress=False)  # a fifth writer, in process
        _gemm_ok(d)
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    keys = _file_keys(real)
    assert _keys(seeded) <= keys and len(keys) == len(seeded) + 4 * 15 + 1
    assert link.is_symlink()


_HOLDER = textwrap.dedent(
    """
    import fcntl, sys, time

    with open(sys.argv[1], "a") as f:  # the cache's lock is an flock on this file
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """
)


def test_lock_held_by_another_process_keeps_the_winner_in_memory(tmp_path, caplog, monkeypatch):
    path = tmp_path / "tuning.json"
    seeded = _seeded(path)
    before = path.read_bytes()
    monkeypatch.setenv("FP4_DISPATCH_CACHE_LOCK_TIMEOUT", "0.3")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(TuningCache(path).lock_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        _tune_and_run(path, caplog)
        assert time.monotonic() - t0 < 30
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert caplog.text.count("could not save") == 1
    _warned_about(caplog, path, "kept in memory")
    assert path.read_bytes() == before and _file_keys(path) == _keys(seeded)


# ---- the CLI on what the loader accepts ---------------------------------------------------


def test_cache_show_tolerates_odd_optional_fields(tmp_path, monkeypatch, capsys):
    from fp4_dispatch.cli import main

    path = tmp_path / "odd.json"
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(path))
    odd = [
        {**_entry(0), "runner_up": "fast", "heuristic": {"us": "slow"}, "timestamp": 5},
        {**_entry(1), "heuristic": [1, 2], "env": "yes", "us": 0},
        {**_entry(2), "tactic": {"backend": "fault-a", 3: None}, "runner_up": {"us": None}},
        {**_entry(3), "env": {"torch": None, "triton": 3}},
    ]
    raw = {"format": FORMAT, "format_version": 1, "metadata": {"devices": ["not", "a", "map"],
           "torch": {"odd": 1}}, "entries": odd}  # fmt: skip
    path.write_text(json.dumps(raw))
    assert main(["cache", "show"]) == 0
    text = capsys.readouterr().out
    assert text.count("other-gpu|9.0|132") == 4 and "(none recorded)" in text
    assert main(["cache", "show", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["entries"]) == 4


def test_cache_import_of_a_corrupt_file_is_reported(tmp_path, monkeypatch, capsys, caplog):
    from fp4_dispatch.cli import main

    path = tmp_path / "mine.json"
    seeded = _seeded(path)
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(path))
    bad = tmp_path / "from-elsewhere.json"
    bad.write_text('{"format": "fp4-dispatch-tuning", "entr')
    with caplog.at_level(logging.WARNING):
        assert main(["cache", "import", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().out
    assert _file_keys(path) == _keys(seeded)
    assert bad.read_text() == '{"format": "fp4-dispatch-tuning", "entr'  # not moved aside
