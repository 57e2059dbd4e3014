"""ctypes bindings to the CUDA driver API (``libcuda``), loaded only on demand.

Contract:

* :func:`load_driver` is the ONE place a CUDA library is opened. The path is,
  in order: its ``path`` argument, the environment variable
  ``KVOFFLOAD_HAL_CUDA_LIBRARY``, ``libcuda.so.1``. Tests point it at a fake
  driver compiled from C; the production code cannot tell the difference.
  Importing this module opens nothing.
* Every binding keeps the driver's real C signature (``CUresult`` return,
  opaque handles as pointers). Names the CUDA headers remap to a versioned
  symbol (``cuStreamDestroy`` -> ``cuStreamDestroy_v2``) are bound under the
  symbol the driver exports, so no header macro is needed.
* The batched copy is resolved at run time through ``cuGetProcAddress`` with an
  explicit ABI version (:meth:`CudaDriver.resolve_batch_memcpy`): CUDA 13 changed
  ``cuMemcpyBatchAsync`` from 9 arguments (with ``failIdx``) to 8 (the ``_v2``
  entry point) while keeping the name, so linking by name alone would call one
  ABI with the other's arguments.
* :meth:`CudaDriver.check` turns a non-success ``CUresult`` into
  :class:`CudaError` naming the function and the error.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BatchMemcpy",
    "CudaDriver",
    "CudaError",
    "LIBRARY_ENV_VAR",
    "load_driver",
    "probe_library",
]

LIBRARY_ENV_VAR = "KVOFFLOAD_HAL_CUDA_LIBRARY"
DEFAULT_LIBRARY = "libcuda.so.1"

# CUresult values (cuda.h) this backend tells apart.
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801

# Flags and enums (cuda.h).
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
# CUmemcpySrcAccessOrder. STREAM: the source is read in stream order, after
# everything enqueued before the copy. ANY: the driver may read the source at
# any time after the call, even before earlier work on the stream finished.
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3

# cuMemcpyBatchAsync ABIs, as (cudaVersion passed to cuGetProcAddress, arity).
# 12.8 introduced the call with a trailing ``size_t *failIdx``; 13.0 dropped it.
CUDA_12_8 = 12080
CUDA_13_0 = 13000
_BATCH_ABIS = ((CUDA_13_0, 8), (CUDA_12_8, 9))  # newest first

_SIZE_MAX = 2**64 - 1  # failIdx value for "not tied to one copy"

_p = ctypes.c_void_p
_CUresult = ctypes.c_int

# Required symbols: exported name -> argument types (restype is CUresult).
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "cuGetErrorName": [_CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [_p],
    "cuCtxGetStreamPriorityRange": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "cuStreamCreateWithPriority": [ctypes.POINTER(_p), ctypes.c_uint, ctypes.c_int],
    "cuStreamDestroy_v2": [_p],
    "cuStreamWaitEvent": [_p, _p, ctypes.c_uint],
    "cuStreamSynchronize": [_p],
    "cuEventCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    "cuEventDestroy_v2": [_p],
    "cuEventRecord": [_p, _p],
    "cuEventQuery": [_p],
    "cuEventSynchronize": [_p],
    "cuMemHostRegister_v2": [_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [_p],
    "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _p],
}

# CUdevice_attribute values the copy kernel needs to be 1.
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

# Optional symbols (the copy kernel): a library without them copies with DMA only.
_KERNEL_SIGNATURES: dict[str, list[Any]] = {
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuModuleLoadData": [ctypes.POINTER(_p), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_p), _p, ctypes.c_char_p],
    "cuModuleUnload": [_p],
    # f, grid x/y/z, block x/y/z, sharedMemBytes, stream, kernelParams, extra
    "cuLaunchKernel": [_p, *[ctypes.c_uint] * 7, _p, ctypes.POINTER(_p), ctypes.POINTER(_p)],
}

# CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
#                              cuuint64_t flags, CUdriverProcAddressQueryResult *status)
_GET_PROC_ADDRESS_ARGS = [ctypes.c_char_p, ctypes.POINTER(_p), ctypes.c_int, ctypes.c_uint64,
                          ctypes.POINTER(ctypes.c_int)]

# dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream
_BATCH_8 = ctypes.CFUNCTYPE(_CUresult, _p, _p, _p, ctypes.c_size_t, _p, _p, ctypes.c_size_t, _p)
_BATCH_9 = ctypes.CFUNCTYPE(_CUresult, _p, _p, _p, ctypes.c_size_t, _p, _p, ctypes.c_size_t,
                            _p, _p)


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaError(RuntimeError):
    """A driver call returned something other than ``CUDA_SUCCESS``."""

    def __init__(self, function: str, code: int, name: str, detail: str = "") -> None:
        self.function, self.code, self.name = function, code, name
        super().__init__(f"{function} failed: {name} ({code}){detail}")


@dataclass(frozen=True)
class BatchMemcpy:
    """A resolved ``cuMemcpyBatchAsync`` entry point and the ABI it was resolved for."""

    cuda_version: int  # CUDA_12_8 (9 args, failIdx) or CUDA_13_0 (8 args)
    fn: Any

    @property
    def symbol(self) -> str:
        return "cuMemcpyBatchAsync_v2" if self.cuda_version >= CUDA_13_0 else "cuMemcpyBatchAsync"

    @property
    def label(self) -> str:
        abi = "13.0" if self.cuda_version >= CUDA_13_0 else "12.8"
        return f"{self.symbol} (CUDA {abi} ABI)"

    def __call__(self, dsts: int, srcs: int, sizes: int, count: int,
                 attrs: CUmemcpyAttributes, attrs_idxs: Any, stream: int) -> tuple[int, int | None]:
        """Launch one batch with one attribute; return ``(CUresult, failIdx or None)``."""
        attrs_ref, idxs_ref = ctypes.byref(attrs), ctypes.cast(attrs_idxs, _p)
        if self.cuda_version >= CUDA_13_0:
            return self.fn(dsts, srcs, sizes, count, attrs_ref, idxs_ref, 1, stream), None
        fail_idx = ctypes.c_size_t(_SIZE_MAX)
        code = self.fn(dsts, srcs, sizes, count, attrs_ref, idxs_ref, 1,
                       ctypes.byref(fail_idx), stream)
        return code, (None if fail_idx.value == _SIZE_MAX else fail_idx.value)


class CudaDriver:
    """The bound driver library. Attribute ``cuX`` is the C function ``cuX``."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib, self.path = lib, path
        missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
        if missing:
            raise RuntimeError(f"{path} does not export {missing[0]}; is it a CUDA driver?")
        self.has_kernel_launch = all(hasattr(lib, name) for name in _KERNEL_SIGNATURES)
        bound = {**_SIGNATURES, **(_KERNEL_SIGNATURES if self.has_kernel_launch else {})}
        for name, argtypes in bound.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _CUresult, argtypes
            setattr(self, name, fn)
        try:  # cuGetProcAddress_v2 exists from CUDA 12.0; older drivers have no batch copy
            self._get_proc_address = lib.cuGetProcAddress_v2
            self._get_proc_address.restype = _CUresult
            self._get_proc_address.argtypes = _GET_PROC_ADDRESS_ARGS
        except AttributeError:
            self._get_proc_address = None

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return "CUDA_ERROR_UNRECOGNIZED"
        return name.value.decode()

    def error(self, function: str, code: int, detail: str = "") -> CudaError:
        return CudaError(function, code, self.error_name(code), detail)

    def check(self, code: int, function: str) -> None:
        if code != CUDA_SUCCESS:
            raise self.error(function, code)

    def driver_version(self) -> int:
        version = ctypes.c_int(0)
        self.check(self.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        return version.value

    def resolve_batch_memcpy(self) -> tuple[BatchMemcpy | None, str]:
        """The newest batch ABI this driver offers, or ``(None, why not)``.

        Only ABIs not newer than the driver are asked for: a CUDA 13 driver
        answers the 13.0 request with the 8-argument ``_v2``; a 12.8/12.9 driver
        answers the 12.8 request with the 9-argument form.
        """
        if self._get_proc_address is None:
            return None, f"{self.path} has no cuGetProcAddress_v2 (driver older than CUDA 12.0)"
        version = self.driver_version()
        for cuda_version, arity in _BATCH_ABIS:
            if cuda_version > version:
                continue
            pfn, status = _p(), ctypes.c_int(0)
            code = self._get_proc_address(b"cuMemcpyBatchAsync", ctypes.byref(pfn), cuda_version,
                                          0, ctypes.byref(status))
            if code == CUDA_SUCCESS and status.value == 0 and pfn.value:
                proto = _BATCH_8 if arity == 8 else _BATCH_9
                return BatchMemcpy(cuda_version, proto(pfn.value)), ""
        return None, f"the driver (version {version}) offers no cuMemcpyBatchAsync (needs 12.8+)"


def _library_path(path: str | None) -> str:
    return path or os.environ.get(LIBRARY_ENV_VAR) or DEFAULT_LIBRARY


def probe_library(path: str | None = None) -> str | None:
    """``None`` if the driver library can be opened, else why not (one line).

    Opening ``libcuda`` does not initialise a device (that is ``cuInit``), so
    this is safe in ``unavailable_reason``.
    """
    resolved = _library_path(path)
    try:
        ctypes.CDLL(resolved)
    except OSError as e:
        return f"{resolved} cannot be loaded: {' '.join(str(e).split())}"
    return None


def load_driver(path: str | None = None) -> CudaDriver:
    """Open and bind the driver library (see the module docstring for the path)."""
    resolved = _library_path(path)
    return CudaDriver(ctypes.CDLL(resolved), resolved)
