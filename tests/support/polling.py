"""Bounded waits for asynchronous results: a test that waits never hangs the suite.

``wait_until(predicate, timeout_s, what)`` polls ``predicate`` every millisecond
and fails with ``what`` in the message when it stays false; ``collect_results``
gathers exactly ``n`` results from a ``poll`` callable (a backend's, a tier's);
``wait_for_tier_io`` waits for a worker tier's IO calls to return (a disk answering again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

POLL_INTERVAL_S = 0.001


def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0,
               what: str = "the condition") -> None:
    """Return once ``predicate()`` is true; ``AssertionError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


def collect_results(poll: Callable[[], list], n: int, timeout_s: float = 10.0) -> list:
    """Call ``poll()`` until it has returned ``n`` results in all; return them in order.

    Fails when fewer arrive within ``timeout_s`` seconds, or more than ``n``.
    """
    results: list = []

    def have_all() -> bool:
        results.extend(poll())
        return len(results) >= n

    try:
        wait_until(have_all, timeout_s, f"{n} result(s)")
    except AssertionError as e:
        raise AssertionError(f"{e}; got {len(results)}: {results}") from None
    assert len(results) == n, f"expected {n} result(s), got {len(results)}: {results}"
    return results


def wait_for_tier_io(tier: Any, timeout_s: float = 30.0) -> None:
    """Return once every IO call submitted to the worker tier ``tier`` (a
    ``PooledTier``) has returned: the disk answered. Their results wait in the tier for
    the engine's next steps, as they would in a server that got no request meanwhile."""
    def returned() -> bool:
        return all(f.done() for futures in list(tier._jobs.values()) for f in futures)

    wait_until(returned, timeout_s, f"the {tier.label}'s IO calls to return")
