"""Staged hits of a model with several KV cache groups (scheduler/secondary/staged.py).

Four groups, as vLLM groups a hybrid model's layers: two full-attention ones and two
sliding-window ones (a 32-token window: the last two blocks before a hit's end). The
fake model of ``engine_harness.py`` checks every KV read, in every group: a block
loaded into the wrong place, read before it landed, or missing from a window fails
the test unless it was reported as a failed load.

vLLM < 0.32 cannot be told that a load of several groups failed: there a hit's tier
blocks are read once (checked) before it is offered (scheduler/secondary/staged_check.py).
"""

import pytest

from kvoffload_hal.capabilities import LoadFailedError, select_strategy
from support.disk_files import flip_a_byte_of_block
from support.serving_rig import document, serve

CHECKS_FIRST = select_strategy(num_groups=2).checks_staged_hits_first()

BS = 16
PAGE = BS * 128
DOC_BLOCKS = 20
CPU_BLOCKS = 12  # a plain promotion of a document needs 4 x 20 blocks
FULL, SLIDING, WINDOW_BLOCKS = 2, 2, 2
HIT_BLOCKS = FULL * DOC_BLOCKS + SLIDING * WINDOW_BLOCKS  # what the hit needs: 44

def _doc(seed):
    return document(seed, DOC_BLOCKS)


def _serve(engine, *requests):
    return serve(engine, *requests, max_steps=3000)


def _engine(make_engine, tmp_path, **kwargs):
    # Prefill 2 positions per step: each step's 8 blocks fit the CPU tier on their way
    # to the disk.
    return make_engine(cpu_blocks=CPU_BLOCKS, num_gpu_blocks=72, sliding_window=32,
                       full_groups=FULL, sliding_groups=SLIDING,
                       max_num_batched_tokens=2 * BS, extra_config={
                           "disk_path": str(tmp_path / "kv"),
                           "disk_bytes_to_use": 1024 * PAGE}, **kwargs)


def _on_disk_only(engine, doc):
    """Serve the document, then two others: it leaves the device and the CPU tier."""
    (first,) = _serve(engine, ("first", doc))
    for i in range(2):
        _serve(engine, (f"other-{i}", _doc(50 + i)))
    return first


def _rounds(engine, since=0):
    return [r for meta in engine.sent[since:] if meta is not None for r in meta.rounds]


def _delta(engine, before, key):
    return engine.offload.totals.data.get(key, 0) - before.get(key, 0)


def _longest_hit_within(engine, block_hashes, end):
    """The most blocks before ``end`` whose sliding windows the CPU or the disk tier
    holds (where the window's blocks were stored)."""
    offload = engine.offload
    groups, index = offload.tiers.nearest.groups, offload.tiers.nearest.index
    sliding = [g for g in groups.groups if g not in groups.dense]
    for n in range(end, 0, -1):
        window = block_hashes[max(0, n - WINDOW_BLOCKS):n]
        if all(index.is_ready(k) or offload.cpu.holds(h)
               for bh in window for k, h in groups.at(bh, sliding)):
            return n
    return 0


def _promoted_before_first_round(engine, since):
    """Blocks read from the tier before the first round of a staged hit was sent."""
    n = 0
    for meta in engine.sent[since:]:
        if meta is None:
            continue
        if meta.rounds:
            return n
        for tier in meta.tiers:
            if tier.promote is not None:
                n += len(tier.promote.items)
    return n


def test_a_hybrid_hit_longer_than_the_cpu_tier_comes_back_whole(make_engine, tmp_path):
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS  # every full block came back
    assert _delta(engine, before, "staged_hits") == 1
    # Every full-attention block, and of each sliding-window group only its window.
    assert _delta(engine, before, "blocks_loaded") == HIT_BLOCKS
    # Checked first: read once more, but for what the check left in the CPU tier.
    reads = 2 * HIT_BLOCKS if CHECKS_FIRST else HIT_BLOCKS
    assert HIT_BLOCKS - CPU_BLOCKS <= _delta(engine, before, "blocks_from_disk") <= reads
    rounds = _rounds(engine, sent)
    assert len(rounds) >= HIT_BLOCKS // CPU_BLOCKS and sum(r.final for r in rounds) == 1
    assert all(len(r.cpu_blocks) <= CPU_BLOCKS for r in rounds)
    engine.assert_idle()  # every CPU, device and tier pin released


