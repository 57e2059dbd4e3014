"""describe_kv_tensor, merge_runs and build_copy_batch on the KV layouts the HAL must accept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload_hal.hal.regions import (
    BlockRegion,
    build_copy_batch,
    describe_kv_tensor,
    host_bytes_per_block,
    host_regions_for,
    merge_runs,
)

MIB2 = 2 << 20  # Ascend allocates K and V caches at 2 MiB-aligned offsets


# ----------------------------------------------------------- describe_kv_tensor
def test_vllm_cpu_layout_is_one_contiguous_region():
    nb, heads, bs, head_dim = 10, 2, 16, 64
    t = torch.empty(nb, heads, bs, 2 * head_dim, dtype=torch.float16)
    (r,) = describe_kv_tensor(t, nb)
    block = heads * bs * 2 * head_dim * 2
    assert r == BlockRegion(t.data_ptr(), nb, block, block)
    assert r.contiguous and r.span_bytes == t.numel() * 2


def test_flash_attention_layout_yields_one_region_per_k_and_v():
    nb, bs, heads, head_dim = 7, 16, 4, 32
    t = torch.empty(2, nb, bs, heads, head_dim, dtype=torch.bfloat16)
    regions = describe_kv_tensor(t, nb)
    block = bs * heads * head_dim * 2
    assert regions == [
        BlockRegion(t.data_ptr(), nb, block, block),
        BlockRegion(t.data_ptr() + nb * block, nb, block, block),
    ]


def test_padded_block_stride_keeps_only_useful_bytes():
    nb, bs, heads, head_dim, pad = 5, 16, 2, 16, 96
    useful = bs * heads * head_dim
    buf = torch.empty(nb, useful + pad, dtype=torch.float16)
    k = buf[:, :useful].view(nb, bs, heads, head_dim)
    (r,) = describe_kv_tensor(k, nb)
    assert (r.block_bytes, r.block_stride_bytes) == (useful * 2, (useful + pad) * 2)
    assert not r.contiguous


def test_k_and_v_at_2mib_offsets_of_one_buffer():
    nb, bs, heads, head_dim = 6, 16, 2, 16
    block = bs * heads * head_dim  # int8: one byte per element
    buf = torch.empty(2 * MIB2, dtype=torch.int8)
    # One view spanning both caches: the K/V axis strides 2 MiB.
    kv = buf.as_strided((2, nb, bs, heads, head_dim), (MIB2, block, heads * head_dim, head_dim, 1))
    assert describe_kv_tensor(kv, nb) == [
        BlockRegion(buf.data_ptr(), nb, block, block),
        BlockRegion(buf.data_ptr() + MIB2, nb, block, block),
    ]
    # The same caches handed over as two tensors.
    v = buf[MIB2:MIB2 + nb * block].view(nb, bs, heads, head_dim)
    assert describe_kv_tensor(v, nb) == [BlockRegion(buf.data_ptr() + MIB2, nb, block, block)]


def test_cross_layer_layout_is_one_region_holding_every_layer():
    nb, layers, bs, heads, head_dim = 4, 3, 8, 2, 16
    t = torch.empty(nb, layers, 2, bs, heads, head_dim, dtype=torch.float32)
    (r,) = describe_kv_tensor(t, nb)
    assert r.block_bytes == r.block_stride_bytes == layers * 2 * bs * heads * head_dim * 4


def test_ambiguous_extent_picks_the_outermost_block_dim():
    # block_size == heads == num_blocks: dim 0 is the block dim, the rest is the block.
    nb = 16
    t = torch.empty(nb, nb, nb, 8, dtype=torch.float16)
    (r,) = describe_kv_tensor(t, nb)
    assert r.block_bytes == nb * nb * 8 * 2
    # FlashAttention with block_size == num_blocks: dim 1, not dim 2.
    fa = torch.empty(2, nb, nb, 2, 8, dtype=torch.float16)
    regions = describe_kv_tensor(fa, nb)
    assert len(regions) == 2 and regions[0].block_bytes == nb * 2 * 8 * 2


def test_ambiguous_extents_resolve_to_the_outermost_consistent_dim():
    # (N, N, x) with padding after each row: both "padded blocks of N tokens" and
    # "N layers of N blocks" are consistent; vLLM puts the block axis outermost.
    nb, x, pad = 4, 64, 32
    buf = torch.empty(nb * (nb * x + pad), dtype=torch.uint8)
    t = buf.as_strided((nb, nb, x), (nb * x + pad, x, 1))
    (region,) = describe_kv_tensor(t, nb)
    assert (region.block_bytes, region.block_stride_bytes) == (nb * x, nb * x + pad)


def test_no_dimension_with_the_block_count_is_an_error():
    with pytest.raises(ValueError, match="block count 9"):
        describe_kv_tensor(torch.empty(4, 8, 16), 9)


def test_interleaved_outer_dimension_is_an_error():
    # Two regions whose blocks interleave: region 1 starts inside region 0's span.
    nb, x = 4, 8
    buf = torch.empty(64 * x, dtype=torch.uint8)
    t = buf.as_strided((2, nb, x), (3 * x, 2 * x, 1))
    with pytest.raises(ValueError, match="interleaves"):
        describe_kv_tensor(t, nb)


def test_overlapping_blocks_and_scalars_are_errors():
    buf = torch.empty(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        describe_kv_tensor(buf.as_strided((8, 64), (32, 1)), 8)
    with pytest.raises(ValueError, match="scalar"):
        describe_kv_tensor(torch.tensor(1.0), 1)


def test_block_region_validation():
    with pytest.raises(ValueError, match="empty"):
        BlockRegion(0, 0, 16, 16)
    with pytest.raises(ValueError, match="overlap"):
        BlockRegion(0, 4, 16, 8)


def test_host_regions_are_dense_and_back_to_back():
    dev = [BlockRegion(1000, 8, 64, 128), BlockRegion(5000, 8, 32, 32)]
    host = host_regions_for(dev, 10_000, 3)
    assert host == [BlockRegion(10_000, 3, 64, 64), BlockRegion(10_000 + 3 * 64, 3, 32, 32)]
    assert host_bytes_per_block(dev) == 96


# ------------------------------------------------------------------- merge_runs
def test_merge_runs_splits_where_either_side_breaks():
    s, d, n = merge_runs([3, 4, 5, 9], [10, 11, 12, 0])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3, 9], [10, 0], [3, 1])
    s, d, n = merge_runs([2, 0, 1], [8, 5, 6])  # sorted by source; dst breaks at 6 -> 8
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 2], [5, 8], [2, 1])


def test_merge_runs_edge_cases():
    s, d, n = merge_runs([], [])
    assert s.size == d.size == n.size == 0
    with pytest.raises(ValueError, match="differ in length"):
        merge_runs([1, 2], [1])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_merge_runs_covers_every_pair_with_maximal_runs(data):
    n = data.draw(st.integers(1, 40))
    src = data.draw(st.permutations(range(64)))[:n]
    dst = data.draw(st.permutations(range(64)))[:n]
    s, d, lengths = merge_runs(src, dst)
    pairs = sorted((int(a) + k, int(b) + k) for a, b, m in zip(s, d, lengths) for k in range(m))
    assert pairs == sorted(zip(src, dst))
    # Maximal: no run continues exactly where the previous one ended.
    ends = {(int(a) + int(m), int(b) + int(m)) for a, b, m in zip(s, d, lengths)}
    assert not any((int(a), int(b)) in ends for a, b in zip(s, d))


# ------------------------------------------------------------- build_copy_batch
def _dense(base, nb, size):
    return BlockRegion(base, nb, size, size)


def test_contiguous_regions_give_one_descriptor_per_run_per_region():
    src = [_dense(0, 16, 100), _dense(10_000, 16, 40)]
    dst = [_dense(50_000, 16, 100), _dense(90_000, 16, 40)]
    batch = build_copy_batch(src, dst, [3, 4, 5, 9], [0, 1, 2, 7])
    assert len(batch) == 4
    assert batch.src_ptrs.tolist() == [300, 900, 10_120, 10_360]
    assert batch.dst_ptrs.tolist() == [50_000, 50_700, 90_000, 90_280]
    assert batch.sizes.tolist() == [300, 100, 120, 40]
    assert batch.num_bytes == 4 * 140


def test_padded_region_gives_one_descriptor_per_block():
    src = [BlockRegion(0, 16, 100, 128)]  # padded device blocks never merge
    dst = [_dense(50_000, 16, 100)]
    batch = build_copy_batch(src, dst, [5, 3, 4], [2, 0, 1])
    assert batch.src_ptrs.tolist() == [3 * 128, 4 * 128, 5 * 128]
    assert batch.dst_ptrs.tolist() == [50_000, 50_100, 50_200]
    assert batch.sizes.tolist() == [100, 100, 100]


def test_empty_batch():
    batch = build_copy_batch([_dense(0, 4, 8)], [_dense(64, 4, 8)], [], [])
    assert len(batch) == 0 and batch.num_bytes == 0


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "match"),
    [
        ([0, 16], [0, 1], "source block id out of range"),
        ([-1], [0], "source block id out of range"),
        ([0], [4], "destination block id out of range"),
        ([0, 1], [2, 2], "destination block appears twice"),
    ],
)
def test_invalid_ids_raise(src_ids, dst_ids, match):
    with pytest.raises(ValueError, match=match):
        build_copy_batch([_dense(0, 16, 8)], [_dense(1000, 4, 8)], src_ids, dst_ids)


def test_duplicate_sources_are_allowed():
    batch = build_copy_batch([_dense(0, 4, 8)], [_dense(100, 4, 8)], [1, 1], [0, 3])
    assert sorted(batch.dst_ptrs.tolist()) == [100, 124]
    assert batch.src_ptrs.tolist() == [8, 8]


def test_mismatched_regions_raise():
    with pytest.raises(ValueError, match="differ in block size"):
        build_copy_batch([_dense(0, 4, 8)], [_dense(100, 4, 16)], [0], [0])
    with pytest.raises(ValueError, match="regions"):
        build_copy_batch([_dense(0, 4, 8)], [], [0], [0])


def test_descriptor_arrays_are_uint64():
    batch = build_copy_batch([_dense(2**40, 4, 8)], [_dense(2**41, 4, 8)], np.array([1]), [2])
    assert batch.src_ptrs.dtype == batch.dst_ptrs.dtype == batch.sizes.dtype == np.uint64
    assert int(batch.src_ptrs[0]) == 2**40 + 8 and int(batch.dst_ptrs[0]) == 2**41 + 16


def test_padded_block_dim_wins_over_inner_dim_of_equal_extent():
    nb, useful, pad = 4, 64, 40  # block_size == num_blocks == 4
    buf = torch.empty(nb * (useful + pad), dtype=torch.bfloat16)
    k = buf.view(nb, useful + pad)[:, :useful].view(nb, 4, 2, 8)
    (r,) = describe_kv_tensor(k, nb)
    assert (r.block_bytes, r.block_stride_bytes) == (useful * 2, (useful + pad) * 2)
