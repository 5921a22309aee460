"""The tuning cache: one JSON file that many processes share without losing an entry.

Why a file lock *and* an atomic rename: the rename alone makes every reader see either
the old or the new file (never half of one), but two writers that each read, add their
entries and rename would drop each other's entries. So a writer takes ``<path>.lock``
(``flock``, `fp4_dispatch.safefs.lock`), re-reads the file under it, merges its own
entries in, writes a temporary file in the same directory, fsyncs it and ``os.replace``-s it over
the old one. Readers take no lock.

Format (``FORMAT_VERSION`` 1)::

    {"format": "fp4-dispatch-tuning", "format_version": 1,
     "metadata": {"library": "fp4-dispatch", "library_version": ..., "updated": ...,
                  "devices": {fingerprint: {"name", "compute_capability", "sm_count",
                                            "kind"}},
                  "backends": {name: version}, ...},
     "entries": [entry, ...]}   # sorted by key

One file may hold several devices: an entry's key is (``device`` fingerprint, ``n``,
``k``, ``m_bucket``, ``out_dtype``, ``operation`` - "w4a4" when absent, ``groups`` - the
expert count E of a grouped operation, absent (None) for every other, so dense entries
are written and keyed as before; docs/grouped.md), and the
fingerprint's name, compute capability and SM count are in ``metadata.devices``. An
entry also holds ``backend``, ``backend_version``, ``family``, ``tactic`` (the tactic
as JSON, with its ``backend`` discriminator), ``us`` (measured), ``est_us``,
``runner_up``, ``timestamp`` and whatever else the tuner records (``env``: the
environment it was measured in, see `fp4_dispatch.winners`); the cache only checks the
key and required fields.

A file that is not JSON, is truncated, or has another ``format`` (or an older or
non-integer ``format_version``) is moved aside to ``<path>.corrupt-<timestamp>`` with a
warning and rebuilt. A file of a NEWER format version (written by a newer fp4-dispatch)
is never moved aside nor overwritten: the entries this version understands are read,
the file is used read-only (one warning), and writes raise `CacheReadOnlyError` (the
dispatcher keeps its winners in memory). Single malformed entries are not used (one
warning each) but are written back unchanged by the next write. Whether an entry is
still *usable* (backend present, version, tactic valid, same environment) is the winner
store's question (`fp4_dispatch.winners`), not the file's.

**Only its own regular files** (`fp4_dispatch.safefs`): a symlink at the path is
followed only when this user or root owns every link of its chain (a link planted by
another user is refused), and writes then lock and replace the link's final target, so
a cache shared through links stays shared and two links to one file share one lock.
Nothing that is not a regular file (a folder, device, FIFO) is read, renamed, replaced
or removed, and an unreadable file behind a symlink is never set aside (the link's
target may be any file): the cache is then ignored with one warning and winners stay
in memory. The lock file is opened without following a link and never truncated. A
world-writable cache folder gets one warning. **The mode is kept**: a replaced file
gets the old file's permission bits (a cache shared between users stays readable to
them) and, when running as root, its owner; a new file gets ``0o666 & ~umask`` like
any file the user creates (not `tempfile.mkstemp`'s private 0600). **Killed writers**:
a writer killed mid-write leaves ``.<name>.<random>.tmp``; every writer removes such
regular files whose mtime predates its own lock acquisition (only the lock holder
writes, so an older temp file belongs to a writer that no longer holds the lock,
i.e. is dead).

This module depends only on the standard library, `safefs` and `platformdirs`, so a
process can use it without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import safefs

log = logging.getLogger(__name__)

FORMAT = "fp4-dispatch-tuning"
FORMAT_VERSION = 1
ENV_PATH = "FP4_DISPATCH_CACHE"
#: seconds a writer waits for the lock before giving up with ``TimeoutError`` (a
#: tuning write takes milliseconds; a minute means the holder is stuck). Read at each
#: write, so ``FP4_DISPATCH_CACHE_LOCK_TIMEOUT`` or patching this changes it.
LOCK_TIMEOUT_S = 60.0
ENV_LOCK_TIMEOUT = "FP4_DISPATCH_CACHE_LOCK_TIMEOUT"
#: temp files of this cache's writers: ``.<name>.<random>.tmp`` (see `TuningCache._write`)
TMP_SUFFIX = ".tmp"

KEY_FIELDS = ("device", "n", "k", "m_bucket", "out_dtype", "operation", "groups")
#: key fields an entry may lack, and what it then means (an entry without ``operation``
#: predates W4A16 tuning: it is a W4A4 winner; one without ``groups`` is not grouped)
KEY_DEFAULTS: dict[str, Any] = {"operation": "w4a4", "groups": None}
#: the types an optional key field must have when present
_KEY_TYPES: dict[str, type] = {"operation": str, "groups": int}
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

Key = tuple[str, int, int, int, str, str, int | None]


class CacheFormatError(ValueError):
    """The file is not a tuning cache this version can read (corrupt, truncated, foreign)."""


class ExportTargetError(OSError):
    """Writing an export file failed; ``filename`` is the destination (not the cache)."""


class CacheReadOnlyError(PermissionError):
    """The file was written by a newer format version: this library never overwrites it."""


#: (path, kind) pairs already warned about in this process: one warning per fault
_warned: set[tuple[str, str]] = set()


def warn_once(path: object, kind: str, message: str, *args: object) -> None:
    """Log `message` as a warning the first time (path, kind) is seen in this process."""
    key = (str(path), kind)
    if key in _warned:
        log.debug(message, *args)
        return
    _warned.add(key)
    log.warning(message, *args)


def lock_timeout() -> float:
    """`LOCK_TIMEOUT_S`, or ``$FP4_DISPATCH_CACHE_LOCK_TIMEOUT`` (seconds) when set."""
    raw = os.environ.get(ENV_LOCK_TIMEOUT, "").strip()
    if not raw:
        return LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s", ENV_LOCK_TIMEOUT, raw,
                    LOCK_TIMEOUT_S)  # fmt: skip
        return LOCK_TIMEOUT_S
    return max(0.0, value)


def default_path() -> Path:
    """``$FP4_DISPATCH_CACHE``, else ``<user cache dir>/fp4-dispatch/tuning.json``."""
    env = os.environ.get(ENV_PATH, "").strip()
    if env:
        return Path(env).expanduser()
    import platformdirs  # noqa: PLC0415 - lazy: start-up time

    return Path(platformdirs.user_cache_dir("fp4-dispatch")) / "tuning.json"


def device_fingerprint(name: str, compute_capability: Any, sm_count: int) -> str:
    """``"NVIDIA H200|9.0|132"``: entries of different parts never mix."""
    cc = "-" if compute_capability is None else ".".join(str(x) for x in compute_capability)
    return f"{name}|{cc}|{sm_count}"


def entry_key(entry: Mapping[str, Any]) -> Key:
    return tuple(entry.get(f, KEY_DEFAULTS[f]) if f in KEY_DEFAULTS else entry[f]
                 for f in KEY_FIELDS)  # type: ignore[return-value]  # fmt: skip


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
    for name, want in _KEY_TYPES.items():  # optional key fields: absent or of their type
        value = entry.get(name, KEY_DEFAULTS[name])
        if value is not None and (isinstance(value, bool) or not isinstance(value, want)):
            return f"field {name!r} has type {type(entry[name]).__name__}"
    return None


@dataclass
class CacheData:
    """The parsed file: metadata and entries by key (insertion order = file order)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    entries: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: why this file must not be written (a newer format version), else ""
    read_only: str = ""
    #: why each malformed entry was dropped while parsing
    dropped: list[str] = field(default_factory=list)
    #: the malformed entries themselves: not used, but written back unchanged, so a
    #: rewrite never loses what another version (or a hand edit) put in the file
    unparsed: list[Any] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        ordered = [self.entries[k] for k in sorted(self.entries, key=_sort_key)]
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "entries": ordered + self.unparsed,
        }


