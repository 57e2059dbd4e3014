"""The frozen-store wait is counted as a timeout whichever of the scheduler's two checks
ends it: the request's own lookup, or the in-flight job found overdue at a step's
take_jobs (a loaded host's slow step lets the job's check come first)."""

from kvoffload_hal.scheduler.secondary.breaker import BreakerState
from support.shared_tier import TIMEOUT_S, shared_rig, waiting_request


def test_a_wait_ended_by_the_overdue_job_counts_one_timeout(make_engine):
    engine, _, tiers, clock = shared_rig(make_engine, cpu_blocks=16)
    req = waiting_request(engine, 3, seed=0)
    assert tiers.lookup(req, (), 0, 3) is True  # an existence query is queued
    tiers.take_jobs()  # ... and sent; the store is frozen
    clock.now += TIMEOUT_S + 0.1
    tiers.has_pending()  # the job's check comes before the request's next lookup
    assert tiers.breaker.state is BreakerState.OPEN
    assert tiers.lookup(req, (), 0, 3) is False  # the request recomputes
    totals = tiers.stats.totals.data
    assert totals["mooncake_breaker_opens"] == 1
    assert totals.get("mooncake_timeouts", 0) == 1, totals