@pytest.mark.skipif(not CHECKS_FIRST, reason="vLLM >= 0.32 recomputes a failed load")
def test_without_per_request_recovery_every_tier_block_is_read_before_the_offer(
        make_engine, tmp_path):
    """No round is sent (no device block allocated) before the check read every block
    the hit brings from the tier."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS
    assert _delta(engine, before, "staged_hits") == 1
    # (The CPU tier may still hold some of it: at most its size.)
    assert _promoted_before_first_round(engine, sent) >= HIT_BLOCKS - CPU_BLOCKS
    engine.assert_idle()


@pytest.mark.skipif(CHECKS_FIRST, reason="vLLM < 0.32: the check ends the hit before it")
def test_a_corrupted_block_in_the_middle_ends_the_hybrid_hit_there(make_engine, tmp_path):
    """Nothing after it is read or loaded; vLLM takes a failed load of several groups
    per request, and recomputes the request."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    first = _on_disk_only(engine, doc)
    bad = 11  # not at a promotion's edge
    flip_a_byte_of_block(engine.worker.worker.tiers.nearest.root, first.block_hashes[bad])
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    # Slots go position by position: every group's blocks before it were read, and none
    # from it on (the sliding-window groups' blocks come at the hit's end).
    assert _delta(engine, before, "blocks_from_disk") == FULL * bad
    rounds = _rounds(engine, sent)
    assert sum(r.final for r in rounds) == 1  # staged once: not looked up again
    assert sum(len(r.gpu_blocks) for r in rounds) == FULL * bad
    assert engine.cached_tokens["again"] == 0  # recomputed
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


