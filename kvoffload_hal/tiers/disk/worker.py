"""Local-disk secondary tier: one checksummed file per block and rank.

Layout: ``<disk_path>/rank<r>.<random>/<key[:2]>/<key>.kvb``, one directory per
worker of each running server (see :mod:`kvoffload_hal.tiers.disk.dirs`). A file is

one block value (:mod:`~kvoffload_hal.tiers.block_value`): header, block key,
then the block's bytes in every host region. A read checks all of it: a missing
or short file, another format, another key (a file copied over another's name),
another fingerprint (another model, dtype, layout or rank) or a wrong checksum
fails that key; the scheduler drops it and vLLM recomputes the block.

Writes go to a temporary file first and are renamed into place, so a reader
sees a whole file or none; the temporary is removed on every error, and short
writes are errors. A write still running when shutdown stops waiting for writes
(``shutdown_flush_timeout_s``) removes its temporary instead of renaming it.

Sharing (``disk_shared``): a read whose key this worker's directory lacks goes
on to the directories of the other engines with the same fingerprint under
``disk_path`` (:mod:`~kvoffload_hal.tiers.disk.peers`), checked the same way, and
the tier answers existence queries (:meth:`_probe_batch`) over all of them. It
still writes and deletes only in its own directory.

Restarts (``keep``, the default retention): a server adopts a stopped server's
directory written with its own fingerprint, and lists its blocks
(:mod:`~kvoffload_hal.tiers.disk.rebuild`) for the scheduler's index before the
first request; other directories of servers that are gone are removed at
start-up. With ``remove``, the tier starts empty and removes its directory at a
clean shutdown.

IO runs on a small thread pool (file IO releases the GIL), so the engine never
waits on the disk; results are polled like copy jobs.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterable, Sequence

import torch

from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.block_value import HEADER, BlockValueFormat
from kvoffload_hal.tiers.disk.dirs import DIR_MODE, FILE_MODE, TierDir
from kvoffload_hal.tiers.disk.failures import FailureLog
from kvoffload_hal.tiers.disk.peers import PeerDirs, is_block_file, open_block
from kvoffload_hal.tiers.disk.rebuild import DirScan
from kvoffload_hal.tiers.identity import FINGERPRINT_BYTES
from kvoffload_hal.tiers.spec import BlockKey, TierItem
from kvoffload_hal.tiers.worker_pool import PooledTier

logger = init_logger(__name__)
FAILURES = FailureLog(logger)

MAGIC = b"KVHALBLK"
FORMAT_VERSION = 2
# O_DIRECT needs buffers, offsets and lengths aligned to the logical block size;
# 4 KiB covers every common device.
DIRECT_IO_ALIGN = 4096


class DiskTier(PooledTier):
    name = "disk"
    label = "disk tier"

    def __init__(self, root: str, rank: int, host_views: Sequence[torch.Tensor],
                 o_direct: bool = False, fingerprint: bytes = bytes(FINGERPRINT_BYTES),
                 keep: bool = False, shared: bool = False) -> None:
        """``host_views``: one uint8 ``[num_cpu_blocks, block_bytes]`` view per host region;
        ``fingerprint``: what the blocks' bytes depend on (:mod:`~kvoffload_hal.tiers.identity`);
        ``keep``: the blocks outlive this server (adopt a predecessor's, keep ours);
        ``shared``: also read the blocks of other engines with this fingerprint."""
        self.views = list(host_views)
        self.payload_bytes = sum(v.shape[1] for v in self.views)
        self.format = BlockValueFormat(MAGIC, FORMAT_VERSION, fingerprint, self.payload_bytes)
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.keep = keep
        # Private, locked while this tier runs: a predecessor's (keep) or a new one.
        self._dir = TierDir(root, rank, fingerprint, adopt=keep)
        self.root = self._dir.path
        self.peers = PeerDirs(root, self.root, fingerprint) if shared else None
        self._scan = DirScan(self.root) if self._dir.adopted else None
        self._scan_over = False
        super().__init__()

    # ------------------------------------------------------- PooledTier hooks
    def _store_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        return [k for k, b in items if self._write(k, b) is not None]

    def _load_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        return [k for k, b in items if self._read(k, b) is not None]

    def _probe_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        """The keys neither this worker's directory nor a peer's holds now."""
        return [k for k, _ in items if not self._holds(k)]

    def submit_probe(self, job_id: int, keys: Sequence[BlockKey]) -> None:
        # One call for the whole query: a lookup of a few stats per key, which must
        # not queue a call per key ahead of the reads.
        self._jobs[job_id] = [self._pool.submit(self._guarded, self._probe_batch,
                                                [(k, -1) for k in keys])]

    def _holds(self, key: BlockKey) -> bool:
        return is_block_file(self._path(key)) or (self.peers is not None
                                                  and self.peers.holds(key))

    def _forget(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self._in_background(_unlink, self._path(key))

    def wait_found(self, timeout_s: float) -> None:
        if self._scan is not None:
            self._scan.join(timeout_s)

    def take_found(self) -> tuple[list[BlockKey], bool]:
        """A new directory has nothing to find: done at once (each rank says done once)."""
        if self._scan is None:
            done, self._scan_over = not self._scan_over, True
            return [], done
        found, done = self._scan.take()
        if done:
            self._scan, self._scan_over = None, True
        return found, done

    def _close(self, idle: bool) -> None:
        # The directory goes only when no IO can still write into it.
        self._dir.close(remove=idle and not self.keep)

    # ------------------------------------------------------------ file IO
    def _path(self, key: BlockKey) -> str:
        return os.path.join(self.root, key[:2], f"{key}.kvb")

    def _write(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        """Returns ``key`` if it failed, None on success (run on the IO pool)."""
        tmp = None
        try:
            if self.closing:
                return key  # shutdown stopped waiting for writes: dropped
            data = self._encode(key, cpu_block)
            path = self._path(key)
            os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
            tmp = f"{path}.{threading.get_ident()}.tmp"
            self._write_file(tmp, data)
            if self.closing:  # dropped whole: never published
                _unlink(tmp)
                return key
            os.replace(tmp, path)
            return None
        except Exception as e:  # noqa: BLE001 - any fault fails the key, never the step
            if tmp is not None:
                _unlink(tmp)  # a partial file must not eat the space left
            return _failed(key, "writing", e)

    def _encode(self, key: BlockKey, cpu_block: int) -> bytes:
        payload = b"".join(v[cpu_block].numpy().tobytes() for v in self.views)
        key_bytes = key.encode("ascii")
        return self.format.header(key_bytes, [payload]) + key_bytes + payload

    def _read(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        """Returns ``key`` if it failed, None when the block is in place (run on the IO pool)."""
        try:
            return self._read_into(key, cpu_block)
        except Exception as e:  # noqa: BLE001 - any fault fails the key, never the step
            return _failed(key, "reading", e)

    def _read_into(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        data = memoryview(self._read_block(key))
        key_len, length = self.format.lengths(data) if len(data) >= HEADER.size else (0, 0)
        stored_key = data[HEADER.size:HEADER.size + key_len]
        payload = data[HEADER.size + key_len:HEADER.size + key_len + length]
        why = self.format.problem(data[:HEADER.size], stored_key, key.encode("ascii"),
                                  [payload])
        if why is not None:
            return self._corrupt(key, why)
        offset = 0
        for view in self.views:
            n = view.shape[1]
            view[cpu_block].copy_(torch.frombuffer(payload[offset:offset + n], dtype=torch.uint8))
            offset += n
        return None

    def _corrupt(self, key: BlockKey, why: str) -> BlockKey:
        logger.warning("disk tier: block %s is unusable (%s); it will be recomputed", key, why)
        return key

    def _write_file(self, path: str, data: bytes) -> None:
        if not self.o_direct:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with open(fd, "wb") as f:
                f.write(data)
            return
        # O_DIRECT bypasses the page cache: write from a page-aligned buffer,
        # padded to the alignment (readers use the header's length).
        size = -(-len(data) // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
        with mmap.mmap(-1, size) as buf:
            buf[:len(data)] = data
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT,
                         FILE_MODE)
            try:
                written = os.write(fd, buf)
            finally:
                os.close(fd)
            if written != size:  # a full disk, a quota: never count a truncated file
                raise OSError(errno.ENOSPC, f"short write: {written} of {size} bytes")

    def _read_block(self, key: BlockKey) -> bytearray:
        """The bytes of ``key``'s file: this worker's own, else (shared) a peer's."""
        flags = os.O_DIRECT if self.o_direct else 0
        try:
            fd = open_block(self.root, key, flags)
        except FileNotFoundError:
            if self.peers is None:
                raise
            fd = self.peers.open(key, flags)
        try:
            return self._read_fd(fd)
        finally:
            os.close(fd)

    def _read_fd(self, fd: int) -> bytearray:
        size = os.fstat(fd).st_size
        if not self.o_direct:
            data = bytearray(size)
            return data[:os.readv(fd, [data])] if size else data
        aligned = max(DIRECT_IO_ALIGN, -(-size // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN)
        with mmap.mmap(-1, aligned) as buf:
            return bytearray(buf[:os.readv(fd, [buf])])


def _failed(key: BlockKey, doing: str, error: Exception) -> BlockKey:
    """A key whose IO failed: recomputed by vLLM. Logged per kind of failure, at once,
    then at most once per window with a count (:mod:`~kvoffload_hal.tiers.disk.failures`)."""
    FAILURES.failed(doing, error)
    logger.debug("disk tier: %s block %s failed: %r", doing, key, error)
    return key


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
