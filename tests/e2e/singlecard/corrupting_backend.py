"""CPU backends that damage blocks they load: the canaries of the accuracy tests."""

import ctypes
import os

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


class TailCorruptingCpuBackend(CpuCopyBackend):
    """Damages only what it loads into the device regions from index
    ``KVOFFLOAD_TEST_CORRUPT_FROM`` on: the layers registered last (a draft model's
    layers come after the target's), the others' loads stay exact."""

    name = "tail-corrupting-cpu"

    def _launch(self, direction, batch, fence):
        elapsed = super()._launch(direction, batch, fence)
        if direction is Direction.LOAD:
            first = int(os.environ["KVOFFLOAD_TEST_CORRUPT_FROM"])
            spans = [(r.base_ptr, r.base_ptr + r.num_blocks * r.block_stride_bytes)
                     for r in self._regions[0][first:]]
            for dst, size in zip(batch.dst_ptrs.tolist(), batch.sizes.tolist()):
                if any(lo <= dst < hi for lo, hi in spans):
                    view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(dst))
                    view[::2] ^= 0x5A
        return elapsed
