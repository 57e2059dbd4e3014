"""The scheduler halves of the configured secondary tiers, built from their specs.

Runs in the scheduler process. A tier describes what the scheduler keeps for it
(:class:`~kvoffload_hal.tiers.spec.SchedulerHalf`); this is the one place that
turns the description into machinery: a
:class:`~kvoffload_hal.scheduler.secondary.promotions.PromotingTier` over a
:class:`~kvoffload_hal.scheduler.secondary.index.TierIndex` for a tier only this
instance writes, a :class:`~kvoffload_hal.scheduler.secondary.shared.SharedTier`
(existence queries, bounded waits, the circuit breaker) for one
``shared_across_instances``, in a :class:`~kvoffload_hal.scheduler.secondary.chain.TierChain`
in the configured order (empty without a tier that runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_hal.config import device_bytes_per_block
from kvoffload_hal.scheduler.secondary.base import TierNames
from kvoffload_hal.scheduler.secondary.chain import TierChain
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.reads import TierReads
from kvoffload_hal.scheduler.secondary.shared import SharedTier, SharedTierIndex
from kvoffload_hal.tiers.registry import scheduler_half
from kvoffload_hal.tiers.spec import SchedulerTierContext

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.room import CpuRoom
    from kvoffload_hal.tiers.spec import SchedulerHalf, TierSpec


def build_chain(specs: Sequence[TierSpec], running: Sequence[str],
                kv_cache_config: KVCacheConfig, cpu: CpuTier, world_size: int,
                stats: StatsLedger, room: CpuRoom) -> TierChain:
    """The chain of ``specs`` that run for this model (``running``: their names; the
    others are said once and left out), sharing one room broker."""
    ctx = SchedulerTierContext(kv_cache_config, world_size,
                               device_bytes_per_block(kv_cache_config))
    reads = TierReads(cpu, room, stats)
    tiers = []
    for spec in specs:
        half = scheduler_half(spec, spec.name in running, ctx)
        if half is not None:
            tiers.append(_build_tier(spec, half, cpu, world_size, stats, reads))
    return TierChain(tiers, reads)


def _build_tier(spec: TierSpec, half: SchedulerHalf, cpu: CpuTier, world_size: int,
                stats: StatsLedger, reads: TierReads) -> PromotingTier:
    names = TierNames(spec.name, spec.display_name())
    if spec.shared_across_instances:
        index = SharedTierIndex(half.capacity_blocks, deletes_evicted=half.deletes_evicted)
        return SharedTier(index, cpu, world_size, stats, half.wait_s, names=names,
                                 rebuild=half.rebuild, reads=reads)
    return PromotingTier(TierIndex(half.capacity_blocks), cpu, world_size, stats,
                       rebuild=half.rebuild, names=names, reads=reads)
