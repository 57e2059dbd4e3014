"""Test-side helpers for the fake CUDA driver (fake_cuda.c); fixtures are in conftest.py.

The backend under test runs its real ctypes code against the fake; the tests
read what the fake saw through its ``fake_*`` functions. "Device" KV tensors are
CPU tensors: the fake copies with memmove, so every byte can be checked.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from kvoffload_hal.backends.cuda import CudaCopyBackend
from kvoffload_hal.hal.regions import host_regions_for

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
        out = []
        for i in range(self.lib.fake_num_batches()):
            rec = BatchRecord()
            assert self.lib.fake_batch(i, ctypes.byref(rec)) == 0
            out.append(rec)
        return out

    def registrations(self) -> list[RegRecord]:
        out = []
        for i in range(self.lib.fake_num_registrations()):
            rec = RegRecord()
            assert self.lib.fake_registration(i, ctypes.byref(rec)) == 0
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
    """The real backend; only the compute stream handle (from torch) is injected."""

    compute_stream = 0  # the legacy default stream, as torch reports it

    def _compute_stream_handle(self) -> int:
        return self.compute_stream


class KvSetup:
    """A FlashAttention-like (2, num_blocks, block_bytes) "device" tensor and its host tier."""

    def __init__(self, backend: CudaCopyBackend, num_device_blocks: int = 32,
                 num_host_blocks: int = 48, block_bytes: int = 96, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.kv = torch.randint(0, 256, (2, num_device_blocks, block_bytes), dtype=torch.uint8,
                                generator=gen)
        self.device_regions = backend.describe_kv_tensor(self.kv, num_device_blocks)
        self.host = backend.allocate_host(2 * num_host_blocks * block_bytes)
        self.host.zero_()
        self.host_view = self.host.view(2, num_host_blocks, block_bytes)
        self.host_regions = host_regions_for(self.device_regions, self.host.data_ptr(),
                                             num_host_blocks)
        backend.bind(self.device_regions, self.host_regions)

    def close(self) -> None:
        self.backend.shutdown()
        self.backend.free_host(self.host)


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)
