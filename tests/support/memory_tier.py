"""A whole secondary tier outside the package, as a third party would write one.

Process memory stands in for the medium: a dict of block values per worker.
It has what every tier has (a spec with its own keys, the scheduler half's
description, a worker half on ``PooledTier``) and nothing else, so the tests
can show that a tier plugs in without the connector naming it.
"""

from __future__ import annotations

from typing import Any

from kvoffload_hal.config_values import positive_int
from kvoffload_hal.tiers.spec import SchedulerHalf, TierSpec
from kvoffload_hal.tiers.worker_pool import PooledTier

ENTRY_POINT = "support.memory_tier:MemoryTierSpec"


class MemoryTier(PooledTier):
    name = "memory"
    label = "memory tier"

    def __init__(self, host_views, fingerprint: bytes) -> None:
        self.views = list(host_views)
        self.fingerprint = fingerprint
        self.values: dict[str, tuple[bytes, list[bytes]]] = {}
        self.reads = 0
        super().__init__()

    def _store_batch(self, items):
        for key, block in items:
            self.values[key] = (self.fingerprint,
                                [v[block].numpy().tobytes() for v in self.views])
        return []

    def _load_batch(self, items):
        failed = []
        for key, block in items:
            value = self.values.get(key)
            if value is None or value[0] != self.fingerprint:
                failed.append(key)
                continue
            for view, data in zip(self.views, value[1]):
                view[block].numpy()[:] = memoryview(data)
            self.reads += 1
        return failed

    def _forget(self, keys):
        for key in keys:
            self.values.pop(key, None)


class MemoryTierSpec(TierSpec):
    name = "memory"
    switch_key = "memory_tier_blocks"
    keys = ("memory_tier_blocks",)

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> MemoryTierSpec | None:
        if "memory_tier_blocks" not in extra:
            return None
        return cls(positive_int("memory_tier_blocks", extra["memory_tier_blocks"]))

    def scheduler_half(self, ctx):
        return SchedulerHalf(self.blocks)

    def worker_half(self, ctx):
        return MemoryTier(ctx.host_views, ctx.fingerprint)
