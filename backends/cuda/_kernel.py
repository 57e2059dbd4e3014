"""The copy kernel: one launch moves every descriptor of a batch of small KV blocks.

Why a kernel: ``cuMemcpyBatchAsync`` spends driver time per descriptor, and on an
H100 a batch of 16 KiB blocks moved 4-23 GB/s where one contiguous copy moves 55;
the kernel, its GPU threads reading and writing registered host memory over
unified virtual addressing, moved 50-52 GB/s at every block size from 16 KiB
(``docs/cuda.md``). From 256 KiB on, DMA went as fast in the backend's jobs and
leaves the GPU's cores to the model, so the backend uses the kernel only for
batches whose mean descriptor is at most ``max_bytes`` (default 128 KiB).

And by default for loads only. While it runs, the kernel takes GPU cores from the
model: bf16 matrix products beside a stream of kernel copies ran at 76-85% of their
speed alone, beside DMA at 96-100% (``benchmarks/cuda_beside_compute.py``). A load
gates a request (the request waits for its KV), and DMA loads of small blocks are the
slowest case (8 GB/s at 16 KiB); a store runs beside the model and waits for nothing,
and DMA stores of 16 KiB reach 21 GB/s.

Contract of :meth:`KernelCopier.launch` (copy thread only):

* the descriptor table ``[dsts | srcs | sizes]`` is written to registered host
  memory the kernel reads in place; the caller keeps the returned table until the
  launch's completion event has fired, then hands it back with :meth:`release`
  (a table reused earlier would let a queued kernel read another job's descriptors);
* a launch that fails raises :class:`~._driver.CudaError`; nothing was queued.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload_hal.backends.cuda._driver import (
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
    CUDA_SUCCESS,
    CudaDriver,
)
from kvoffload_hal.backends.cuda._host import HostRegistry
from kvoffload_hal.backends.cuda._kernel_ptx import KERNEL_NAME, PTX
from kvoffload_hal.hal.backend import Direction
from kvoffload_hal.hal.plumbing import env_int, log_once
from kvoffload_hal.hal.regions import CopyBatch
from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

# Launch shape: on an H100, 32 blocks of 512 threads kept 256 KiB of 16-byte loads in
# flight and reached the link's rate; 8 blocks fell to 40 GB/s on loads.
MAX_GRID_BLOCKS = 32
THREADS_PER_BLOCK = 512
# Mean descriptor bytes up to which the kernel is used.
KERNEL_MAX_BYTES_ENV_VAR = "KVOFFLOAD_HAL_CUDA_KERNEL_MAX_BYTES"
KERNEL_MAX_BYTES = 128 << 10
# Which jobs may go by the kernel: loads (the default), all, or off.
KERNEL_DIRECTIONS_ENV_VAR = "KVOFFLOAD_HAL_CUDA_KERNEL_DIRECTIONS"
KERNEL_DIRECTIONS = {"loads": frozenset({Direction.LOAD}), "all": frozenset(Direction),
                     "off": frozenset()}
MIN_TABLE_BYTES = 64 << 10
_WORD = 8  # bytes per descriptor field (uint64)


def kernel_max_bytes_setting(argument: int | None) -> int:
    """The backend's ``kernel_max_bytes``: the argument, else the environment, else the default."""
    if argument is None:
        return env_int(KERNEL_MAX_BYTES_ENV_VAR, KERNEL_MAX_BYTES, minimum=1)
    if argument < 1:
        raise ValueError(f"kernel_max_bytes must be >= 1, got {argument} (kernel_directions='off' "
                         f"turns the kernel off)")
    return argument


def kernel_directions_setting(argument: str | None) -> frozenset[Direction]:
    """The directions the kernel copies: the argument, else the environment, else loads."""
    source = "kernel_directions"
    if argument is None:
        source, argument = KERNEL_DIRECTIONS_ENV_VAR, os.environ.get(KERNEL_DIRECTIONS_ENV_VAR)
    if not argument:
        return KERNEL_DIRECTIONS["loads"]
    if argument not in KERNEL_DIRECTIONS:
        raise ValueError(f"{source}={argument!r}: expected one of "
                         f"{', '.join(KERNEL_DIRECTIONS)}")
    return KERNEL_DIRECTIONS[argument]


def _cannot_address_host_memory(driver: CudaDriver, device: int) -> str:
    """Why the kernel could not use registered host memory at its host address, or "".

    Checked before any launch: a kernel reading an address the GPU cannot map faults,
    and a fault in a kernel ends the whole CUDA context, the model's included.
    """
    if not driver.has_kernel_launch:
        return f"{driver.path} does not export cuModuleLoadData and cuLaunchKernel"
    for attribute, name in ((CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "UNIFIED_ADDRESSING"),
                            (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                             "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM")):
        value = ctypes.c_int(0)
        code = driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device)
        if code != CUDA_SUCCESS or value.value != 1:
            return f"CU_DEVICE_ATTRIBUTE_{name} is not 1 on this GPU"
    return ""


