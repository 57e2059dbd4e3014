"""KV cache tensors laid out as vllm-ascend lays them out.

On Ascend each layer's K and V are separate tensors; with offload enabled the
model runner over-allocates each by a 2 MiB alignment and slices it back, so
the storage is larger than the tensor. Regions must come from shape and
strides (``describe_kv_tensor``), never from the storage size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvoffload_hal.hal.regions import BlockRegion, describe_kv_tensor
from support.backend_rig import BackendRig

MiB = 1 << 20
ASCEND_ALIGN = 2 * MiB  # NPUModelRunner pads each KV tensor to a 2 MiB boundary


@dataclass
class AscendKv:
    """Separate K and V tensors per layer, each starting on a 2 MiB boundary of a larger buffer."""

    tensors: list[torch.Tensor]  # each [num_blocks, block_size, num_heads, head_dim]
    buffers: list[torch.Tensor]  # the over-allocated storage the tensors are sliced from
    num_blocks: int

    def regions(self) -> list[BlockRegion]:
        return [r for t in self.tensors for r in describe_kv_tensor(t, self.num_blocks)]

    def block(self, tensor_index: int, block_id: int) -> bytes:
        block = self.tensors[tensor_index][block_id]
        return block.contiguous().view(torch.uint8).numpy().tobytes()


def ascend_kv(num_layers: int = 2, num_blocks: int = 24, block_size: int = 16,
              num_heads: int = 2, head_dim: int = 16, dtype=torch.bfloat16,
              seed: int = 0) -> AscendKv:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_heads, head_dim)
    element_bytes = torch.tensor([], dtype=dtype).element_size()
    nbytes = num_blocks * block_size * num_heads * head_dim * element_bytes
    tensors, buffers = [], []
    for _ in range(2 * num_layers):  # K and V are separate allocations on Ascend
        buf = torch.empty(nbytes + 2 * ASCEND_ALIGN, dtype=torch.uint8)
        skip = -buf.data_ptr() % ASCEND_ALIGN
        t = buf[skip:skip + nbytes].view(dtype).view(shape)
        t.copy_(torch.randn(shape, generator=gen).to(dtype))
        tensors.append(t)
        buffers.append(buf)
    return AscendKv(tensors, buffers, num_blocks)


NUM_HOST_BLOCKS = 32


def bind_rig(backend, kv: AscendKv, num_host_blocks: int = NUM_HOST_BLOCKS) -> BackendRig:
    """``backend`` bound to every K and V tensor of ``kv`` and to host memory it allocated."""
    return BackendRig(backend, kv.tensors, kv.num_blocks, num_host_blocks)
