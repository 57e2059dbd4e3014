"""Completion tracking shared by every backend: one copy thread, two queues.

:class:`ThreadedCopyBackend` implements the job half of
:class:`~kvoffload_hal.hal.backend.DmaCopyBackend` once, so a vendor backend only
says how to launch one batch of descriptors and how to ask whether it is done.

Threads and what they own:

* the **engine thread** calls ``submit``/``poll``/``flush``/``shutdown``; it alone
  owns the id high-water marks, the list of launched jobs and the pending count;
* the **copy thread** builds descriptors and launches jobs in submission order
  (hiding the per-call submission cost behind compute, as a device stream would);
  it owns nothing but the vendor stream it launches on.

They share nothing but two ``queue.SimpleQueue``: ``submit -> copy thread``
(jobs, each with the region pairs bound at its submission, and flush barriers)
and ``copy thread -> engine`` (launched jobs with their completion handles),
plus one ``threading.Event`` set when a shutdown gives up waiting, after which
the copy thread launches nothing more (the caller may free the memory as soon as
``shutdown`` returns). No list is mutated from two threads.
A flush puts a barrier behind every queued job and waits for the copy thread to
reach it, so jobs still queued and not yet launched are waited for as well as
launched ones. With nothing pending it returns at once: waking the copy thread
costs a context switch, and on vLLM's CPU platform every core runs compute.

A job's errors never escape ``submit``: once a job passes the checks of
``submit`` (bound, not shut down, a new id), it counts as submitted (its id is
taken and ``num_pending`` grows) and every later failure is its result. If
``_prepare`` raises, the job is queued with the error instead of a fence and the
copy thread reports it failed, in submission order, without launching it; if
building its descriptors or ``_launch`` raises, likewise. ``poll`` and ``flush``
report such a job once, with ``ok=False`` and the exception in ``error``.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, JobResult, TransferJob
from kvoffload_hal.hal.regions import BlockRegion, CopyBatch, build_copy_batch
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

# A flush longer than this means the copy thread is wedged (a DMA that never
# returns); failing loudly beats hanging the engine forever.
FLUSH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class _Launch:
    job: TransferJob
    fence: Any  # from _prepare(), e.g. an event recorded on the compute stream
    regions: tuple  # (device, host) regions bound when the job was submitted
    error: str | None = None  # _prepare() raised: report this, launch nothing


@dataclass(frozen=True)
class _Barrier:
    reached: threading.Event


_STOP = object()


def _check_same_layout(old: Sequence[BlockRegion], new: Sequence[BlockRegion]) -> None:
    """A rebind moves regions; their count and block geometry must stay."""
    def layout(regions):
        return [(r.num_blocks, r.block_bytes, r.block_stride_bytes) for r in regions]

    if layout(new) != layout(old):
        raise ValueError(f"rebind(): the regions' layout changed ({len(new)} regions vs "
                         f"{len(old)}); only their addresses may")


def _error_text(e: BaseException) -> str:
    """The ``JobResult.error`` of a job failed by ``e``."""
    return f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class _Launched:
    job: TransferJob
    handle: Any
    error: str | None
    launched_at: float
    num_bytes: int


class ThreadedCopyBackend(DmaCopyBackend):
    """A DmaCopyBackend whose jobs are launched by one background copy thread.

    Subclasses implement :meth:`_launch` (copy thread), :meth:`_query` and
    :meth:`_synchronize` (engine thread) and the host-memory methods.
    """

    def __init__(self, device=None) -> None:
        super().__init__(device)
        self._submit_q: queue.SimpleQueue = queue.SimpleQueue()
        self._done_q: queue.SimpleQueue = queue.SimpleQueue()
        # Engine-thread state only.
        self._last_job_id = {Direction.STORE: -1, Direction.LOAD: -1}
        self._launched: deque[_Launched] = deque()
        self._num_pending = 0
        self._regions: tuple[tuple[BlockRegion, ...], tuple[BlockRegion, ...]] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # forward_done() ordered the copy streams after the step's forward pass.
        self._fenced_at_forward_end = False
        # Set by a shutdown that timed out: queued jobs are failed, not launched.
        self._abandoned = threading.Event()

    # ----------------------------------------------------------------- hooks
    def _start(self) -> None:
        """Engine thread, once in :meth:`bind`: create streams and the like."""

    def _prepare(self, job: TransferJob) -> Any:
        """Engine thread, per job: return a fence the copy must wait for.

        May raise: the job then still counts as submitted and is reported failed.
        """
        return None

    @abstractmethod
    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> Any:
        """Copy thread: start ``batch``; return a handle for :meth:`_query`. Raise on failure."""

    def _fence_copy_streams(self) -> None:
        """Engine thread: make every copy stream wait for the compute enqueued so far.

        Once it returned, :meth:`_prepare` is skipped until :meth:`step_done`.
        Raise NotImplementedError where jobs can only fence one by one."""
        raise NotImplementedError

    def _query(self, handle: Any) -> bool:
        """Engine thread, non-blocking: has the launched batch finished? Raise if it failed."""
        return True

    def _synchronize(self, handle: Any) -> None:
        """Engine thread: block until the launched batch finished. Raise if it failed."""

    def _elapsed_s(self, handle: Any, launched_at: float, observed_at: float) -> float:
        """Seconds the copy took; by default launch to observed completion."""
        return observed_at - launched_at

    def _stop(self) -> None:
        """Engine thread, once at shutdown after the copy thread ended."""

    # ------------------------------------------------------------------ API
    def bind(self, device_regions: Sequence[BlockRegion],
             host_regions: Sequence[BlockRegion]) -> None:
        if self._regions is not None:
            raise RuntimeError(f"{type(self).__name__} is already bound")
        if len(device_regions) != len(host_regions):
            raise ValueError(f"{len(device_regions)} device regions vs "
                             f"{len(host_regions)} host regions")
        self._regions = (tuple(device_regions), tuple(host_regions))
        self._start()
        self._thread = threading.Thread(
            target=self._copy_loop, name=f"kvoffload-{self.name or 'copy'}", daemon=True
        )
        self._thread.start()

    def rebind(self, device_regions: Sequence[BlockRegion]) -> None:
        if self._regions is None or self._num_pending:
            why = ("before bind()" if self._regions is None
                   else f"with {self._num_pending} job(s) pending: flush() first")
            raise RuntimeError(f"{type(self).__name__}.rebind() {why}")
        _check_same_layout(self._regions[0], device_regions)
        self._regions = (tuple(device_regions), self._regions[1])

    def forward_done(self) -> None:
        if self._regions is None or self._closed:
            return
        try:
            self._fence_copy_streams()
            self._fenced_at_forward_end = True
        except NotImplementedError:
            pass
        except Exception as e:  # noqa: BLE001 - each job then records its own fence
            logger.warning("%s: no fence at the forward pass's end (%s); the step's jobs "
                           "fence at their submission", type(self).__name__, e)

    def step_done(self) -> None:
        self._fenced_at_forward_end = False

    def submit(self, job: TransferJob) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is shut down")
        if self._regions is None:
            raise RuntimeError(f"{type(self).__name__}.bind() must be called before submit()")
        if job.job_id <= self._last_job_id[job.direction]:
            logger.debug("ignoring re-submission of %s job %d", job.direction.value, job.job_id)
            return
        try:
            fence = None if self._fenced_at_forward_end else self._prepare(job)
            launch = _Launch(job, fence, self._regions)
        except Exception as e:  # noqa: BLE001 - reported as a failed job, not raised
            logger.error("%s job %d failed to prepare: %s", job.direction.value, job.job_id, e)
            launch = _Launch(job, None, self._regions, _error_text(e))
        self._last_job_id[job.direction] = job.job_id
        self._num_pending += 1
        self._submit_q.put(launch)

    def poll(self) -> list[JobResult]:
        self._drain_done_queue()
        results: list[JobResult] = []
        still_running: deque[_Launched] = deque()
        for entry in self._launched:
            if entry.error is not None:
                results.append(self._result(entry, error=entry.error))
                continue
            try:
                finished = self._query(entry.handle)
            except Exception as e:  # noqa: BLE001 - any runtime error fails the job
                results.append(self._result(entry, error=_error_text(e)))
                continue
            if finished:
                results.append(self._result(entry))
            else:
                still_running.append(entry)
        self._launched = still_running
        self._num_pending -= len(results)
        return results

    def flush(self) -> list[JobResult]:
        if not self._num_pending:  # nothing queued or launched: let the copy thread sleep
            return []
        # After shutdown the copy thread stops at its stop marker and would
        # never reach a barrier queued behind it: fail what is still queued.
        if not self._closed and self._thread is not None and self._thread.is_alive():
            barrier = _Barrier(threading.Event())
            self._submit_q.put(barrier)
            if not barrier.reached.wait(FLUSH_TIMEOUT_S):
                raise RuntimeError(f"{type(self).__name__}: copy thread did not reach the "
                                   f"flush barrier within {FLUSH_TIMEOUT_S:.0f} s")
        else:
            self._fail_unlaunched("copy thread is not running" if not self._closed
                                  else "backend shut down before launch")
        self._drain_done_queue()
        results = []
        for entry in self._launched:
            error = entry.error
            if error is None:
                try:
                    self._synchronize(entry.handle)
                except Exception as e:  # noqa: BLE001
                    error = _error_text(e)
            results.append(self._result(entry, error=error))
        self._launched.clear()
        self._num_pending -= len(results)
        return results

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        if self._closed:
            return not self._abandoned.is_set()
        self._closed = True
        if self._thread is not None:
            self._submit_q.put(_STOP)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._abandoned.set()
                logger.warning(
                    "%s: copy thread still busy after %.1f s; abandoning %d pending job(s)",
                    type(self).__name__, timeout_s, self._num_pending,
                )
                return False  # the daemon thread may still use device state: leave it alone
        self._stop()
        return True

    @property
    def num_pending(self) -> int:
        return self._num_pending

    # ------------------------------------------------------------- internals
    def _copy_loop(self) -> None:
        while True:
            item = self._submit_q.get()
            if item is _STOP:
                return
            if isinstance(item, _Barrier):
                item.reached.set()
                continue
            job = item.job
            launched_at = time.perf_counter()
            if item.error is not None or self._abandoned.is_set():
                error = item.error or "backend shut down before launch"
                self._done_q.put(_Launched(job, None, error, launched_at, 0))
                continue
            device_regions, host_regions = item.regions
            try:
                if job.direction is Direction.STORE:
                    batch = build_copy_batch(device_regions, host_regions,
                                             job.src_block_ids, job.dst_block_ids)
                else:
                    batch = build_copy_batch(host_regions, device_regions,
                                             job.src_block_ids, job.dst_block_ids)
                handle = self._launch(job.direction, batch, item.fence) if len(batch) else None
            except Exception as e:  # noqa: BLE001 - reported as a failed job
                logger.error("%s job %d failed to launch: %s", job.direction.value, job.job_id, e)
                self._done_q.put(_Launched(job, None, _error_text(e), launched_at, 0))
                continue
            self._done_q.put(_Launched(job, handle, None, launched_at, batch.num_bytes))

    def _drain_done_queue(self) -> None:
        while True:
            try:
                self._launched.append(self._done_q.get_nowait())
            except queue.Empty:
                return

    def _fail_unlaunched(self, reason: str) -> None:
        while True:
            try:
                item = self._submit_q.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Launch):
                error = item.error or reason
                self._done_q.put(_Launched(item.job, None, error, time.perf_counter(), 0))
            elif item is _STOP:
                # A copy thread still busy in a launch must still find its stop marker.
                self._submit_q.put(_STOP)
                return

    def _result(self, entry: _Launched, error: str | None = None) -> JobResult:
        now = time.perf_counter()
        seconds = (0.0 if entry.handle is None
                   else self._elapsed_s(entry.handle, entry.launched_at, now))
        return JobResult(
            job_id=entry.job.job_id,
            direction=entry.job.direction,
            ok=error is None,
            num_blocks=entry.job.num_blocks,
            num_bytes=entry.num_bytes if error is None else 0,
            seconds=seconds,
            tag=entry.job.tag,
            error=error,
        )
