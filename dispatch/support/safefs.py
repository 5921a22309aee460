"""Files the library owns: it reads, locks, renames and replaces only its own regular files.

Why: the tuning cache, its lock and the kernel cache may sit in folders other users can
write (a shared cache folder, ``/tmp``), and the library may run as root. A name there
can be a symlink planted to a system file, a device node or a FIFO. So:

- **symlinks** are followed only when trusted (`resolve`): every link of the chain is
  owned by this user or by root, like the kernel's ``fs.protected_symlinks`` rule for
  sticky folders. A link another user owns is refused (`UnsafePathError`).
- **only regular files** are read (`read_regular`: opened non-blocking, so a FIFO never
  hangs, and checked with ``fstat`` after opening, so a swap between check and open
  is caught), renamed or replaced (`check_regular`).
- **the lock file** is opened without following a link and never truncated (`lock`),
  unlike a plain ``open(path, "w")``; it must be a regular file.
- a **world-writable folder** is reported once (`warn_world_writable`).

`UnsafePathError` is a `PermissionError`, so every caller that already handles an
unwritable cache (winner kept in memory, one warning) handles these too.

Standard library only (the cache module must load without torch).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

try:  # POSIX advisory locks; elsewhere `lock` uses the filelock package
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: symlink hops `resolve` follows before giving up (Linux's own limit, ELOOP)
MAX_LINKS = 40
#: seconds between two tries of a held lock (a cache write holds it for milliseconds)
LOCK_POLL_S = 0.05

_warned: set[tuple[str, str]] = set()


class UnsafePathError(PermissionError):
    """A path the library refuses to follow, read, rename or replace (not its own file)."""


def _trusted_owner(uid: int) -> bool:
    """A link made by this user or by root may be followed."""
    return uid in (0, os.geteuid()) if hasattr(os, "geteuid") else True


def resolve(path: Path) -> Path:
    """`path` with its last component's symlink chain followed, each link checked.

    Folders above are resolved by the OS (``realpath``); the file name itself, if a
    link, must be owned by this user or root, and so must each link it points to.
    Raises `UnsafePathError` for a link another user owns or a chain too long.
    """
    current = Path(os.path.realpath(path.parent)) / path.name
    for _ in range(MAX_LINKS):
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return current
        if not stat.S_ISLNK(st.st_mode):
            return current
        if not _trusted_owner(st.st_uid):
            raise UnsafePathError(
                errno.EPERM,
                f"is a symlink owned by another user (uid {st.st_uid}); not following it",
                str(current),
            )
        nxt = Path(os.readlink(current))
        nxt = nxt if nxt.is_absolute() else current.parent / nxt
        current = Path(os.path.realpath(nxt.parent)) / nxt.name
    raise UnsafePathError(errno.ELOOP, "too many levels of symbolic links", str(path))


def check_regular(path: Path, what: str = "file") -> os.stat_result | None:
    """The ``lstat`` of `path` when it is a regular file, None when absent.

    Raises `UnsafePathError` for anything else (a symlink, folder, device, FIFO,
    socket): the library never renames, replaces, truncates or removes those.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(
            errno.EPERM, f"{what} is a {kind_of(st.st_mode)}, not a regular file; "
            "not touching it", str(path),
        )  # fmt: skip
    return st


def kind_of(mode: int) -> str:
    """'folder', 'symlink', 'character device', ... for an ``st_mode``."""
    kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symlink"), (stat.S_ISCHR, "character "
             "device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "regular file"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "special file")


def read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at `path` (a trusted link followed), None if absent.

    Opened with ``O_NONBLOCK`` (a FIFO or device never blocks the open) and checked
    with ``fstat`` before reading: anything but a regular file raises `UnsafePathError`
    without a byte read. A folder raises ``IsADirectoryError``.
    """
    real = resolve(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    if not stat.S_ISREG(st.st_mode):  # never open a device: opening one can act
        raise UnsafePathError(
            errno.EPERM, f"is a {kind_of(st.st_mode)}, not a regular file; not reading it",
            str(path),
        )  # fmt: skip
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between lstat and open
            raise UnsafePathError(errno.EPERM, "is not a regular file; not reading it", str(path))
        return f.read()


def warn_world_writable(directory: Path, what: str) -> None:
    """One warning per folder and process when other users may write into `directory`."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return
    if not mode & stat.S_IWOTH:
        return
    key = (str(directory), what)
    if key in _warned:
        return
    _warned.add(key)
    sticky = " (sticky)" if mode & stat.S_ISVTX else ""
    log.warning("%s folder %s is world-writable%s: other users can plant files there; "
                "only this user's regular files and links are used", what, directory,
                sticky)  # fmt: skip


@contextlib.contextmanager
def lock(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive lock on the regular file `path` (created 0o666 & ~umask if absent).

    POSIX: ``open(O_RDWR | O_CREAT | O_NOFOLLOW)`` - never truncating, never through a
    link - then ``fstat`` (a regular file or `UnsafePathError`) and ``flock``, retried
    every `LOCK_POLL_S` until `timeout` seconds (then ``TimeoutError``). The file is
    left in place: removing it would let two writers lock two different files.
    """
    if fcntl is None:  # pragma: no cover - Windows: no symlink or device attack to guard
        import filelock  # noqa: PLC0415 - only where fcntl is missing

        with filelock.FileLock(str(path), timeout=timeout):
            yield
        return
    check_regular(path, "lock file")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link appeared after the check
            raise UnsafePathError(errno.EPERM, "lock file is a symlink; not using it",
                                  str(path)) from exc  # fmt: skip
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(errno.EPERM, "lock file is not a regular file", str(path))
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the lock {path} is held by another process "
                                       f"(waited {timeout:g} s)") from None  # fmt: skip
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
