"""TierIndex: capacity, LRU eviction, pins and readiness."""

from kvoffload_hal.scheduler.secondary.index import TierIndex


def test_reserve_commit_and_ready_run():
    index = TierIndex(capacity_blocks=4)
    assert index.reserve(["a", "b", "c"]) == ["a", "b", "c"]
    assert index.ready_run(["a", "b", "c"]) == 0  # written on no rank yet
    index.commit(["a", "b"])
    assert index.ready_run(["a", "b", "c"]) == 2
    assert index.ready_run(["b", "a"]) == 2 and index.ready_run(["x", "a"]) == 0


def test_full_index_evicts_least_recently_used_ready_unpinned():
    index = TierIndex(capacity_blocks=3)
    index.reserve(["a", "b", "c"])
    index.commit(["a", "b", "c"])
    index.pin(["a"])  # being promoted, and now most recently used
    assert index.reserve(["d"]) == ["d"]  # evicts b (a is pinned)
    assert "b" not in index and "a" in index
    assert index.take_evicted() == ["b"]
    index.unpin(["a"])
    index.commit(["d"])
    assert index.reserve(["e"]) == ["e"]  # c is now the least recently used
    assert index.take_evicted() == ["c"] and index.take_evicted() == []


def test_reserve_stops_when_nothing_is_evictable():
    index = TierIndex(capacity_blocks=2)
    index.reserve(["a", "b"])  # not committed: writes in flight are never evicted
    assert index.reserve(["c", "d"]) == []
    index.commit(["a"])
    index.pin(["a"])
    assert index.reserve(["c"]) == []
    assert len(index) == 2


def test_drop_and_reset():
    index = TierIndex(capacity_blocks=8)
    index.reserve(["a", "b", "c"])
    index.commit(["a", "b"])
    index.pin(["b"])
    index.drop(["c"])
    index.reset()  # b is being read: kept until its reader is done, never readable again
    assert "a" not in index and "b" in index and "c" not in index
    assert sorted(index.take_evicted()) == ["a", "c"]
    assert not index.is_ready("b") and index.ready_run(["b"]) == 0
    index.unpin(["b"])
    assert "b" not in index and index.take_evicted() == ["b"]
