"""Store policies on a real vLLM device ``BlockPool``: which blocks each one offers."""

import logging
from types import SimpleNamespace

import pytest
import torch

from kvoffload_hal.demo.inprocess import set_inprocess_env

set_inprocess_env()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvoffload_hal import vllm_compat  # noqa: E402
from kvoffload_hal.scheduler.store_policy import (  # noqa: E402
    BlockPicker,
    EagerPolicy,
    LazyPolicy,
    lazy_window_blocks,
)

BS = 16


def _pool(num_blocks=40):
    return BlockPool(num_blocks, enable_caching=True, hash_block_size=BS)


def _hash(i):
    return make_block_hash_with_group_id(i.to_bytes(32, "little"), 0)


def _set_hash(pool, block, block_hash):
    vllm_compat.insert_block_hashes(pool, [block], [block_hash])  # as vLLM caches it


def _cached_free_blocks(pool, n):
    """``n`` hashed blocks returned to the free queue, in this order (oldest first)."""
    blocks = pool.get_new_blocks(n)
    for i, block in enumerate(blocks):
        _set_hash(pool, block, _hash(1000 + i))
    pool.free_blocks(blocks)
    return blocks


def _everything(block):
    return True


def test_lazy_offers_only_the_window_at_the_head_of_the_free_queue():
    pool = _pool()
    cached = _cached_free_blocks(pool, 30)  # taken from the head, returned to the tail
    # Never-used blocks now lead the free queue (the null block is not in it).
    fresh = pool.free_block_queue.num_free_blocks - 30
    policy = LazyPolicy(window_blocks=fresh + 5)
    policy.bind(pool)
    picker = BlockPicker(budget=100, wanted=_everything)
    policy.select(None, picker)
    # The window ends 5 blocks into the cached ones: never hashed blocks are not offered.
    assert [b.block_id for b in picker.blocks] == [b.block_id for b in cached[:5]]


def test_lazy_window_smaller_than_the_free_queue_stops_at_its_end():
    pool = _pool()
    cached = _cached_free_blocks(pool, 39)  # the whole free queue is cached blocks
    for window in (1, 4, 17):
        policy = LazyPolicy(window)
        policy.bind(pool)
        picker = BlockPicker(budget=100, wanted=_everything)
        policy.select(None, picker)
        assert [b.block_id for b in picker.blocks] == [b.block_id for b in cached[:window]]


def test_lazy_respects_the_budget_and_skips_unwanted_blocks():
    pool = _pool()
    cached = _cached_free_blocks(pool, 39)
    policy = LazyPolicy(10)
    policy.bind(pool)
    stored = {cached[1].block_id, cached[2].block_id}
    picker = BlockPicker(budget=3, wanted=lambda b: b.block_id not in stored)
    policy.select(None, picker)
    assert [b.block_id for b in picker.blocks] == [cached[i].block_id for i in (0, 3, 4)]


def test_a_pickers_free_order_is_each_run_deepest_first():
    """vLLM frees a request's blocks of a group deepest first; a store frees what it kept
    the same way, each run offered together on its own, and a lone offer as it came."""
    pool = _pool()
    blocks = _cached_free_blocks(pool, 8)
    ids = [b.block_id for b in blocks]
    picker = BlockPicker(budget=100, wanted=_everything)
    picker.offer_ids(blocks, range(8), 0, 3)  # one request's group: blocks 0-2
    picker.offer_ids(blocks, range(8), 3, 5)  # the next group, or request: 3-4
    picker.offer(blocks[5])
    picker.offer(blocks[6])
    assert [b.block_id for b in picker.free_order(7)] == [ids[i] for i in (2, 1, 0, 4, 3, 5, 6)]
    # Fewer CPU blocks than kept: the store takes the first ones, in the same order.
    assert [b.block_id for b in picker.free_order(4)] == [ids[i] for i in (2, 1, 0, 3)]


def _config(*specs):
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s)
                                          for i, s in enumerate(specs)])


def test_lazy_window_is_two_steps_of_allocations_per_group():
    kw = dict(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    full = FullAttentionSpec(**kw)
    window = SlidingWindowSpec(sliding_window=100, **kw)
    mamba = MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,))
    # Full attention: a step allocates at most a batch's tokens.
    assert lazy_window_blocks(_config(full), 512) == 2 * 32
    assert lazy_window_blocks(_config(full), 100) == 2 * 7
    # Sliding window: never more than the window plus one block, whatever the batch.
    assert lazy_window_blocks(_config(window), 512) == 2 * (7 + 1)
    # Mamba: the state and the one being written.
    assert lazy_window_blocks(_config(mamba), 512) == 2 * 2
    assert lazy_window_blocks(_config(full, window, mamba), 512) == 2 * (32 + 8 + 2)


def _request(req_id, computed, prompt=1 << 30):
    return SimpleNamespace(request_id=req_id, num_computed_tokens=computed,
                           num_output_placeholders=0, num_prompt_tokens=prompt)


