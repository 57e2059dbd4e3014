"""The adaptive policy's memory of recent block hashes (``RecentHashes``) and its shadows.

The sketch stands for a history of the last ``window`` hashes stored: these
tests hold it to that (every key of the window remembered, none long after),
bound its false "recent" answers, and check that its memory is fixed at
construction, whatever the traffic.
"""

import hashlib
import tracemalloc

import pytest

from kvoffload_hal.eviction.adaptive import (
    CANDIDATES,
    FRESH,
    RETURNED,
    AdaptiveEviction,
    Duel,
    RecentHashes,
)
from kvoffload_hal.eviction.sketch import GENERATIONS, HEADROOM


def _hashes(first, count, group=0):
    """Block hashes as vLLM makes them: a 32-byte digest, then the group id."""
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() + group.to_bytes(4, "big")
            for i in range(first, first + count)]


def _recent_after(window, age, keys=100):
    """The fraction of ``keys`` hashes recorded together that are still recent
    when the oldest of them has ``age`` newer ones."""
    sketch = RecentHashes(window)
    sketch.see_all(_hashes(2 * 10**6, 3 * window))  # a sketch in its steady state
    probe = _hashes(0, keys)
    sketch.see_all(probe)
    sketch.see_all(_hashes(10**6, age - keys))
    return sum(sketch.see_all(probe)) / keys


@pytest.mark.parametrize("window", [1000, 20_000])
def test_the_keys_of_the_window_are_remembered_and_none_long_after(window):
    """A history of the last ``window`` keys, within a few keys: at 90 % of the
    window at least 99 % of them are remembered; past the window by a
    generation and a bit, none (keys recorded together are forgotten together)."""
    assert _recent_after(window, int(0.9 * window)) >= 0.99
    assert _recent_after(window, int((1 + 1 / GENERATIONS) * window) + window // 8) == 0


def test_a_key_recorded_again_counts_once():
    sketch = RecentHashes(1000)
    keys = _hashes(0, 500)
    assert sketch.see_all(keys) == [False] * 500
    assert sketch.see_all(keys) == [True] * 500
    assert sketch.see_all(_hashes(10**6, 400)) == [False] * 400  # 900 new keys: all in
    assert all(sketch.see_all(keys))


def test_the_same_block_of_two_kv_cache_groups_is_two_keys():
    sketch = RecentHashes(1000)
    sketch.see_all(_hashes(0, 200, group=0))
    assert not any(sketch.see_all(_hashes(0, 200, group=1)))


def test_false_recent_answers_stay_rare():
    """Hashes never recorded, asked of a sketch in its steady state (full, and
    past several windows): at most 0.1 % are taken for recent ones (expected:
    about WAYS / 2**20, 0.01 %)."""
    window = 20_000
    sketch = RecentHashes(window)
    sketch.see_all(_hashes(0, 5 * window))
    new = sketch.see_all(_hashes(10**7, 100_000))
    assert sum(new) <= 100


def test_memory_is_fixed_at_construction():
    window = 40_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sketch = RecentHashes(window)
        built = tracemalloc.get_traced_memory()[0]
        for start in range(0, 10 * window, 4000):  # ten windows of traffic
            sketch.see_all(_hashes(start, 4000))
        after_traffic = tracemalloc.get_traced_memory()[0]
        del sketch
    finally:
        tracemalloc.stop()
    # 3 bytes per slot, HEADROOM slots per key of the window, nothing per access.
    assert built - before <= 3 * HEADROOM * window * 1.02 + 4096
    assert after_traffic - built < 16_384  # the key lists of the loop, not the sketch


def _policy_bytes():
    """Bytes held by objects the eviction modules allocated (tracemalloc on)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/kvoffload_hal/scheduler/eviction*.py")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_the_policy_memory_does_not_grow_with_accesses():
    """The whole adaptive policy (class array, sketch, shadows) after one and
    after five tier sizes of stores: under 32 bytes per block, and the same."""
    from kvoffload_hal.demo.eviction_replay import KeyHashes, make_replay_tier, replay_tier

    num_blocks = 8192
    tier = make_replay_tier(num_blocks, "lru")
    hashes = KeyHashes()
    chunk = num_blocks // 16
    chunks = [[[i * 16 + j for j in range(16)] for i in range(k, k + chunk)]
              for k in range(0, 6 * chunk, chunk)]
    tracemalloc.start()
    try:
        tier.eviction = AdaptiveEviction(tier.pool, num_blocks + 1, CANDIDATES)
        replay_tier(tier, chunks[0], hashes)
        first = _policy_bytes()
        for requests in chunks[1:]:
            replay_tier(tier, requests, hashes)
        last = _policy_bytes()
    finally:
        tracemalloc.stop()
    assert last <= 32 * num_blocks  # class 1 + sketch 27 + shadows 2.5 bytes per block
    assert abs(last - first) <= 0.01 * first


@pytest.mark.parametrize("num_blocks", [1, 7, 100, 8192, 10_000, 100_000, 4_000_000])
def test_the_sampled_hashes_are_those_below_the_sampling_bound(num_blocks):
    # The hot paths compare a hash with ``sample_below_hash`` (bytes order); the
    # rule is its first two bytes, big-endian, below ``sample_below``.
    duel = Duel(CANDIDATES, num_blocks)
    for first in range(256):
        for second in (0, 1, 0x7F, 0xFF):
            for rest in (b"\x00", b"\xff" * 35):
                key = bytes((first, second)) + rest
                assert (key < duel.sample_below_hash) == (
                    (first << 8 | second) < duel.sample_below), (key, duel.sample_below)


def test_a_stored_block_s_class_is_whether_the_history_saw_its_hash():
    # on_stored writes the sketch's answer (a bool) as the class.
    assert (FRESH, RETURNED) == (False, True)
