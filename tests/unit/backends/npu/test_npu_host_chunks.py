"""The CPU tier's host memory in several aclrtMallocHost calls, on the fake runtime.

The fake answers ACL_ERROR_RT_MEMORY_ALLOCATION (207001) to any aclrtMallocHost
call above the limit a test sets, as one call above about 200-250 GB does on
Atlas A2 (910B, LMCache-Ascend issue #242), and counts calls, the largest size
asked for and the allocations not freed. Copies go through the real ctypes path
into every chunk, the blocks at chunk ends included, and are compared byte for
byte.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from ascend_kv import ascend_kv

from kvoffload_hal.backends.npu._acl import AclError
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.regions import BlockRegion, host_bytes_per_block, host_regions_for

KiB = 1 << 10
NUM_HOST_BLOCKS = 16
MEMORY_ALLOCATION = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION


def _block(region: BlockRegion, block_id: int) -> bytes:
    address = region.base_ptr + block_id * region.block_stride_bytes
    return bytes((ctypes.c_uint8 * region.block_bytes).from_address(address))


def _mixed_kv(head_dims, num_blocks: int = 24, seed: int = 3) -> list[torch.Tensor]:
    """Device tensors ``[num_blocks, 16, 2, head_dim]`` in bf16: 64 * head_dim B per block."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((num_blocks, 16, 2, d), generator=gen).to(torch.bfloat16)
            for d in head_dims]


def _regions(backend, tensors, num_blocks: int = 24) -> list[BlockRegion]:
    return [r for t in tensors for r in backend.describe_kv_tensor(t, num_blocks)]


def test_a_tier_above_the_per_call_limit_is_allocated_in_chunks_under_it(npu_env):
    # 6 regions of 16 KiB (96 KiB) against a runtime refusing calls above 40 KiB.
    backend = npu_env.backend("full", host_chunk_bytes=40 * KiB)
    acl = npu_env.acl
    acl.set_malloc_host_limit(40 * KiB)
    kv = ascend_kv(num_layers=3)
    regions = _regions(backend, kv.tensors)
    before = acl.live_host_allocs()
    tier = backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    assert acl.malloc_host_calls() == len(tier.chunks) == 3
    assert acl.max_malloc_host_size() <= 40 * KiB
    assert [c.numel() for c in tier.chunks] == [32 * KiB] * 3
    assert acl.live_host_allocs() == before + 3
    assert tier.chunk_of == (0, 0, 1, 1, 2, 2)
    # Laid end to end, the chunks hold the regions where one buffer would.
    one_buffer = host_regions_for(regions, 0, NUM_HOST_BLOCKS)
    ends = np.cumsum([0] + [c.numel() for c in tier.chunks])
    for region, k, flat in zip(tier.regions, tier.chunk_of, one_buffer):
        offset = region.base_ptr - tier.chunks[k].data_ptr()
        assert 0 <= offset and offset + region.span_bytes <= tier.chunks[k].numel()
        assert ends[k] + offset == flat.base_ptr  # same offset as in the one-buffer layout
        assert region.block_bytes == flat.block_bytes == region.block_stride_bytes
    backend.free_host_regions(tier)
    assert acl.live_host_allocs() == before


@pytest.mark.parametrize("variant", ["full", "v1", "none"])
def test_copies_into_and_out_of_every_chunk_are_byte_for_byte(npu_env, variant):
    # Regions of 16, 32, 16, 8, 16 and 16 KiB in chunks of at most 32 KiB: [0] [1] [2, 3]
    # [4, 5]; host blocks 0 and 15 of each region sit at a chunk's start, end or next to
    # another region.
    backend = npu_env.backend(variant, host_chunk_bytes=32 * KiB)
    npu_env.acl.set_malloc_host_limit(32 * KiB)
    tensors = _mixed_kv([16, 32, 16, 8, 16, 16])
    for t in tensors:
        npu_env.acl.declare_device_memory(t.data_ptr(), t.numel() * t.element_size(), 0)
    regions = _regions(backend, tensors)
    tier = backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    assert tier.chunk_of == (0, 1, 2, 2, 3, 3)
    assert [c.numel() for c in tier.chunks] == [16 * KiB, 32 * KiB, 24 * KiB, 32 * KiB]
    assert npu_env.acl.max_malloc_host_size() <= 32 * KiB
    for chunk in tier.chunks:
        chunk.fill_(0xA5)
    backend.bind(regions, list(tier.regions))
    initial = [[_block(r, b) for b in range(r.num_blocks)] for r in regions]

    src = np.arange(8, 8 + NUM_HOST_BLOCKS)[::-1]  # device blocks 23..8 -> host 0..15
    dst = np.arange(NUM_HOST_BLOCKS)
    backend.submit(TransferJob(0, Direction.STORE, src, dst))
    [stored] = backend.flush()
    assert stored.ok
    for i, region in enumerate(tier.regions):
        for s, d in zip(src, dst):
            assert _block(region, int(d)) == initial[i][int(s)], f"region {i} host block {d}"
    # Laid end to end, the chunks are byte for byte the one-buffer layout.
    expected = b"".join(initial[i][int(s)] for i in range(len(regions)) for s in src)
    assert b"".join(c.numpy().tobytes() for c in tier.chunks) == expected

    load_dst = np.arange(NUM_HOST_BLOCKS)  # host 0..15 -> device blocks 0..15
    backend.submit(TransferJob(0, Direction.LOAD, dst, load_dst))
    [loaded] = backend.flush()
    assert loaded.ok
    for i, region in enumerate(regions):
        for h, d in zip(dst, load_dst):
            assert _block(region, int(d)) == _block(tier.regions[i], int(h))
        assert [_block(region, b) for b in range(16, 24)] == initial[i][16:24]  # untouched


