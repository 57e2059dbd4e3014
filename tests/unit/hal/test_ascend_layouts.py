"""vllm-ascend 0.23's KV cache layouts through describe_kv_caches and the real CPU backend.

Each layout is built as NPUModelRunner builds it (see ascend_caches.py). A handled
layout must copy every byte of a block exactly once: host bytes per block equal
the distinct device bytes of one block, and a store then a load into other
blocks reproduces those blocks byte for byte while every other byte of every
allocation (other blocks, alignment padding, page padding) stays as it was.
Anything else is refused with one line naming the layer and the layout.
"""

from __future__ import annotations

import ascend_caches as ac
import pytest
import torch

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.layouts import describe_kv_caches
from kvoffload_hal.hal.regions import host_bytes_per_block, host_regions_for

NUM_BLOCKS = 12
NUM_HOST_BLOCKS = 6
STORED = [(2, 0), (5, 1), (6, 3), (11, 4)]  # device block -> host block
LOADED = [(0, 9), (1, 0), (3, 7), (4, 8)]  # host block -> device block


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind ``t`` (alignment padding included), as uint8."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _alias(t: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """``t``'s view (dtype, shape, strides, offset) over another allocation of equal size."""
    return torch.empty(0, dtype=t.dtype).set_(storage.untyped_storage(), t.storage_offset(),
                                              t.shape, t.stride())


def _storages(c: ac.Caches) -> dict[int, torch.Tensor]:
    return {t.untyped_storage().data_ptr(): _storage_bytes(t) for t, _ in c.entries()}


