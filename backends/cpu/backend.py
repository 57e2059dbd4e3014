"""The CPU reference backend.

vLLM's CPU platform keeps the "device" KV cache in host memory, so a copy is a
``memmove`` between two host addresses. The backend runs the same job and
completion machinery as the device backends (one copy thread, results through
the queues of :class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`), which is
what lets the whole connector be tested end to end without an accelerator.
Each job is fully copied by the copy thread before it is reported launched, so
the completion handle is simply the measured copy time.

Copies go through the small C extension ``_hostcopy``: one call per batch with
the GIL released (a Python loop of ``ctypes.memmove`` spends as long per 16 KiB
block as the copy itself). The extension can split a large batch across a second
thread, which helps only where a core is idle: inside vLLM's CPU worker every
core runs a compute thread, which keeps spinning for a while after each forward
pass, and a batch split across two threads took about three times as long as on
one (long-document QA: 183 MiB of loads in 36-49 ms against 13-15 ms). So a
backend copies on one thread unless told otherwise (``num_copy_threads=2``, or
``KVOFFLOAD_HAL_CPU_COPY_THREADS=2`` where vLLM's threads leave a core free).
Where the extension was not built (no C compiler), a Python loop is used and
that is logged once.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from typing import Any

import torch

from kvoffload_hal.hal.backend import Direction
from kvoffload_hal.hal.plumbing import env_int, log_once
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.hal.threaded import ThreadedCopyBackend
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

try:
    from kvoffload_hal.backends.cpu import _hostcopy
except ImportError:  # built optionally by setup.py
    _hostcopy = None

COPY_THREADS_ENV_VAR = "KVOFFLOAD_HAL_CPU_COPY_THREADS"


def _copy_batch_python(batch: CopyBatch) -> None:
    # map() keeps the per-descriptor loop in C; only the ctypes call remains.
    deque(map(ctypes.memmove, batch.dst_ptrs.tolist(), batch.src_ptrs.tolist(),
              batch.sizes.tolist()), maxlen=0)


class CpuCopyBackend(ThreadedCopyBackend):
    name = "cpu"
    synchronous_compute = True  # vLLM's CPU forward pass has returned when copies start
    host_memcpy = True

    def __init__(self, device=None, num_copy_threads: int | None = None) -> None:
        super().__init__(device)
        if num_copy_threads is None:
            num_copy_threads = env_int(COPY_THREADS_ENV_VAR, 1, minimum=1, maximum=2)
        if num_copy_threads not in (1, 2):
            raise ValueError(f"num_copy_threads must be 1 or 2, got {num_copy_threads}")
        self.num_copy_threads = num_copy_threads
        if _hostcopy is None:
            log_once(logger, logging.WARNING, "kvoffload_hal: the _hostcopy extension is not "
                     "built; the CPU backend copies with a slower Python loop")

    @property
    def copy_path(self) -> str:
        """How batches are copied: the ``_hostcopy`` C extension, or the Python fallback."""
        return "_hostcopy.copy_batch (C)" if _hostcopy is not None else "ctypes.memmove loop"

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"host allocation must be positive, got {num_bytes} bytes")
        return torch.empty(num_bytes, dtype=torch.uint8)

    def free_host(self, tensor: torch.Tensor) -> None:
        # Plain host memory: dropping the last reference frees it.
        pass

    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> float:
        start = time.perf_counter()
        if _hostcopy is None:
            _copy_batch_python(batch)
        else:
            _hostcopy.copy_batch(batch.dst_ptrs.ctypes.data, batch.src_ptrs.ctypes.data,
                                 batch.sizes.ctypes.data, len(batch), self.num_copy_threads)
        return time.perf_counter() - start

    def _elapsed_s(self, handle: float, launched_at: float, observed_at: float) -> float:
        return handle
