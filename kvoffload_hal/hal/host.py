"""The CPU tier's host memory: one or more buffers, and the block regions in them.

A backend returns :class:`HostChunks` from ``allocate_host_regions``: the
buffers it allocated (``chunks``) and one host region per device region, each
wholly inside one chunk, so no block's host slot straddles two allocations.
Most backends allocate one buffer (:func:`one_buffer`); the NPU backend splits
a large tier over several ``aclrtMallocHost`` calls, since one call above about
200 GB fails there (``backends/npu/_host.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvoffload_hal.hal.regions import BlockRegion, host_regions_for


@dataclass(frozen=True)
class HostChunks:
    """The CPU tier's host memory as buffers (chunks) and the regions laid out in them.

    ``regions[i]`` mirrors device region ``i`` (pass them to ``bind``) and lies
    wholly inside ``chunks[chunk_of[i]]``.
    """

    chunks: tuple[torch.Tensor, ...]  # 1-D uint8, one per allocation
    regions: tuple[BlockRegion, ...]
    chunk_of: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def region_views(self) -> list[torch.Tensor]:
        """One uint8 ``[num_blocks, block_bytes]`` view per region, into its chunk."""
        views = []
        for region, k in zip(self.regions, self.chunk_of):
            chunk = self.chunks[k]
            offset = region.base_ptr - chunk.data_ptr()
            views.append(chunk[offset:offset + region.num_blocks * region.block_bytes]
                         .view(region.num_blocks, region.block_bytes))
        return views


def one_buffer(buffer: torch.Tensor, device_regions: Sequence[BlockRegion],
               num_host_blocks: int) -> HostChunks:
    """Every host region back to back in one buffer (the layout of ``host_regions_for``)."""
    regions = host_regions_for(device_regions, buffer.data_ptr(), num_host_blocks)
    return HostChunks((buffer,), tuple(regions), (0,) * len(regions))
