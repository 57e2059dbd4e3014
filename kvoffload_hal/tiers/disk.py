"""Local-disk secondary tier: one checksummed file per block and rank.

Layout: ``<disk_path>/rank<r>/<key[:2]>/<key>.kvb``. A file is a 24-byte header
(magic, format version, CRC-32 of the payload, payload length) followed by the
block's bytes in every host region, in region order. Writes go to a temporary
file first and are renamed into place, so a reader sees a whole file or none.
A read that finds no file, a short file, a wrong header or a wrong checksum
fails that key: the scheduler drops it and vLLM recomputes the block.

Restarts: the tier starts empty. Its rank directory is emptied at start-up, since
the index of what it holds lives in the scheduler's memory only; only a directory
the tier created is emptied, and directories and files are private to the serving
user (see :mod:`kvoffload_hal.tiers.dirs`).

IO runs on a small thread pool (file IO releases the GIL), so the engine never
waits on the disk; results are polled like copy jobs.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch

from kvoffload_hal.hal.plumbing import log_once
from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.base import BlockKey, SecondaryTier, TierItem, TierJobResult
from kvoffload_hal.tiers.dirs import DIR_MODE, FILE_MODE, claim_tier_dir

logger = init_logger(__name__)

MAGIC = b"KVHALBLK"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, crc32, payload bytes
# O_DIRECT needs buffers, offsets and lengths aligned to the logical block size;
# 4 KiB covers every common device.
DIRECT_IO_ALIGN = 4096
IO_THREADS = 2


class DiskTier(SecondaryTier):
    name = "disk"

    def __init__(self, root: str, rank: int, host_views: Sequence[torch.Tensor],
                 o_direct: bool = False) -> None:
        """``host_views``: one uint8 ``[num_cpu_blocks, block_bytes]`` view per host region."""
        self.root = os.path.join(root, f"rank{rank}")
        self.views = list(host_views)
        self.payload_bytes = sum(v.shape[1] for v in self.views)
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        claim_tier_dir(self.root)  # start empty: see the module docstring and tiers/dirs.py
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvoffload-disk")
        self._jobs: dict[int, list[Future]] = {}

    # ------------------------------------------------------------- the ABC
    def submit_store(self, job_id: int, items: Sequence[TierItem]) -> None:
        self._jobs[job_id] = [self._pool.submit(self._write, k, b) for k, b in items]

    def submit_load(self, job_id: int, items: Sequence[TierItem]) -> None:
        self._jobs[job_id] = [self._pool.submit(self._read, k, b) for k, b in items]

    def poll(self) -> list[TierJobResult]:
        results = []
        for job_id in [j for j, fs in self._jobs.items() if all(f.done() for f in fs)]:
            failed = tuple(k for f in self._jobs.pop(job_id) if (k := f.result()) is not None)
            results.append(TierJobResult(job_id, failed))
        return results

    def evict(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._pool.submit(_unlink, self._path(key))

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Cancel queued IO and wait at most ``timeout_s`` for IO in progress: a
        hung mount must not hang the engine's exit. True when no IO still runs."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = [f for fs in self._jobs.values() for f in fs]
        _, not_done = futures_wait(running, timeout=timeout_s)
        if not_done:
            logger.warning("disk tier: %d block IO(s) still running after %.0f s at shutdown",
                           len(not_done), timeout_s)
            return False
        return True

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    # ------------------------------------------------------------ file IO
    def _path(self, key: BlockKey) -> str:
        return os.path.join(self.root, key[:2], f"{key}.kvb")

    def _write(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        """Returns ``key`` if it failed, None on success (run on the IO pool)."""
        try:
            payload = b"".join(v[cpu_block].numpy().tobytes() for v in self.views)
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, zlib.crc32(payload), len(payload))
            path = self._path(key)
            os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            self._write_file(tmp, header + payload)
            os.replace(tmp, path)
            return None
        except Exception as e:  # noqa: BLE001 - any fault fails the key, never the step
            return _failed(key, "writing", e)

    def _read(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        """Returns ``key`` if it failed, None when the block is in place (run on the IO pool)."""
        try:
            return self._read_into(key, cpu_block)
        except Exception as e:  # noqa: BLE001 - any fault fails the key, never the step
            return _failed(key, "reading", e)

    def _read_into(self, key: BlockKey, cpu_block: int) -> BlockKey | None:
        data = self._read_file(self._path(key))
        if len(data) < _HEADER.size:
            return self._corrupt(key, "shorter than its header")
        magic, version, crc, length = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size:_HEADER.size + length]
        if magic != MAGIC or version != FORMAT_VERSION:
            return self._corrupt(key, "unknown header")
        if length != self.payload_bytes or len(payload) != length:
            return self._corrupt(
                key, f"{len(payload)} payload bytes, expected {self.payload_bytes}")
        if zlib.crc32(payload) != crc:
            return self._corrupt(key, "checksum mismatch")
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
                os.write(fd, buf)
            finally:
                os.close(fd)

    def _read_file(self, path: str) -> bytearray:
        if not self.o_direct:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                return data[:f.readinto(data)]
        size = os.stat(path).st_size
        aligned = max(DIRECT_IO_ALIGN, -(-size // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN)
        with mmap.mmap(-1, aligned) as buf:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                n = os.readv(fd, [buf])
            finally:
                os.close(fd)
            return bytearray(buf[:n])


def _failed(key: BlockKey, doing: str, error: Exception) -> BlockKey:
    """A key whose IO failed: recomputed by vLLM. Logged once per kind of failure."""
    log_once(logger, logging.WARNING, "disk tier: %s a block failed with %s; such blocks "
             "are recomputed", doing, type(error).__name__)
    logger.debug("disk tier: %s block %s failed: %r", doing, key, error)
    return key


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
