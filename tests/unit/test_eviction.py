"""The CPU tier's eviction order, on the real tier (vLLM's BlockPool and coordinator).

Requests are replayed as the scheduler drives the tier (find the hit, pin it,
load it, store the misses, publish, unpin): see ``eviction_replay``.
"""

import random

import pytest
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal import vllm_compat
from kvoffload_hal.demo.eviction_replay import KeyHashes, make_replay_tier, replay_tier
from kvoffload_hal.eviction.adaptive import (
    CANDIDATES,
    FRESH,
    HEAD,
    RETURNED,
    REUSED,
    TAIL,
    USED_UP,
    AdaptiveEviction,
    Insertion,
    Shadow,
)

CANDIDATE = {c.name: c for c in CANDIDATES}
SCAN_RESISTANT, LRU_ORDER = CANDIDATE["scan-resistant"], CANDIDATE["lru"]
KEEP_RESIDENTS = CANDIDATE["keep-residents"]


def _tier(num_blocks, eviction="adaptive", candidates=CANDIDATES):
    tier = make_replay_tier(num_blocks, eviction)
    if eviction == "adaptive":
        tier.eviction = AdaptiveEviction(tier.pool, num_blocks, candidates)
    return tier


def _chain(doc, n):
    return [doc * 1000 + i for i in range(n)]


def _hit_blocks(tier, request, hashes):
    return tier.find_hit([hashes(k) for k in request], 0, 1 << 30)[1] // tier.block_size


@pytest.mark.parametrize("eviction, a_hits, b_hits", [("lru", 0, 4), ("adaptive", 4, 2)])
def test_a_block_never_loaded_goes_before_a_loaded_one(eviction, a_hits, b_hits):
    """A was loaded back, B never was: storing C evicts B's deepest blocks, not A.
    vLLM's LRU evicts A, the oldest, from its first block on."""
    tier, hashes = _tier(8, eviction, [SCAN_RESISTANT]), KeyHashes()
    a, b, c = _chain(1, 4), _chain(2, 4), _chain(3, 2)
    replay_tier(tier, [a, a, b, c], hashes)
    assert _hit_blocks(tier, a, hashes) == a_hits
    assert _hit_blocks(tier, b, hashes) == b_hits


def test_blocks_of_one_release_go_deepest_first():
    """A partly evicted prefix keeps its head: the hit survives, shorter."""
    tier, hashes = _tier(8, candidates=[LRU_ORDER]), KeyHashes()
    a, b = _chain(1, 6), _chain(2, 4)
    replay_tier(tier, [a, b], hashes)  # B needs 2 of A's 6 blocks
    assert _hit_blocks(tier, a, hashes) == 4
    lru, hashes = _tier(8, "lru"), KeyHashes()
    replay_tier(lru, [a, b], hashes)
    assert _hit_blocks(lru, a, hashes) == 0  # vLLM's order takes A's first blocks


def _store(tier, keys, hashes, ends=()):
    """Store ``keys`` as a store job would; ``ends``: those that end a prompt exactly."""
    block_hashes = [make_block_hash_with_group_id(hashes(k), 0) for k in keys]
    blocks = tier.allocate(len(keys))
    tier.publish(blocks, block_hashes, {block_hashes[keys.index(k)] for k in ends})
    tier.unpin(blocks)
    return blocks


def _load(tier, keys, hashes):
    hit, _ = tier.find_hit([hashes(k) for k in keys], 0, 1 << 30)
    tier.pin_hit(hit)
    tier.record_load([b.block_id for b in hit[0]])
    tier.unpin_hit(hit)


def test_blocks_that_end_a_prompt_go_first_once_the_tier_is_full():
    """A and B end their prompts exactly: their last blocks are evicted before any
    other, whatever the candidate (here vLLM's order), including A's, released while
    the tier still had room. vLLM's LRU takes A's first blocks."""
    for eviction, a_hits, b_hits in (("adaptive", 3, 3), ("lru", 0, 4)):
        tier, hashes = _tier(8, eviction, [LRU_ORDER]), KeyHashes()
        a, b, c = _chain(1, 4), _chain(2, 4), _chain(3, 2)
        _store(tier, a, hashes, ends=a[-1:])
        _store(tier, b, hashes, ends=b[-1:])
        _store(tier, c, hashes)
        assert (_hit_blocks(tier, a, hashes), _hit_blocks(tier, b, hashes)) == (a_hits, b_hits)


