"""Properties of the CPU tier's eviction on random traces, on the real tier.

The tier under test is :class:`~kvoffload_hal.scheduler.cpu_tier.CpuTier` with the
policy the connector uses (vLLM's ``BlockPool`` underneath), driven by the same
replay as the benchmark. For any trace, tier size and pins:

* the tier never caches more blocks than it has, and its free queue stays a
  well-formed list of exactly the unreferenced blocks (the policy moves blocks
  within it);
* a pinned block (a load, store or promotion in flight) is never evicted;
* no policy scores more hit blocks than Belady's offline optimum.
"""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal import vllm_compat
from kvoffload_hal.demo.eviction_replay import (
    KeyHashes,
    belady_hits,
    count_oracle_hits,
    make_replay_tier,
    replay_tier,
)
from kvoffload_hal.eviction.adaptive import CANDIDATES, AdaptiveEviction, Shadow

CANDIDATE_LRU = next(c for c in CANDIDATES if c.name == "lru")
# vLLM's LRU, the duel over every candidate, and each candidate alone.
POLICIES = [("lru", None), ("adaptive", CANDIDATES), *(("adaptive", (c,)) for c in CANDIDATES)]

# A request: (prefix family, branch, length). Requests of one family share
# their first three blocks, then branch: a prefix tree, as prompts make.
requests = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 8)),
                    min_size=1, max_size=60)
pins = st.lists(st.booleans(), min_size=60, max_size=60)


def _keys(family, branch, length):
    return [family * 10_000 + (branch if i >= 3 else 0) * 100 + i for i in range(length)]


def _tier(capacity, policy):
    name, candidates = policy
    tier = make_replay_tier(capacity, name)
    if name == "adaptive":
        tier.eviction = AdaptiveEviction(tier.pool, capacity + 1, candidates)
    return tier


def _check_queue(tier, capacity):
    pool = tier.pool
    seen = set()
    for block in vllm_compat.iter_free_blocks(pool.free_block_queue):
        assert block.ref_cnt == 0 and not block.is_null
        assert block.block_id not in seen
        seen.add(block.block_id)
    assert len(seen) == pool.get_num_free_blocks()
    cached = [b for b in pool.blocks if b.block_hash is not None and not b.is_null]
    assert len(cached) <= capacity
    referenced = {b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
    assert len(seen) + len(referenced) == capacity  # every block is free or referenced


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(2, 24), policy=st.sampled_from(POLICIES), trace=requests,
       pin_after=pins)
def test_capacity_pins_and_the_optimum_hold_on_random_traces(capacity, policy, trace, pin_after):
    tier, hashes = _tier(capacity, policy), KeyHashes()
    keys = [_keys(*r) for r in trace]
    hits = 0
    held = None  # (blocks, their hashes) pinned across the next request, as a copy in flight
    for i, request in enumerate(keys):
        hits += replay_tier(tier, [request], hashes)
        _check_queue(tier, capacity)
        if held is not None:
            blocks, block_hashes = held
            assert [b.block_hash for b in blocks] == block_hashes  # never evicted
            assert all(tier.holds(h) for h in block_hashes)
            tier.unpin(blocks)
            held = None
        if pin_after[i]:
            hit, _ = tier.find_hit([hashes(k) for k in request], 0, 1 << 30)
            if hit and hit[0]:
                blocks = list(hit[0])
                tier.pin(blocks)
                held = (blocks, [b.block_hash for b in blocks])
                # Another lookup finds the same blocks and lets go without a load
                # (the scheduler took no external tokens): still referenced.
                tier.pin_hit(hit)
                tier.unpin_hit(hit)
        _check_queue(tier, capacity)
    assert hits <= belady_hits(keys, capacity)


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(1, 30), trace=requests)
def test_belady_is_at_least_every_policy_and_lru_of_a_big_tier_misses_only_once(capacity, trace):
    keys = [_keys(*r) for r in trace]
    optimum = belady_hits(keys, capacity)
    total = sum(len(r) for r in keys)
    distinct = len({k for r in keys for k in r})
    assert optimum <= total - min(distinct, total)  # every block's first use misses
    if capacity >= distinct:  # nothing is evicted: every later use hits, for every policy
        for policy in POLICIES:
            assert replay_tier(_tier(capacity, policy), keys) == total - distinct == optimum


def test_stored_blocks_are_published_under_group_zero_hashes():
    """The replay publishes as the scheduler does: hashes with the group id."""
    tier, hashes = _tier(4, POLICIES[1]), KeyHashes()
    replay_tier(tier, [[1, 2]], hashes)
    assert tier.holds(make_block_hash_with_group_id(hashes(1), 0))


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(1, 30), trace=requests)
def test_knowing_how_often_blocks_are_read_serves_no_more_than_belady(capacity, trace):
    keys = [_keys(*r) for r in trace]
    assert count_oracle_hits(keys, capacity) <= belady_hits(keys, capacity)


def test_knowing_how_often_keeps_the_block_read_most_and_bypasses_the_rest():
    # Block 1 is read three times, 2 and 3 once: a one-block cache keeps 1.
    trace = [[1], [2], [1], [3], [1]]
    assert count_oracle_hits(trace, 1) == 2
    assert replay_tier(make_replay_tier(1, "lru"), trace) == 0
    # Equal reads left: the cached block stays (the order, not the count, decides).
    assert count_oracle_hits([[1], [2], [1], [2]], 1) == 1
    assert count_oracle_hits([[1], [2], [1], [2]], 1, counted_from=3) == 0


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 12), keys=st.lists(st.integers(0, 30), max_size=200))
def test_the_lru_shadow_scores_an_lru_caches_hits(capacity, keys):
    """The duel's shadows are caches: the one of the ``lru`` candidate scores
    exactly the hits of an LRU cache of its size."""
    shadow = Shadow(CANDIDATE_LRU, capacity)
    reference: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in keys:
        shadow.access(0, key.to_bytes(3, "little"), False)
        if key in reference:
            hits += 1
            reference.move_to_end(key)
        else:
            reference[key] = None
            if len(reference) > capacity:
                reference.popitem(last=False)
    assert shadow.hits == hits
