"""The tuning cache: one JSON file that many processes share without losing an entry.

Why a file lock *and* an atomic rename: the rename alone makes every reader see either
the old or the new file (never half of one), but two writers that each read, add their
entries and rename would drop each other's entries. So a writer takes
``<path>.lock`` (`filelock`), re-reads the file under it, merges its own entries in,
writes a temporary file in the same directory, fsyncs it and ``os.replace``-s it over
the old one. Readers take no lock.

Format (``FORMAT_VERSION`` 1)::

    {"format": "fp4-dispatch-tuning", "format_version": 1,
     "metadata": {"library": "fp4-dispatch", "library_version": ..., "updated": ...,
                  "devices": {fingerprint: {"name", "compute_capability", "sm_count",
                                            "kind"}},
                  "backends": {name: version}, ...},
     "entries": [entry, ...]}   # sorted by key

One file may hold several devices: an entry's key is (``device`` fingerprint, ``n``,
``k``, ``m_bucket``, ``out_dtype``), and the fingerprint's name, compute capability and
SM count are in ``metadata.devices``. An entry also holds ``backend``,
``backend_version``, ``family``, ``tactic`` (the tactic as JSON, with its ``backend``
discriminator), ``us`` (measured), ``est_us``, ``runner_up``, ``timestamp`` and
whatever else the tuner records; the cache only checks the key and required fields.

A file that is not JSON, is truncated, or has another ``format``/``format_version`` is
moved aside to ``<path>.corrupt-<timestamp>`` with a warning and rebuilt. Single
malformed entries are dropped with a warning. Whether an entry is still *usable*
(backend present, version, tactic valid) is the dispatcher's question, not the file's.

This module depends only on the standard library, `filelock` and `platformdirs`, so a
process can use it without importing torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock

log = logging.getLogger(__name__)

FORMAT = "fp4-dispatch-tuning"
FORMAT_VERSION = 1
ENV_PATH = "FP4_DISPATCH_CACHE"
#: seconds a writer waits for the lock before giving up with an error
LOCK_TIMEOUT_S = 60.0

KEY_FIELDS = ("device", "n", "k", "m_bucket", "out_dtype")
#: field -> accepted types; an entry missing one (or of another type) is dropped
REQUIRED: dict[str, tuple[type, ...]] = {
    "device": (str,),
    "n": (int,),
    "k": (int,),
    "m_bucket": (int,),
    "out_dtype": (str,),
    "backend": (str,),
    "backend_version": (str,),
    "tactic": (dict,),
    "us": (int, float),
}

Key = tuple[str, int, int, int, str]


class CacheFormatError(ValueError):
    """The file is not a tuning cache this version can read (corrupt, truncated, foreign)."""


def default_path() -> Path:
    """``$FP4_DISPATCH_CACHE``, else ``<user cache dir>/fp4-dispatch/tuning.json``."""
    env = os.environ.get(ENV_PATH, "").strip()
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fp4-dispatch")) / "tuning.json"


def device_fingerprint(name: str, compute_capability: Any, sm_count: int) -> str:
    """``"NVIDIA H200|9.0|132"``: entries of different parts never mix."""
    cc = "-" if compute_capability is None else ".".join(str(x) for x in compute_capability)
    return f"{name}|{cc}|{sm_count}"


def entry_key(entry: Mapping[str, Any]) -> Key:
    return tuple(entry[f] for f in KEY_FIELDS)  # type: ignore[return-value]


def check_entry(entry: object) -> str | None:
    """Why `entry` is malformed (None when it has every required field, well typed)."""
    if not isinstance(entry, dict):
        return f"expected an object, got {type(entry).__name__}"
    for name, types in REQUIRED.items():
        if name not in entry:
            return f"missing field {name!r}"
        value = entry[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"field {name!r} has type {type(value).__name__}"
    return None


@dataclass
class CacheData:
    """The parsed file: metadata and entries by key (insertion order = file order)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    entries: dict[Key, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "entries": [self.entries[k] for k in sorted(self.entries, key=_sort_key)],
        }


def _sort_key(key: Key) -> tuple:
    return tuple(str(x) if isinstance(x, str) else f"{x:020d}" for x in key)