def _scheduled(req_id, new_block_ids):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=new_block_ids)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))


def _hashed(pool, n):
    blocks = pool.get_new_blocks(n)
    for i, block in enumerate(blocks):
        _set_hash(pool, block, _hash(i))
    return blocks


def _eager(num_blocks, computed, prompt=1 << 30):
    """A bound eager policy and request "r" holding ``num_blocks`` hashed device blocks."""
    pool = _pool()
    blocks = _hashed(pool, num_blocks)
    policy = EagerPolicy([BS], [0])
    policy.bind(pool)
    req = _request("r", computed=computed, prompt=prompt)
    policy.on_allocated(req, 1)
    return pool, blocks, policy, req


def test_eager_offers_each_confirmed_full_block_once():
    pool, blocks, policy, req = _eager(4, computed=2 * BS + 3)  # two full blocks confirmed
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("r", ([b.block_id for b in blocks],)), picker)
    assert picker.blocks == blocks[:2]
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("r", None), picker)
    assert picker.blocks == []  # nothing new confirmed
    req.num_computed_tokens = 4 * BS
    picker = BlockPicker(100, _everything)
    policy.on_finished(req, ([b.block_id for b in blocks],), picker)
    assert picker.blocks == blocks[2:]  # the last blocks, from the final block table


@pytest.mark.parametrize("prompt, end", [(3 * BS, 2), (3 * BS + 1, None), (BS, 0)])
def test_eager_names_the_block_that_ends_the_prompt_exactly(prompt, end):
    """Only a prompt that fills its last block has one: its own lookups never read it."""
    pool, blocks, policy, req = _eager(4, computed=4 * BS, prompt=prompt)
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("r", ([b.block_id for b in blocks],)), picker)
    assert picker.blocks == blocks
    assert picker.prompt_ends == ({blocks[end].block_hash} if end is not None else set())


def test_eager_offers_a_finished_requests_leftovers_while_the_device_holds_them():
    pool, blocks, policy, req = _eager(4, computed=4 * BS)
    ids = [b.block_id for b in blocks]
    picker = BlockPicker(1, _everything)  # room for one block when the request finishes
    policy.on_finished(req, (ids,), picker)
    assert picker.blocks == blocks[:1] and policy.has_pending()
    pool.free_blocks(blocks)  # the request is gone; its blocks stay cached on the device
    picker = BlockPicker(2, _everything)
    policy.select(_scheduled("x", None), picker)
    assert picker.blocks == blocks[1:3] and policy.has_pending()
    blocks[3].reset_hash()  # evicted from the device meanwhile: nothing left to store
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("x", None), picker)
    assert picker.blocks == [] and not policy.has_pending()


def test_eager_rewinds_on_preemption_and_reset():
    _, blocks, policy, req = _eager(2, computed=2 * BS)
    ids = [b.block_id for b in blocks]
    policy.select(_scheduled("r", (ids,)), BlockPicker(100, _everything))
    policy.reset()  # the CPU tier forgot them: offered again
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("r", None), picker)
    assert picker.blocks == blocks
    policy.on_preempted("r")  # a fresh block table: the old ids are forgotten
    picker = BlockPicker(100, _everything)
    policy.select(_scheduled("r", None), picker)
    assert picker.blocks == []


def test_picker_keeps_one_block_per_hash_and_stops_when_full():
    pool = _pool()
    a, b, c = _hashed(pool, 3)
    twin = pool.get_new_blocks(1)[0]
    _set_hash(pool, twin, a.block_hash)
    picker = BlockPicker(2, _everything)
    for block in (a, twin, pool.null_block, b):
        picker.offer(block)
    assert picker.blocks == [a, b] and picker.full


def test_eager_needs_the_device_pool_bound():
    policy = EagerPolicy([BS], [0])
    policy.on_allocated(_request("r", computed=BS), 1)
    with pytest.raises(AssertionError, match="bind"):
        policy.select(_scheduled("r", ([1],)), BlockPicker(100, _everything))


def test_a_model_with_align_mode_mamba_state_gets_lazy_stores_said_once(caplog):
    """Eager stores never take a block its group replaces in place (align-mode Mamba
    state): such a model is switched to lazy stores, with one line at start-up."""
    from kvoffload_hal.config import OffloadConfig
    from kvoffload_hal.scheduler.core import _make_policy

    kw = dict(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    config = _config(FullAttentionSpec(**kw),
                     MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,)))
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=512))
    eager = OffloadConfig.from_extra_config({})

    def cpu(unstable):
        return SimpleNamespace(unstable_groups=unstable, group_block_sizes=[BS, BS],
                               cacheable_groups=[g for g in (0, 1) if g not in unstable])

    assert isinstance(_make_policy(eager, config, vllm_config, cpu([])), EagerPolicy)
    assert not caplog.records
    with caplog.at_level(logging.INFO):
        assert isinstance(_make_policy(eager, config, vllm_config, cpu([1])), LazyPolicy)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "lazy stores for this model" in said[0] and "MambaSpec" in said[0]
