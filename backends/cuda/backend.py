"""The CUDA backend: batched DMA copies through the CUDA driver API (ctypes).

How the :class:`~kvoffload_hal.hal.backend.DmaCopyBackend` contract is met:

* **Host memory**: pageable tensors registered with ``cuMemHostRegister`` in
  chunks of at most ``register_chunk_bytes`` (see ``_host.py`` for why).
* **Streams**: two copy streams (store, load) created with the lowest priority
  and ``CU_STREAM_NON_BLOCKING``, so KV traffic yields to compute and never
  synchronises implicitly with the legacy default stream.
* **Ordering against compute**: ``_prepare`` (engine thread) records an event
  on the compute stream at submission; the copy thread makes the copy stream
  wait on it before the batch. A store therefore never reads a block before
  the compute enqueued before ``submit`` has finished writing it, and a load
  never overwrites a block that compute enqueued earlier may still read (a
  block freed by one request and reallocated to a loading one; the
  write-after-read race of vLLM issue #47282). If the event cannot be
  recorded, ``_prepare`` raises and the job is reported failed, never launched.
  Where vLLM says the forward pass is enqueued (``finish_forward``, vLLM >= 0.33),
  ``forward_done`` records that event then, and both copy streams wait on it: the
  step's jobs, submitted after the sampler was enqueued, wait for the forward
  pass only (the sampler never touches the KV cache), and skip their own event.
* **Copies**: a load (``kernel_directions``: loads by default) of small blocks
  (mean descriptor up to ``kernel_max_bytes``) is one launch of the copy kernel
  (``_kernel.py``); any other job is one
  ``cuMemcpyBatchAsync`` (chunked above ``max_descriptors``), else a
  ``cuMemcpyAsync`` loop (see ``_copy.py``). A driver that cannot load the kernel
  leaves every job to DMA, and says why once in the log.
* **Completion**: an event recorded on the copy stream after the batch;
  ``poll`` queries it without blocking (``CUDA_ERROR_NOT_READY`` = still
  running, any other error fails the job), ``flush`` synchronises on it.

Every driver call goes through :func:`~._driver.load_driver`, so pointing
``KVOFFLOAD_HAL_CUDA_LIBRARY`` (or the ``library_path`` argument) at another
library swaps the whole driver; the CPU test suite does that with a fake.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload_hal.backends.cuda._copy import LOOP_PATH, BatchCopier
from kvoffload_hal.backends.cuda._driver import (
    CU_EVENT_DISABLE_TIMING,
    CU_STREAM_NON_BLOCKING,
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    CudaDriver,
    load_driver,
    probe_library,
)
from kvoffload_hal.backends.cuda._host import REGISTER_CHUNK_BYTES, HostRegistry
from kvoffload_hal.backends.cuda._kernel import (
    KernelCopier,
    Table,
    kernel_directions_setting,
    kernel_max_bytes_setting,
)
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.plumbing import env_int, log_once
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.hal.threaded import ThreadedCopyBackend
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

MAX_DESCRIPTORS_ENV_VAR = "KVOFFLOAD_HAL_CUDA_MAX_DESCRIPTORS"
# Descriptors per cuMemcpyBatchAsync call. CUDA documents no ceiling; ROCm's
# equivalent faults above 8192 (vLLM chunks there too). At 8192 descriptors
# the per-call submission cost (a few us) is already amortised, so chunking
# costs nothing measurable while bounding what one driver call must take in.
MAX_DESCRIPTORS = 8192


@dataclass
class _Pending:
    """Completion handle of one launched job: an event recorded after its copies, and
    the copy kernel's descriptor table, held until then."""

    event: int | None
    table: Table | None = None