def test_prompt_ends_go_first_when_the_tier_fills_for_the_first_time():
    """B, then A (whose last block ends its prompt) leave one block free; C's two
    blocks take it and evict one more: A's end, not one of B's blocks (vLLM's
    order takes B's first, so B has no hit left)."""
    for eviction, a_hits, b_hits in (("adaptive", 3, 3), ("lru", 4, 0)):
        tier, hashes = _tier(8, eviction, [LRU_ORDER]), KeyHashes()
        a, b, c = _chain(1, 4), _chain(2, 3), _chain(3, 2)
        _store(tier, b, hashes)
        _store(tier, a, hashes, ends=a[-1:])
        _store(tier, c, hashes)
        assert (_hit_blocks(tier, a, hashes), _hit_blocks(tier, b, hashes)) == (a_hits, b_hits)
        assert _hit_blocks(tier, c, hashes) == 2


def test_a_block_that_ends_a_prompt_is_an_ordinary_block_once_loaded():
    """A longer prompt read it: it has a use, and goes where its class says (here
    vLLM's order, which takes B, the older, first)."""
    tier, hashes = _tier(8, candidates=[LRU_ORDER]), KeyHashes()
    a, b = _chain(1, 4), _chain(2, 4)
    _store(tier, b, hashes)
    blocks = _store(tier, a, hashes, ends=a[-1:])
    _load(tier, a, hashes)
    assert tier.eviction.block_class(blocks[-1]) == REUSED
    _store(tier, _chain(3, 2), hashes)
    assert (_hit_blocks(tier, a, hashes), _hit_blocks(tier, b, hashes)) == (4, 2)


def test_a_block_stored_again_after_an_unused_eviction_is_protected():
    """The history: H is evicted without a hit and stored again, so it was wanted
    twice; it then outlives the blocks stored once after it. Placed at the head
    again (as a first-time block), the next store evicts it."""
    f, h, s, t = _chain(1, 4), _chain(2, 2), _chain(3, 2), _chain(4, 2)
    trace = [f, h, s, h, t]  # s evicts h (never loaded); h comes back
    returned_at_head = SCAN_RESISTANT._replace(name="returned-at-head", returned=HEAD)
    for candidate, h_hits in ((SCAN_RESISTANT, 2), (returned_at_head, 0)):
        tier, hashes = _tier(4, candidates=[candidate]), KeyHashes()
        assert replay_tier(tier, trace, hashes) == 0
        assert _hit_blocks(tier, h, hashes) == h_hits


def _classes_of(tier, keys, hashes):
    blocks = tier.cached(make_block_hash_with_group_id(hashes(k), 0) for k in keys)
    assert len(blocks) == len(keys)
    return [tier.eviction.block_class(b) for b in blocks]


