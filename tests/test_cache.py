"""The tuning cache file: merge under a lock, atomic writes, bad files set aside, CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from fp4_dispatch.store import cache as cache_mod
from fp4_dispatch.store.cache import FORMAT, FORMAT_VERSION, TuningCache


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Never touch the user's cache: every test gets its own FP4_DISPATCH_CACHE."""
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "env-cache" / "tuning.json"))


def entry(i: int, device: str = "dev|9.0|132", **extra) -> dict:
    return {
        "device": device,
        "n": 4096,
        "k": 4096,
        "m_bucket": 1 << (i % 15),
        "out_dtype": "bfloat16",
        "backend": "fake-a",
        "backend_version": "1",
        "family": "fa",
        "tactic": {"backend": "fake-a", "tile_m": 128, "tile_n": 64 + i},
        "us": 10.0 + i,
        **extra,
    }


def test_put_merges_and_round_trips(tmp_path):
    c = TuningCache(tmp_path / "sub" / "tuning.json")
    assert c.entries() == []
    assert c.put([entry(0), entry(1)], {"devices": {"dev|9.0|132": {"sm_count": 132}}}) == 2
    assert c.put([entry(2, device="other|10.0|148")], {"devices": {"other|10.0|148": {}}}) == 3
    replaced = entry(1, us=5.0)
    assert c.put([replaced]) == 3  # same key: replaced, not added
    data = c.load()
    assert set(data.metadata["devices"]) == {"dev|9.0|132", "other|10.0|148"}
    assert data.entries[cache_mod.entry_key(replaced)]["us"] == 5.0
    assert [e["device"] for e in c.entries("other|10.0|148")] == ["other|10.0|148"]
    raw = json.loads(c.path.read_text())
    assert raw["format"] == FORMAT and raw["format_version"] == FORMAT_VERSION
    assert len(raw["entries"]) == 3
    assert not list(c.path.parent.glob("*.tmp"))  # the temp file was renamed away


def test_malformed_entry_is_refused_before_writing(tmp_path):
    c = TuningCache(tmp_path / "tuning.json")
    c.put([entry(0)])
    before = c.path.read_bytes()
    bad = entry(1)
    del bad["tactic"]
    with pytest.raises(ValueError, match="missing field 'tactic'"):
        c.put([entry(2), bad])
    assert c.path.read_bytes() == before


WRITER = textwrap.dedent(
    """
    import importlib, os, sys, time, types
    # Load cache.py (and the safefs it imports) without the package's __init__ (no torch):
    # the test measures the lock, not interpreter start.
    pkg = types.ModuleType("fp4_cache_alone")
    pkg.__path__ = [os.path.dirname(sys.argv[1])]
    sys.modules[pkg.__name__] = pkg
    mod = importlib.import_module("fp4_cache_alone.cache")
    cache = mod.TuningCache(sys.argv[2])
    worker, start = int(sys.argv[3]), float(sys.argv[4])
    while time.time() < start:
        time.sleep(0.005)
    for i in range(50):
        e = {"device": f"dev{worker}|9.0|132", "n": 1000 + i, "k": 512, "m_bucket": 16,
             "out_dtype": "bfloat16", "backend": "fake-a", "backend_version": "1",
             "tactic": {"backend": "fake-a", "tile_m": 64, "tile_n": 64}, "us": float(i),
             "writer": worker}
        cache.put([e], {"devices": {f"dev{worker}|9.0|132": {"sm_count": 132}}})
    """
)


def test_eight_processes_lose_nothing(tmp_path):
    path = tmp_path / "shared" / "tuning.json"
    start = time.time() + 1.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, cache_mod.__file__, str(path), str(w), str(start)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(8)
    ]
    errors = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _ in errors), errors
    data = TuningCache(path).load()
    assert len(data.entries) == 400
    got = {(e["writer"], e["n"]) for e in data.entries.values()}
    assert got == {(w, 1000 + i) for w in range(8) for i in range(50)}
    assert len(data.metadata["devices"]) == 8
    assert not list(path.parent.glob("*.tmp")) and not list(path.parent.glob("*.corrupt-*"))