def test_every_chunk_is_freed_after_shutdown(npu_env):
    backend = npu_env.backend("full", host_chunk_bytes=16 * KiB)
    acl = npu_env.acl
    kv = ascend_kv(num_layers=2)
    regions = _regions(backend, kv.tensors)
    before = acl.live_host_allocs()
    tier = backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    backend.bind(regions, list(tier.regions))
    assert acl.live_host_allocs() == before + 4
    assert backend.shutdown() is True
    assert acl.live_host_allocs() == before + 4  # the caller frees it, after shutdown
    backend.free_host_regions(tier)
    assert acl.live_host_allocs() == before
    with pytest.raises(ValueError, match="already freed"):
        backend.free_host_regions(tier)


def test_a_failed_chunk_frees_the_chunks_before_it_and_names_size_index_and_code(npu_env):
    # Regions of 16, 16 and 64 KiB in 64 KiB chunks: chunk 0 holds 32 KiB, chunk 1 64 KiB,
    # and the runtime refuses calls above 48 KiB.
    backend = npu_env.backend("full", host_chunk_bytes=64 * KiB)
    acl = npu_env.acl
    acl.set_malloc_host_limit(48 * KiB)
    regions = _regions(backend, _mixed_kv([16, 16, 64]))
    before = acl.live_host_allocs()
    with pytest.raises(AclError) as info:
        backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    assert acl.malloc_host_calls() == 2 and acl.live_host_allocs() == before
    message = str(info.value)
    assert info.value.code == MEMORY_ALLOCATION and "\n" not in message
    for part in ("aclError 207001", "chunk 1 of 2", f"({64 * KiB} bytes",
                 f"{96 * KiB}-byte", "chunk 0 was freed", "ACL_ERROR_RT_MEMORY_ALLOCATION",
                 "KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES"):
        assert part in message, (part, message)


def test_a_limit_below_one_block_fails_clearly_and_leaks_nothing(npu_env):
    backend = npu_env.backend("full")  # default 64 GiB chunks: one call for the whole tier
    acl = npu_env.acl
    acl.set_malloc_host_limit(512)  # below one 1 KiB block
    kv = ascend_kv(num_layers=2)
    regions = _regions(backend, kv.tensors)
    before = acl.live_host_allocs()
    with pytest.raises(AclError, match=r"aclError 207001 for chunk 0 of 1 \(65536 bytes"):
        backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    assert acl.malloc_host_calls() == 1 and acl.live_host_allocs() == before


def test_a_chunk_smaller_than_one_region_is_refused_before_any_call(npu_env):
    backend = npu_env.backend("full", host_chunk_bytes=8 * KiB)
    acl = npu_env.acl
    regions = _regions(backend, ascend_kv(num_layers=1).tensors)  # 16 KiB regions
    with pytest.raises(ValueError) as info:
        backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    message = str(info.value)
    assert message.startswith(f"host region 0 needs {16 * KiB} bytes")
    assert "KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES" in message and "never split" in message
    assert acl.malloc_host_calls() == 0


def test_the_one_buffer_allocation_names_size_and_code_when_refused(npu_env):
    backend = npu_env.backend("full")
    acl = npu_env.acl
    acl.set_malloc_host_limit(1 << 20)
    before = acl.live_host_allocs()
    with pytest.raises(AclError) as info:
        backend.allocate_host(2 << 20)
    message = str(info.value)
    assert info.value.code == MEMORY_ALLOCATION and acl.live_host_allocs() == before
    assert f"chunk 0 of 1 ({2 << 20} bytes" in message and "host buffer" in message
    assert "200-250 GB" in message and "lower cpu_bytes_to_use" in message


def test_chunk_size_default_and_environment(npu_env, monkeypatch):
    assert npu_env.backend("full").host_chunk_bytes == 64 << 30
    monkeypatch.setenv("KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES", str(1 << 30))
    assert npu_env.backend("full").host_chunk_bytes == 1 << 30
    assert npu_env.backend("full", host_chunk_bytes=4096).host_chunk_bytes == 4096
    monkeypatch.setenv("KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES", "0")
    with pytest.raises(ValueError, match=r"^KVOFFLOAD_HAL_NPU_HOST_CHUNK_BYTES='0' is invalid"):
        npu_env.backend("full")


def test_region_views_address_each_region_inside_its_chunk(npu_env):
    backend = npu_env.backend("full", host_chunk_bytes=32 * KiB)
    regions = _regions(backend, _mixed_kv([16, 32, 16]))
    tier = backend.allocate_host_regions(regions, NUM_HOST_BLOCKS)
    views = tier.region_views()
    assert [tuple(v.shape) for v in views] == [(NUM_HOST_BLOCKS, r.block_bytes) for r in regions]
    for view, region in zip(views, tier.regions):
        view[NUM_HOST_BLOCKS - 1].fill_(7)
        assert view.data_ptr() == region.base_ptr
        assert _block(region, NUM_HOST_BLOCKS - 1) == bytes([7]) * region.block_bytes
    assert tier.num_bytes == NUM_HOST_BLOCKS * host_bytes_per_block(regions)
    backend.free_host_regions(tier)
