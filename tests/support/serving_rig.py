"""Requests served to the end on the engine harness, and the documents tier tests ask.

Shared by the staged-hit, hybrid, bad-block and object-store tests (``tests/unit/tiers``).
"""

from __future__ import annotations

BS = 16  # the harness's block size in those tests


def document(seed: int, num_blocks: int) -> list[int]:
    """A prompt of ``num_blocks`` full blocks and one token more (the last is computed)."""
    return [(seed * 7 + i) % 89 + 1 for i in range(num_blocks * BS + 1)]


def serve(engine, *requests: tuple[str, list[int]], max_steps: int = 2000) -> list:
    """Add ``(req_id, prompt)`` requests, step until they are done, then until every
    copy in flight was reported; the requests."""
    reqs = [engine.add(req_id, prompt) for req_id, prompt in requests]
    engine.run_until_done(max_steps)
    engine.drain()
    return reqs