def parse(text: str, source: str = "<text>") -> CacheData:
    """Parse a cache file's text; raise `CacheFormatError` saying what is wrong with it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CacheFormatError(f"{source}: not valid JSON (corrupt or truncated): {exc}") from exc
    if not isinstance(raw, dict):
        raise CacheFormatError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise CacheFormatError(
            f"{source}: not an fp4-dispatch tuning cache ({raw.get('format')!r})"
        )
    if raw.get("format_version") != FORMAT_VERSION:
        raise CacheFormatError(
            f"{source}: format version {raw.get('format_version')!r}, "
            f"this library reads version {FORMAT_VERSION}"
        )
    metadata, entries = raw.get("metadata"), raw.get("entries")
    if not isinstance(metadata, dict) or not isinstance(entries, list):
        raise CacheFormatError(f"{source}: 'metadata' must be an object and 'entries' a list")
    data = CacheData(metadata=metadata)
    dropped = 0
    for i, entry in enumerate(entries):
        why = check_entry(entry)
        if why is not None:
            dropped += 1
            log.warning("tuning cache %s: entry %d dropped: %s", source, i, why)
            continue
        data.entries[entry_key(entry)] = entry
    return data


class TuningCache:
    """A tuning cache file: read without a lock, merge-write under one.

    `path` defaults to `default_path()` (resolved when the object is made).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_path()

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _lock(self) -> filelock.BaseFileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S)

    # ---- reading ----------------------------------------------------------------------

    def _read(self) -> CacheData:
        """Parse the file as it is now (empty when absent); raises `CacheFormatError`."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return CacheData()
        except UnicodeDecodeError as exc:
            raise CacheFormatError(f"{self.path}: not UTF-8 text: {exc}") from exc
        return parse(text, str(self.path))

    def load(self) -> CacheData:
        """The file's content. A corrupt or foreign file is set aside (under the lock).

        Raises OSError only when the file exists but cannot be read at all.
        """
        try:
            return self._read()
        except CacheFormatError:
            with self._lock():
                try:  # a writer may have replaced it meanwhile: look again under the lock
                    return self._read()
                except CacheFormatError as exc:
                    self._set_aside(exc)
                    return CacheData()

    def entries(self, device: str | None = None) -> list[dict[str, Any]]:
        """Entries in key order, optionally only those of one device fingerprint."""
        data = self.load()
        keys = sorted(data.entries, key=_sort_key)
        return [data.entries[k] for k in keys if device is None or k[0] == device]

    # ---- writing ----------------------------------------------------------------------

    def put(
        self, entries: Iterable[Mapping[str, Any]], metadata: Mapping[str, Any] | None = None
    ) -> int:
        """Merge `entries` into the file (an entry replaces the one with its key).

        `metadata` is merged one level deep (``devices`` and ``backends`` maps are
        merged key by key, other fields replaced). Returns the number of entries now in
        the file. Raises ValueError for a malformed entry, before touching the file.
        """
        new = [dict(e) for e in entries]
        for e in new:
            why = check_entry(e)
            if why is not None:
                raise ValueError(f"tuning cache entry is malformed: {why}: {e!r}")
        with self._lock():
            try:
                data = self._read()
            except CacheFormatError as exc:
                self._set_aside(exc)
                data = CacheData()
            for e in new:
                data.entries[entry_key(e)] = e
            data.metadata = _merge_metadata(data.metadata, metadata or {})
            self._write(data)
            return len(data.entries)

    def clear(self) -> int:
        """Remove the file; returns how many entries it held (0 if absent or unreadable)."""
        with self._lock():
            try:
                count = len(self._read().entries)
            except CacheFormatError as exc:
                log.warning("tuning cache %s was unreadable (%s); removing it", self.path, exc)
                count = 0
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return count

    def _write(self, data: CacheData) -> None:
        """Temp file in the same directory, fsync, os.replace: readers never see half."""
        text = json.dumps(data.to_json(), indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path.parent)

    def _set_aside(self, exc: CacheFormatError) -> Path:
        """Move an unreadable file to ``<path>.corrupt-<timestamp>`` (call under the lock)."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
            n += 1
        os.replace(self.path, target)
        log.warning("tuning cache: %s; moved it aside to %s and starting afresh", exc, target)
        return target


def _merge_metadata(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(old)
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    merged["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return merged


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable where the platform allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:  # e.g. Windows: directories cannot be opened; rename is enough
        log.debug("cannot fsync directory %s: %r", directory, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.debug("fsync of directory %s failed: %r", directory, exc)
    finally:
        os.close(fd)
