"""Around an engine harness with a secondary tier: slow reads, emptied caches, lookups.

:func:`slow_reads` wraps the worker half of a running tier (the disk tier's files,
a memory tier) on its instance, so the scheduler and the worker run their normal
code: only the pool threads that read take longer, as a slow disk or a remote
store would. Writes are untouched.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any


def slow_reads(tier: Any, seconds_per_block: float) -> None:
    """Every block ``tier`` reads from now on waits ``seconds_per_block`` before it."""
    read = tier._load_batch

    def slow(items):
        time.sleep(seconds_per_block * len(items))
        return read(items)

    tier._load_batch = slow


def gate_reads(tier: Any) -> threading.Event:
    """Every block ``tier`` reads from now on waits for the returned event to be set."""
    gate = threading.Event()
    read = tier._load_batch

    def gated(items):
        gate.wait(30)
        return read(items)

    tier._load_batch = gated
    return gate


def forget_caches(engine: Any) -> None:
    """Empty the device prefix cache and the CPU tier of an idle engine (harness
    ``Engine``), so that the secondary tier alone holds what was served before."""
    engine.drain()
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    engine.offload.cpu.drop_all()


def count_waits(engine: Any) -> Counter:
    """Count, per request, the lookups the connector answered "ask again later"
    (``None``): its own answers to vLLM's scheduler, observed on the instance."""
    waits: Counter = Counter()
    lookup = engine.offload.get_num_new_matched_tokens

    def counting(request, num_computed_tokens):
        found = lookup(request, num_computed_tokens)
        if found[0] is None:
            waits[request.request_id] += 1
        return found

    engine.offload.get_num_new_matched_tokens = counting
    return waits
