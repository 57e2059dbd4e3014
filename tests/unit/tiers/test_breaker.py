"""The circuit breaker alone, on a fake clock: every transition, the backoff, the log lines."""

import logging

import pytest

from kvoffload_hal.scheduler.secondary.breaker import BreakerState, CircuitBreaker
from support.clock import FakeClock

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


@pytest.fixture
def breaker():
    clock = FakeClock(50.0)
    moves = []
    b = CircuitBreaker("test tier", probe_timeout_s=5.0,
                       on_transition=lambda old, new: moves.append((old, new)),
                       base_backoff_s=1.0, max_backoff_s=4.0, max_errors=3, clock=clock)
    return b, clock, moves


def test_a_timeout_opens_at_once_and_the_window_skips_every_caller(breaker):
    b, clock, moves = breaker
    assert b.allow("a") and b.state is CLOSED
    b.timeout()
    assert b.state is OPEN and b.backoff_s == 1.0 and moves == [(CLOSED, OPEN)]
    clock.now += 0.9
    assert not b.allow("a") and not b.allow("b")
    assert b.state is OPEN


def test_errors_open_only_in_a_row(breaker):
    b, _, moves = breaker
    b.error()
    b.error()
    b.success()  # resets the count
    b.error()
    b.error()
    assert b.state is CLOSED and moves == []
    b.error()
    assert b.state is OPEN and moves == [(CLOSED, OPEN)]


def test_after_the_window_one_caller_probes_and_its_success_closes(breaker):
    b, clock, moves = breaker
    b.timeout()
    clock.now += 1.0
    assert b.allow("probe") and b.state is HALF_OPEN
    assert not b.allow("other")  # only the probe goes through
    assert b.allow("probe")  # and keeps going while it waits
    b.success()
    assert b.state is CLOSED and b.allow("other")
    assert moves == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    b.timeout()  # closing reset the backoff
    assert b.backoff_s == 1.0


def test_a_failed_probe_reopens_with_a_window_that_doubles_up_to_the_cap(breaker):
    b, clock, moves = breaker
    b.timeout()
    windows = [b.backoff_s]
    for failure in (b.error, b.timeout, b.error, b.error):
        clock.now += b.backoff_s
        assert b.allow("probe") and b.state is HALF_OPEN
        failure()
        assert b.state is OPEN
        windows.append(b.backoff_s)
    assert windows == [1.0, 2.0, 4.0, 4.0, 4.0]
    clock.now += 3.9
    assert not b.allow("probe")
    assert moves.count((HALF_OPEN, OPEN)) == 4


def test_a_probe_without_an_answer_in_time_reopens(breaker):
    b, clock, moves = breaker
    b.timeout()
    clock.now += 1.0
    assert b.allow("probe")
    clock.now += 5.1  # never answered (its request went away, its job is stuck)
    assert not b.allow("other") and b.state is OPEN and b.backoff_s == 2.0
    assert moves[-1] == (HALF_OPEN, OPEN)


def test_a_probe_that_sent_nothing_hands_the_probe_to_the_next_caller(breaker):
    b, clock, _ = breaker
    b.timeout()
    clock.now += 1.0
    assert b.allow("a")
    b.cancel("b")  # not the probe: nothing changes
    assert not b.allow("b")
    b.cancel("a")
    assert b.allow("b") and not b.allow("a") and b.state is HALF_OPEN


def test_a_late_success_while_open_closes(breaker):
    b, _, moves = breaker
    b.timeout()
    b.success()  # a reply to a job sent before the breaker opened
    assert b.state is CLOSED and moves[-1] == (OPEN, CLOSED)


def test_each_transition_is_logged_once(breaker, caplog):
    b, clock, _ = breaker
    caplog.set_level(logging.INFO, logger="kvoffload_hal.scheduler.secondary.breaker")
    b.timeout()
    for _ in range(5):  # many callers while open: no more lines
        b.allow("x")
        b.timeout()
        b.error()
    clock.now += 1.0
    b.allow("p")
    b.allow("q")
    b.success()
    lines = [r.getMessage() for r in caplog.records if "circuit breaker" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "closed -> open" in lines[0] and "skipped for 1 s" in lines[0]
    assert "open -> half-open" in lines[1] and "half-open -> closed" in lines[2]
    assert all(line.startswith("test tier: ") for line in lines)
