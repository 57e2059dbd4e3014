"""Disk hits longer than the CPU tier, staged through it in rounds (scheduler/secondary/staged.py).

vLLM's real scheduler and both connector roles (``engine_harness.py``): the fake model
checks every KV read, so a block loaded into the wrong place, or read before it
landed, fails the test unless it was reported as a failed load.
"""

import threading
import time

from support.disk_files import flip_a_byte_of_block, flip_a_byte_of_every_block
from support.serving_rig import document, serve

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOC_BLOCKS = 20
CPU_BLOCKS = 6  # far fewer than a document's blocks


def _doc(seed):
    return document(seed, DOC_BLOCKS)


def _serve(engine, *requests):
    return serve(engine, *requests)


def _engine(make_engine, tmp_path, num_gpu_blocks=24, **kwargs):
    # Prefill 4 blocks per step: each step's blocks reach the CPU tier, then the disk.
    return make_engine(cpu_blocks=CPU_BLOCKS, num_gpu_blocks=num_gpu_blocks,
                       max_num_batched_tokens=4 * BS, extra_config={
                           "disk_path": str(tmp_path / "kv"),
                           "disk_bytes_to_use": 256 * PAGE}, **kwargs)


def _on_disk_only(engine, *docs):
    """Serve each document, then two others: each leaves the device and the CPU tier.
    The first requests, with their block hashes."""
    first = [_serve(engine, (f"first-{i}", doc))[0] for i, doc in enumerate(docs)]
    for i in range(2):
        _serve(engine, (f"other-{i}", _doc(50 + i)))
    return first


def _rounds(engine):
    return [r for meta in engine.sent if meta is not None for r in meta.rounds]


def _delta(engine, before, key):
    return engine.offload.totals.data.get(key, 0) - before.get(key, 0)


