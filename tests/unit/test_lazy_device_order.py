"""Stores never change when the device evicts a block.

A lazy store copies the device blocks next in line for eviction (the head of vLLM's
free queue), and holds them while it runs. vLLM's ``free_blocks`` would then put them at
the tail, as if a request had just used them: the device would keep blocks the CPU tier
holds already and evict, in their place, blocks it would have kept. The store puts them
back where they were (scheduler/store_jobs.py, ``put_back``).

An eager store of a request that finishes while it runs holds the request's last blocks
when vLLM frees them. They enter the free queue when the store ends, in the order vLLM
frees a request's blocks, deepest first (``BlockPicker.free_order``): in block order, the
device would evict each such prefix from its first block and keep blocks no lookup can
reach.
"""

import pytest

from kvoffload_hal.demo.inprocess import set_inprocess_env

set_inprocess_env()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from kvoffload_hal import vllm_compat  # noqa: E402
from kvoffload_hal.scheduler.cpu_tier import pin_ids, unpin_ids  # noqa: E402
from kvoffload_hal.scheduler.store_jobs import next_cached, put_back  # noqa: E402
from support.serving_rig import serve  # noqa: E402

BS = 16
DOC_BLOCKS = 5


def _doc(seed):
    return [(seed * 7 + i) % 89 + 1 for i in range(DOC_BLOCKS * BS + 1)]


def _free_queue_owners(pool, owner):
    """The documents of the cached blocks in the device's free queue, head first."""
    return [owner[b.block_hash] for b in vllm_compat.iter_free_blocks(pool.free_block_queue)
            if b.block_hash is not None]


def _run_keeping_order(engine, pool, owner):
    """Step until no request is left, checking after every step that the cached blocks
    in the device's free queue are in vLLM's order (their ``owner`` keys sorted)."""
    for _ in range(100):
        if not engine.scheduler.has_requests():
            return
        engine.step()
        order = _free_queue_owners(pool, owner)
        assert order == sorted(order), f"step {engine.steps}: {order}"
    raise AssertionError("requests left after 100 steps")


def test_lazily_stored_blocks_keep_their_place_in_the_devices_eviction_order(make_engine):
    """Fails where a lazy store's device blocks go to the tail of the free queue when it
    ends: a document's block then follows the next document's."""
    engine = make_engine(lazy=True, num_gpu_blocks=24, cpu_blocks=64,
                         max_num_batched_tokens=4 * BS)
    pool = engine.scheduler.kv_cache_manager.block_pool
    owner = {}
    for n in range(8):  # one at a time: each frees its blocks after the one before
        req = engine.add(f"doc-{n}", _doc(n + 1), max_tokens=2)
        owner.update((make_block_hash_with_group_id(h, 0), n) for h in req.block_hashes)
        _run_keeping_order(engine, pool, owner)
    engine.drain()
    assert engine.offload.totals.data["blocks_stored"] >= 3 * DOC_BLOCKS
    # Nothing was lost on the way: each block is on the device or in the CPU tier.
    device = pool.cached_block_hash_to_block
    assert all(device.get_one_block(h) is not None or engine.offload.cpu.holds(h)
               for h in owner)
    # And the device kept the latest documents, as vLLM's order has it.
    assert _free_queue_owners(pool, owner)[-DOC_BLOCKS:] == [7] * DOC_BLOCKS
    hits = engine.offload.totals.data.get("cpu_hit_tokens", 0)
    serve(engine, ("again", _doc(1)))  # the first document, from the CPU tier
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS
    assert engine.offload.totals.data["cpu_hit_tokens"] - hits == DOC_BLOCKS * BS


