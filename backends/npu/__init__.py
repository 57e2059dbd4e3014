"""Ascend NPU backend (aclrtMemcpyBatchAsync through ctypes).

Imports no CANN library at import time."""

from kvoffload_hal.backends.npu.backend import NpuCopyBackend

__all__ = ["NpuCopyBackend"]
