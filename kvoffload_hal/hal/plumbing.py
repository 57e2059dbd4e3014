"""Plumbing every vendor backend needs, written once.

``enqueue_in_chunks(count, max_per_chunk, enqueue, wait_for_enqueued)``
    Split ``count`` copy descriptors into chunks of at most ``max_per_chunk``
    and call ``enqueue(start, end)`` for each, in order. If any chunk raises,
    ``wait_for_enqueued()`` runs before the error propagates: chunks already
    enqueued may still be writing the destination, and a job reported failed
    has its blocks reused at once, so no copy of it may still be running.

``env_int(name, default, minimum)``
    An integer setting from the environment, rejected with one line naming the
    variable, its value and what was expected.

``log_once(logger, level, msg, *args)``
    Log a message the first time its formatted text is seen in this process
    (:func:`kvoffload_hal.logger.log_once`, offered here beside the rest).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from kvoffload_hal.logger import init_logger, log_once

__all__ = ["chunk_bounds", "enqueue_in_chunks", "env_int", "log_once"]

logger = init_logger(__name__)

def chunk_bounds(count: int, max_per_chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of at most ``max_per_chunk``, covering
    ``[0, count)`` in order."""
    if max_per_chunk <= 0:
        raise ValueError(f"max_per_chunk must be positive, got {max_per_chunk}")
    for start in range(0, count, max_per_chunk):
        yield start, min(start + max_per_chunk, count)


def enqueue_in_chunks(count: int, max_per_chunk: int, enqueue: Callable[[int, int], int],
                      wait_for_enqueued: Callable[[], object]) -> int:
    """Run ``enqueue(start, end)`` per chunk; return the sum of what it returns (runtime calls).

    On any exception from a chunk, ``wait_for_enqueued()`` is called (e.g. a
    stream synchronize) and the exception is re-raised. An error from the wait
    itself is logged and dropped: the copy error is the one to report.
    """
    calls = 0
    try:
        for start, end in chunk_bounds(count, max_per_chunk):
            calls += enqueue(start, end)
    except BaseException:
        try:
            wait_for_enqueued()
        except Exception as e:  # noqa: BLE001 - the original error matters more
            logger.warning("waiting for the copies already enqueued failed too: %s: %s",
                           type(e).__name__, e)
        raise
    return calls


def env_int(name: str, default: int, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """``int($name)``, or ``default`` when unset or empty; ``ValueError`` naming ``name`` else."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    bounds = [f">= {minimum}"] if minimum is not None else []
    bounds += [f"<= {maximum}"] if maximum is not None else []
    expected = " ".join(["an integer", " and ".join(bounds)]).strip()
    try:
        value = int(raw)
    except ValueError:
        value = None
    if (value is None or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise ValueError(f"{name}={raw!r} is invalid: expected {expected}")
    return value