def test_a_hit_longer_than_the_cpu_tier_comes_back_whole(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS  # every full block came back
    assert _delta(engine, before, "staged_hits") == 1
    assert _delta(engine, before, "blocks_from_disk") >= DOC_BLOCKS - CPU_BLOCKS
    rounds = _rounds(engine)
    assert len(rounds) >= DOC_BLOCKS // CPU_BLOCKS and sum(r.final for r in rounds) == 1
    assert all(len(r.cpu_blocks) <= CPU_BLOCKS for r in rounds)
    engine.assert_idle()  # every CPU, device and tier pin released


def test_two_staged_hits_at_once_both_finish(make_engine, tmp_path):
    """Each round takes free CPU blocks and gives them back: no deadlock."""
    engine = _engine(make_engine, tmp_path, num_gpu_blocks=2 * DOC_BLOCKS + 8)
    docs = [_doc(1), _doc(2)]
    _on_disk_only(engine, *docs)
    for _ in range(2):  # the device holds both documents: push them out
        _serve(engine, *((f"push-{i}", _doc(60 + i)) for i in range(2)))
        engine.scheduler.reset_prefix_cache()
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again-0", docs[0]), ("again-1", docs[1]))
    for i in range(2):
        assert engine.outputs[f"again-{i}"] == engine.outputs[f"first-{i}"]
        assert engine.cached_tokens[f"again-{i}"] == DOC_BLOCKS * BS
    assert _delta(engine, before, "staged_hits") >= 1
    engine.assert_idle()


def test_a_second_request_on_a_staged_hit_waits_and_copies_nothing(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path, num_gpu_blocks=2 * DOC_BLOCKS + 8)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    engine.scheduler.reset_prefix_cache()
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again-0", doc), ("again-1", doc))
    assert engine.outputs["again-0"] == engine.outputs["again-1"] == engine.outputs["first-0"]
    assert [engine.cached_tokens[f"again-{i}"] for i in range(2)] == [DOC_BLOCKS * BS] * 2
    assert _delta(engine, before, "staged_hits") == 1
    # One copy of each block: the second request took the device prefix-cache hit.
    assert _delta(engine, before, "blocks_loaded") == DOC_BLOCKS
    assert _delta(engine, before, "shared_load_waits") == 1  # a request, not a step
    assert _delta(engine, before, "blocks_from_disk") <= DOC_BLOCKS
    engine.assert_idle()


def test_aborting_a_staged_request_mid_way_strands_nothing(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    engine.add("doomed", doc)
    for _ in range(100):
        engine.step()
        if any(not r.final for r in _rounds(engine)):
            break
    assert any(not r.final for r in _rounds(engine)), "no round was sent"
    engine.abort(["doomed"])
    engine.run_until_done()
    engine.drain()
    engine.assert_idle()
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first-0"]
    engine.assert_idle()


def test_a_corrupted_block_ends_the_hit_there(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    root = engine.worker.worker.tiers.nearest.root
    flip_a_byte_of_every_block(root)
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again", doc))
    # Recomputed from the first corrupted block on: the model saw only correct KV.
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert _delta(engine, before, "blocks_from_disk") == 0
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


def test_a_corrupted_block_in_the_middle_ends_the_hit_there(make_engine, tmp_path):
    """The blocks before it are served; nothing after it is promoted or loaded."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    (first,) = _on_disk_only(engine, doc)
    bad = DOC_BLOCKS // 2 - 1  # not at a promotion's edge: CPU_BLOCKS does not divide it
    flip_a_byte_of_block(engine.worker.worker.tiers.nearest.root, first.block_hashes[bad])
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert _delta(engine, before, "blocks_from_disk") == bad  # none from it on
    assert engine.cached_tokens["again"] == bad * BS  # recomputed from it on
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


def test_a_failed_first_round_ends_the_hit_there(make_engine, tmp_path):
    """Its copy failed: no later round is promoted or sent, and the request recomputes."""
    from support import flaky_backend  # noqa: F401 (registers flaky-loads: one load fails)

    engine = _engine(make_engine, tmp_path, backend="flaky-loads")
    doc = _doc(1)
    _on_disk_only(engine, doc)
    assert engine.worker.worker.backend.failed_loads == 0  # no load yet: the next one fails
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert engine.worker.worker.backend.failed_loads == 1
    rounds = [r for meta in engine.sent[sent:] if meta is not None for r in meta.rounds]
    assert sum(not r.final for r in rounds) == 1  # the one that failed, and the last
    # At most the promotion in flight when it failed came on: not the whole document.
    assert _delta(engine, before, "blocks_from_disk") <= 2 * CPU_BLOCKS < DOC_BLOCKS
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


def test_a_rounds_cpu_blocks_wait_for_every_rank(make_engine, tmp_path):
    """With two ranks, a round's CPU blocks stay pinned until the second one reported it."""
    from support.second_rank import SecondRank

    engine = _engine(make_engine, tmp_path, ranks=2)
    rank1 = SecondRank(engine)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    engine.add("again", doc)
    assert rank1.run_checking_round_pins(engine, "again", max_steps=2000) >= 2
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS
    assert engine.offload.totals.data["staged_hits"] == 1
    engine.assert_idle()


def test_failed_round_copies_are_recomputed(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path, backend="failing-loads")
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert any(not r.final for r in _rounds(engine))
    assert _delta(engine, before, "staged_hits") == 0
    assert engine.worker.worker.totals.data.get("failed_jobs", 0) > 0
    engine.assert_idle()


def test_a_failed_load_of_a_promoted_hit_is_not_promoted_again(make_engine, tmp_path):
    """vLLM looks a request whose load failed up again; promoting its disk blocks again
    would fail again, for ever, on a device that fails every load."""
    engine = make_engine(backend="failing-loads-async", cpu_blocks=12, num_gpu_blocks=24,
                         max_num_batched_tokens=4 * BS, extra_config={
                             "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 256 * PAGE})
    doc = _doc(1)[:8 * BS + 1]  # fits the CPU tier: promoted whole, then loaded
    _serve(engine, ("first", doc))
    for i in range(2):
        _serve(engine, (f"other-{i}", _doc(50 + i)[:8 * BS + 1]))
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    assert _delta(engine, before, "blocks_from_disk") > 0
    assert engine.worker.worker.totals.data.get("failed_jobs", 0) > 0
    engine.assert_idle()


def test_a_staged_hit_without_room_gives_up_and_recomputes(make_engine, tmp_path, monkeypatch):
    """Disk writes that never end hold every CPU block: after MAX_ROOM_WAIT_S the rest
    of the hit is reported failed and recomputed, with nothing stranded."""
    from kvoffload_hal.scheduler.secondary import reads

    monkeypatch.setattr(reads, "MAX_ROOM_WAIT_S", 0.3)
    engine = make_engine(cpu_blocks=4, num_gpu_blocks=16, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 256 * PAGE})
    doc = _doc(1)[:6 * BS + 1]
    _serve(engine, ("first", doc))
    for seed in range(2, 5):
        _serve(engine, (f"other-{seed}", _doc(seed)[:6 * BS + 1]))
    tier = engine.worker.worker.tiers.nearest
    gate = threading.Event()  # disk writes wait here: the spills hold the CPU tier
    write = tier._store_batch
    tier._store_batch = lambda items: (gate.wait(30), write(items))[1]
    try:
        engine.add("last", _doc(5)[:6 * BS + 1])
        while "last" not in engine.finished:
            engine.step()
        assert engine.offload.cpu.num_free_blocks() == 0
        engine.add("again", doc)
        deadline = time.monotonic() + 20
        while "again" not in engine.finished and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.01)
        assert "again" in engine.finished, "the staged hit waited past its limit"
    finally:
        gate.set()
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] < 6 * BS  # recomputed, not served
    assert engine.offload.totals.data.get("staged_hits", 0) == 0
    engine.assert_idle()


def test_a_prefetched_request_with_a_long_hit_is_still_served_whole(make_engine, tmp_path):
    """Prefetch promotes what its budget allows while the request waits; the rest of
    the hit is staged at its lookup, not recomputed."""
    from support.prefetch_rig import forget_caches

    engine = make_engine(cpu_blocks=CPU_BLOCKS * 2, num_gpu_blocks=2 * DOC_BLOCKS + 16,
                         max_num_seqs=1, max_num_batched_tokens=4 * BS, extra_config={
                             "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 256 * PAGE,
                             "prefetch_requests": 2})
    doc = _doc(1)
    _serve(engine, ("first", doc))
    forget_caches(engine)
    engine.add("filler", [90] * (2 * BS + 1), max_tokens=40)  # takes the only slot
    engine.step()
    engine.add("again", doc)
    for _ in range(20):
        engine.step()
    assert engine.offload.totals.data.get("blocks_prefetched", 0) > 0
    engine.run_until_done()
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS
    assert engine.offload.totals.data.get("staged_hits", 0) == 1
    engine.assert_idle()


def test_landed_loads_behind_a_request_the_device_cannot_take_are_picked_up(make_engine,
                                                                           tmp_path):
    """vLLM < 0.32 stops its scan of the waiting queue at the first request it cannot
    allocate. Queued requests whose disk hits are promoted ask again later; those behind
    them, with no CPU room left, are staged and take the device. Once the promoted ones
    need device blocks, the staged ones (done, holding them) must still be picked up:
    without that, 0.23 stalled here for ever (0.32 drains block holders first)."""
    from support.prefetch_rig import forget_caches, slow_reads

    docs = [_doc(10 + i)[:-1] * 2 for i in range(32)]  # 32 documents of 40 blocks
    engine = make_engine(cpu_blocks=512, num_gpu_blocks=4 * 44 + 64, max_num_seqs=4,
                         max_num_batched_tokens=2048, extra_config={
                             "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 2048 * PAGE})
    for i, doc in enumerate(docs):
        engine.add(f"first-{i}", doc + [1], max_tokens=1)
        if i % 4 == 3:
            engine.run_until_done()
            engine.drain()
    forget_caches(engine)
    slow_reads(engine.worker.worker.tiers.nearest, 0.0005)
    for i, doc in enumerate(docs):
        engine.add(f"q-{i}", doc + [2], max_tokens=4)
    engine.run_until_done(max_steps=3000)
    engine.drain()
    assert engine.offload.totals.data.get("staged_hits", 0) > 0
    cached = {i: engine.cached_tokens[f"q-{i}"] for i in range(len(docs))}
    short = {i: n for i, n in cached.items() if n != len(docs[i])}  # every block came back
    assert not short, (short, engine.offload.totals.data)
    engine.assert_idle()


def test_a_cache_reset_stops_a_staged_hit_after_what_it_promoted(make_engine, tmp_path):
    """reset_cache forgets every prefix: a staged hit being served loads the rounds in
    flight, recomputes the rest and is not counted; nothing stays pinned."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before = dict(engine.offload.totals.data)
    engine.add("again", doc)
    for _ in range(100):
        engine.step()
        if any(not r.final for r in _rounds(engine)):
            break
    assert any(not r.final for r in _rounds(engine)), "no round was sent"
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # vLLM's reset, as an RL loop
    engine.run_until_done()
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first-0"]
    assert 0 < engine.cached_tokens["again"] < DOC_BLOCKS * BS  # stopped part-way
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


def test_a_staged_hit_the_scheduler_takes_less_of_serves_its_leading_blocks(make_engine,
                                                                            tmp_path):
    """vLLM may accept fewer tokens than a lookup offered: a one-group hit keeps the
    leading blocks it accepted, and one it accepts none of is let go whole."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    gpu_pool = engine.scheduler.kv_cache_manager.block_pool
    for accepted in (0, 4):  # (the second is left unserved: the test ends there)
        req = engine.add(f"again-{accepted}", doc)
        engine.scheduler.waiting.remove(req)  # drive the two phases by hand
        for _ in range(200):  # until the lookup answers (idle steps in between)
            answer = engine.offload.get_num_new_matched_tokens(req, 0)
            if answer[0] is not None:
                break
            engine.step()
        assert answer == (DOC_BLOCKS * BS, True)
        gpu_blocks = gpu_pool.get_new_blocks(DOC_BLOCKS)
        engine.offload.update_state_after_alloc(req, KVCacheBlocks((gpu_blocks,)),
                                                accepted * BS)
        staged = engine.offload.staged._active.get(req.request_id)
        if accepted:
            assert sorted(staged.gpu_ids.values()) == sorted(
                b.block_id for b in gpu_blocks[:accepted])
            assert staged.failed_at is None and staged.num_tokens == accepted * BS
        else:
            assert staged is None
            assert engine.offload.num_pinned_cpu_blocks() == 0
            assert not engine.offload.has_pending_transfers()
            gpu_pool.free_blocks(gpu_blocks)
