"""The Mooncake Store tier, shared by every instance: its keys, and both halves.

Its keys are documented in :mod:`kvoffload_hal.tiers.mooncake.config`. The
scheduler remembers up to :data:`KNOWN_KEYS` keys the store holds and waits at most
``mooncake_timeout_s`` for the store (``scheduler/secondary/shared.py`` does the rest);
the worker half is :class:`~kvoffload_hal.tiers.mooncake.worker.MooncakeTier`,
one store client per rank, one object per (group, block); instances find
each other's blocks only with the same ``PYTHONHASHSEED``.
"""

from __future__ import annotations

from typing import Any

from kvoffload_hal.tiers.mooncake.config import MOONCAKE_KEYS, MooncakeConfig, parse_mooncake
from kvoffload_hal.tiers.spec import (
    SchedulerHalf,
    SchedulerTierContext,
    SecondaryTier,
    TierSpec,
    WorkerTierContext,
)

# Keys the scheduler remembers the store holds. Not the store's capacity (the
# master evicts by itself): past it, the least recently used are forgotten and
# asked for again when needed.
KNOWN_KEYS = 1 << 16


class MooncakeTierSpec(TierSpec):
    name = "mooncake"
    label = "Mooncake tier"
    one_group_only = False  # one entry per (group, block): scheduler/secondary/plan.py
    switch_key = "mooncake_master"
    keys = MOONCAKE_KEYS
    shared_across_instances = True

    def __init__(self, config: MooncakeConfig) -> None:
        self.config = config

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> MooncakeTierSpec | None:
        config = parse_mooncake(extra)
        return None if config is None else cls(config)

    def scheduler_half(self, ctx: SchedulerTierContext) -> SchedulerHalf | None:
        """None (with one warning) when the master cannot be reached."""
        from kvoffload_hal.tiers.mooncake.client import tier_available

        if not tier_available(self.config, "scheduler"):
            return None
        return SchedulerHalf(KNOWN_KEYS, wait_s=self.config.timeout_s)

    def worker_half(self, ctx: WorkerTierContext) -> SecondaryTier:
        from kvoffload_hal.tiers.mooncake.worker import open_mooncake_tier

        return open_mooncake_tier(self.config, ctx.host_chunks, ctx.host_views, ctx.fingerprint)
