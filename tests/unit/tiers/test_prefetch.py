"""Prefetch: waiting requests' secondary-tier blocks promoted into the CPU tier before
vLLM's scheduler looks them up (scheduler/secondary/prefetch.py).

vLLM's real scheduler in the engine harness: two long "filler" requests take both
running slots, documents served before (now on disk only) wait behind them; the
fillers are aborted once the prefetch had time to land, and the documents run.
Every KV read is checked by the fake model.
"""

import time

import pytest

from support.prefetch_rig import count_waits, forget_caches, gate_reads

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOC_BLOCKS = 8


def _engine(make_engine, tmp_path, **prefetch):
    return make_engine(cpu_blocks=64, num_gpu_blocks=80, max_num_seqs=2, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 400 * PAGE, **prefetch})


def _doc(seed):
    return [(seed * 13 + i * 7) % 89 + 1 for i in range(DOC_BLOCKS * BS + 1)]


def _on_disk_only(engine, docs):
    """Serve each document once, then leave its blocks on disk alone."""
    for i, doc in enumerate(docs):
        engine.add(f"first-{i}", doc)
    engine.run_until_done()
    forget_caches(engine)
    assert engine.offload.cpu.find_hit(engine.add("probe", docs[0]).block_hashes, 0,
                                       10_000)[1] == 0
    engine.abort(["probe"])


def _queue_behind_fillers(engine, docs, steps=30, settle=True):
    """Fillers take both slots; the documents wait. Returns the filler ids and the
    blocks held by prefetch after each step; ``settle``: then step until no tier job
    is in flight (the fillers still running)."""
    fillers = [f"filler-{i}" for i in range(2)]
    for i, name in enumerate(fillers):
        engine.add(name, [90 + i] * (2 * BS + 1), max_tokens=1000)
    engine.step()
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc)
    held = []
    for _ in range(steps):
        engine.step()
        held.append(engine.offload.prefetch.num_held_blocks())
    deadline = time.monotonic() + 30
    while settle and engine.offload.tiers.has_pending():
        assert time.monotonic() < deadline, "tier jobs still in flight"
        time.sleep(0.002)
        engine.step()
        held.append(engine.offload.prefetch.num_held_blocks())
    return fillers, held


def _run_queue(engine, docs, steps=30):
    waits = count_waits(engine)
    fillers, held = _queue_behind_fillers(engine, docs, steps)
    prefetched = engine.offload.totals.data.get("blocks_prefetched", 0)
    waiting = [engine.scheduler.requests[f"doc-{i}"] for i in range(len(docs))]
    assert all(r.num_computed_tokens == 0 for r in waiting)  # still queued
    engine.abort(fillers)
    engine.run_until_done()
    engine.drain()
    for i in range(len(docs)):
        assert engine.outputs[f"doc-{i}"] == engine.outputs[f"first-{i}"]
    return prefetched, waits, held


def test_queued_requests_are_promoted_before_they_are_scheduled(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path, prefetch_requests=4, prefetch_cpu_share=1.0)
    docs = [_doc(s) for s in range(3)]
    _on_disk_only(engine, docs)
    hits = engine.offload.totals.data.get("cpu_hit_tokens", 0)
    prefetched, waits, _ = _run_queue(engine, docs)
    totals = engine.offload.totals.data
    assert prefetched == 3 * DOC_BLOCKS  # every document, while it waited
    assert totals["blocks_from_disk"] == 3 * DOC_BLOCKS  # promoted once, not again
    assert not any(waits[f"doc-{i}"] for i in range(3))  # admitted at its first lookup
    assert totals["cpu_hit_tokens"] - hits == 3 * DOC_BLOCKS * BS  # checked reads
    assert engine.offload.prefetch.num_held_blocks() == 0
    engine.assert_idle()


def test_without_prefetch_each_request_waits_for_its_promotion(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path, prefetch_requests=0)
    docs = [_doc(s) for s in range(3)]
    _on_disk_only(engine, docs)
    assert type(engine.offload.prefetch).__name__ == "NullPrefetcher"
    prefetched, waits, held = _run_queue(engine, docs)
    assert prefetched == 0 and not any(held)
    assert all(waits[f"doc-{i}"] >= 1 for i in range(3))  # promoted only once looked up
    assert engine.offload.totals.data["blocks_from_disk"] == 3 * DOC_BLOCKS
    engine.assert_idle()


@pytest.mark.parametrize("share, blocks, cap", [
    (0.25, 12, 12),  # 64 CPU blocks x 0.25 = 16, and 12 blocks: the smaller cap wins
    (0.25, 40, 16),
    (0.25, 0, 16),  # no cap in blocks: the share alone
])
def test_prefetch_holds_no_more_than_its_cap(make_engine, tmp_path, share, blocks, cap):
    engine = _engine(make_engine, tmp_path, prefetch_requests=4, prefetch_cpu_share=share,
                     prefetch_blocks=blocks)
    docs = [_doc(s) for s in range(4)]
    _on_disk_only(engine, docs)
    prefetched, waits, held = _run_queue(engine, docs)
    assert max(held) == cap and prefetched == cap  # of 4 x 8 blocks waiting
    assert not waits["doc-0"]
    if cap < 2 * DOC_BLOCKS:  # the second was prefetched in part, the third not at all:
        assert waits["doc-2"] >= 1  # it was left to its lookup
    assert engine.offload.totals.data["blocks_from_disk"] == 4 * DOC_BLOCKS
    engine.assert_idle()