@pytest.mark.skipif(not CHECKS_FIRST, reason="vLLM >= 0.32 recomputes a failed load")
def test_a_corrupted_block_found_by_the_check_ends_the_hybrid_hit_before_it(make_engine,
                                                                           tmp_path):
    """The check reads the staged hit's blocks before it is offered: the hit offered is
    the longest one before the corrupted block, all of it comes back, and nothing is
    reported failed. Here that hit is two blocks (the disk holds the sliding window only
    at the document's start and end): 8 entries, which a promotion brings."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    first = _on_disk_only(engine, doc)
    bad = 11
    flip_a_byte_of_block(engine.worker.worker.tiers.nearest.root, first.block_hashes[bad])
    n = _longest_hit_within(engine, first.block_hashes, bad)
    assert n >= WINDOW_BLOCKS
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == n * BS
    # Every full-attention block of the hit, and each window at its end.
    assert _delta(engine, before, "blocks_loaded") == FULL * n + SLIDING * WINDOW_BLOCKS
    # The check read the whole staged hit (longer than the CPU tier) and found the block.
    assert _delta(engine, before, "disk_failed_blocks") == 1
    if FULL * n + SLIDING * WINDOW_BLOCKS <= CPU_BLOCKS:
        assert _delta(engine, before, "staged_hits") == 0  # what is left fits a promotion
        assert not _rounds(engine, sent)
    else:
        assert _delta(engine, before, "staged_hits") == 1
        assert sum(r.final for r in _rounds(engine, sent)) == 1
    assert not engine.offload.loads.failed_requests
    engine.assert_idle()


@pytest.mark.skipif(CHECKS_FIRST, reason="vLLM < 0.32 stops: see the test after")
def test_a_failed_round_ends_the_hybrid_hit(make_engine, tmp_path):
    """Its copy failed: no later round is promoted or sent, the request recomputes, and
    it is not staged again (a retry would fail the same way)."""
    from support import flaky_backend  # noqa: F401 (registers flaky-loads: one load fails)

    engine = _engine(make_engine, tmp_path, backend="flaky-loads")
    doc = _doc(1)
    _on_disk_only(engine, doc)
    assert engine.worker.worker.backend.failed_loads == 0  # no load yet: the next one fails
    before, sent = dict(engine.offload.totals.data), len(engine.sent)
    _serve(engine, ("again", doc))
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.worker.worker.backend.failed_loads == 1
    rounds = _rounds(engine, sent)
    assert sum(not r.final for r in rounds) == 1  # the one that failed, and the last
    assert sum(r.final for r in rounds) == 1  # staged once
    assert _delta(engine, before, "blocks_from_disk") <= 2 * CPU_BLOCKS < HIT_BLOCKS
    assert _delta(engine, before, "staged_hits") == 0
    engine.assert_idle()


@pytest.mark.skipif(not CHECKS_FIRST, reason="vLLM >= 0.32 recomputes a failed load")
def test_without_per_request_recovery_a_round_that_fails_after_the_check_stops(
        make_engine, tmp_path):
    """A copy that fails once the hit was checked cannot be recomputed by this vLLM: the
    engine stops before the request reads a block (the fake model would fail the test
    on an unfilled block it read)."""
    from support import flaky_backend  # noqa: F401 (registers flaky-loads: one load fails)

    engine = _engine(make_engine, tmp_path, backend="flaky-loads")
    doc = _doc(1)
    _on_disk_only(engine, doc)
    engine.add("again", doc)
    with pytest.raises(LoadFailedError, match="staged KV hit of request again failed"):
        engine.run_until_done(max_steps=3000)
    assert engine.worker.worker.backend.failed_loads == 1
    assert not engine.outputs["again"]  # no token: it never ran


def test_requests_on_one_hybrid_hit_read_it_once(make_engine, tmp_path):
    """Two requests on the document arrive together: one checks (vLLM < 0.32) and stages
    the hit, the other waits for it and takes the device prefix-cache hit."""
    engine = _engine(make_engine, tmp_path)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    before = dict(engine.offload.totals.data)
    _serve(engine, ("again-0", doc), ("again-1", doc))
    for req_id in ("again-0", "again-1"):
        assert engine.outputs[req_id] == engine.outputs["first"]
        assert engine.cached_tokens[req_id] == DOC_BLOCKS * BS
    assert _delta(engine, before, "staged_hits") == 1
    reads = 2 * HIT_BLOCKS if CHECKS_FIRST else HIT_BLOCKS
    assert _delta(engine, before, "blocks_from_disk") <= reads
    engine.assert_idle()


def test_a_hybrid_rounds_cpu_blocks_wait_for_every_rank(make_engine, tmp_path):
    """With two ranks, a round's CPU blocks stay pinned until the second one reported it."""
    from support.second_rank import SecondRank

    engine = _engine(make_engine, tmp_path, ranks=2)
    rank1 = SecondRank(engine)
    doc = _doc(1)
    _on_disk_only(engine, doc)
    engine.add("again", doc)
    assert rank1.run_checking_round_pins(engine, "again", max_steps=3000) >= 2
    engine.drain()
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == DOC_BLOCKS * BS
    assert engine.offload.totals.data["staged_hits"] == 1
    engine.assert_idle()


def test_a_request_whose_asynchronous_load_failed_is_offered_no_hit_again(make_engine,
                                                                         tmp_path):
    """vLLM keeps such a request among the prefills it reserves device blocks for: a
    second asynchronous load of it needs room for both, and waited for ever where the
    device had less (a hybrid hit staged again after a failed read). It recomputes."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = make_engine(cpu_blocks=256, num_gpu_blocks=128, sliding_window=32,
                         full_groups=FULL, sliding_groups=SLIDING)
    doc = _doc(1)
    _serve(engine, ("first", doc))
    offload = engine.offload

    def lookup(req_id):
        req = Request(req_id, doc, SamplingParams(max_tokens=1), None,
                      block_hasher=engine._hasher)
        found = offload.get_num_new_matched_tokens(req, 0)
        offload.loads.release_hit(req_id)
        return found

    assert lookup("fresh") == (DOC_BLOCKS * BS, True)  # the CPU tier holds the document
    offload.loads.failed_requests.add("failed")  # as a failed asynchronous load leaves it
    assert lookup("failed") == (0, False)
    offload.loads.failed_requests.discard("failed")
    engine.assert_idle()
