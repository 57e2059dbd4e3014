"""Test-side helpers for the fake CUDA driver (fake_cuda.c); fixtures are in conftest.py.

The backend under test runs its real ctypes code against the fake; the tests
read what the fake saw through its ``fake_*`` functions. "Device" KV tensors are
CPU tensors: the fake copies with memmove, so every byte can be checked.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvoffload_hal.backends.cuda import CudaCopyBackend
from support.backend_rig import BackendRig

FAKE_SOURCE = Path(__file__).with_name("fake_cuda.c")

# Build variant -> extra gcc flags (see the header of fake_cuda.c).
VARIANTS = {
    "cuda12_8": [],
    "cuda13": ["-DFAKE_CUDA_VERSION=13000"],
    "no_batch": ["-DFAKE_NO_BATCH"],
    "no_proc_address": ["-DFAKE_NO_PROC_ADDRESS"],
}

SIZE_MAX = 2**64 - 1
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801


class BatchRecord(ctypes.Structure):
    _fields_ = [
        ("num_args", ctypes.c_int), ("result", ctypes.c_int), ("count", ctypes.c_size_t),
        ("num_attrs", ctypes.c_size_t), ("attrs_idx0", ctypes.c_size_t),
        ("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint), ("stream", ctypes.c_void_p),
    ]


class RegRecord(ctypes.Structure):
    _fields_ = [("registered", ctypes.c_int), ("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class LaunchRecord(ctypes.Structure):
    _fields_ = [
        ("result", ctypes.c_int), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint), ("table", ctypes.c_uint64), ("count", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
    ]


class FakeDriver:
    """Test-side view of one loaded fake library (the same handle the backend gets)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.fake_log_entry.restype = ctypes.c_char_p
        self.lib.fake_log_entry.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                            ctypes.POINTER(ctypes.c_void_p)]
        self.lib.fake_calls.restype = ctypes.c_long
        self.lib.fake_fail_batch.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
        self.lib.fake_stream_priority.argtypes = [ctypes.c_void_p]
        self.lib.fake_stream_flags.argtypes = [ctypes.c_void_p]
        self.lib.fake_stream_flags.restype = ctypes.c_uint

    def calls(self, name: str) -> int:
        return self.lib.fake_calls(name.encode())

    def log(self) -> list[tuple[str, int, int]]:
        """Every logged call in order: (function, stream or 0, event or 0)."""
        out = []
        for i in range(self.lib.fake_log_len()):
            stream, event = ctypes.c_void_p(), ctypes.c_void_p()
            name = self.lib.fake_log_entry(i, ctypes.byref(stream), ctypes.byref(event))
            out.append((name.decode(), stream.value or 0, event.value or 0))
        return out

    def batches(self) -> list[BatchRecord]:
        return self._records(BatchRecord, self.lib.fake_num_batches, self.lib.fake_batch)

    def launches(self) -> list[LaunchRecord]:
        return self._records(LaunchRecord, self.lib.fake_num_launches, self.lib.fake_launch)

    def registrations(self) -> list[RegRecord]:
        return self._records(RegRecord, self.lib.fake_num_registrations,
                             self.lib.fake_registration)

    @staticmethod
    def _records(record_type, count, read) -> list:
        """Every record the fake kept: ``read(i, &record)`` for ``i < count()``."""
        out = []
        for i in range(count()):
            rec = record_type()
            assert read(i, ctypes.byref(rec)) == 0
            out.append(rec)
        return out

    def create_stream(self) -> int:
        """A stream made by the test thread (needs the backend's context current)."""
        stream = ctypes.c_void_p()
        assert self.lib.cuStreamCreateWithPriority(ctypes.byref(stream), 1, 0) == 0
        return stream.value

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        fn = self.lib.cuMemcpyAsync
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        assert fn(dst, src, size, stream) == 0


class FakeGpuBackend(CudaCopyBackend):
    """The real backend; only the compute stream handle (from torch) is injected.

    The copy kernel is off unless a test passes ``kernel_directions``: the DMA tests
    read the batch calls their jobs make (``test_cuda_kernel.py`` covers the kernel).
    """

    compute_stream = 0  # the legacy default stream, as torch reports it

    def __init__(self, *args, kernel_directions: str | None = "off", **kwargs) -> None:
        super().__init__(*args, kernel_directions=kernel_directions, **kwargs)

    def _compute_stream_handle(self) -> int:
        return self.compute_stream


def flash_attn_rig(backend: CudaCopyBackend, num_device_blocks: int = 32,
                   num_host_blocks: int = 48, block_bytes: int = 96, seed: int = 0) -> BackendRig:
    """``backend`` bound to a FlashAttention-like (2, num_blocks, block_bytes) "device" tensor
    of random bytes (two regions, K and V) and to a zeroed host tier."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, (2, num_device_blocks, block_bytes), dtype=torch.uint8,
                       generator=gen)
    return BackendRig(backend, [kv], num_device_blocks, num_host_blocks)