@dataclass(eq=False)
class Table:
    """One registered descriptor table: ``words`` views ``tensor``'s memory."""

    tensor: torch.Tensor
    words: np.ndarray

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()


class TablePool:
    """Registered descriptor tables, reused once their kernel has completed."""

    def __init__(self, host: HostRegistry) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._free: list[Table] = []
        self._all: list[Table] = []

    def acquire(self, num_words: int) -> Table:
        with self._lock:
            fits = [t for t in self._free if t.words.size >= num_words]
            if fits:
                table = min(fits, key=lambda t: t.words.size)
                self._free.remove(table)
                return table
        num_bytes = max(MIN_TABLE_BYTES, 1 << (num_words * _WORD - 1).bit_length())
        tensor = self._host.allocate(num_bytes)
        table = Table(tensor, tensor.numpy().view(np.uint64))
        with self._lock:
            self._all.append(table)
        return table

    def release(self, table: Table) -> None:
        with self._lock:
            if table in self._all:  # not after close()
                self._free.append(table)

    def close(self) -> None:
        """Unregister every table; the caller has waited for every kernel."""
        with self._lock:
            tables, self._all, self._free = self._all, [], []
        for table in tables:
            self._host.free(table.tensor)


class KernelCopier:
    """The loaded copy kernel and its descriptor tables."""

    def __init__(self, driver: CudaDriver, module: int, function: int,
                 host: HostRegistry, max_bytes: int, directions: frozenset[Direction]) -> None:
        self._driver, self._function = driver, function
        self._module: int | None = module
        self.max_bytes, self.directions = max_bytes, directions
        self._tables = TablePool(host)

    @classmethod
    def start(cls, driver: CudaDriver, device: int, host: HostRegistry, max_bytes: int,
              directions: frozenset[Direction]) -> KernelCopier | None:
        """The kernel, or None where it is off or cannot run (logged once)."""
        if not directions:
            return None
        why_not = _cannot_address_host_memory(driver, device)
        kernel = None
        if not why_not:
            kernel, why_not = cls.load(driver, host, max_bytes, directions)
        if kernel is None:
            log_once(logger, logging.WARNING, "CUDA KV offload copy kernel unavailable (%s); "
                     "small blocks are copied by DMA, which is slower", why_not)
        else:
            log_once(logger, logging.INFO, "CUDA KV offload: %s", kernel.label)
        return kernel

    @classmethod
    def load(cls, driver: CudaDriver, host: HostRegistry, max_bytes: int,
             directions: frozenset[Direction]) -> tuple[KernelCopier | None, str]:
        """The kernel compiled for this GPU by the driver, or ``(None, why not)``."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        code = driver.cuModuleLoadData(ctypes.byref(module), PTX.encode())
        if code != CUDA_SUCCESS:
            return None, f"cuModuleLoadData failed: {driver.error_name(code)} ({code})"
        code = driver.cuModuleGetFunction(ctypes.byref(function), module.value,
                                          KERNEL_NAME.encode())
        if code != CUDA_SUCCESS:
            driver.cuModuleUnload(module.value)
            return None, f"cuModuleGetFunction failed: {driver.error_name(code)} ({code})"
        return cls(driver, module.value, function.value, host, max_bytes, directions), ""

    @property
    def label(self) -> str:
        jobs = " and ".join(f"{d.value}s" for d in (Direction.LOAD, Direction.STORE)
                            if d in self.directions)
        return f"copy kernel for {jobs} of descriptors up to {self.max_bytes} B on average"

    def wants(self, direction: Direction, batch: CopyBatch) -> bool:
        """Whether ``batch`` goes by the kernel (see the module docstring)."""
        return (direction in self.directions and len(batch) > 0
                and batch.num_bytes <= self.max_bytes * len(batch))

    def launch(self, batch: CopyBatch, stream: int) -> Table:
        """Queue one kernel for every descriptor of ``batch`` on ``stream``."""
        count = len(batch)
        table = self._tables.acquire(3 * count)
        words = table.words
        words[:count] = batch.dst_ptrs
        words[count:2 * count] = batch.src_ptrs
        words[2 * count:3 * count] = batch.sizes
        table_ptr, num = ctypes.c_uint64(table.ptr), ctypes.c_uint64(count)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(table_ptr), ctypes.addressof(num))
        grid = min(count, MAX_GRID_BLOCKS)
        code = self._driver.cuLaunchKernel(self._function, grid, 1, 1, THREADS_PER_BLOCK, 1, 1,
                                           0, stream, params, None)
        if code != CUDA_SUCCESS:
            self._tables.release(table)
            raise self._driver.error("cuLaunchKernel", code, f" ({count} descriptors)")
        return table

    def release(self, table: Table) -> None:
        self._tables.release(table)

    def close(self) -> None:
        """Free the tables and unload the module; every launch has completed."""
        self._tables.close()
        if self._module is not None:
            self._driver.cuModuleUnload(self._module)
            self._module = None