def _good_file(path) -> str:
    TuningCache(path).put([entry(0), entry(1)])
    return path.read_text()


BAD_FILES = {
    "garbage": lambda good: "\x00\x01not json at all",
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: "",
    "older-version": lambda good: json.dumps({**json.loads(good), "format_version": 0}),
    "foreign": lambda good: json.dumps({"format": "someone-else", "entries": []}),
    "not-an-object": lambda good: "[1, 2, 3]",
    "entries-not-list": lambda good: json.dumps({**json.loads(good), "entries": {}}),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_is_set_aside_and_rebuilt(tmp_path, caplog, kind):
    path = tmp_path / "tuning.json"
    bad = BAD_FILES[kind](_good_file(path))
    path.write_text(bad)
    c = TuningCache(path)
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.store.cache"):
        assert c.entries() == []
    assert "moved it aside" in caplog.text
    aside = list(tmp_path.glob("tuning.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == bad
    assert not path.exists()
    assert c.put([entry(3)]) == 1  # rebuilt from scratch
    assert json.loads(path.read_text())["entries"][0]["m_bucket"] == 8


def test_bad_file_found_by_a_writer_is_set_aside(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text('{"format": "fp4-dispatch-tuning", "format_ver')
    TuningCache(path).put([entry(0)])
    assert len(list(tmp_path.glob("tuning.json.corrupt-*"))) == 1
    assert len(TuningCache(path).entries()) == 1


def test_malformed_entries_are_dropped_others_kept(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    good = json.loads(_good_file(path))
    good["entries"].append({"device": "x", "n": "not an int"})
    good["entries"].append("not an object")
    path.write_text(json.dumps(good))
    with caplog.at_level(logging.WARNING, logger="fp4_dispatch.store.cache"):
        assert len(TuningCache(path).entries()) == 2
    assert caplog.text.count("dropped") == 2
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_clear(tmp_path):
    c = TuningCache(tmp_path / "tuning.json")
    c.put([entry(0), entry(1), entry(2)])
    assert c.clear() == 3
    assert not c.path.exists()
    assert c.clear() == 0


def test_default_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(tmp_path / "x.json"))
    assert cache_mod.default_path() == tmp_path / "x.json"
    assert TuningCache().path == tmp_path / "x.json"
    monkeypatch.delenv("FP4_DISPATCH_CACHE")
    import platformdirs

    want = os.path.join(platformdirs.user_cache_dir("fp4-dispatch"), "tuning.json")
    assert str(cache_mod.default_path()) == want


def test_device_fingerprint():
    assert cache_mod.device_fingerprint("NVIDIA H200", (9, 0), 132) == "NVIDIA H200|9.0|132"
    assert cache_mod.device_fingerprint("cpu", None, 1) == "cpu|-|1"


# ---- CLI --------------------------------------------------------------------------------


def test_cli_cache_show_path_clear(capsys, monkeypatch, tmp_path):
    from fp4_dispatch.cli import main

    path = tmp_path / "cli" / "tuning.json"
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(path))
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(path)

    assert main(["cache", "show"]) == 0
    assert "no entries" in capsys.readouterr().out

    TuningCache(path).put(
        [entry(0), entry(4)], {"devices": {"dev|9.0|132": {"name": "Fake GPU", "sm_count": 132}}}
    )
    assert main(["cache", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert set(shown) == {"path", "metadata", "entries"}
    assert shown["path"] == str(path)
    assert [e["m_bucket"] for e in shown["entries"]] == [1, 16]
    assert shown["metadata"]["devices"]["dev|9.0|132"]["name"] == "Fake GPU"

    assert main(["cache", "show"]) == 0
    text = capsys.readouterr().out
    assert "Fake GPU" in text and "M<=16" in text and "fake-a 1" in text

    assert main(["cache", "clear"]) == 0
    assert "2 entries" in capsys.readouterr().out
    assert not path.exists()


# ---- export / import (file level) ---------------------------------------------------------


def test_export_all_or_one_device(tmp_path):
    src = TuningCache(tmp_path / "src.json")
    devices = {"dev|9.0|132": {"name": "A"}, "other|10.0|148": {"name": "B"}}
    src.put([entry(0), entry(1), entry(2, device="other|10.0|148")], {"devices": devices})
    assert src.export_to(tmp_path / "all.json") == 3
    assert src.export_to(tmp_path / "one.json", device="other|10.0|148") == 1
    one = TuningCache(tmp_path / "one.json").load()
    assert [k[0] for k in one.entries] == ["other|10.0|148"]
    assert set(one.metadata["devices"]) == {"other|10.0|148"}
    assert len(TuningCache(tmp_path / "all.json").entries()) == 3
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temp file, renamed


def test_import_merges_and_never_loses_an_entry(tmp_path):
    mine = TuningCache(tmp_path / "mine.json")
    mine.put([entry(0), entry(1, us=1.0)])
    theirs = TuningCache(tmp_path / "theirs.json")
    theirs.put([entry(1, us=99.0), entry(2), entry(3)])
    raw = json.loads(theirs.path.read_text())
    raw["entries"].append({"device": "x"})  # malformed: reported, not taken
    theirs.path.write_text(json.dumps(raw))

    report = mine.import_from(theirs.path, lambda e: "no thanks" if e["m_bucket"] == 8 else None)
    assert [e["m_bucket"] for e in report.taken] == [4]
    reasons = sorted(why for _, why in report.skipped)
    assert any("already has an entry" in r for r in reasons)
    assert "no thanks" in reasons and any("malformed" in r for r in reasons)
    got = {e["m_bucket"]: e["us"] for e in mine.entries()}
    assert got == {1: 10.0, 2: 1.0, 4: 12.0}  # existing M<=2 kept at 1.0 us
    assert json.dumps(report.to_json())  # serialisable for --json

    again = mine.import_from(theirs.path, replace=True)
    assert {e["m_bucket"] for e in again.taken} == {2, 4, 8}
    assert {e["m_bucket"]: e["us"] for e in mine.entries()}[2] == 99.0


@pytest.mark.parametrize("kind", ["garbage", "foreign", "truncated"])
def test_import_of_a_bad_file_raises_and_writes_nothing(tmp_path, kind):
    mine = TuningCache(tmp_path / "mine.json")
    mine.put([entry(0)])
    before = mine.path.read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_text(BAD_FILES[kind](before.decode()))
    with pytest.raises(cache_mod.CacheFormatError, match=r"bad\.json"):
        mine.import_from(bad)
    assert mine.path.read_bytes() == before and bad.exists()


def test_cli_show_marks_a_newer_file_read_only_and_shows_the_environment(
    tmp_path, monkeypatch, capsys
):
    from fp4_dispatch.cli import main

    path = tmp_path / "new.json"
    monkeypatch.setenv("FP4_DISPATCH_CACHE", str(path))
    env = {"torch": "2.13.0", "triton": "3.9.0", "cuda_driver": "12.8"}
    TuningCache(path).put([entry(0, env=env), entry(1)])
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format_version": FORMAT_VERSION + 1}))
    before = path.read_bytes()
    assert main(["cache", "show"]) == 0
    text = capsys.readouterr().out
    assert "read-only" in text and "newer fp4-dispatch" in text
    assert "torch 2.13.0 triton 3.9.0 driver 12.8" in text and "(none recorded)" in text
    assert main(["cache", "clear"]) == 1  # refused, reported, file kept
    assert str(path) in capsys.readouterr().out and path.read_bytes() == before
