"""SharedTier's circuit breaker on a fake clock: what opens it, what an open breaker
skips, the probe that closes it, and an engine that does not step for a frozen store."""

import pytest

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.scheduler.secondary.breaker import BreakerState
from support.shared_tier import TIMEOUT_S, shared_rig, tier_keys, waiting_request


@pytest.fixture
def shared(make_engine):
    engine, _, tiers, clock = shared_rig(make_engine, cpu_blocks=16)
    return engine, tiers, clock


def _published(engine, n, seed):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = waiting_request(engine, n, seed)
    cpu = engine.offload.cpu
    blocks = cpu.allocate(n)
    hashes = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:n]]
    cpu.publish(blocks, hashes)
    return blocks, hashes


def _counters(tiers):
    return {k[len("mooncake_breaker_"):]: v for k, v in tiers.stats.totals.data.items()
            if k.startswith("mooncake_breaker_")}


def _open_by_a_timeout(engine, tiers, clock):
    """A first request pays the full timeout of a frozen store; the breaker opens."""
    req = waiting_request(engine, 3, seed=0)
    assert tiers.lookup(req, (), 0, 3) is True
    probe = tiers.take_jobs().probe
    clock.now += TIMEOUT_S + 0.1
    assert tiers.lookup(req, (), 0, 3) is False
    assert tiers.breaker.state is BreakerState.OPEN
    return req, probe


def test_while_open_lookups_miss_at_once_and_spills_are_not_sent(shared):
    engine, tiers, clock = shared
    _, stuck = _open_by_a_timeout(engine, tiers, clock)
    later = waiting_request(engine, 3, seed=1)
    assert tiers.lookup(later, (), 0, 3) is False  # no query, no wait
    blocks, hashes = _published(engine, 2, seed=2)
    tiers.on_published(blocks, hashes)
    jobs = tiers.take_jobs()
    assert jobs.probe is None and jobs.spill is None and jobs.promote is None
    assert _counters(tiers) == {"opens": 1, "skips": 2}
    assert tiers.stats.totals.data["mooncake_timeouts"] == 1  # only the first one waited
    # The probe stuck on the frozen store keeps no idle engine stepping.
    assert not tiers.has_pending()
    tiers.on_reports({stuck.job_id: JobReport(ranks=2)})  # the store thawed: closes
    assert tiers.breaker.state is BreakerState.CLOSED and _counters(tiers)["closes"] == 1


def test_a_request_already_waiting_stops_waiting_when_the_breaker_opens(shared):
    engine, tiers, clock = shared
    waiting = waiting_request(engine, 3, seed=1)
    tiers.index.learn(tier_keys(waiting, 3))
    assert tiers.lookup(waiting, (), 0, 3) is True
    promote = tiers.take_jobs().promote
    tiers.breaker.timeout()  # another request's wait ran out
    assert tiers.lookup(waiting, (), 0, 3) is False  # does not wait its own timeout
    cpu = engine.offload.cpu
    assert cpu.num_pinned_blocks() == 3  # the read may still land: its blocks stay
    tiers.request_finished(waiting.request_id)
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    assert cpu.num_pinned_blocks() == 0


def test_after_the_backoff_one_request_probes_and_an_answer_closes(shared):
    engine, tiers, clock = shared
    _open_by_a_timeout(engine, tiers, clock)
    clock.now += 1.0  # the first window
    first, second = waiting_request(engine, 3, seed=1), waiting_request(engine, 3, seed=2)
    assert tiers.lookup(first, (), 0, 3) is True  # the probe: asks the store
    assert tiers.breaker.state is BreakerState.HALF_OPEN
    assert tiers.lookup(second, (), 0, 3) is False  # everyone else still skips
    probe = tiers.take_jobs().probe
    assert [k for k, _ in probe.items] == tier_keys(first, 3)
    assert tiers.has_pending() is False  # half-open: the probe's job is no push work
    tiers.on_reports({probe.job_id: JobReport(ranks=2, failed_keys=tuple(tier_keys(first, 3)))})
    assert tiers.breaker.state is BreakerState.CLOSED
    assert tiers.lookup(first, (), 0, 3) is False  # answered: the store lacks them
    assert _counters(tiers) == {"opens": 1, "closes": 1, "skips": 1}