def test_a_block_stored_again_three_tier_sizes_later_is_known_to_return():
    """The history spans HISTORY_FACTOR (8) tier sizes of stores: a request
    evicted and stored again after three tier sizes of other blocks is
    returning, and a scan-resistant tier keeps it through the next scan. A
    history of one tier size (8 times too short) takes it for a new one, puts it
    first in line and loses it to the scan."""
    num_blocks = 64
    hot = _chain(1, 8)
    filler = [_chain(50 + i, 8) for i in range(num_blocks // 8)]
    scan = [_chain(100 + i, 8) for i in range(3 * num_blocks // 8)]  # 3 tier sizes
    second_scan = [_chain(500 + i, 8) for i in range(num_blocks // 8)]
    tier, hashes = _tier(num_blocks, candidates=[SCAN_RESISTANT]), KeyHashes()
    # On a full tier hot goes first in line (stored once) and the scan evicts it.
    replay_tier(tier, [*filler, hot, *scan], hashes)
    assert _hit_blocks(tier, hot, hashes) == 0
    replay_tier(tier, [hot], hashes)  # stored again
    assert _classes_of(tier, hot, hashes) == [RETURNED] * 8
    replay_tier(tier, second_scan, hashes)
    assert _hit_blocks(tier, hot, hashes) == 8


def test_a_block_loaded_twice_is_used_up():
    """Classes follow the loads: loaded once (reused), loaded more (used up),
    stored again after an eviction (returned)."""
    tier, hashes = _tier(16, candidates=[LRU_ORDER]), KeyHashes()
    a, b = _chain(1, 4), _chain(2, 4)
    replay_tier(tier, [a, b], hashes)
    assert _classes_of(tier, a, hashes) == [FRESH] * 4
    replay_tier(tier, [a, b, a], hashes)
    assert _classes_of(tier, a, hashes) == [USED_UP] * 4
    assert _classes_of(tier, b, hashes) == [REUSED] * 4


def test_keep_residents_lets_a_block_loaded_twice_go_first():
    """keep-residents: a block loaded once is kept, one loaded twice is done
    (a loop larger than the tier has no third read of it)."""
    tier, hashes = _tier(8, candidates=[KEEP_RESIDENTS]), KeyHashes()
    a, b, c = _chain(1, 4), _chain(2, 4), _chain(3, 4)
    replay_tier(tier, [a, b, a, b, a], hashes)  # a loaded twice, b once
    replay_tier(tier, [c], hashes)  # evicts what is first in line
    assert _hit_blocks(tier, a, hashes) == 0
    assert _hit_blocks(tier, b, hashes) == 4


def test_a_shadow_counts_a_key_hit_twice_as_used_up():
    """The shadows move classes as the tier does: the second hit on a key makes
    it used up, which this candidate puts first in line."""
    shadow = Shadow(Insertion("used-up-first", TAIL, TAIL, TAIL, HEAD), capacity=2)
    one, two, three = (k.to_bytes(3, "little") for k in (1, 2, 3))
    for key in (one, two, one, one, three):  # one: hit twice; three evicts the first in line
        shadow.access(0, key, False)
    assert shadow.hits == 2
    shadow.access(0, two, False)
    assert shadow.hits == 3  # two was kept
    shadow.access(0, one, False)
    assert shadow.hits == 3  # one was evicted


def _docs(num_requests, num_docs, seed=0):
    """Requests reading one of ``num_docs`` 8-block documents and 1-4 blocks of their own."""
    rng, unique, trace = random.Random(seed), 10**7, []
    for _ in range(num_requests):
        doc, own = rng.randrange(num_docs), rng.randint(1, 4)
        trace.append([*_chain(doc, 8), *range(unique, unique + own)])
        unique += own
    return trace


@pytest.mark.parametrize("warm_up", [True, False], ids=["as-built", "no-warm-up"])
def test_a_tier_full_of_unused_blocks_serves_as_many_hits_as_lru(warm_up):
    """A tier that starts full of blocks no one reads (stored before; the
    shadows saw them stored, nothing else): over the next 1000 requests the
    adaptive tier hits as often as LRU. Deciding as soon as the shadows are
    full (no warm-up after that) picks the first candidate, which puts every
    new block first in line, behind the unused ones, and loses 12 %."""
    num_blocks = 8192
    unused = [[10**9 + i * 16 + j for j in range(16)] for i in range(num_blocks // 16 + 1)]
    work = _docs(1000, num_blocks // 4)
    hits = {}
    for eviction in ("lru", "adaptive"):
        tier, hashes = _tier(num_blocks, eviction), KeyHashes()
        if not warm_up and eviction == "adaptive":
            tier.eviction.duel._warm_after = tier.eviction.duel.capacity
        replay_tier(tier, unused, hashes)
        hits[eviction] = replay_tier(tier, work, hashes)
    if warm_up:
        assert hits["adaptive"] >= 0.95 * hits["lru"]
    else:
        assert hits["adaptive"] < 0.95 * hits["lru"]


def _cyclic(num_docs, blocks, rounds):
    return [_chain(d, blocks) for _ in range(rounds) for d in range(num_docs)]


def _reread_soon(num_docs, blocks, gap):
    """Each document read once, then again ``gap`` documents later: recency is right."""
    order = [d for i in range(num_docs + gap) for d in (i, i - gap) if 0 <= d < num_docs]
    return [_chain(d, blocks) for d in order]


def test_the_duel_leaves_lru_on_a_loop_larger_than_the_tier():
    trace = _cyclic(20, 16, 6)  # 320 blocks through a tier of 256
    lru = replay_tier(_tier(256, "lru"), trace)
    tier = _tier(256)
    adaptive = replay_tier(tier, trace)
    assert tier.eviction.duel.best().name != "lru"
    assert lru == 0 and adaptive > 0.5 * 256 * 5  # LRU thrashes, the duel keeps most


def test_the_duel_picks_lru_where_recency_is_right():
    """A first-time block at the head is evicted before its re-read: every
    candidate but LRU misses here, and the duel learns it."""
    trace = _reread_soon(300, 8, gap=3)
    head_only = replay_tier(_tier(256, candidates=[SCAN_RESISTANT]), trace)
    tier = _tier(256)
    hits = replay_tier(tier, trace)
    lru = replay_tier(_tier(256, "lru"), trace)
    assert tier.eviction.duel.best().name == "lru"
    assert lru == 300 * 8 and head_only < 0.2 * lru and hits > 0.9 * lru


def test_a_candidate_places_each_class_where_it_says():
    tier = _tier(8, candidates=[Insertion("all-head", HEAD, HEAD, HEAD, HEAD)])
    a, b = _chain(1, 4), _chain(2, 4)
    hashes = KeyHashes()
    replay_tier(tier, [a, b, a], hashes)
    queue = [blk.block_hash for blk in vllm_compat.iter_free_blocks(tier.pool.free_block_queue)]
    a_hashes = [make_block_hash_with_group_id(hashes(k), 0) for k in a]
    assert queue[:4] == a_hashes[::-1]  # just loaded, placed at the head, deepest first
    tier, hashes = _tier(8, candidates=[LRU_ORDER]), KeyHashes()
    replay_tier(tier, [a, b, a], hashes)
    queue = [blk.block_hash for blk in vllm_compat.iter_free_blocks(tier.pool.free_block_queue)]
    assert queue[-4:] == a_hashes[::-1]  # at the tail, deepest first


def test_reset_forgets_protection():
    tier, hashes = _tier(8, candidates=[SCAN_RESISTANT]), KeyHashes()
    a = _chain(1, 4)
    replay_tier(tier, [a, a], hashes)
    tier.drop_all()
    assert not any(tier.eviction._classes)
    assert _hit_blocks(tier, a, hashes) == 0


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_the_scheduler_tells_the_policy_of_every_load_and_store(make_engine, lazy):
    """On vLLM's real scheduler: each block loaded is a hit the policy saw and
    protects; each block stored is a miss it saw."""
    engine = make_engine(lazy=lazy, extra_config={"eviction": "adaptive"})
    cpu = engine.offload.cpu
    assert cpu.eviction.name == "adaptive"
    cpu.eviction.trace = []
    rng = __import__("random").Random(0)
    docs = [[rng.randrange(1, 90) for _ in range(80)] for _ in range(6)]
    for round_ in ("a", "b"):  # the second pass finds the device's evictions on the CPU
        for i, d in enumerate(docs):
            engine.add(f"{round_}{i}", d + ([5, 6] if round_ == "b" else []))
        engine.run_until_done()
    engine.drain()
    totals = engine.offload.totals.data
    loads = [key for key, hit in cpu.eviction.trace if hit]
    stores = [key for key, hit in cpu.eviction.trace if not hit]
    assert len(loads) == totals["blocks_loaded"] > 0
    assert len(stores) == totals["blocks_stored"] > 0
    protected = {b.block_hash for b in cpu.pool.blocks
                 if cpu.eviction.block_class(b) in (REUSED, USED_UP)}
    assert protected and protected <= set(loads)
