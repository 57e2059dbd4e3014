"""A restarted server's disk tier: the blocks its predecessor left, listed at start-up.

When the tier adopts a stopped server's directory (:mod:`.dirs`), its files
are valid blocks for this server (same fingerprint), but the scheduler's index
starts empty. :class:`DirScan` lists the directory on its own thread, started
when the KV caches are registered, so that it runs while vLLM warms the model up:

* every ``<key[:2]>/<key>.kvb`` file is a block; the keys are handed over
  oldest first (by modification time), so that the index, filling in that
  order, evicts the oldest first when the files exceed ``disk_bytes_to_use``;
* temporary files older than the tier's start are writes a killed server left
  half done: they are removed (the tier's own writes in progress are newer);
* a file is not read here: a read checks its header, key, fingerprint and
  checksum, and a damaged one is recomputed like any other failed read.

The worker waits for the listing in vLLM's KV connector handshake, before the
first request, and hands every key found to the scheduler
(:class:`~kvoffload_hal.metadata.OffloadHandshake`); a listing longer than that
wait goes on, its keys taken with :meth:`DirScan.take` each step and reported in
:attr:`~kvoffload_hal.metadata.OffloadWorkerMetadata.tier_found`.
"""

from __future__ import annotations

import os
import threading
import time

from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.spec import BlockKey

logger = init_logger(__name__)

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
REPORT_BATCH = 8192  # keys handed over per step, so one step's metadata stays small


class DirScan:
    """Lists an adopted tier directory on a daemon thread; see the module docstring."""

    def __init__(self, root: str, started_at_ns: int | None = None) -> None:
        self.root = root
        self.started_at_ns = time.time_ns() if started_at_ns is None else started_at_ns
        self._lock = threading.Lock()
        self._found: list[BlockKey] = []
        self._done = False
        self._reported_done = False
        self.removed_temporaries = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-disk-scan",
                                        daemon=True)
        self._thread.start()

    def take(self) -> tuple[list[BlockKey], bool]:
        """Keys found since the last call (oldest first, at most :data:`REPORT_BATCH`),
        and True once, with the last of them, when the scan is over."""
        with self._lock:
            batch, self._found = self._found[:REPORT_BATCH], self._found[REPORT_BATCH:]
            finished = self._done and not self._found and not self._reported_done
            self._reported_done |= finished
        return batch, finished

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            found = self._list()
        except Exception as e:  # noqa: BLE001 - a failed scan finds nothing, never fails
            logger.warning("disk tier: listing %s failed (%s); its blocks are not used",
                           self.root, e)
            found = []
        found.sort()
        seconds = time.perf_counter() - start
        with self._lock:
            self._found.extend(key for _, key in found)
            self._done = True
        logger.info("disk tier: found %d blocks of a stopped server in %s in %.2f s "
                    "(%.0f files/s); %d unfinished writes removed", len(found), self.root,
                    seconds, len(found) / seconds if seconds > 0 else 0.0,
                    self.removed_temporaries)

    def _list(self) -> list[tuple[int, BlockKey]]:
        found = []
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if not entry.is_file(follow_symlinks=False):
                    continue
                name = entry.name
                if name.endswith(BLOCK_SUFFIX):
                    mtime = entry.stat(follow_symlinks=False).st_mtime_ns
                    found.append((mtime, name[:-len(BLOCK_SUFFIX)]))
                elif name.endswith(TEMP_SUFFIX):
                    self._remove_if_left_over(entry)
        return found

    def _remove_if_left_over(self, entry: os.DirEntry) -> None:
        try:
            if entry.stat(follow_symlinks=False).st_mtime_ns < self.started_at_ns:
                os.unlink(entry.path)
                self.removed_temporaries += 1
        except FileNotFoundError:
            pass  # renamed into place meanwhile