def test_a_probe_that_times_out_reopens_for_a_longer_window(shared):
    engine, tiers, clock = shared
    _open_by_a_timeout(engine, tiers, clock)
    clock.now += 1.0
    req = waiting_request(engine, 3, seed=1)
    assert tiers.lookup(req, (), 0, 3) is True
    tiers.take_jobs()
    clock.now += TIMEOUT_S + 0.1
    assert tiers.lookup(req, (), 0, 3) is False
    assert tiers.breaker.state is BreakerState.OPEN and tiers.breaker.backoff_s == 2.0
    assert _counters(tiers)["reopens"] == 1


def test_jobs_that_fail_as_a_whole_three_times_in_a_row_open_it(shared):
    engine, tiers, _ = shared
    for seed in range(3):
        assert tiers.breaker.state is BreakerState.CLOSED
        blocks, hashes = _published(engine, 2, seed=seed)
        tiers.on_published(blocks, hashes)
        spill = tiers.take_jobs().spill
        keys = tuple(k for k, _ in spill.items)
        tiers.on_reports({spill.job_id: JobReport(ranks=2, failed_keys=keys)})
    assert tiers.breaker.state is BreakerState.OPEN
    assert tiers.stats.totals.data["mooncake_failed_blocks"] == 6


def test_a_spill_stuck_past_the_timeout_opens_it_and_the_engine_stops_stepping(shared):
    engine, tiers, clock = shared
    blocks, hashes = _published(engine, 2, seed=0)
    tiers.on_published(blocks, hashes)
    spill = tiers.take_jobs().spill
    assert tiers.has_pending()  # in flight, in time: the engine steps to collect it
    clock.now += TIMEOUT_S + 0.1
    assert not tiers.has_pending()  # stuck: the breaker opened
    assert tiers.breaker.state is BreakerState.OPEN and _counters(tiers) == {"opens": 1}
    tiers.on_reports({spill.job_id: JobReport(ranks=2)})
    assert tiers.breaker.state is BreakerState.CLOSED and tiers.index.is_ready(hashes[0].hex())


def test_after_the_backoff_spills_may_probe_too(shared):
    engine, tiers, clock = shared
    _open_by_a_timeout(engine, tiers, clock)
    clock.now += 1.0
    blocks, hashes = _published(engine, 2, seed=1)
    tiers.on_published(blocks, hashes)  # the first to come after the window: the probe
    assert tiers.breaker.state is BreakerState.HALF_OPEN
    later = waiting_request(engine, 3, seed=2)
    assert tiers.lookup(later, (), 0, 3) is False  # the spills probe: requests skip
    spill = tiers.take_jobs().spill
    tiers.on_reports({spill.job_id: JobReport(ranks=2)})
    assert tiers.breaker.state is BreakerState.CLOSED and tiers.index.is_ready(hashes[0].hex())


def test_two_spills_stuck_at_once_open_it_once(shared):
    """Two jobs in flight when the store freezes: the first found overdue opens the
    breaker, which forgets what is in flight; the second is not counted again (it
    once raised KeyError there, from build_connector_meta, and stopped the engine)."""
    engine, tiers, clock = shared
    for seed in (0, 7):
        blocks, hashes = _published(engine, 2, seed=seed)
        tiers.on_published(blocks, hashes)
        assert tiers.take_jobs().spill is not None
    clock.now += TIMEOUT_S + 0.1
    assert not tiers.has_pending()
    assert tiers.breaker.state is BreakerState.OPEN and _counters(tiers) == {"opens": 1}