@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_eagerly_stored_blocks_enter_the_free_queue_deepest_first(make_engine, max_tokens):
    """Fails where a store frees its device blocks in block order: with one or two output
    tokens the requests finish while their prompts' stores run, and each document's first
    block went to the head of the queue, its last one nearest the tail."""
    engine = make_engine(num_gpu_blocks=24, cpu_blocks=64, max_num_batched_tokens=8 * BS)
    pool = engine.scheduler.kv_cache_manager.block_pool
    owner = {}
    for n in range(6):  # one at a time: each frees its blocks after the one before
        req = engine.add(f"doc-{n}", _doc(n + 1), max_tokens=max_tokens)
        owner.update((make_block_hash_with_group_id(h, 0), (n, -i))
                     for i, h in enumerate(req.block_hashes))
        _run_keeping_order(engine, pool, owner)
        engine.drain()
    assert engine.offload.totals.data["blocks_stored"] == 6 * DOC_BLOCKS
    # The oldest document left on the device lost its last blocks, not its first: the
    # device still serves its prefix.
    oldest = _free_queue_owners(pool, owner)[0][0]
    assert _free_queue_owners(pool, owner)[0] != (oldest, 0)
    hits = engine.offload.totals.data.get("cpu_hit_tokens", 0)
    serve(engine, ("again", _doc(oldest + 1)))
    device_tokens = engine.cached_tokens["again"] - (
        engine.offload.totals.data.get("cpu_hit_tokens", 0) - hits)
    assert device_tokens > 0


def _cached_pool(n):
    """A device pool of ``n`` cached blocks, all free, oldest first (and the null block)."""
    pool = BlockPool(n + 1, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(n)
    vllm_compat.insert_block_hashes(pool, blocks, [make_block_hash_with_group_id(
        i.to_bytes(32, "little"), 0) for i in range(n)])
    pool.free_blocks(blocks)
    return pool, blocks


def _queue(pool):
    return [b.block_id for b in vllm_compat.iter_free_blocks(pool.free_block_queue)]


@pytest.mark.parametrize("evicted, expected", [
    (1, [1, 2, 3, 4, 5]),  # the block after them is still cached: in front of it
    (2, [1, 2, 4, 5]),  # vLLM evicted it: it would have evicted them first, at the head
])
def test_a_stores_blocks_go_back_in_front_of_the_block_that_followed_them(evicted, expected):
    pool, blocks = _cached_pool(6)
    taken = [blocks[1].block_id, blocks[2].block_id]
    anchor = next_cached(blocks[2], set(taken))
    assert anchor == (blocks[3], blocks[3].block_hash)
    pin_ids(pool, taken)  # the store holds them
    pool.get_new_blocks(evicted)  # the device allocates from the head meanwhile
    unpin_ids(pool, taken)
    assert _queue(pool)[-2:] == taken  # vLLM's free_blocks: at the tail
    put_back(pool, [blocks[1], blocks[2]], anchor, window=6)
    assert _queue(pool) == [blocks[i].block_id for i in expected]


def test_a_block_a_request_took_meanwhile_is_left_where_vllm_frees_it():
    pool, blocks = _cached_pool(4)
    anchor = next_cached(blocks[1], {blocks[0].block_id, blocks[1].block_id})
    pin_ids(pool, [blocks[0].block_id, blocks[1].block_id])
    pool.touch([blocks[1]])  # a prefix hit of a request on the device
    unpin_ids(pool, [blocks[0].block_id, blocks[1].block_id])
    put_back(pool, [blocks[0], blocks[1]], anchor, window=4)
    assert _queue(pool) == [blocks[0].block_id, blocks[2].block_id, blocks[3].block_id]
    assert next_cached(blocks[3], set()) is None  # the queue's end: left at the tail


def test_the_walk_to_the_anchor_stops_after_the_window():
    """A store's blocks came from the first ``window`` of the queue: the walk back to
    them is never longer (blocks put back ahead of them may have pushed the anchor)."""
    pool, blocks = _cached_pool(6)
    taken = [blocks[3].block_id, blocks[4].block_id]
    anchor = next_cached(blocks[4], set(taken))
    pin_ids(pool, taken)
    unpin_ids(pool, taken)
    put_back(pool, [blocks[3], blocks[4]], anchor, window=1)
    assert _queue(pool) == [blocks[i].block_id for i in (0, 3, 4, 1, 2, 5)]
