"""Regions of Ascend's separate K and V tensors, padded to 2 MiB: from strides, not storage size."""

from __future__ import annotations

import pytest
import torch
from ascend_kv import ASCEND_ALIGN, ascend_kv

from kvoffload_hal.hal.regions import describe_kv_tensor, host_regions_for


def test_one_dense_region_per_separate_k_and_v_tensor():
    kv = ascend_kv(num_layers=3, num_blocks=10, block_size=16, num_heads=4, head_dim=8)
    block_bytes = 16 * 4 * 8 * 2  # bf16
    regions = kv.regions()
    assert len(regions) == 6  # K and V of 3 layers
    for tensor, buffer, region in zip(kv.tensors, kv.buffers, regions):
        assert region.base_ptr == tensor.data_ptr() and region.base_ptr % ASCEND_ALIGN == 0
        assert (region.num_blocks, region.block_bytes, region.block_stride_bytes) == (
            10, block_bytes, block_bytes)
        # The storage is padded well beyond the blocks; none of it is described.
        assert tensor.untyped_storage().nbytes() >= region.span_bytes + ASCEND_ALIGN
        assert region.span_bytes == 10 * block_bytes


def test_longer_block_axis_is_rejected_not_truncated():
    # A tensor whose block axis is longer than the KV config's block count is
    # rejected rather than silently truncated: no dimension matches.
    kv = ascend_kv(num_layers=1, num_blocks=12)
    with pytest.raises(ValueError, match="block count 10"):
        describe_kv_tensor(kv.tensors[0], 10)
    regions = describe_kv_tensor(kv.tensors[0][:10], 10)  # the runner's slice
    assert regions[0].num_blocks == 10 and regions[0].base_ptr == kv.tensors[0].data_ptr()


def test_padded_block_stride_copies_only_useful_bytes():
    # Each block padded to a 2 KiB boundary inside the tensor (as an aligned
    # allocator might): the stride exceeds the block, and only the block is copied.
    num_blocks, block_elems = 6, 3 * 128  # 768 B of bf16 per block
    storage = torch.zeros(num_blocks * 1024 + ASCEND_ALIGN, dtype=torch.bfloat16)
    skip = (-storage.data_ptr() % ASCEND_ALIGN) // 2
    t = storage[skip:].as_strided((num_blocks, 3, 128), (1024, 128, 1))
    [region] = describe_kv_tensor(t, num_blocks)
    assert (region.block_bytes, region.block_stride_bytes) == (block_elems * 2, 2048)
    assert not region.contiguous
    [host] = host_regions_for([region], 0x10000, 4)
    assert host.block_bytes == host.block_stride_bytes == block_elems * 2
