"""Ascend NPU backend (placeholder until the ACL binding lands)."""

from __future__ import annotations

import importlib.util

from kvoffload_hal.hal.threaded import ThreadedCopyBackend


class NpuCopyBackend(ThreadedCopyBackend):
    name = "npu"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not importable"
        return "the NPU backend is not implemented yet"
