"""ctypes bindings to the few AscendCL (``libascendcl.so``) calls the NPU backend needs.

Nothing here imports torch_npu or touches a device at import time; the library
is opened only by :func:`load_acl_library`, the one place that decides which
file is loaded (``KVOFFLOAD_HAL_ACL_LIBRARY`` points it elsewhere, e.g. at the
fake runtime the unit tests compile).

Calls bound (signatures from the CANN runtime API reference):

* ``aclrtMemcpyBatchAsyncV2(dsts, destMaxs, srcs, sizes, numBatches, attrs,
  attrsIndexes, numAttrs, stream)`` (CANN 9.1+),
* ``aclrtMemcpyBatchAsync(...same..., size_t *failIndex, stream)`` (CANN 8.3.RC1+,
  Atlas A2/A3),
* ``aclrtMemcpyAsync(dst, destMax, src, count, kind, stream)``, the per-copy
  fallback for older runtimes,
* ``aclrtMallocHost(void **hostPtr, size_t size)`` / ``aclrtFreeHost(void *)``,
* ``aclrtSynchronizeStream(stream)``, to drain the stream after a failed call.

Contract of :meth:`AclRuntime.memcpy_batch`: enqueue every descriptor on the
raw ``aclrtStream`` and return without waiting (given pinned host memory);
raise :class:`AclError` on the first failed call, naming the descriptor index
when the runtime reports one, after waiting for the calls already enqueued, so
a failed job has no copy still writing its destination (chunking and that wait
are :func:`~kvoffload_hal.hal.plumbing.enqueue_in_chunks`). Copies within one
call are unordered, exactly as the runtime documents for a batch.

A batch call answering ``ACL_ERROR_RT_FEATURE_NOT_SUPPORT`` is not a failure:
every CANN >= 8.3 exports the batch symbols, but chips without batch copy
reject the call with that code. The runtime then switches for good to the
``aclrtMemcpyAsync`` loop (logged once, counted in :attr:`AclRuntime.fallbacks`)
and copies the rejected descriptors with it, so the job still succeeds.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np

from kvoffload_hal.hal.plumbing import enqueue_in_chunks, log_once
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

#: Environment variable naming the ACL runtime library to load (tests point it at a fake).
ACL_LIBRARY_ENV = "KVOFFLOAD_HAL_ACL_LIBRARY"
DEFAULT_ACL_LIBRARY = "libascendcl.so"

# aclrtMemLocationType (acl_rt.h): HOST=0, DEVICE=1. HOST is supported from CANN 8.1.RC1.
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
# aclrtMemcpyKind for the per-copy fallback.
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_SUCCESS = 0
# ACL_ERROR_RT_FEATURE_NOT_SUPPORT: what aclrtMemcpyBatchAsync(V2) returns on chips the
# CANN docs list as unsupported (Atlas training 910, Atlas inference 310P, Atlas 200I/500 A2),
# although the symbols are exported on every CANN >= 8.3.
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
# ACL_ERROR_RT_MEMORY_ALLOCATION (rt_error_codes.h): what aclrtMallocHost answers when it
# cannot pin the memory asked for, e.g. one call above about 200-250 GB on Atlas A2 (910B)
# (LMCache-Ascend issue #242), although the host has the memory free.
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
# failIndex is SIZE_MAX when the error is not tied to one descriptor.
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1

BATCH_V2 = "aclrtMemcpyBatchAsyncV2"
BATCH_V1 = "aclrtMemcpyBatchAsync"
PER_COPY = "aclrtMemcpyAsync"


class AclError(RuntimeError):
    """An ACL call returned a non-zero ``aclError`` (``code``, where one call is to blame)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class AclMemLocation(ctypes.Structure):
    """``aclrtMemLocation``: ``id`` FIRST, then ``type`` (the reverse of CUDA's CUmemLocation)."""

    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class AclMemcpyBatchAttr(ctypes.Structure):
    """``aclrtMemcpyBatchAttr``: ``dstLoc`` FIRST, then ``srcLoc``, then 16 reserved zero bytes."""

    _fields_ = [
        ("dstLoc", AclMemLocation),
        ("srcLoc", AclMemLocation),
        ("rsv", ctypes.c_uint8 * 16),
    ]


# A wrong layout would make the runtime read garbage locations: fail at import instead.
assert ctypes.sizeof(AclMemcpyBatchAttr) == 32, ctypes.sizeof(AclMemcpyBatchAttr)

_P = ctypes.c_void_p
_PSIZE = ctypes.POINTER(ctypes.c_size_t)
_PATTR = ctypes.POINTER(AclMemcpyBatchAttr)
_BATCH_COMMON = [_P, _PSIZE, _P, _PSIZE, ctypes.c_size_t, _PATTR, _PSIZE, ctypes.c_size_t]


