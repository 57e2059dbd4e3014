"""Ascend NPU backend: ``aclrtMemcpyBatchAsync`` through ctypes, torch_npu streams, events.

What this backend adds to :class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`
(which owns job ids, queues, polling and the flush barrier):

* **Copies.** The copy thread hands each job's :class:`CopyBatch` to
  :meth:`AclRuntime.memcpy_batch <kvoffload_hal.backends.npu._acl.AclRuntime.memcpy_batch>`
  on a dedicated ``torch.npu.Stream`` per direction, passing the raw
  ``aclrtStream`` (``stream.npu_stream``). Batches longer than
  ``max_batch_descriptors`` (``KVOFFLOAD_HAL_NPU_MAX_BATCH_DESCRIPTORS``,
  default 8192) are split into several calls on the same stream; if one
  fails, the stream is synchronized before the job is reported failed, so no
  earlier call is still writing its destination.
* **Fences.** A store must not read a block before the compute already
  enqueued has written it, and a load must not overwrite a block that compute
  enqueued earlier may still read (a block freed and reallocated to a loading
  request; vLLM issue #47282). So :meth:`_prepare` records a fresh
  ``torch.npu.Event`` on ``torch.npu.current_stream()`` in the engine thread
  for every job, and the copy thread makes the copy stream wait on it before
  the batch. Where vLLM says the forward pass is enqueued (``finish_forward``),
  ``forward_done`` records one event then and both copy streams wait on it: the
  step's jobs skip their own (they are submitted after the sampler, which never
  touches the KV cache, so they would wait for it too).
* **Completion.** After the batch the copy thread records an event on the
  copy stream; ``poll`` queries it, ``flush`` synchronizes it.
* **Host memory.** :meth:`allocate_host` returns memory from ``aclrtMallocHost``
  (page-locked). Pageable memory would make the batch call silently
  synchronous, and ``aclrtHostRegister`` only yields a device-side mapping
  that the runtime documents as unusable for memory copies. One call above
  about 200-250 GB fails on Atlas A2, so :meth:`allocate_host_regions` lays
  a large tier out over several calls of at most ``host_chunk_bytes``
  (``KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES``, default 64 GiB), never splitting a
  region (:mod:`~kvoffload_hal.backends.npu._host`).

torch_npu is imported when the backend is constructed, never at module import,
so ``import kvoffload_hal.backends.npu`` works on machines without CANN.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload_hal.backends.npu._acl import PER_COPY, AclRuntime, load_acl_library
from kvoffload_hal.backends.npu._host import (
    DEFAULT_HOST_CHUNK_BYTES,
    HOST_CHUNK_BYTES_ENV,
    HostChunks,
    NpuHostMemory,
)
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.plumbing import env_int, log_once
from kvoffload_hal.hal.regions import BlockRegion, CopyBatch
from kvoffload_hal.hal.threaded import ThreadedCopyBackend
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

#: Environment variable capping the descriptors of one ACL batch call.
MAX_DESCRIPTORS_ENV = "KVOFFLOAD_HAL_NPU_MAX_BATCH_DESCRIPTORS"
# CANN documents no limit on numBatches; HIP's equivalent faults above 8192,
# vLLM chunks at the same number, so it is a conservative default.
DEFAULT_MAX_BATCH_DESCRIPTORS = 8192


def _log_copy_path_once(path: str) -> None:
    if path == PER_COPY:
        log_once(logger, logging.WARNING,
                 "kvoffload_hal npu: this CANN exports no aclrtMemcpyBatchAsync "
                 "(needs 8.3.RC1+ on Atlas A2/A3); falling back to one aclrtMemcpyAsync "
                 "per block run, which is slower")
    else:
        log_once(logger, logging.INFO, "kvoffload_hal npu: block copies use %s", path)


@dataclass(frozen=True)
class _NpuHandle:
    """Completion handle of one launched job: timing events around its ACL calls."""

    start: Any  # torch.npu.Event(enable_timing=True), recorded before the batch
    end: Any  # recorded after the batch: its completion is the job's completion
    acl_calls: int


class NpuCopyBackend(ThreadedCopyBackend):
    """Copies KV blocks between NPU HBM and pinned host memory with ACL batch copies."""

    name = "npu"
    runtime_name = "AscendCL"
    fallback_copy_paths = frozenset({PER_COPY})

    def __init__(self, device=None, max_batch_descriptors: int | None = None,
                 host_chunk_bytes: int | None = None) -> None:
        super().__init__(device)
        importlib.import_module("torch_npu")  # registers torch.npu; needs CANN
        self._npu = torch.npu
        if max_batch_descriptors is None:
            max_batch_descriptors = env_int(MAX_DESCRIPTORS_ENV, DEFAULT_MAX_BATCH_DESCRIPTORS,
                                            minimum=1)
        if host_chunk_bytes is None:
            host_chunk_bytes = env_int(HOST_CHUNK_BYTES_ENV, DEFAULT_HOST_CHUNK_BYTES, minimum=1)
        self._acl = AclRuntime(load_acl_library(), max_batch_descriptors)
        self._host = NpuHostMemory(self._acl, host_chunk_bytes)
        _log_copy_path_once(self._acl.path)
        if self.device is not None and self.device.index is not None:
            self._device_index = self.device.index
        else:
            self._device_index = int(self._npu.current_device())
        self._streams: dict[Direction, Any] = {}
        self._copy_thread_bound = False  # touched by the copy thread only

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """First missing piece of: torch_npu, the ACL library, a visible NPU. No device init."""
        try:
            found = importlib.util.find_spec("torch_npu") is not None
        except (ImportError, ValueError):  # a broken or spec-less torch_npu module
            found = False
        if not found:
            return "torch_npu is not importable"
        try:
            load_acl_library()
        except OSError as e:
            return f"libascendcl.so cannot be loaded: {' '.join(str(e).split())}"
        try:
            importlib.import_module("torch_npu")
            visible = bool(torch.npu.is_available())
        except Exception as e:  # noqa: BLE001 - torch_npu fails in many ways without CANN
            detail = " ".join(str(e).split())
            return f"torch_npu is not importable: {type(e).__name__}: {detail}"
        return None if visible else "no NPU is visible"

    @property
    def copy_path(self) -> str:
        """The ACL symbol block copies go through (batch V2, batch, or per-copy)."""
        return self._acl.path

    @property
    def runtime_version(self) -> str | None:
        """The AscendCL version (``aclrtGetVersion``, "major.minor.patch"), or None."""
        return self._acl.version()

    # ------------------------------------------------------------ host memory
    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """One contiguous ``aclrtMallocHost`` block as a 1-D uint8 tensor.

        One call whatever the size, since separate calls return unrelated
        addresses; :meth:`allocate_host_regions` is the chunked form. The tensor
        does not own the memory; :meth:`free_host` returns it to ACL, after
        which the tensor must not be used.
        """
        return self._host.allocate(num_bytes)

    def free_host(self, tensor: torch.Tensor) -> None:
        self._host.free(tensor)

    def allocate_host_regions(self, device_regions: Sequence[BlockRegion],
                              num_host_blocks: int) -> HostChunks:
        """Host regions mirroring ``device_regions``, ``num_host_blocks`` blocks each, over
        ``aclrtMallocHost`` calls of at most ``host_chunk_bytes``; no region is split.

        Pass ``.regions`` to :meth:`bind`; give the memory back with
        :meth:`free_host_regions` once no job can touch it (after ``shutdown``).
        """
        return self._host.allocate_regions(device_regions, num_host_blocks)

    def free_host_regions(self, tier: HostChunks) -> None:
        """``aclrtFreeHost`` every chunk of ``tier``; its tensors must not be used after."""
        self._host.free_regions(tier)

    @property
    def host_chunk_bytes(self) -> int:
        """The most bytes one ``aclrtMallocHost`` call of :meth:`allocate_host_regions` asks."""
        return self._host.chunk_bytes

    # ------------------------------------------------------------------ hooks
    def _start(self) -> None:
        # No stream priority: torch_npu rejects Stream.priority_range().
        self._streams = {d: self._npu.Stream(device=self._device_index) for d in Direction}

    def _prepare(self, job: TransferJob) -> Any:
        # A fresh event per job: re-recording one shared event could move the
        # fence past work a not-yet-launched store must wait for.
        fence = self._npu.Event()
        fence.record(self._npu.current_stream())
        return fence

    def _fence_copy_streams(self) -> None:
        fence = self._npu.Event()
        fence.record(self._npu.current_stream())
        for stream in self._streams.values():
            stream.wait_event(fence)

    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> _NpuHandle:
        if not self._copy_thread_bound:
            # ACL contexts are per thread: bind this thread to the device once.
            self._npu.set_device(self._device_index)
            self._copy_thread_bound = True
        stream = self._streams[direction]
        if fence is not None:
            stream.wait_event(fence)
        start = self._npu.Event(enable_timing=True)
        start.record(stream)
        # Read npu_stream after the torch_npu calls above: it drains torch_npu's
        # task queue, so the wait and the start event precede the raw ACL calls.
        calls = self._acl.memcpy_batch(batch.dst_ptrs, batch.src_ptrs, batch.sizes,
                                       to_device=direction is Direction.LOAD,
                                       device_id=self._device_index, stream=stream.npu_stream)
        end = self._npu.Event(enable_timing=True)
        end.record(stream)
        return _NpuHandle(start, end, calls)

    def _query(self, handle: _NpuHandle) -> bool:
        return bool(handle.end.query())

    def _synchronize(self, handle: _NpuHandle) -> None:
        handle.end.synchronize()

    def _elapsed_s(self, handle: _NpuHandle, launched_at: float, observed_at: float) -> float:
        try:
            return float(handle.start.elapsed_time(handle.end)) / 1e3
        except Exception:  # noqa: BLE001 - timing is informative only
            return observed_at - launched_at

    def _stop(self) -> None:
        # Copies still queued end first: the caller frees the host memory next.
        # Streams are released with their last reference; host memory is the
        # caller's to free (free_host), since tensors may still point at it.
        for stream in self._streams.values():
            stream.synchronize()
        self._streams = {}
        if len(self._host):
            logger.debug("npu backend stopped with %d host allocation(s) not freed",
                         len(self._host))
