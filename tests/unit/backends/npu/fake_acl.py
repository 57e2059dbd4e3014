"""Python side of the fake libascendcl: its test hooks (call counts, last arguments)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("fake_ascendcl.c")

# Runtime variants, as -D flags of fake_ascendcl.c.
VARIANTS = {
    "full": [],  # CANN 9.1+: V2 and the 10-argument batch
    "v1": ["-DFAKE_NO_V2"],  # CANN 8.3.RC1 - 9.0: 10-argument batch only
    "v2": ["-DFAKE_NO_V1"],  # V2 only
    "none": ["-DFAKE_NO_V1", "-DFAKE_NO_V2"],  # older CANN: per-copy fallback
    "failing": ["-DFAKE_NO_V2", "-DFAKE_FAIL_INDEX=2"],  # 10-argument batch reports failIndex 2
    # Chips without batch copy (910, 310P, 200I/500 A2): the symbols exist, the calls answer
    # ACL_ERROR_RT_FEATURE_NOT_SUPPORT, on CANN 9.1+ (V2 first) and on 8.3 - 9.0.
    "unsupported": ["-DFAKE_BATCH_UNSUPPORTED"],
    "unsupported_v1": ["-DFAKE_NO_V2", "-DFAKE_BATCH_UNSUPPORTED"],
}


class FakeAcl:
    """The test hooks of one loaded fake library variant."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for fn in ("fake_max_num_batches", "fake_last_num_batches", "fake_last_num_attrs",
                   "fake_last_attr_index0", "fake_last_stream", "fake_last_sync_stream"):
            getattr(self.lib, fn).restype = ctypes.c_size_t
        self.lib.fake_max_malloc_host_size.restype = ctypes.c_size_t
        self.lib.fake_set_malloc_host_limit.argtypes = [ctypes.c_size_t]
        for fn in ("fake_v1_calls", "fake_v2_calls", "fake_copy_calls", "fake_total_calls",
                   "fake_live_host_allocs", "fake_sync_calls", "fake_sync_after_calls",
                   "fake_unsupported_calls", "fake_malloc_host_calls"):
            getattr(self.lib, fn).restype = ctypes.c_long
        self.lib.fake_add_device_memory.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                                    ctypes.c_uint32]
        self.lib.fake_fail_call.argtypes = [ctypes.c_long, ctypes.c_int]
        self.lib.fake_reset()

    def __getattr__(self, name: str):
        return getattr(self.lib, f"fake_{name}")

    def declare_device_memory(self, base: int, num_bytes: int, device: int) -> None:
        """From now on ``[base, base + num_bytes)`` is memory of NPU ``device`` (until reset)."""
        assert self.lib.fake_add_device_memory(base, num_bytes, device) == 0, "too many ranges"

    def attr_bytes(self) -> bytes:
        buf = (ctypes.c_uint8 * 32)()
        self.lib.fake_last_attr_bytes(buf)
        return bytes(buf)


def host_buffers(n: int, size: int, seed: int = 0):
    """``n`` random source and zeroed destination arrays of ``size`` bytes, with their
    addresses and sizes as the ``uint64`` arrays the runtime's batch calls take."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
    ptrs = lambda arrs: np.array([a.ctypes.data for a in arrs], dtype=np.uint64)  # noqa: E731
    return src, dst, ptrs(src), ptrs(dst), np.full(n, size, dtype=np.uint64)
