"""Worker side: the job half of a secondary tier, written once for every tier.

:class:`PooledTier` is the tiers' twin of
:class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`: IO runs on a small
thread pool (file and network IO release the GIL), so the engine thread never
waits on a disk or a store; a job is the list of its pool calls, and
:meth:`poll` hands back, once each, the jobs whose calls all ended, with the keys
that failed. A tier only says how to move one batch of items
(:meth:`_store_batch`, :meth:`_load_batch`, and :meth:`_probe_batch` for a shared
tier), each returning the keys that failed, and what to do with keys to forget.

Faults: a batch call that raises fails every key of its batch (they are
recomputed), logged once per kind of error; it never fails the engine step.

Shutdown: writes already submitted (stores and deletions) get ``flush_s`` to
finish, reads and existence queries still queued are cancelled at once. Then the
writes left are dropped: queued ones cancelled, running ones told through
:attr:`closing` (a tier drops a write it has not published yet, never leaves one
half-written), and running calls get a bounded wait: a hung mount or store must
not hang the engine's exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from kvoffload_hal.logger import init_logger, log_once
from kvoffload_hal.tiers.spec import BlockKey, SecondaryTier, TierItem, TierJobResult

logger = init_logger(__name__)

IO_THREADS = 2

Batch = Callable[[list[TierItem]], Iterable[BlockKey]]


class PooledTier(SecondaryTier):
    """A :class:`SecondaryTier` whose IO runs on a thread pool; see the module docstring."""

    label = ""  # how logs name the tier ("disk tier")
    batch_items = 1  # items per pool call: one per file, many per network round trip

    def __init__(self, io_threads: int = IO_THREADS) -> None:
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvoffload-{self.name}")
        self._jobs: dict[int, list[Future]] = {}
        self._writes: set[int] = set()  # ids of store jobs, flushed at shutdown
        self._background: list[Future] = []  # deletions, flushed at shutdown
        self._closing = threading.Event()

    @property
    def closing(self) -> bool:
        """Shutdown gave up waiting for writes: drop a write not published yet."""
        return self._closing.is_set()

    # ------------------------------------------------------------- hooks
    def _store_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        """Pool thread: write each ``(key, CPU block)``; return the keys that failed."""
        raise NotImplementedError

    def _load_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        """Pool thread: read each key into its CPU block, checked; return the keys that failed."""
        raise NotImplementedError

    def _probe_batch(self, items: list[TierItem]) -> Iterable[BlockKey]:
        """Pool thread (shared tiers): return the keys the tier does not hold."""
        raise NotImplementedError(f"the {self.name} tier answers no existence queries")

    def _forget(self, keys: list[BlockKey]) -> None:
        """Engine thread: the scheduler evicted ``keys`` (queue their deletion, if any)."""

    def _close(self, idle: bool) -> None:
        """Engine thread, at shutdown: release what the tier holds. ``idle``: no IO
        runs any more (else only what no running call can still touch)."""

    # ------------------------------------------------------------- the ABC
    def submit_store(self, job_id: int, items: Sequence[TierItem]) -> None:
        self._jobs[job_id] = self._submit(self._store_batch, items)
        self._writes.add(job_id)

    def submit_load(self, job_id: int, items: Sequence[TierItem]) -> None:
        self._jobs[job_id] = self._submit(self._load_batch, items)

    def submit_probe(self, job_id: int, keys: Sequence[BlockKey]) -> None:
        self._jobs[job_id] = self._submit(self._probe_batch, [(k, -1) for k in keys])

    def poll(self) -> list[TierJobResult]:
        results = []
        for job_id in [j for j, fs in self._jobs.items() if all(f.done() for f in fs)]:
            self._writes.discard(job_id)
            failed = tuple(k for f in self._jobs.pop(job_id) for k in f.result())
            results.append(TierJobResult(job_id, failed))
        return results

    def evict(self, keys: Iterable[BlockKey]) -> None:
        keys = list(keys)
        if keys:
            self._forget(keys)

    def shutdown(self, timeout_s: float = 10.0, flush_s: float = 0.0) -> bool:
        """Let submitted writes finish for at most ``flush_s`` (reads and queries still
        queued are cancelled), drop the writes left, then wait at most ``timeout_s``
        for IO in progress. True when no IO still runs (the tier is then closed);
        False when some may still read or write CPU-tier memory."""
        for job_id, futures in self._jobs.items():
            if job_id not in self._writes:
                for f in futures:
                    f.cancel()  # only those not started
        self._flush(flush_s)
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = [f for fs in self._jobs.values() for f in fs] + list(self._background)
        _, not_done = futures_wait(running, timeout=timeout_s)
        if not_done:
            logger.warning("%s: %d IO call(s) still running after %.0f s at shutdown",
                           self.label, len(not_done), timeout_s)
        self._close(idle=not not_done)
        return not not_done

    def _flush(self, flush_s: float) -> None:
        writes = [f for j in self._writes for f in self._jobs.get(j, ())]
        writes += self._background
        if not writes:
            return
        _, unfinished = futures_wait(writes, timeout=flush_s)
        if unfinished:
            logger.warning("%s: %d write call(s) unfinished %.1f s into shutdown "
                           "(shutdown_flush_timeout_s); they are dropped, none is left "
                           "half-written", self.label, len(unfinished), flush_s)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    # ------------------------------------------------------------ helpers
    def _submit(self, call: Batch, items: Sequence[TierItem]) -> list[Future]:
        items = list(items)
        n = self.batch_items
        return [self._pool.submit(self._guarded, call, items[i:i + n])
                for i in range(0, len(items), n)]

    def _in_background(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn`` on the pool, outside any job (deletions)."""
        self._background = [f for f in self._background if not f.done()]
        self._background.append(self._pool.submit(fn, *args))

    def _guarded(self, call: Batch, items: list[TierItem]) -> list[BlockKey]:
        """Run one batch; any exception fails its keys (recomputed), never the step."""
        try:
            return list(call(items))
        except Exception as e:  # noqa: BLE001 - any fault fails the keys, never the step
            log_once(logger, logging.WARNING, "%s: a call failed with %s; its blocks are "
                     "recomputed", self.label, type(e).__name__)
            logger.debug("%s: call failed: %r", self.label, e)
            return [k for k, _ in items]
