"""KV cache tensors laid out as vllm-ascend lays them out, and binding them to a backend.

On Ascend each layer's K and V are separate tensors; with offload enabled the
model runner over-allocates each by a 2 MiB alignment and slices it back, so
the storage is larger than the tensor. Regions must come from shape and
strides (``describe_kv_tensor``), never from the storage size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvoffload_hal.hal.regions import BlockRegion, describe_kv_tensor, host_regions_for

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
        return self.tensors[tensor_index][block_id].contiguous().view(torch.uint8).numpy().tobytes()


def ascend_kv(num_layers: int = 2, num_blocks: int = 24, block_size: int = 16, num_heads: int = 2,
              head_dim: int = 16, dtype=torch.bfloat16, seed: int = 0) -> AscendKv:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_heads, head_dim)
    nbytes = num_blocks * block_size * num_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    tensors, buffers = [], []
    for _ in range(2 * num_layers):  # K and V are separate allocations on Ascend
        buf = torch.empty(nbytes + 2 * ASCEND_ALIGN, dtype=torch.uint8)
        skip = -buf.data_ptr() % ASCEND_ALIGN
        t = buf[skip:skip + nbytes].view(dtype).view(shape)
        t.copy_(torch.randn(shape, generator=gen).to(dtype))
        tensors.append(t)
        buffers.append(buf)
    return AscendKv(tensors, buffers, num_blocks)


def bind_host(backend, kv: AscendKv, num_host_blocks: int):
    """Allocate the host tier through the backend and bind it; returns (host tensor, host regions)."""
    device_regions = kv.regions()
    per_block = sum(r.block_bytes for r in device_regions)
    host = backend.allocate_host(per_block * num_host_blocks)
    host_regions = host_regions_for(device_regions, host.data_ptr(), num_host_blocks)
    backend.bind(device_regions, host_regions)
    return host, host_regions


NUM_HOST_BLOCKS = 32


def host_block(host: torch.Tensor, region, block_id: int) -> bytes:
    start = region.base_ptr - host.data_ptr() + block_id * region.block_bytes
    return host[start:start + region.block_bytes].numpy().tobytes()


def wait_results(backend, n: int, timeout_s: float = 5.0) -> list:
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < n and time.monotonic() < deadline:
        results += backend.poll()
        time.sleep(0.001)
    return results
