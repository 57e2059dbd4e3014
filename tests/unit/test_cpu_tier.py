"""CpuTier on its public methods: lookup, pins, publish, drop, events."""

import pytest

BS = 16  # the make_engine fixture's block size


@pytest.fixture
def tier(make_engine):
    engine = make_engine(cpu_blocks=8, kv_events=True)
    engine.offload.cpu.take_events()  # start from a clean event queue
    return engine, engine.offload.cpu


def _publish_chain(engine, cpu, n, seed=0):
    """A request's first ``n`` block hashes, published in ``n`` fresh CPU blocks."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = engine.add(f"req{seed}", [seed + 1 + i % 50 for i in range(n * BS + 1)])
    engine.scheduler.waiting.remove(req)
    blocks = cpu.allocate(n)
    cpu.publish(blocks, [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:n]])
    cpu.unpin(blocks)
    return req, blocks


def test_published_blocks_are_found_as_a_prefix_hit(tier):
    engine, cpu = tier
    req, blocks = _publish_chain(engine, cpu, 3)
    hit, tokens = cpu.find_hit(req.block_hashes, 0, 10_000)
    assert tokens == 3 * BS and list(hit[0]) == blocks
    hit, tokens = cpu.find_hit(req.block_hashes, 1, 10_000)  # from the second block on
    assert tokens == 2 * BS and list(hit[0]) == blocks[1:]
    assert cpu.find_hit(req.block_hashes, 0, 2 * BS)[1] == 2 * BS  # capped
    assert all(cpu.holds(b.block_hash) for b in blocks)


def test_a_miss_on_the_first_block_is_an_empty_hit(tier):
    engine, cpu = tier
    _publish_chain(engine, cpu, 2)
    other = engine.add("other", [77] * (2 * BS + 1))
    assert cpu.find_hit(other.block_hashes, 0, 10_000) == ((), 0)


def test_pinned_blocks_survive_lru_eviction_and_unpinned_ones_do_not(tier):
    engine, cpu = tier
    req_a, blocks_a = _publish_chain(engine, cpu, 3, seed=0)
    req_b, blocks_b = _publish_chain(engine, cpu, 3, seed=1)
    hit_a, _ = cpu.find_hit(req_a.block_hashes, 0, 10_000)
    cpu.pin_hit(hit_a)
    assert cpu.num_pinned_blocks() == 3
    taken = cpu.allocate(cpu.num_free_blocks())  # every unpinned block, evicting b
    assert cpu.find_hit(req_a.block_hashes, 0, 10_000)[1] == 3 * BS
    assert cpu.find_hit(req_b.block_hashes, 0, 10_000)[1] == 0
    cpu.unpin(taken)
    cpu.unpin_hit(hit_a)
    assert cpu.num_pinned_blocks() == 0


def test_drop_and_drop_all_forget_blocks(tier):
    engine, cpu = tier
    req, blocks = _publish_chain(engine, cpu, 3)
    cpu.drop([blocks[1].block_id])
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == BS  # the hit stops at the gap
    cpu.drop_all()
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 0


def test_publish_and_eviction_events_say_cpu(tier):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    engine, cpu = tier
    _, blocks = _publish_chain(engine, cpu, 2)
    cpu.drop_all()
    events = list(cpu.take_events())
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) == 2 and len(removed) >= 1
    assert {e.medium for e in stored + removed} == {"CPU"}
    assert [e.block_size for e in stored] == [BS, BS]


def test_with_an_eagle_drafter_a_hit_drops_its_last_block(make_engine, tiny_model_dir,
                                                          tiny_eagle_dir):
    """vLLM drops the last block of a device prefix-cache hit for drafters fed the
    target's hidden states (that block's draft KV was computed with the token after
    it); the CPU tier's hits, looked up by its own coordinator, follow the same rule."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from support.eagle_tier import eagle_cpu_tier

    engine = make_engine(cpu_blocks=8)
    cpu = eagle_cpu_tier(engine, tiny_model_dir, tiny_eagle_dir)
    req = engine.add("req", [1 + i % 50 for i in range(3 * BS + 1)])
    blocks = cpu.allocate(3)
    cpu.publish(blocks, [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:3]])
    cpu.unpin(blocks)
    hit, tokens = cpu.find_hit(req.block_hashes, 0, 10_000)
    assert tokens == 2 * BS and list(hit[0]) == blocks[:2]