def _sort_key(key: Key) -> tuple:
    return tuple("" if x is None else str(x) if isinstance(x, str) else f"{x:020d}"
                 for x in key)  # fmt: skip


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
    version = raw.get("format_version")
    newer = type(version) is int and version > FORMAT_VERSION
    if version != FORMAT_VERSION and not newer:
        raise CacheFormatError(
            f"{source}: format version {raw.get('format_version')!r}, "
            f"this library reads version {FORMAT_VERSION}"
        )
    metadata, entries = raw.get("metadata"), raw.get("entries")
    if newer:  # read what this version understands; never write it
        metadata = metadata if isinstance(metadata, dict) else {}
        entries = entries if isinstance(entries, list) else []
    if not isinstance(metadata, dict) or not isinstance(entries, list):
        raise CacheFormatError(f"{source}: 'metadata' must be an object and 'entries' a list")
    data = CacheData(metadata=metadata)
    if newer:
        data.read_only = (
            f"{source}: written by a newer fp4-dispatch (format version {version}, this "
            f"library writes {FORMAT_VERSION}); using it read-only"
        )
    dropped = 0
    for i, entry in enumerate(entries):
        why = check_entry(entry)
        if why is not None:
            dropped += 1
            data.dropped.append(f"entry {i} malformed: {why}")
            data.unparsed.append(entry)
            log.warning("tuning cache %s: entry %d dropped from use (kept in the file): %s",
                        source, i, why)  # fmt: skip
            continue
        data.entries[entry_key(entry)] = entry
    return data


