"""A shared disk tier (``disk_shared``): the directories of the other engines it reads.

Every engine still writes only into its own directory (:mod:`.dirs`), and deletes
only files there; with ``disk_shared`` it also *reads* the block files of the
other tier directories under the same ``disk_path`` whose :data:`~.dirs.FINGERPRINT`
file names its own fingerprint (the data-parallel ranks of one server, other
servers of the same model, weights and layout: their bytes for a key are the
ones this engine would compute). Nothing a peer does can make a read wrong:

* a peer writes a block to a temporary name and renames it into place, so a
  file is whole or absent; a file the peer deletes (its eviction) or replaces
  after it was opened stays readable through the open descriptor;
* every read checks the block value's header, key, fingerprint, length and
  CRC (:mod:`~kvoffload_hal.tiers.block_value`): a truncated or damaged file is
  refused, and that block recomputed; it is never deleted (it is the peer's);
* the file is opened under the peer's directory one component at a time with
  ``O_NOFOLLOW`` (no symbolic link is followed anywhere below ``disk_path``),
  non-blocking (a FIFO never hangs a read), and used only if it is a regular
  file owned by this user.

The directories are listed again at most every :data:`RESCAN_S` seconds (a
listing is one ``scandir`` of ``disk_path``); a directory that vanished since
only makes its reads miss.
"""

from __future__ import annotations

import os
import stat
import threading
import time

from kvoffload_hal.tiers.disk.dirs import FINGERPRINT, MARKER, read_private

BLOCK_SUFFIX = ".kvb"
# How stale the list of peer directories may be: an engine that started since is
# read after at most this long (its blocks are missed until then).
RESCAN_S = 1.0


def open_block(root: str, key: str, flags: int = 0) -> int:
    """A read-only descriptor of ``root/<key[:2]>/<key>.kvb``, following no symbolic
    link at any step (``root`` included); ``OSError`` when it is absent or not a
    regular file of this user's."""
    nofollow = os.O_RDONLY | os.O_NOFOLLOW
    top = os.open(root, nofollow | os.O_DIRECTORY)
    try:
        sub = os.open(key[:2], nofollow | os.O_DIRECTORY, dir_fd=top)
        try:
            fd = os.open(f"{key}{BLOCK_SUFFIX}", nofollow | os.O_NONBLOCK | flags, dir_fd=sub)
        finally:
            os.close(sub)
    finally:
        os.close(top)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(f"{key}{BLOCK_SUFFIX} is not a regular file of this user's")
    return fd


def is_block_file(path: str) -> bool:
    """Whether ``path`` is a regular file now (a symbolic link is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class PeerDirs:
    """The other tier directories under ``disk_path`` written with ``fingerprint``."""

    def __init__(self, disk_path: str, own: str, fingerprint: bytes) -> None:
        self.disk_path = disk_path
        self.own = own
        self.fingerprint_hex = fingerprint.hex()
        self._lock = threading.Lock()
        self._paths: tuple[str, ...] = ()
        self._listed_at = float("-inf")

    def paths(self) -> tuple[str, ...]:
        """The peers' directories, listed again when the list is older than
        :data:`RESCAN_S` (by whichever IO thread asks first)."""
        # The first listing is waited for; a later one is made by the thread that
        # asks first, the others using the list it replaces.
        never = self._listed_at == float("-inf")
        if self._stale() and self._lock.acquire(blocking=never):
            try:
                if self._stale():  # not listed by another thread meanwhile
                    self._paths = tuple(self._list())
                    self._listed_at = time.monotonic()
            finally:
                self._lock.release()
        return self._paths

    def _stale(self) -> bool:
        return time.monotonic() - self._listed_at > RESCAN_S

    def holds(self, key: str) -> bool:
        """Whether some peer's directory holds a file for ``key`` now."""
        name = os.path.join(key[:2], f"{key}{BLOCK_SUFFIX}")
        return any(is_block_file(os.path.join(path, name)) for path in self.paths())

    def open(self, key: str, flags: int = 0) -> int:
        """A descriptor of the first peer file found for ``key``;
        ``FileNotFoundError`` when no peer holds it."""
        for path in self.paths():
            try:
                return open_block(path, key, flags)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"no engine sharing the disk tier holds block {key}")

    def _list(self) -> list[str]:
        found = []
        uid = os.geteuid()
        for entry in os.scandir(self.disk_path):
            try:
                if entry.path == self.own or not entry.is_dir(follow_symlinks=False) \
                        or entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if not os.path.isfile(os.path.join(entry.path, MARKER)):
                    continue  # not a tier directory: never read
            except OSError:
                continue  # removed meanwhile
            if read_private(os.path.join(entry.path, FINGERPRINT)) == self.fingerprint_hex:
                found.append(entry.path)
        return found