def load_acl_library() -> ctypes.CDLL:
    """Open the ACL runtime: ``$KVOFFLOAD_HAL_ACL_LIBRARY`` or ``libascendcl.so``.

    Raises ``OSError`` when the library cannot be loaded. Loading it does not
    initialise a device (only ``aclInit``/``aclrtSetDevice`` would).
    """
    return ctypes.CDLL(os.environ.get(ACL_LIBRARY_ENV) or DEFAULT_ACL_LIBRARY)


def _has(lib: ctypes.CDLL, symbol: str) -> bool:
    try:
        getattr(lib, symbol)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class _Pointers:
    """numpy views kept alive for the duration of one ACL call."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray


class AclRuntime:
    """The bound ACL calls and the batch path chosen for this runtime.

    Batch symbol order: ``aclrtMemcpyBatchAsyncV2`` first, then the 10-argument
    ``aclrtMemcpyBatchAsync``, then a loop of ``aclrtMemcpyAsync``. V2 goes first
    because CANN 9.1 routes its own C++ overloads through it, while the
    10-argument form is documented as a trial feature that may change; its
    only extra, ``failIndex``, reports attribute and direction validation
    errors, and with one attribute and one direction per call built here those
    cannot point at a particular copy. Where V2 is missing (CANN 8.3-9.0) the
    10-argument form is used and its ``failIndex`` is put in the error message.
    """

    def __init__(self, lib: ctypes.CDLL, max_batch_descriptors: int = 8192) -> None:
        if max_batch_descriptors <= 0:
            raise ValueError("max_batch_descriptors must be positive, "
                             f"got {max_batch_descriptors}")
        self.lib = lib
        self.max_batch_descriptors = max_batch_descriptors
        if _has(lib, BATCH_V2):
            self.path = BATCH_V2
            self._batch = lib.aclrtMemcpyBatchAsyncV2
            self._batch.argtypes = [*_BATCH_COMMON, _P]
        elif _has(lib, BATCH_V1):
            self.path = BATCH_V1
            self._batch = lib.aclrtMemcpyBatchAsync
            self._batch.argtypes = [*_BATCH_COMMON, _PSIZE, _P]
        else:
            self.path = PER_COPY
            self._batch = None
        if self._batch is not None:
            self._batch.restype = ctypes.c_int
        #: Switches from a batch symbol to the per-copy loop (0 or 1): the chip said
        #: ACL_ERROR_RT_FEATURE_NOT_SUPPORT. ``path`` is PER_COPY afterwards.
        self.fallbacks = 0
        self._copy = lib.aclrtMemcpyAsync
        self._copy.argtypes = [_P, ctypes.c_size_t, _P, ctypes.c_size_t, ctypes.c_int, _P]
        self._copy.restype = ctypes.c_int
        self._malloc_host = lib.aclrtMallocHost
        self._malloc_host.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self._malloc_host.restype = ctypes.c_int
        self._free_host = lib.aclrtFreeHost
        self._free_host.argtypes = [_P]
        self._free_host.restype = ctypes.c_int
        self._synchronize_stream = lib.aclrtSynchronizeStream
        self._synchronize_stream.argtypes = [_P]
        self._synchronize_stream.restype = ctypes.c_int

    def version(self) -> str | None:
        """``aclrtGetVersion`` as "major.minor.patch"; None when the runtime does not
        export it or the call fails (informative only, never needed for copies)."""
        if not _has(self.lib, "aclrtGetVersion"):
            return None
        get_version = self.lib.aclrtGetVersion
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int32)] * 3
        get_version.restype = ctypes.c_int
        parts = [ctypes.c_int32(0) for _ in range(3)]
        if get_version(*(ctypes.byref(p) for p in parts)) != ACL_SUCCESS:
            return None
        return ".".join(str(p.value) for p in parts)

    # ------------------------------------------------------------ host memory
    def malloc_host(self, num_bytes: int) -> int:
        """Pinned host memory (64-byte aligned) of ``num_bytes``; returns its address."""
        ptr = ctypes.c_void_p()
        ret = self._malloc_host(ctypes.byref(ptr), num_bytes)
        if ret != ACL_SUCCESS:
            raise AclError(f"aclrtMallocHost({num_bytes} bytes) failed with aclError {ret}",
                           ret)
        if not ptr.value:
            raise AclError(f"aclrtMallocHost({num_bytes} bytes) returned success but no pointer")
        return ptr.value

    def free_host(self, ptr: int) -> None:
        ret = self._free_host(ptr)
        if ret != ACL_SUCCESS:
            raise AclError(f"aclrtFreeHost(0x{ptr:x}) failed with aclError {ret}")

    # ----------------------------------------------------------------- copies
    def memcpy_batch(self, dst_ptrs: np.ndarray, src_ptrs: np.ndarray, sizes: np.ndarray,
                     to_device: bool, device_id: int, stream: int) -> int:
        """Enqueue ``sizes[k]`` bytes ``src_ptrs[k] -> dst_ptrs[k]`` on ``stream``.

        Returns the ACL copy calls made. ``to_device`` is the single direction
        of the whole call (host->device when true); the runtime rejects batches
        that mix directions.
        """
        dsts = np.ascontiguousarray(dst_ptrs, dtype=np.uint64)
        srcs = np.ascontiguousarray(src_ptrs, dtype=np.uint64)
        lens = np.ascontiguousarray(sizes, dtype=np.uint64)
        if not (dsts.size == srcs.size == lens.size):
            raise ValueError("descriptor arrays differ in length: "
                             f"{dsts.size}, {srcs.size}, {lens.size}")
        attr = self._attr(to_device, device_id)

        def enqueue(start: int, stop: int) -> int:
            """Descriptors ``[start, stop)``; returns the ACL copy calls made."""
            # _batch is re-read per chunk: a call answering "not supported" clears it.
            if self._batch is not None and self._batch_call(
                    _Pointers(dsts[start:stop], srcs[start:stop], lens[start:stop]),
                    attr, start, stream):
                return 1
            return self._copy_each(dsts, srcs, lens, start, stop, to_device, stream)

        return enqueue_in_chunks(lens.size, self.max_batch_descriptors, enqueue,
                                 lambda: self.synchronize_stream(stream))

    def synchronize_stream(self, stream: int) -> None:
        """Block until every task enqueued on the raw ``stream`` has finished."""
        ret = self._synchronize_stream(stream)
        if ret != ACL_SUCCESS:
            raise AclError(f"aclrtSynchronizeStream failed with aclError {ret}")

    @staticmethod
    def _attr(to_device: bool, device_id: int) -> AclMemcpyBatchAttr:
        device = AclMemLocation(device_id, ACL_MEM_LOCATION_TYPE_DEVICE)
        host = AclMemLocation(0, ACL_MEM_LOCATION_TYPE_HOST)
        attr = AclMemcpyBatchAttr()  # ctypes zero-fills rsv, which the runtime requires
        attr.dstLoc, attr.srcLoc = (device, host) if to_device else (host, device)
        return attr

    def _batch_call(self, p: _Pointers, attr: AclMemcpyBatchAttr, first: int,
                    stream: int) -> bool:
        """One batch call; False when the chip has no batch copy and the loop must do it."""
        count = p.sizes.size
        size_p = p.sizes.ctypes.data_as(_PSIZE)
        # One attribute covering every copy: attrsIndexes = [0], numAttrs = 1.
        # destMaxs = sizes: each destination block is exactly as large as its copy.
        attrs_index = (ctypes.c_size_t * 1)(0)
        args = [p.dsts.ctypes.data, size_p, p.srcs.ctypes.data, size_p, count,
                ctypes.byref(attr), attrs_index, 1]
        if self.path == BATCH_V2:
            ret = self._batch(*args, stream)
            if ret == ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
                return self._switch_to_per_copy()
            if ret != ACL_SUCCESS:
                raise AclError(f"{BATCH_V2} of {count} copies (from descriptor {first}) "
                               f"failed with aclError {ret}")
            return True
        fail_index = ctypes.c_size_t(SIZE_MAX)
        ret = self._batch(*args, ctypes.byref(fail_index), stream)
        if ret == ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
            return self._switch_to_per_copy()
        if ret != ACL_SUCCESS:
            where = ("not tied to one copy" if fail_index.value == SIZE_MAX
                     else f"failIndex {first + fail_index.value}")
            raise AclError(f"{BATCH_V1} of {count} copies failed with aclError {ret} ({where})")
        return True

    def _switch_to_per_copy(self) -> bool:
        """The chip rejected the batch call as unsupported: use the loop from now on."""
        log_once(logger, logging.WARNING,
                 "kvoffload_hal npu: %s answered ACL_ERROR_RT_FEATURE_NOT_SUPPORT (%d): this "
                 "chip has no batch copy (CANN lists Atlas training 910, Atlas inference 310P, "
                 "Atlas 200I/500 A2); copying with one %s per block run from now on",
                 self.path, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, PER_COPY)
        self.path, self._batch = PER_COPY, None
        self.fallbacks += 1
        return False

    def _copy_each(self, dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray, start: int,
                   stop: int, to_device: bool, stream: int) -> int:
        """One ``aclrtMemcpyAsync`` per descriptor of ``[start, stop)``."""
        kind = ACL_MEMCPY_HOST_TO_DEVICE if to_device else ACL_MEMCPY_DEVICE_TO_HOST
        for k, (dst, src, n) in enumerate(zip(dsts[start:stop].tolist(),
                                              srcs[start:stop].tolist(),
                                              lens[start:stop].tolist()), start):
            ret = self._copy(dst, n, src, n, kind, stream)
            if ret != ACL_SUCCESS:
                raise AclError(f"{PER_COPY} of descriptor {k} ({n} bytes) "
                               f"failed with aclError {ret}")
        return stop - start
