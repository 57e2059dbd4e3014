"""The CPU reference backend.

vLLM's CPU platform keeps the "device" KV cache in host memory, so a copy is a
``memmove`` between two host addresses. The backend runs the same job and
completion machinery as the device backends (one copy thread, results through
the queues of :class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`), which is
what lets the whole connector be tested end to end without an accelerator.
Each job is fully copied by the copy thread before it is reported launched, so
the completion handle is simply the measured copy time.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from kvoffload_hal.hal.backend import Direction
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.hal.threaded import ThreadedCopyBackend

_memmove = ctypes.memmove  # a CFUNCTYPE: the GIL is released during the copy


class CpuCopyBackend(ThreadedCopyBackend):
    name = "cpu"

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"host allocation must be positive, got {num_bytes} bytes")
        return torch.empty(num_bytes, dtype=torch.uint8)

    def free_host(self, tensor: torch.Tensor) -> None:
        # Plain host memory: dropping the last reference frees it.
        pass

    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> float:
        start = time.perf_counter()
        for dst, src, size in zip(batch.dst_ptrs.tolist(), batch.src_ptrs.tolist(),
                                  batch.sizes.tolist()):
            _memmove(dst, src, size)
        return time.perf_counter() - start

    def _elapsed_s(self, handle: float, launched_at: float, observed_at: float) -> float:
        return handle
