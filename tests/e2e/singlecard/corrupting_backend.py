"""A CPU backend that damages every block it loads: the canary of the accuracy test."""

import ctypes

import numpy as np

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import Direction


class CorruptingCpuBackend(CpuCopyBackend):
    name = "corrupting-cpu"

    def _launch(self, direction, batch, fence):
        elapsed = super()._launch(direction, batch, fence)
        if direction is Direction.LOAD:
            for dst, size in zip(batch.dst_ptrs.tolist(), batch.sizes.tolist()):
                view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(dst))
                view[::2] ^= 0x5A  # flip bits in the low byte of every bf16 value
        return elapsed
