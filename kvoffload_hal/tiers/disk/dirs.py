"""Directories of the disk tier: private, locked while in use, never someone else's.

KV reveals the prompts it was computed from, and several servers may be given
the same ``disk_path``, so:

* every directory the tier uses belongs to the serving user and is not a
  symbolic link (checked with ``lstat``), so neither the files nor a removal
  can be redirected elsewhere; directories are 0700 and files 0600;
* each worker writes only into its own directory,
  ``<disk_path>/rank<r>.<random>``, holding the tier's :data:`MARKER` file and
  a :data:`LOCK` file it keeps ``flock``-ed while it runs: two servers never
  share files, whatever their models;
* at start-up, directories left by servers that are gone (the marker present,
  the lock free: the kernel drops it when its process dies) are removed, stray
  temporary files with them; a directory without the marker is never touched;
* a server that keeps its blocks across restarts (``disk_retention: keep``)
  first *adopts* the newest such directory whose :data:`FINGERPRINT` file names
  its own fingerprint (same model, weights, layout, rank, hash seed: the blocks
  are valid for it), and removes the others;
* creating, adopting and removing happen under :data:`SETUP_LOCK`, and a
  directory is locked before that lock is released, so a starting server never
  removes the directory another one is creating, and two servers starting at
  once never adopt the same one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Iterator

from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

MARKER = ".kvoffload-hal-tier"
LOCK = ".kvoffload-hal-lock"
SETUP_LOCK = ".kvoffload-hal-setup.lock"
FINGERPRINT = ".kvoffload-hal-fingerprint"  # hex of what the directory's blocks depend on
DIR_MODE = 0o700
FILE_MODE = 0o600


def check_private_dir(path: str, what: str) -> None:
    """Raise ``ValueError`` unless ``path`` is a real directory owned by this user."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{what}={path!r} is a symbolic link: expected a directory owned by "
                         "this user (point the setting at the link's target instead)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what}={path!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what}={path!r} is owned by uid {st.st_uid}: expected a directory "
                         f"owned by this user (uid {os.geteuid()})")


class TierDir:
    """This worker's own directory under ``disk_path``, locked until :meth:`close`.

    ``adopt_fingerprint``: take over a stopped server's directory written with
    this fingerprint, if there is one (:attr:`adopted`), instead of a new one.
    """

    def __init__(self, disk_path: str, rank: int, fingerprint: bytes = b"",
                 adopt: bool = False) -> None:
        check_private_dir(disk_path, "disk tier directory")
        self.adopted = False
        with _setup_lock(disk_path):
            found = _adoptable(disk_path, fingerprint) if adopt else None
            removed = remove_stale_dirs(disk_path, keep=found)
            if found is None:
                self.path = os.path.join(disk_path, f"rank{rank}.{uuid.uuid4().hex[:12]}")
                os.mkdir(self.path, DIR_MODE)
                _write_private(os.path.join(self.path, FINGERPRINT), fingerprint.hex())
                _touch(os.path.join(self.path, MARKER))
            else:
                self.path, self.adopted = found, True
                _touch(os.path.join(self.path, MARKER))  # adopted now: the newest
            self._lock_fd: int | None = _open_private(os.path.join(self.path, LOCK))
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if removed:
            logger.info("disk tier: removed %d directory(ies) left by stopped servers in %s",
                        removed, disk_path)

    def close(self, remove: bool) -> None:
        """Release the lock; with ``remove``, delete the directory (else a later
        server with the same fingerprint adopts it)."""
        if self._lock_fd is None:
            return
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None


def remove_stale_dirs(disk_path: str, keep: str | None = None) -> int:
    """Remove the tier directories under ``disk_path`` whose owner is gone, but ``keep``."""
    removed = 0
    for entry in os.scandir(disk_path):
        if entry.path != keep and _is_stale(entry):
            shutil.rmtree(entry.path, ignore_errors=True)  # never follows links inside
            removed += 1
    return removed


def _adoptable(disk_path: str, fingerprint: bytes) -> str | None:
    """The newest stopped server's directory whose blocks were written with ``fingerprint``."""
    if not fingerprint:
        return None
    best: tuple[int, str] | None = None
    for entry in os.scandir(disk_path):
        if not _is_stale(entry) or read_private(os.path.join(entry.path, FINGERPRINT)) \
                != fingerprint.hex():
            continue
        mtime = os.stat(os.path.join(entry.path, MARKER), follow_symlinks=False).st_mtime_ns
        if best is None or mtime > best[0]:
            best = (mtime, entry.path)
    return None if best is None else best[1]


def _is_stale(entry: os.DirEntry) -> bool:
    if not entry.is_dir(follow_symlinks=False):
        return False
    if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
        return False
    if not os.path.isfile(os.path.join(entry.path, MARKER)):
        return False  # not ours: never touched
    try:
        fd = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True  # marked, never locked: an older layout or a server killed mid-setup
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False  # a running server holds it
    finally:
        os.close(fd)


@contextlib.contextmanager
def _setup_lock(disk_path: str) -> Iterator[None]:
    fd = _open_private(os.path.join(disk_path, SETUP_LOCK))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_private(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)


def _touch(path: str) -> None:
    os.close(_open_private(path))
    os.utime(path, follow_symlinks=False)  # an adopted directory's marker: its last start


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    with open(fd, "w") as f:
        f.write(text)


def read_private(path: str) -> str | None:
    """A small file the tier wrote, or None (missing, a link, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with open(fd) as f:
        return f.read(256)
