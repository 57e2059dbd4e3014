"""The CUDA backend damaging what it loads: the canary of the accuracy tests on a GPU.

A load's sources are the CPU tier's blocks in registered host memory; every other
byte of them is changed before the copy is enqueued, so the KV that reaches the GPU
differs from what was stored (an increment, not an XOR: a block loaded twice does
not come back whole). Imported only where ``KVOFFLOAD_HAL_BACKEND`` names it.
"""

import ctypes

import numpy as np

from kvoffload_hal.backends.cuda import CudaCopyBackend
from kvoffload_hal.hal import Direction


class CorruptingCudaBackend(CudaCopyBackend):
    name = "corrupting-cuda"

    def _launch(self, direction, batch, fence):
        if direction is Direction.LOAD:
            for src, size in zip(batch.src_ptrs.tolist(), batch.sizes.tolist()):
                view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(src))
                view[::2] += 1  # the low byte of every bf16 value, wrapping
        return super()._launch(direction, batch, fence)