class CudaCopyBackend(ThreadedCopyBackend):
    """KV block copies between GPU memory and registered host memory."""

    name = "cuda"
    runtime_name = "CUDA driver"
    fallback_copy_paths = frozenset({LOOP_PATH})

    def __init__(self, device: torch.device | str | None = None, *,
                 library_path: str | None = None, max_descriptors: int | None = None,
                 register_chunk_bytes: int = REGISTER_CHUNK_BYTES,
                 kernel_max_bytes: int | None = None,
                 kernel_directions: str | None = None) -> None:
        super().__init__(device)
        self.max_descriptors = (max_descriptors if max_descriptors is not None
                                else env_int(MAX_DESCRIPTORS_ENV_VAR, MAX_DESCRIPTORS, minimum=1))
        if self.max_descriptors <= 0:
            raise ValueError(f"max_descriptors must be positive, got {self.max_descriptors}")
        self.register_chunk_bytes = register_chunk_bytes
        self.kernel_max_bytes = kernel_max_bytes_setting(kernel_max_bytes)
        self.kernel_directions = kernel_directions_setting(kernel_directions)
        self._library_path = library_path
        self._driver: CudaDriver | None = None
        self._host: HostRegistry | None = None
        self._cu_device = 0
        self._ctx: int | None = None  # retained primary context, released once idle
        self._ordinal = 0
        self._streams: dict[Direction, int] = {}
        self._copier: BatchCopier | None = None
        self._kernel: KernelCopier | None = None
        self._thread_state = threading.local()

    @property
    def copy_path(self) -> str | None:
        """The copy path in use (batch ABI or the loop); None before bind."""
        return self._copier.path if self._copier is not None else None

    @property
    def copy_kernel(self) -> str | None:
        """The copy kernel in use for small blocks, or None (DMA only, or before bind)."""
        return self._kernel.label if self._kernel is not None else None

    @property
    def runtime_version(self) -> str | None:
        """The driver's CUDA version ("12.8", from ``cuDriverGetVersion``); None before the
        driver is loaded (``allocate_host`` or ``bind``) or when the call fails."""
        if self._driver is None:
            return None
        try:
            version = self._driver.driver_version()
        except Exception:  # noqa: BLE001 - informative only
            return None
        return f"{version // 1000}.{version % 1000 // 10}"

    # ------------------------------------------------------------ probing
    @classmethod
    def unavailable_reason(cls) -> str | None:
        # torch.cuda.is_available() asks NVML / the driver without creating a
        # context, and dlopen of libcuda runs no cuInit: both side-effect free.
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return probe_library()

    # ------------------------------------------------ overridable for tests
    def _device_ordinal(self) -> int:
        if self.device is not None and self.device.index is not None:
            return self.device.index
        return torch.cuda.current_device()

    def _compute_stream_handle(self) -> int:
        """Raw ``CUstream`` of the stream the model runs on (0 = legacy default)."""
        return torch.cuda.current_stream(self._ordinal).cuda_stream

    # -------------------------------------------------------- host memory
    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        self._ensure_context()
        assert self._host is not None
        return self._host.allocate(num_bytes)

    def free_host(self, tensor: torch.Tensor) -> None:
        if self._host is None:
            raise ValueError("free_host: no host memory was allocated by this backend")
        self._set_current()
        try:
            self._host.free(tensor)
        finally:
            self._release_context_if_idle()

    # ---------------------------------------------- ThreadedCopyBackend hooks
    def _start(self) -> None:
        driver = self._ensure_context()
        least, greatest = ctypes.c_int(0), ctypes.c_int(0)
        driver.check(driver.cuCtxGetStreamPriorityRange(ctypes.byref(least),
                                                        ctypes.byref(greatest)),
                     "cuCtxGetStreamPriorityRange")
        for direction in Direction:
            stream = ctypes.c_void_p()
            # "least" is the lowest priority (numerically the largest value).
            driver.check(driver.cuStreamCreateWithPriority(ctypes.byref(stream),
                                                           CU_STREAM_NON_BLOCKING, least.value),
                         "cuStreamCreateWithPriority")
            self._streams[direction] = stream.value or 0
        batch_memcpy, why_not = driver.resolve_batch_memcpy()
        self._copier = BatchCopier(driver, batch_memcpy, self.max_descriptors, self._ordinal)
        assert self._host is not None
        self._kernel = KernelCopier.start(driver, self._cu_device, self._host,
                                          self.kernel_max_bytes, self.kernel_directions)
        path = self._copier.path
        # Once per process, not per worker restart.
        if batch_memcpy is None:
            log_once(logger, logging.INFO, "CUDA KV offload copies: %s (%s)", path, why_not)
        else:
            log_once(logger, logging.INFO,
                     "CUDA KV offload copies: %s, up to %d descriptors per call",
                     path, self.max_descriptors)

    def _prepare(self, job: TransferJob) -> Any:
        # An empty job is never launched, so a fence recorded for it would never
        # be waited on and destroyed.
        if job.num_blocks == 0:
            return None
        try:
            self._bind_thread()  # the submitting thread may never have used this GPU
            return self._record_event(self._compute_stream_handle())
        except Exception as e:
            raise RuntimeError(f"could not record the compute fence: {e}") from e

    def _fence_copy_streams(self) -> None:
        driver = self._driver
        assert driver is not None
        self._bind_thread()
        event = self._record_event(self._compute_stream_handle())
        try:
            for stream in self._streams.values():
                driver.check(driver.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
        finally:
            driver.cuEventDestroy_v2(event)  # the waits are enqueued already

    def _launch(self, direction: Direction, batch: CopyBatch, fence: Any) -> _Pending:
        driver, stream = self._driver, self._streams[direction]
        assert driver is not None and self._copier is not None
        self._bind_thread()
        if fence is not None:
            try:
                driver.check(driver.cuStreamWaitEvent(stream, fence, 0), "cuStreamWaitEvent")
            finally:
                # The wait is already enqueued; destroying the event does not cancel it.
                driver.cuEventDestroy_v2(fence)
        if self._kernel is None or not self._kernel.wants(direction, batch):
            self._copier.copy(direction, batch, stream)
            return _Pending(self._record_event(stream))
        table = self._kernel.launch(batch, stream)
        try:
            return _Pending(self._record_event(stream), table)
        except BaseException:
            driver.cuStreamSynchronize(stream)  # the kernel reads the table until it ends
            self._kernel.release(table)
            raise

    def _query(self, handle: _Pending | None) -> bool:
        if handle is None or handle.event is None:
            return True
        driver = self._driver
        assert driver is not None
        code = driver.cuEventQuery(handle.event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._complete(handle)
        driver.check(code, "cuEventQuery")
        return True

    def _synchronize(self, handle: _Pending | None) -> None:
        if handle is None or handle.event is None:
            return
        driver = self._driver
        assert driver is not None
        code = driver.cuEventSynchronize(handle.event)
        self._complete(handle)
        driver.check(code, "cuEventSynchronize")

    def _stop(self) -> None:
        driver = self._driver
        if driver is None:
            return
        self._set_current()
        for stream in self._streams.values():
            # cuStreamDestroy returns before queued copies end: wait for them,
            # since the caller unregisters and frees the host memory next.
            driver.cuStreamSynchronize(stream)
            driver.cuStreamDestroy_v2(stream)
        self._streams.clear()
        if self._kernel is not None:
            self._kernel.close()  # kept: copy_kernel still names it, as copy_path does
        self._release_context_if_idle()

    # ------------------------------------------------------------ helpers
    def _ensure_context(self) -> CudaDriver:
        if self._driver is None:
            driver = load_driver(self._library_path)
            driver.check(driver.cuInit(0), "cuInit")
            self._ordinal = self._device_ordinal()
            cu_device, ctx = ctypes.c_int(0), ctypes.c_void_p()
            driver.check(driver.cuDeviceGet(ctypes.byref(cu_device), self._ordinal), "cuDeviceGet")
            # The primary context is the one the CUDA runtime (and so PyTorch) uses:
            # our streams, events and registrations live in the same context as
            # the KV cache tensors.
            driver.check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), cu_device),
                         "cuDevicePrimaryCtxRetain")
            self._driver, self._cu_device, self._ctx = driver, cu_device.value, ctx.value
            self._host = HostRegistry(driver, self.register_chunk_bytes)
        self._set_current()
        return self._driver

    def _set_current(self) -> None:
        assert self._driver is not None
        self._driver.check(self._driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._thread_state.has_context = True

    def _bind_thread(self) -> None:
        """Driver calls need a current context in each calling thread: set it once per thread."""
        if not getattr(self._thread_state, "has_context", False):
            self._set_current()

    def _release_context_if_idle(self) -> None:
        """Drop our primary-context reference once shut down and no host memory is left."""
        if self._ctx is None or not self._closed or (self._host is not None and len(self._host)):
            return
        assert self._driver is not None
        self._driver.cuDevicePrimaryCtxRelease_v2(self._cu_device)
        self._ctx = None

    def _record_event(self, stream: int) -> int:
        driver = self._driver
        assert driver is not None
        event = ctypes.c_void_p()
        driver.check(driver.cuEventCreate(ctypes.byref(event), CU_EVENT_DISABLE_TIMING),
                     "cuEventCreate")
        code = driver.cuEventRecord(event.value, stream)
        if code != CUDA_SUCCESS:
            driver.cuEventDestroy_v2(event.value)
            driver.check(code, "cuEventRecord")
        return event.value

    def _complete(self, handle: _Pending) -> None:
        """The job's copies ended (or failed): destroy its event, hand its table back."""
        assert self._driver is not None and handle.event is not None
        self._driver.cuEventDestroy_v2(handle.event)
        handle.event = None
        if handle.table is not None and self._kernel is not None:
            self._kernel.release(handle.table)
        handle.table = None
