"""Enqueue one :class:`~kvoffload_hal.hal.regions.CopyBatch` on a CUDA stream.

Contract of :meth:`BatchCopier.copy` (called from the copy thread only):

* one ``cuMemcpyBatchAsync`` per ``max_descriptors`` descriptors (one call for a
  normal job), each with ONE attribute covering every copy, since a batch never
  mixes directions;
* when the driver has no batch entry point, or a batch call answers
  ``CUDA_ERROR_NOT_SUPPORTED``, a loop of ``cuMemcpyAsync`` on the same stream;
  the switch is permanent for this copier and logged once;
* any other non-success result raises :class:`~._driver.CudaError` (with the
  job-level index of the offending descriptor when the driver names one) after
  waiting for the chunks already enqueued, so a failed job has no copy still
  writing its destination (chunking and that wait are
  :func:`~kvoffload_hal.hal.plumbing.enqueue_in_chunks`).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvoffload_hal.backends.cuda._driver import (
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_MEM_LOCATION_TYPE_HOST,
    CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_SUCCESS,
    BatchMemcpy,
    CudaDriver,
    CUmemcpyAttributes,
)
from kvoffload_hal.hal.backend import Direction
from kvoffload_hal.hal.plumbing import enqueue_in_chunks
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

LOOP_PATH = "cuMemcpyAsync loop"

# Source access order per direction.
# STORE (device -> host) reads device blocks the model may still be writing;
# the copy stream waits on a compute event first, and STREAM makes the DMA honour
# that wait. ANY would let the engine prefetch the source as soon as the call
# returns, i.e. possibly read KV before compute finished (vLLM PR #39306).
# LOAD (host -> device) reads registered host memory that no stream writes while
# the job is pending, so ANY is safe and lets the DMA start earliest.
SRC_ACCESS_ORDER = {
    Direction.STORE: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    Direction.LOAD: CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
}

assert ctypes.sizeof(ctypes.c_size_t) == 8, "descriptor arrays are passed as uint64"


def make_attributes(direction: Direction, device_ordinal: int) -> CUmemcpyAttributes:
    """The one attribute of every batch in ``direction``.

    Location hints only matter for pageable or managed memory, but naming the
    real locations costs nothing and keeps a misconfigured buffer well-defined.
    """
    device = (CU_MEM_LOCATION_TYPE_DEVICE, device_ordinal)
    host = (CU_MEM_LOCATION_TYPE_HOST, 0)
    src, dst = (device, host) if direction is Direction.STORE else (host, device)
    attrs = CUmemcpyAttributes()
    attrs.srcAccessOrder = SRC_ACCESS_ORDER[direction]
    attrs.srcLocHint.type, attrs.srcLocHint.id = src
    attrs.dstLocHint.type, attrs.dstLocHint.id = dst
    attrs.flags = 0
    return attrs


class BatchCopier:
    """Turns a CopyBatch into batched (or, as a fallback, looped) driver copies."""

    def __init__(self, driver: CudaDriver, batch_memcpy: BatchMemcpy | None,
                 max_descriptors: int, device_ordinal: int) -> None:
        if max_descriptors <= 0:
            raise ValueError(f"max_descriptors must be positive, got {max_descriptors}")
        self._driver = driver
        self._batch = batch_memcpy
        self.max_descriptors = max_descriptors
        self._attrs = {d: make_attributes(d, device_ordinal) for d in Direction}
        # attrsIdxs has numAttrs (= 1) entries: attribute 0 covers copies [0, count).
        self._attrs_idxs = (ctypes.c_size_t * 1)(0)

    @property
    def path(self) -> str:
        return self._batch.label if self._batch is not None else LOOP_PATH

    def copy(self, direction: Direction, batch: CopyBatch, stream: int) -> int:
        """Enqueue every descriptor of ``batch`` on ``stream``; return the driver calls made."""
        dsts = np.ascontiguousarray(batch.dst_ptrs, dtype=np.uint64)
        srcs = np.ascontiguousarray(batch.src_ptrs, dtype=np.uint64)
        sizes = np.ascontiguousarray(batch.sizes, dtype=np.uint64)

        def enqueue(start: int, end: int) -> int:
            """Descriptors ``[start, end)``; returns the driver copy calls made."""
            if self._batch is not None and self._copy_batched(direction, dsts, srcs, sizes,
                                                              start, end, stream):
                return 1
            self._copy_looped(dsts, srcs, sizes, start, end, stream)
            return end - start

        # On failure the stream is drained; its result is ignored, since the
        # copy error is the one to report.
        return enqueue_in_chunks(sizes.size, self.max_descriptors, enqueue,
                                 lambda: self._driver.cuStreamSynchronize(stream))

    def _copy_batched(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
                      sizes: np.ndarray, start: int, end: int, stream: int) -> bool:
        """One batch call for descriptors ``[start, end)``; False if the loop must do it."""
        assert self._batch is not None
        offset = start * 8  # bytes per uint64 descriptor field
        code, fail_idx = self._batch(dsts.ctypes.data + offset, srcs.ctypes.data + offset,
                                     sizes.ctypes.data + offset, end - start,
                                     self._attrs[direction], self._attrs_idxs, stream)
        if code == CUDA_SUCCESS:
            return True
        # When does "not supported" reach this line? cuda.h (12.8 and 13.0, checked by
        # test_cuda_header_abi.py) documents only SUCCESS, DEINITIALIZED, NOT_INITIALIZED
        # and INVALID_VALUE for cuMemcpyBatchAsync, plus errors of earlier asynchronous
        # work. A driver without batch copy (older than 12.8) does not get here:
        # cuGetProcAddress_v2 answers CUDA_ERROR_NOT_FOUND with SYMBOL_NOT_FOUND or
        # VERSION_NOT_SUFFICIENT, resolve_batch_memcpy returns None and the loop is used
        # from the start. So on NVIDIA's own drivers this branch is not expected to run;
        # it stays for libraries that export the entry point but refuse the call with 801
        # (shims and re-implementations of libcuda, as HIP does for its batch call), where
        # failing every job would offload nothing.
        if code == CUDA_ERROR_NOT_SUPPORTED:
            logger.warning("%s answered CUDA_ERROR_NOT_SUPPORTED; copying with a %s from now on",
                           self._batch.label, LOOP_PATH)
            self._batch = None
            return False
        detail = ""
        if fail_idx is not None:
            detail = f" at descriptor {start + fail_idx} of {sizes.size}"
        raise self._driver.error(self._batch.symbol, code, detail)

    def _copy_looped(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     start: int, end: int, stream: int) -> None:
        memcpy = self._driver.cuMemcpyAsync
        for k, (dst, src, size) in enumerate(zip(dsts[start:end].tolist(),
                                                 srcs[start:end].tolist(),
                                                 sizes[start:end].tolist()), start):
            code = memcpy(dst, src, size, stream)
            if code != CUDA_SUCCESS:
                raise self._driver.error("cuMemcpyAsync", code,
                                         f" at descriptor {k} of {sizes.size}")
