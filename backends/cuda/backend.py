"""CUDA backend (placeholder until the driver binding lands)."""

from __future__ import annotations

from kvoffload_hal.hal.threaded import ThreadedCopyBackend


class CudaCopyBackend(ThreadedCopyBackend):
    name = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return "the CUDA backend is not implemented yet"
