"""The scheduler half of the configured secondary tier, built from its spec's description.

Runs in the scheduler process. A tier describes what the scheduler keeps for it
(:class:`~kvoffload_hal.tiers.spec.SchedulerHalf`); this is the one place that
turns the description into machinery: a
:class:`~kvoffload_hal.scheduler.cascade.tier_cascade.TierCascade` over a
:class:`~kvoffload_hal.scheduler.cascade.index.TierIndex` for a tier only this
instance writes, a :class:`~kvoffload_hal.scheduler.cascade.shared.SharedTierCascade`
(existence queries, bounded waits, the circuit breaker) for one
``shared_across_instances``, and :class:`~kvoffload_hal.scheduler.cascade.base.NullCascade`
when there is no tier, or it cannot run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_hal.config import device_bytes_per_block
from kvoffload_hal.scheduler.cascade.base import NullCascade, TierNames
from kvoffload_hal.scheduler.cascade.index import TierIndex
from kvoffload_hal.scheduler.cascade.shared import SharedTierCascade, SharedTierIndex
from kvoffload_hal.scheduler.cascade.tier_cascade import TierCascade
from kvoffload_hal.tiers.registry import scheduler_half
from kvoffload_hal.tiers.spec import SchedulerTierContext

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.room import CpuRoom
    from kvoffload_hal.tiers.spec import TierSpec


def build_cascade(spec: TierSpec | None, runs: bool, kv_cache_config: KVCacheConfig,
                  cpu: CpuTier, world_size: int, stats: StatsLedger,
                  room: CpuRoom) -> NullCascade:
    """The cascade for ``spec`` (None: no tier); ``runs``: the tier serves this model;
    ``room``: the scheduler's room broker."""
    ctx = SchedulerTierContext(kv_cache_config, world_size,
                               device_bytes_per_block(kv_cache_config))
    half = scheduler_half(spec, runs, ctx)
    if spec is None or half is None:
        return NullCascade()
    names = TierNames(spec.name, spec.display_name())
    if spec.shared_across_instances:
        index = SharedTierIndex(half.capacity_blocks, deletes_evicted=half.deletes_evicted)
        return SharedTierCascade(index, cpu, world_size, stats, half.wait_s, names=names,
                                 rebuild=half.rebuild, room=room)
    return TierCascade(TierIndex(half.capacity_blocks), cpu, world_size, stats,
                       rebuild=half.rebuild, names=names, room=room)