@dataclass
class ImportReport:
    """What `TuningCache.import_from` took and skipped (and why), by entry key."""

    source: str
    taken: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[dict[str, Any] | None, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def key(e: dict[str, Any] | None) -> dict[str, Any] | None:
            return None if e is None else {f: e.get(f) for f in (*KEY_FIELDS, "backend")}

        return {
            "source": self.source,
            "taken": [key(e) for e in self.taken],
            "skipped": [{"entry": key(e), "reason": why} for e, why in self.skipped],
        }


#: ``accept(entry) -> None`` (take it) or the reason to skip it
Acceptor = Callable[[dict[str, Any]], "str | None"]


class TuningCache:
    """A tuning cache file: read without a lock, merge-write under one.

    `path` defaults to `default_path()` (resolved when the object is made). It may be a
    symlink: reads follow it, writes lock and replace its final target.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_path()

    @property
    def target(self) -> Path:
        """The file writes replace: `path` with its trusted symlinks resolved (may not
        exist). Raises `safefs.UnsafePathError` for a link another user owns."""
        return safefs.resolve(self.path)

    @property
    def lock_path(self) -> Path:
        t = self.target
        return t.with_name(t.name + ".lock")

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        folder = self.target.parent
        folder.mkdir(parents=True, exist_ok=True)
        safefs.warn_world_writable(folder, "tuning cache")
        with safefs.lock(self.lock_path, lock_timeout()):
            yield

    # ---- reading ----------------------------------------------------------------------

    def _read(self) -> CacheData:
        """Parse the file as it is now (empty when absent); raises `CacheFormatError`,
        or `safefs.UnsafePathError` for what is not a regular file of this cache's own."""
        safefs.warn_world_writable(self.path.parent, "tuning cache")
        raw = safefs.read_regular(self.path)
        if raw is None:
            return CacheData()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CacheFormatError(f"{self.path}: not UTF-8 text: {exc}") from exc
        data = parse(text, str(self.path))
        if data.read_only:
            warn_once(self.path, "newer", "tuning cache %s", data.read_only)
        return data

    def load(self) -> CacheData:
        """The file's content. A corrupt or foreign file is set aside (under the lock).

        Raises OSError only when the file exists but cannot be read at all. When a bad
        file cannot be set aside (read-only directory, lock held), it is left alone and
        read as empty, with one warning.
        """
        try:
            return self._read()
        except CacheFormatError as first:
            try:
                with self._lock():
                    try:  # a writer may have replaced it meanwhile: look again under the lock
                        return self._read()
                    except CacheFormatError as exc:
                        self._set_aside(exc)
                        return CacheData()
            except (OSError, TimeoutError) as exc:  # cannot move it: leave it, run without
                warn_once(self.path, "unreadable",
                          "tuning cache %s: %s; cannot set it aside (%s); ignoring it",
                          self.path, first, exc)  # fmt: skip
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
        the file. Raises ValueError for a malformed entry, before touching the file;
        `CacheReadOnlyError` for a file of a newer format version; TimeoutError when the
        lock is not free within `lock_timeout()`; OSError when the file cannot be written.
        """
        new = [dict(e) for e in entries]
        for e in new:
            why = check_entry(e)
            if why is not None:
                raise ValueError(f"tuning cache entry is malformed: {why}: {e!r}")
        with self._lock():
            data = self._read_for_write()
            for e in new:
                data.entries[entry_key(e)] = e
            data.metadata = _merge_metadata(data.metadata, metadata or {})
            self._write(data)
            return len(data.entries)

    def _read_for_write(self) -> CacheData:
        """The file under the lock: a bad one set aside, a newer one refused."""
        try:
            data = self._read()
        except CacheFormatError as exc:
            self._set_aside(exc)
            data = CacheData()
        if data.read_only:
            raise CacheReadOnlyError(data.read_only)
        return data

    def clear(self) -> int:
        """Remove the file; returns how many entries it held (0 if absent or unreadable).

        A file of a newer format version is not removed (`CacheReadOnlyError`)."""
        with self._lock():
            try:
                data = self._read()
            except CacheFormatError as exc:
                log.warning("tuning cache %s was unreadable (%s); removing it", self.path, exc)
                data = CacheData()
            if data.read_only:
                raise CacheReadOnlyError(data.read_only)
            target = self.target
            if safefs.check_regular(target, "tuning cache") is not None:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
            return len(data.entries)

    # ---- travelling -------------------------------------------------------------------

    def export_to(self, path: str | os.PathLike[str], device: str | None = None) -> int:
        """Write this cache's entries (only `device`'s fingerprint if given) to `path`.

        The export is a cache file itself (same format), written atomically (temp file,
        rename; an existing regular file at `path` is replaced). Its folder must exist
        (a typo is not silently made a folder tree), and `path` must not be a symlink or
        anything but a regular file: the export never writes through a link. No lock
        file is left beside it (an export replaces the whole file; the rename alone
        makes it atomic). Errors name `path`. Returns the number of entries exported.
        """
        data = self.load()
        out = CacheData(metadata=dict(data.metadata))
        out.entries = {k: e for k, e in data.entries.items() if device is None or k[0] == device}
        devices = data.metadata.get("devices")
        if device is not None and isinstance(devices, dict):
            out.metadata["devices"] = {d: v for d, v in devices.items() if d == device}
        dest = Path(path).expanduser()
        if not dest.parent.is_dir():
            raise ExportTargetError(errno.ENOENT, "export: the folder does not exist "
                                    "(create it first)", str(dest.parent))  # fmt: skip
        try:
            safefs.check_regular(dest, "export target")
            _replace_file(dest, out)
        except OSError as exc:  # name the destination, not this cache
            raise ExportTargetError(exc.errno, f"export failed: {exc.strerror or exc}",
                                    str(dest)) from exc  # fmt: skip
        return len(out.entries)

    def import_from(
        self,
        path: str | os.PathLike[str],
        accept: Acceptor | None = None,
        *,
        replace: bool = False,
    ) -> ImportReport:
        """Merge the entries of the cache file at `path` into this one.

        Each entry is taken unless it is malformed, `accept` returns a reason to skip
        it (the winner store checks backends and environment), or this cache already
        has an entry with its key (kept, unless ``replace``): importing never loses an
        entry of another key. Raises `CacheFormatError` for a corrupt or foreign file
        (nothing is written), OSError/TimeoutError like `put`.
        """
        src = Path(path).expanduser()
        raw = safefs.read_regular(src)  # never blocks on a FIFO nor opens a device
        if raw is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(src))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CacheFormatError(f"{src}: not UTF-8 text: {exc}") from exc
        incoming = parse(text, str(src))
        report = ImportReport(str(src))
        report.skipped.extend((None, why) for why in incoming.dropped)
        with self._lock():
            data = self._read_for_write()
            for key, e in incoming.entries.items():
                why = accept(e) if accept is not None else None
                if why is None and key in data.entries and not replace:
                    why = "this cache already has an entry for the bucket (kept)"
                if why is not None:
                    report.skipped.append((e, why))
                    continue
                data.entries[key] = e
                report.taken.append(e)
            if report.taken:
                data.metadata = _merge_metadata(data.metadata, _devices_of(incoming, report))
                self._write(data)
        return report

    # ---- the file ---------------------------------------------------------------------

    def _write(self, data: CacheData) -> None:
        """Temp file next to the target, same mode, fsync, os.replace (call under the lock).

        Readers never see half a file; the target of a trusted symlink is replaced, not
        the link; anything but a regular file at the target is refused.
        """
        target = self.target
        safefs.check_regular(target, "tuning cache")
        self._remove_dead_temp_files(target)
        _replace_file(target, data)

    def _remove_dead_temp_files(self, target: Path) -> None:
        """Remove ``.<name>.*.tmp`` files older than our lock: their writer is dead.

        Only the lock holder writes temp files, and we hold the lock, so a temp file
        modified before this call belongs to a writer killed mid-write (SIGKILL, power).
        A one-second margin guards against coarse file-system timestamps.
        """
        now = time.time()
        for tmp in target.parent.glob(f".{glob.escape(target.name)}.*{TMP_SUFFIX}"):
            try:
                st = tmp.lstat()  # only regular files: never a link's target
                if stat.S_ISREG(st.st_mode) and st.st_mtime < now - 1.0:
                    tmp.unlink()
                    log.info("tuning cache %s: removed %s left by a killed writer", target, tmp)
            except OSError as exc:  # gone meanwhile, or not ours to remove: say so, go on
                log.debug("tuning cache %s: cannot remove %s: %r", target, tmp, exc)

    def _set_aside(self, exc: CacheFormatError) -> Path:
        """Move an unreadable file to ``<path>.corrupt-<timestamp>`` (under the lock).

        Only a regular file at `path` itself is moved: behind a symlink the unreadable
        file may be anything (a system file a planted link points to), so it is left
        alone and `safefs.UnsafePathError` raised (the caller runs without the cache).
        """
        if self.path.is_symlink():
            raise safefs.UnsafePathError(
                errno.EPERM, f"{exc}; it is behind a symlink, so it is not set aside or "
                "replaced (point the link at a tuning cache, or remove it)", str(self.path),
            )  # fmt: skip
        safefs.check_regular(self.path, "tuning cache")
        source = Path(os.path.realpath(self.path.parent)) / self.path.name
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = source.with_name(f"{source.name}.corrupt-{stamp}")
        n = 1
        while os.path.lexists(aside):
            aside = source.with_name(f"{source.name}.corrupt-{stamp}.{n}")
            n += 1
        os.replace(source, aside)
        log.warning("tuning cache: %s; moved it aside to %s and starting afresh", exc, aside)
        return aside


def _replace_file(target: Path, data: CacheData) -> None:
    """Write `data` to a temp file beside `target`, keep `target`'s mode (and owner, as
    root), fsync, then ``os.replace`` (which replaces the name, never a link's target)."""
    text = json.dumps(data.to_json(), indent=1, sort_keys=True)
    old = safefs.check_regular(target, "file")
    mode = stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp made it 0600; os.fchmod is POSIX-only
        if old is not None and hasattr(os, "geteuid") and os.geteuid() == 0:
            os.chown(tmp, old.st_uid, old.st_gid)  # root keeps a user's cache theirs
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _devices_of(data: CacheData, report: ImportReport) -> dict[str, Any]:
    """The ``devices`` metadata of the imported entries' fingerprints."""
    devices = data.metadata.get("devices")
    if not isinstance(devices, dict):
        return {}
    wanted = {e["device"] for e in report.taken}
    return {"devices": {d: v for d, v in devices.items() if d in wanted}}


def _umask() -> int:
    """The process umask, read from /proc where possible (setting it is process-wide)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError) as exc:
        log.debug("cannot read the umask from /proc: %r", exc)
    old = os.umask(0o022)
    os.umask(old)
    return old


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


def from_argument(cache: str | os.PathLike[str] | TuningCache | bool | None) -> TuningCache | None:
    """The `Dispatcher` ``cache`` argument as a cache: False = none (memory only), None or
    True = `default_path` (``FP4_DISPATCH_CACHE`` or the user cache dir), else that file."""
    if cache is False:
        return None
    if cache is None or cache is True:
        return TuningCache()
    return cache if isinstance(cache, TuningCache) else TuningCache(cache)