def test_an_aborted_waiting_request_releases_its_prefetched_blocks(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path, prefetch_requests=4, prefetch_cpu_share=1.0)
    docs = [_doc(s) for s in range(2)]
    _on_disk_only(engine, docs)
    gate = gate_reads(engine.worker.worker.tiers.nearest)
    try:
        fillers, held = _queue_behind_fillers(engine, docs, steps=3, settle=False)
        assert held == [DOC_BLOCKS, 2 * DOC_BLOCKS, 2 * DOC_BLOCKS]  # one request a step
        engine.abort(["doc-0"])  # while its promotion is in flight
        assert engine.offload.prefetch.num_held_blocks() == DOC_BLOCKS
    finally:
        gate.set()
    for _ in range(30):
        engine.step()
    assert engine.offload.tiers.held_for("doc-1") == DOC_BLOCKS  # promoted, pinned
    engine.abort(["doc-1"])
    assert engine.offload.prefetch.num_held_blocks() == 0
    engine.abort(fillers)
    engine.run_until_done()
    engine.drain()
    assert engine.offload.num_pinned_cpu_blocks() == 0
    # What was prefetched stays in the CPU tier as ordinary content.
    again = engine.add("again", docs[1])
    assert engine.offload.cpu.find_hit(again.block_hashes, 0, 10_000)[1] == DOC_BLOCKS * BS
    engine.run_until_done()
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first-1"]
    engine.assert_idle()


@pytest.mark.parametrize("end", ["aborted while waiting", "served"])
def test_the_cpu_hit_a_prefetch_extends_is_released(make_engine, tmp_path, end):
    """A document's first blocks in the CPU tier, the rest on disk only: the prefetch
    promotes the rest and pins the CPU hit it extends, until the request is looked up
    (then served from the CPU tier) or aborted."""
    engine = _engine(make_engine, tmp_path, prefetch_requests=4, prefetch_cpu_share=1.0)
    doc = _doc(0)
    _on_disk_only(engine, [doc])
    in_cpu = 3
    engine.add("prefix", doc[:in_cpu * BS + 1])  # promotes its 3 blocks from disk
    engine.run_until_done()
    engine.drain()
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    totals = engine.offload.totals.data
    prefetched, hits = totals.get("blocks_prefetched", 0), totals.get("cpu_hit_tokens", 0)
    fillers, held = _queue_behind_fillers(engine, [doc])
    assert totals["blocks_prefetched"] - prefetched == DOC_BLOCKS - in_cpu  # from disk
    assert held[-1] == DOC_BLOCKS  # the promoted blocks and the CPU hit they extend
    if end == "aborted while waiting":
        engine.abort(["doc-0"])
        assert engine.offload.prefetch.num_held_blocks() == 0
    engine.abort(fillers)
    engine.run_until_done()
    engine.drain()
    if end == "served":
        assert engine.outputs["doc-0"] == engine.outputs["first-0"]
        assert totals["cpu_hit_tokens"] - hits == DOC_BLOCKS * BS  # all of it, checked
    assert engine.offload.num_pinned_cpu_blocks() == 0
    engine.assert_idle()


def test_no_secondary_tier_means_no_prefetcher(make_engine):
    engine = make_engine(extra_config={"prefetch_requests": 8})
    assert type(engine.offload.prefetch).__name__ == "NullPrefetcher"


def test_a_cache_reset_lets_go_of_prefetched_blocks(make_engine, tmp_path):
    """After vLLM's prefix-cache reset the prefetched CPU blocks are no prefix of
    anything: nothing stays pinned for the waiting requests (neither the CPU hits a
    prefetch extended nor what it promoted), which then recompute."""
    engine = _engine(make_engine, tmp_path, prefetch_requests=4, prefetch_cpu_share=1.0)
    docs = [_doc(s) for s in range(2)]
    _on_disk_only(engine, docs)
    for i, doc in enumerate(docs):  # each document's first 3 blocks back in the CPU tier
        engine.add(f"head-{i}", doc[:3 * BS + 1])
    engine.run_until_done()
    engine.drain()
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    fillers, held = _queue_behind_fillers(engine, docs, steps=4)
    assert held[-1] == 2 * DOC_BLOCKS
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # the fillers keep running
    assert engine.offload.prefetch.num_held_blocks() == 0
    assert all(engine.offload.tiers.held_for(f"doc-{i}") == 0 for i in range(2))
    engine.abort(fillers)
    engine.run_until_done()
    engine.drain()
    for i in range(2):
        assert engine.outputs[f"doc-{i}"] == engine.outputs[f"first-{i}"]
        assert engine.cached_tokens[f"doc-{i}"] == 0  # the reset forgot them everywhere
    engine.assert_idle()
