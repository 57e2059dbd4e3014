"""CUDA backend (batched DMA through the CUDA driver). Imports no CUDA library at import time."""

from kvoffload_hal.backends.cuda.backend import CudaCopyBackend

__all__ = ["CudaCopyBackend"]