def _randomize(c: ac.Caches, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for s in _storages(c).values():
        s.copy_(torch.randint(0, 256, s.shape, generator=gen, dtype=torch.uint8))


def distinct_bytes_of_block(c: ac.Caches, block: int) -> int:
    """Bytes block ``block`` owns over every view, each byte counted once."""
    marks = {p: torch.zeros_like(s) for p, s in _storages(c).items()}
    for t, rows in c.entries():
        view = _alias(t, marks[t.untyped_storage().data_ptr()])
        view[block * rows:(block + 1) * rows].view(torch.uint8).fill_(1)
    return sum(int(m.sum()) for m in marks.values())


def expected_after_moves(c: ac.Caches, moves: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
    """Every allocation as it must be after device block ``src`` is copied to ``dst``."""
    before = {p: s.clone() for p, s in _storages(c).items()}
    after = {p: s.clone() for p, s in before.items()}
    for t, rows in c.entries():
        p = t.untyped_storage().data_ptr()
        src, dst = _alias(t, before[p]), _alias(t, after[p])
        for s, d in moves:
            dst[d * rows:(d + 1) * rows] = src[s * rows:(s + 1) * rows]
    return after


def round_trip(c: ac.Caches) -> int:
    """Store STORED, then load LOADED, through the CPU backend; return host bytes per block."""
    backend = CpuCopyBackend()
    regions = describe_kv_caches(c.kv_caches, c.num_blocks, backend.describe_kv_tensor)
    per_block = host_bytes_per_block(regions)
    host = backend.allocate_host(NUM_HOST_BLOCKS * per_block)
    host.fill_(0x5A)
    host_regions = host_regions_for(regions, host.data_ptr(), NUM_HOST_BLOCKS)
    backend.bind(regions, host_regions)
    try:
        moves = [(d, dst) for h, dst in LOADED for d, hh in STORED if hh == h]
        expected = expected_after_moves(c, moves)
        backend.submit(TransferJob(0, Direction.STORE, *zip(*STORED)))
        assert [r.ok for r in backend.flush()] == [True]
        for r in host_regions:  # host block 2 was not stored
            start = r.base_ptr - host.data_ptr() + 2 * r.block_bytes
            assert bool((host[start:start + r.block_bytes] == 0x5A).all())
        backend.submit(TransferJob(1, Direction.LOAD, *zip(*LOADED)))
        assert [r.ok for r in backend.flush()] == [True]
        for p, s in _storages(c).items():
            assert torch.equal(s, expected[p]), f"allocation {p:#x} differs after the round trip"
    finally:
        backend.shutdown()
        backend.free_host(host)
    return per_block


def _caches(*builders) -> ac.Caches:
    c = ac.Caches(NUM_BLOCKS)
    for build in builders:
        build(c)
    _randomize(c)
    return c


# ------------------------------------------------------------------ handled layouts
@pytest.mark.parametrize("build", [
    pytest.param(lambda c: (ac.dense(c, "l0.attn"), ac.dense(c, "l1.attn")), id="dense-k-v"),
    pytest.param(lambda c: ac.mla(c, "l0.attn"), id="mla-nope-rope"),
    pytest.param(lambda c: ac.dense(c, "l0.attn", block_size=32, kernel_block=8),
                 id="kernel-blocks"),
    pytest.param(lambda c: ac.sparse_dsa(c, "l0.attn", replicated=1), id="dsa"),
    pytest.param(lambda c: ac.sparse_dsa(c, "l0.attn", replicated=4), id="dsa-replicated"),
    pytest.param(lambda c: ac.sparse_dsa(c, "l0.attn", replicated=2, li_c8=True,
                                         kernel_block=8), id="dsa-li-c8-kernel-blocks"),
    pytest.param(lambda c: ac.sparse_dsa(c, "l0.attn", replicated=2, li_c8=True, sfa_c8=True),
                 id="dsa-sfa-c8-li-c8"),
    pytest.param(lambda c: ac.mamba(c, "l0.linear_attn"), id="mamba-state-list"),
    pytest.param(lambda c: ac.compressed(c, "l0.attn", a5=False), id="compressed"),
])
def test_layout_round_trips_every_byte_of_a_block_once(build):
    c = _caches(build)
    assert round_trip(c) == distinct_bytes_of_block(c, 0)


def test_a5_compressed_views_are_merged_into_one_page_per_block():
    # Keys, scales and the full row over both: three views of one page per block.
    c = _caches(lambda c: ac.compressed(c, "l0.attn", a5=True))
    page = 16 * (128 + 4)
    regions = describe_kv_caches(c.kv_caches, NUM_BLOCKS)
    assert len(regions) == 1 and regions[0].block_bytes == regions[0].block_stride_bytes == page
    assert round_trip(c) == page == distinct_bytes_of_block(c, 0)  # not 2 * page


def test_layers_sharing_one_allocation_are_copied_once():
    # HMA: the layers of a kv_cache_tensor's shared_by get the same raw tensor. Two
    # compressed layers alias it exactly; a third views each page as one int8 row.
    c = ac.Caches(NUM_BLOCKS)
    raw = ac.compressed(c, "l0.attn", a5=False)
    ac.compressed(c, "l1.attn", a5=False, raw=raw)
    page = 16 * (128 + 2)
    c.add("l2.attn", torch.as_strided(raw, (NUM_BLOCKS, 16, 1, 130), (page, 130, 130, 1),
                                      raw.storage_offset()))
    _randomize(c)
    assert round_trip(c) == page == distinct_bytes_of_block(c, 0)


def test_indexer_rows_of_a_block_form_one_region_of_r_rows():
    c = _caches(lambda c: ac.sparse_dsa(c, "l0.attn", replicated=4, li_c8=True))
    k, v, index, scale = describe_kv_caches(c.kv_caches, NUM_BLOCKS)
    row = 16 * 16  # block_size x index_head_dim int8
    assert (index.block_bytes, index.block_stride_bytes) == (4 * row, 4 * row)
    assert (scale.block_bytes, scale.block_stride_bytes) == (4 * 16 * 2, 4 * 16 * 2)
    assert index.base_ptr % ac.ALIGN == 0
    assert scale.base_ptr == index.base_ptr + NUM_BLOCKS * 4 * row  # same allocation, after
    assert (k.num_blocks, v.num_blocks) == (NUM_BLOCKS, NUM_BLOCKS)


# ------------------------------------------------------------------ refused layouts
def _refusal(c: ac.Caches) -> str:
    with pytest.raises(ValueError) as info:
        describe_kv_caches(c.kv_caches, NUM_BLOCKS)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kernel_block", [8, 16])
def test_hybrid_attention_and_mamba_sharing_one_tensor_is_copied_exactly(kernel_block):
    """vllm-ascend's real hybrid geometry (Qwen3.5-like: conv 384 B, SSM = K = 512 B,
    page 1408 B): each block id owns three stripes of the shared tensor, and a
    block's copy holds every one of its bytes once, never another block's."""
    c = ac.Caches(NUM_BLOCKS)
    geometry = ac.hybrid_attention_mamba(c, "l3.attn", "l0.linear_attn",
                                         kernel_block=kernel_block)
    assert geometry == {"conv": 384, "ssm": 512, "k": 512, "page": 1408}
    regions = describe_kv_caches(c.kv_caches, NUM_BLOCKS)
    base = min(r.base_ptr for r in regions)
    n, conv, k = NUM_BLOCKS, geometry["conv"], geometry["k"]
    assert sorted((r.base_ptr - base, r.block_bytes, r.block_stride_bytes)
                  for r in regions) == [(0, conv, conv), (n * conv, k, k),
                                        (n * conv + n * k, k, k)]
    _randomize(c)
    assert round_trip(c) == geometry["page"] == distinct_bytes_of_block(c, 0)


@pytest.mark.parametrize("kernel_block", [8, 16])
def test_a_block_size_above_the_derived_one_is_refused_saying_what_to_change(kernel_block):
    # With --block-size 32 the K page (1024 B) is twice the SSM state (512 B): block
    # b's K starts where block 2b's SSM state lies, so block ids share bytes.
    c = ac.Caches(NUM_BLOCKS)
    ac.hybrid_attention_mamba(c, "l3.attn", "l0.linear_attn", block_size=32,
                              kernel_block=kernel_block)
    message = _refusal(c)
    assert "l0.linear_attn[" in message and "l3.attn[" in message
    assert "block stride 512 B" in message and "block stride 1024 B" in message
    assert "--block-size" in message and "share a block stride" in message


def test_block_rows_that_are_not_a_multiple_of_the_block_count_are_refused():
    c = ac.Caches(NUM_BLOCKS)
    index = ac.view_as(ac.int8_cache((2 * NUM_BLOCKS + 1) * 16 * 16), torch.int8,
                       (2 * NUM_BLOCKS + 1, 16, 1, 16))
    c.add("l0.attn", (index,))
    message = _refusal(c)
    assert message.startswith("KV cache 'l0.attn[0]' (torch.int8): ")
    assert "(25, 16, 1, 16)" in message and "block count 12" in message


def test_block_rows_that_are_not_outermost_are_refused():
    # Kernel-block rows whose per-token axis strides wider: a block's rows interleave.
    c = ac.Caches(NUM_BLOCKS)
    t = ac.view_as(ac.int8_cache(8 * NUM_BLOCKS * 2 * 8 * 2), torch.bfloat16,
                   (8, NUM_BLOCKS * 2, 1, 8)).transpose(0, 1)
    c.add("l1.attn", (t,))
    message = _refusal(c)
    assert "'l1.attn[0]'" in message and "strides (8, 192, 8, 1)" in message
    assert "expected one of extent 12, or an outermost one of 12 x k rows" in message


def test_views_of_one_page_reaching_into_the_next_block_are_refused():
    # Same block stride, but the second view starts half a page in and is a page long.
    c = ac.Caches(NUM_BLOCKS)
    page = 256
    raw = ac.int8_cache(NUM_BLOCKS * page + page)
    first = torch.as_strided(raw, (NUM_BLOCKS, page), (page, 1), raw.storage_offset())
    second = torch.as_strided(raw, (NUM_BLOCKS, page), (page, 1), raw.storage_offset() + 128)
    c.add("l0.attn", [first, second])
    message = _refusal(c)
    assert "['l0.attn[0]', 'l0.attn[1]']" in message
    assert "block stride of 256 B" in message and "span 384 B" in message


def test_a_state_not_kept_per_block_is_refused():
    c = ac.Caches(NUM_BLOCKS)
    c.add("l0.linear_attn", [torch.zeros(1, 3, 24, dtype=torch.bfloat16)])
    assert "'l0.linear_attn[0]'" in _refusal(c)
