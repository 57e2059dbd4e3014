"""A copy backend bound to "device" KV tensors and to a host buffer it allocated.

In the unit tests the device KV tensors are CPU tensors (the CPU backend
copies host to host; the fake CUDA and ACL runtimes copy with ``memcpy``), so
every block on both sides can be read back and compared byte for byte.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.hal.regions import BlockRegion, host_bytes_per_block, host_regions_for


def _block_view(region: BlockRegion, block_id: int) -> torch.Tensor:
    """The live bytes of one block of ``region`` (host-addressable memory only)."""
    if not 0 <= block_id < region.num_blocks:
        raise IndexError(f"block {block_id} out of range for {region.num_blocks} blocks")
    address = region.base_ptr + block_id * region.block_stride_bytes
    array = (ctypes.c_uint8 * region.block_bytes).from_address(address)
    return torch.frombuffer(array, dtype=torch.uint8)


class BackendRig:
    """``backend`` bound to ``tensors`` (``num_blocks`` blocks each) and to host blocks.

    The host buffer comes from ``backend.allocate_host`` and is filled with
    ``host_fill``; the device blocks as they were at bind time are kept, so a
    store can be checked against them after the tensors have changed.
    """

    def __init__(self, backend: DmaCopyBackend, tensors: Sequence[torch.Tensor],
                 num_blocks: int, num_host_blocks: int, host_fill: int = 0) -> None:
        self.backend = backend
        self.tensors = list(tensors)
        self.num_host_blocks = num_host_blocks
        self.device_regions = [r for t in self.tensors
                               for r in backend.describe_kv_tensor(t, num_blocks)]
        host_bytes = num_host_blocks * host_bytes_per_block(self.device_regions)
        self.host = backend.allocate_host(host_bytes)
        self.host.fill_(host_fill)
        self.host_regions = host_regions_for(self.device_regions, self.host.data_ptr(),
                                             num_host_blocks)
        self._initial = [[_block_view(r, b).clone() for b in range(r.num_blocks)]
                         for r in self.device_regions]
        backend.bind(self.device_regions, self.host_regions)

    @property
    def kv(self) -> torch.Tensor:
        """The device KV tensor, for a rig bound to exactly one."""
        (tensor,) = self.tensors
        return tensor

    @property
    def host_view(self) -> torch.Tensor:
        """The host buffer as ``(region, host block, byte)``; regions must have equal blocks."""
        return self.host.view(len(self.host_regions), self.num_host_blocks, -1)

    def device_block(self, region: int, block_id: int) -> torch.Tensor:
        """Live uint8 view of device block ``block_id`` of region ``region``."""
        return _block_view(self.device_regions[region], block_id)

    def initial_device_block(self, region: int, block_id: int) -> torch.Tensor:
        """Device block ``block_id`` of region ``region`` as it was when the rig was bound."""
        return self._initial[region][block_id]

    def host_block(self, region: int, block_id: int) -> torch.Tensor:
        """Live uint8 view of host block ``block_id`` of region ``region`` (writable)."""
        return _block_view(self.host_regions[region], block_id)

    def assert_stored(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Host block ``dst[k]`` holds device block ``src[k]`` as bound, in every region."""
        for i in range(len(self.device_regions)):
            for s, d in zip(src, dst):
                expected = self.initial_device_block(i, int(s))
                assert torch.equal(self.host_block(i, int(d)), expected), (
                    f"region {i}: host block {d} does not hold device block {s}")

    def assert_loaded(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Device block ``dst[k]`` holds host block ``src[k]`` now, in every region."""
        for i in range(len(self.device_regions)):
            for s, d in zip(src, dst):
                assert torch.equal(self.device_block(i, int(d)), self.host_block(i, int(s))), (
                    f"region {i}: device block {d} does not hold host block {s}")

    def close(self) -> None:
        """Shut the backend down, then give its host memory back."""
        self.backend.shutdown()
        self.backend.free_host(self.host)
