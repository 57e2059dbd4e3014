"""SharedTier against a real CpuTier: existence queries, bounded waits, what is learned."""

import itertools

import pytest

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.scheduler.secondary.shared import SharedTierIndex
from support.shared_tier import BS, TIMEOUT_S, shared_rig, tier_keys, waiting_request


@pytest.fixture
def shared(make_engine):
    return shared_rig(make_engine, cpu_blocks=8)


def test_a_miss_asks_the_store_then_promotes_what_every_rank_holds(shared):
    engine, cpu, tiers, _ = shared
    req = waiting_request(engine, 4)
    keys = tier_keys(req, 4)
    assert tiers.lookup(req, (), 0, 4) is True  # asking the store: ask again later
    probe = tiers.take_jobs().probe
    assert [k for k, _ in probe.items] == keys
    assert tiers.lookup(req, (), 0, 4) is True and tiers.take_jobs().probe is None  # once
    # Rank 0 holds all four, rank 1 misses the third: blocks 0-1 are readable.
    tiers.on_reports({probe.job_id: JobReport(ranks=1)})
    tiers.on_reports({probe.job_id: JobReport(ranks=1, failed_keys=(keys[2],))})
    assert tiers.lookup(req, (), 0, 4) is True  # promotion started
    promote = tiers.take_jobs().promote
    assert [k for k, _ in promote.items] == keys[:2]
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 2 * BS
    assert tiers.stats.totals.data["blocks_from_mooncake"] == 2
    assert tiers.lookup(req, (), 2, 4) is False  # the store has nothing more for it
    tiers.request_finished(req.request_id)
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_key_any_rank_misses_is_never_learned_whatever_order_the_ranks_report_in(
        make_engine, order):
    engine, _, tiers, _ = shared_rig(make_engine, cpu_blocks=8, world_size=3)
    req = waiting_request(engine, 4)
    keys = tier_keys(req, 4)
    assert tiers.lookup(req, (), 0, 4) is True
    probe = tiers.take_jobs().probe
    missing = {0: (keys[3],), 1: (keys[1],), 2: ()}  # rank 2 holds everything
    for rank in order:
        tiers.on_reports({probe.job_id: JobReport(ranks=1, failed_keys=missing[rank])})
    assert [k for k in keys if tiers.index.is_ready(k)] == [keys[0], keys[2]]
    assert tiers.lookup(req, (), 0, 4) is True
    promote = tiers.take_jobs().promote  # a prefix: up to the first block some rank lacks
    assert [k for k, _ in promote.items] == keys[:1]
    tiers.on_reports({promote.job_id: JobReport(ranks=3)})
    tiers.request_finished(req.request_id)
    assert engine.offload.cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def test_a_probe_that_does_not_answer_in_time_is_a_miss(shared):
    engine, _, tiers, clock = shared
    req = waiting_request(engine, 3)
    assert tiers.lookup(req, (), 0, 3) is True
    probe = tiers.take_jobs().probe
    clock.now += TIMEOUT_S + 0.1
    assert tiers.lookup(req, (), 0, 3) is False  # recomputes now
    assert tiers.stats.totals.data["mooncake_timeouts"] == 1
    tiers.on_reports({probe.job_id: JobReport(ranks=2)})  # the late answer is still learned
    assert tiers.lookup(req, (), 0, 3) is False  # but this request no longer waits
    tiers.request_finished(req.request_id)
    assert not tiers.has_pending()


def test_a_read_that_times_out_keeps_its_blocks_until_it_really_ends(shared):
    engine, cpu, tiers, clock = shared
    req = waiting_request(engine, 3)
    tiers.index.learn(tier_keys(req, 3))  # known from earlier: no probe needed
    assert tiers.lookup(req, (), 0, 3) is True
    promote = tiers.take_jobs().promote
    assert promote is not None and cpu.num_pinned_blocks() == 3
    clock.now += TIMEOUT_S + 0.1
    assert tiers.lookup(req, (), 0, 3) is False  # the request stops waiting
    assert cpu.num_pinned_blocks() == 3  # the late read may still write them
    tiers.request_finished(req.request_id)
    assert cpu.num_pinned_blocks() == 3
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def test_evictions_never_reach_the_shared_store(shared):
    engine, cpu, _, _ = shared
    index = SharedTierIndex(2)
    index.learn(["a", "b", "c"])  # over capacity: the oldest is forgotten here only
    assert "a" not in index and index.is_ready("c")
    assert index.take_evicted() == []


def _twin(engine, req):
    """A second request on the same prompt."""
    twin = engine.add(f"{req.request_id}-twin", list(req.prompt_token_ids))
    engine.scheduler.waiting.remove(twin)
    return twin


def _promoting_with_a_twin(engine, tiers):
    """A request promoting 3 blocks, and a second one on its prompt waiting for them."""
    req = waiting_request(engine, 3)
    twin = _twin(engine, req)
    tiers.index.learn(tier_keys(req, 3))
    assert tiers.lookup(req, (), 0, 3) is True
    promote = tiers.take_jobs().promote
    assert tiers.lookup(twin, (), 0, 3) is True  # waits for the same blocks
    return req, twin, promote


def test_a_second_request_waits_for_the_first_ones_promotion(shared):
    engine, cpu, tiers, _ = shared
    req, twin, promote = _promoting_with_a_twin(engine, tiers)
    assert len(promote.items) == 3
    assert tiers.take_jobs().promote is None  # the twin promotes none of them again
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    hit, tokens = cpu.find_hit(twin.block_hashes, 0, 10_000)
    assert tokens == 3 * BS
    assert tiers.lookup(twin, hit, 3, 3) is False
    assert tiers.stats.totals.data["blocks_from_mooncake"] == 3
    for r in (req, twin):
        tiers.request_finished(r.request_id)
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def test_a_request_waiting_on_a_frozen_promotion_recomputes_after_the_timeout(shared):
    engine, cpu, tiers, clock = shared
    req, twin, promote = _promoting_with_a_twin(engine, tiers)
    clock.now += TIMEOUT_S + 0.1
    assert tiers.lookup(twin, (), 0, 3) is False  # stops waiting, recomputes
    assert tiers.stats.totals.data["mooncake_timeouts"] == 1
    for r in (req, twin):
        tiers.request_finished(r.request_id)
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()
