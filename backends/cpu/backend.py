"""The CPU reference backend.

vLLM's CPU platform keeps the "device" KV cache in host memory, so a copy is a
``memmove`` between two host addresses. The backend runs the same job and
completion machinery as the device backends (one copy thread, results through
the queues of :class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`), which is
what lets the whole connector be tested end to end without an accelerator.
Each job is fully copied by the copy thread before it is reported launched, so
the completion handle is simply the measured copy time.

One thread does not saturate host memory: below glibc's non-temporal threshold
each ``memmove`` runs at about half the speed of one large copy, and a second
core roughly doubles it. Large batches are therefore split by bytes between the
copy thread and one helper thread (``ctypes.memmove`` releases the GIL during
the copy). The helper only ever runs inside a ``_launch`` call, so the job
semantics of the copy thread are unchanged.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from kvoffload_hal.hal.backend import Direction
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.hal.threaded import ThreadedCopyBackend

_memmove = ctypes.memmove  # a CFUNCTYPE: the GIL is released during the copy

# Below this a batch is copied by the copy thread alone: the hand-off to the
# helper (a queue put and an event wait, some tens of microseconds) costs more
# than the second core saves (measured with benchmarks/copy_bench.py).
PARALLEL_MIN_BYTES = 1 << 20


def _copy_all(dst_ptrs: list[int], src_ptrs: list[int], sizes: list[int]) -> None:
    # map() keeps the per-descriptor loop in C; only the ctypes call remains.
    deque(map(_memmove, dst_ptrs, src_ptrs, sizes), maxlen=0)


class _HelperTask:
    __slots__ = ("args", "done", "error")

    def __init__(self, args: tuple[list[int], list[int], list[int]]) -> None:
        self.args = args
        self.done = threading.Event()
        self.error: BaseException | None = None


class _CopyHelper:
    """A second copying thread, fed one slice of a batch at a time by the copy thread."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start_copy(self, dst_ptrs: list[int], src_ptrs: list[int], sizes: list[int]) -> _HelperTask:
        task = _HelperTask((dst_ptrs, src_ptrs, sizes))
        self._tasks.put(task)
        return task

    def stop(self) -> None:
        self._tasks.put(None)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                _copy_all(*task.args)
            except BaseException as e:  # noqa: BLE001 - re-raised on the copy thread
                task.error = e
            task.done.set()


class CpuCopyBackend(ThreadedCopyBackend):
    name = "cpu"

    def __init__(self, device=None, num_copy_threads: int | None = None) -> None:
        super().__init__(device)
        if num_copy_threads is None:
            num_copy_threads = 2 if (os.cpu_count() or 1) >= 2 else 1
        if num_copy_threads not in (1, 2):
            raise ValueError(f"num_copy_threads must be 1 or 2, got {num_copy_threads}")
        self.num_copy_threads = num_copy_threads
        self._helper: _CopyHelper | None = None

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"host allocation must be positive, got {num_bytes} bytes")
        return torch.empty(num_bytes, dtype=torch.uint8)

    def free_host(self, tensor: torch.Tensor) -> None:
        # Plain host memory: dropping the last reference frees it.
        pass

    def _start(self) -> None:
        if self.num_copy_threads > 1:
            self._helper = _CopyHelper(f"kvoffload-{self.name}-helper")

    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> float:
        start = time.perf_counter()
        dst, src, sizes = batch.dst_ptrs.tolist(), batch.src_ptrs.tolist(), batch.sizes.tolist()
        if self._helper is None or len(sizes) < 2 or batch.num_bytes < PARALLEL_MIN_BYTES:
            _copy_all(dst, src, sizes)
            return time.perf_counter() - start
        # Split by bytes, not by count: merged runs make descriptor sizes uneven.
        cut = int(np.searchsorted(np.cumsum(batch.sizes), batch.num_bytes // 2))
        cut = min(max(cut, 1), len(sizes) - 1)
        task = self._helper.start_copy(dst[cut:], src[cut:], sizes[cut:])
        try:
            _copy_all(dst[:cut], src[:cut], sizes[:cut])
        finally:
            # Never return while the helper still writes into the job's blocks.
            task.done.wait()
        if task.error is not None:
            raise task.error
        return time.perf_counter() - start

    def _elapsed_s(self, handle: float, launched_at: float, observed_at: float) -> float:
        return handle

    def _stop(self) -> None:
        if self._helper is not None:
            self._helper.stop()
            self._helper = None
