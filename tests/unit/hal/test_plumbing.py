"""The plumbing vendor backends share: chunked enqueueing, env-var integers, log-once."""

from __future__ import annotations

import logging

import pytest

from kvoffload_hal import logger as package_logger
from kvoffload_hal.hal.plumbing import chunk_bounds, enqueue_in_chunks, env_int, log_once

VAR = "KVOFFLOAD_HAL_TEST_SETTING"


@pytest.mark.parametrize(("count", "max_per_chunk", "expected"), [
    (0, 4, []),
    (3, 4, [(0, 3)]),
    (8, 4, [(0, 4), (4, 8)]),
    (10, 4, [(0, 4), (4, 8), (8, 10)]),
    (3, 1, [(0, 1), (1, 2), (2, 3)]),
])
def test_chunk_bounds_cover_every_item_once_in_order(count, max_per_chunk, expected):
    assert list(chunk_bounds(count, max_per_chunk)) == expected


def test_chunk_bounds_reject_a_non_positive_limit():
    with pytest.raises(ValueError, match="must be positive, got 0"):
        list(chunk_bounds(5, 0))


class Stream:
    """Records enqueued chunks and waits; the chunk starting at ``fail_at`` raises."""

    def __init__(self, fail_at: int | None = None, wait_error: Exception | None = None):
        self.fail_at, self.wait_error = fail_at, wait_error
        self.events: list = []

    def enqueue(self, start: int, end: int) -> int:
        if start == self.fail_at:
            raise OSError(f"copy of chunk {start} failed")
        self.events.append((start, end))
        return 1

    def wait(self) -> None:
        self.events.append("wait")
        if self.wait_error is not None:
            raise self.wait_error


def test_enqueue_in_chunks_sums_the_calls_and_does_not_wait_on_success():
    stream = Stream()
    assert enqueue_in_chunks(10, 4, stream.enqueue, stream.wait) == 3
    assert stream.events == [(0, 4), (4, 8), (8, 10)]


def test_a_failed_chunk_waits_for_those_enqueued_then_raises_its_error():
    stream = Stream(fail_at=8)
    with pytest.raises(OSError, match="copy of chunk 8 failed"):
        enqueue_in_chunks(10, 4, stream.enqueue, stream.wait)
    assert stream.events == [(0, 4), (4, 8), "wait"]  # the last chunk never enqueued


def test_an_error_of_the_wait_does_not_hide_the_copy_error(caplog):
    stream = Stream(fail_at=4, wait_error=RuntimeError("device lost"))
    with pytest.raises(OSError, match="copy of chunk 4 failed"):
        enqueue_in_chunks(10, 4, stream.enqueue, stream.wait)
    assert stream.events == [(0, 4), "wait"]
    assert any("device lost" in r.getMessage() for r in caplog.records)


def test_env_int_reads_the_variable_or_the_default(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert env_int(VAR, 8192, minimum=1) == 8192
    monkeypatch.setenv(VAR, "")
    assert env_int(VAR, 8192, minimum=1) == 8192
    monkeypatch.setenv(VAR, " 16 ")
    assert env_int(VAR, 8192, minimum=1) == 16
    monkeypatch.setenv(VAR, "-5")
    assert env_int(VAR, 0) == -5  # no minimum


@pytest.mark.parametrize("raw", ["many", "2.5", "0x10", "0", "-1", "7\nmore"])
def test_env_int_names_variable_value_and_expectation_in_one_line(monkeypatch, raw):
    monkeypatch.setenv(VAR, raw)
    with pytest.raises(ValueError) as info:
        env_int(VAR, 8192, minimum=1)
    assert str(info.value) == f"{VAR}={raw!r} is invalid: expected an integer >= 1"


def test_log_once_logs_each_text_once_per_logger_and_level(monkeypatch, caplog):
    monkeypatch.setattr(package_logger, "_logged_messages", set())
    log = logging.getLogger("kvoffload_hal.test_plumbing")
    with caplog.at_level(logging.INFO, logger=log.name):
        assert log_once(log, logging.INFO, "copies: %s", "batch")
        assert not log_once(log, logging.INFO, "copies: %s", "batch")
        assert not log_once(log, logging.INFO, "copies: batch")  # same text
        assert log_once(log, logging.INFO, "copies: %s", "loop")  # other text
        assert log_once(log, logging.WARNING, "copies: %s", "batch")  # other level
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "copies: batch"), (logging.INFO, "copies: loop"),
        (logging.WARNING, "copies: batch")]
    assert caplog.records[0].funcName == (
        "test_log_once_logs_each_text_once_per_logger_and_level")  # the caller, not log_once
