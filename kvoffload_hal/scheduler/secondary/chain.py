"""The chain of secondary tiers behind the CPU tier, nearest first: what the scheduler calls.

Each tier has its own index, jobs, wait and breaker; they share one
:class:`~.reads.TierReads` and one room broker. docs/design.md ("A chain of tiers")
states the rule: a block published in the CPU tier is written to every tier with room
for it, and a hit is read from the nearest tier that holds it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.config import device_bytes_per_block
from kvoffload_hal.scheduler.parts import RequestPart
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.reads import TierReads
from kvoffload_hal.scheduler.secondary.shared import SharedTier, SharedTierIndex
from kvoffload_hal.scheduler.secondary.spill import TierNames
from kvoffload_hal.tiers.registry import scheduler_half
from kvoffload_hal.tiers.spec import SchedulerTierContext

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvoffload_hal.metadata import JobReport, TierJobs
    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.room import CpuRoom
    from kvoffload_hal.tiers.spec import BlockKey, TierSpec


class TierChain(RequestPart):
    """The tiers behind the CPU tier, nearest first (see the module docstring)."""

    def __init__(self, tiers: Sequence[PromotingTier], reads: TierReads) -> None:
        self.tiers = list(tiers)
        self.reads = reads
        self.room = reads.room
        self.active = bool(self.tiers)
        cpu = reads.cpu
        # vLLM's lookup ends every hit at the first block a full-attention group lacks.
        self._bounding = [g for g in cpu.dense_groups if g in cpu.prefix_groups]
        self._asks_store = any(isinstance(tier, SharedTier) for tier in self.tiers)

    @classmethod
    def build(cls, specs: Sequence[TierSpec], running: Sequence[str],
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
            if half is None:
                continue
            names = TierNames(spec.name, spec.display_name())
            if spec.shared_across_instances:
                index = SharedTierIndex(half.capacity_blocks,
                                        deletes_evicted=half.deletes_evicted)
                tiers.append(SharedTier(index, cpu, world_size, stats, half.wait_s,
                                        names=names, rebuild=half.rebuild, reads=reads))
            else:
                tiers.append(PromotingTier(TierIndex(half.capacity_blocks), cpu, world_size,
                                           stats, rebuild=half.rebuild, names=names,
                                           reads=reads, wait_s=half.wait_s))
        return cls(tiers, reads)

    def __iter__(self):
        return iter(self.tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    @property
    def nearest(self) -> PromotingTier:
        return self.tiers[0]

    def bind(self, gpu_pool: BlockPool) -> None:
        for tier in self.tiers:
            tier.bind(gpu_pool)

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        for tier in self.tiers:
            tier.bind_copies(copies_in_flight)

    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        """Blocks were just published in the CPU tier: written through the chain."""
        for tier in self.tiers:
            tier.on_published(blocks, hashes)

    def may_extend(self, block_hashes: Sequence[Any], first_block: int, end_block: int,
                   ) -> bool:
        """Whether a tier may extend a CPU hit that ends at block ``first_block`` (hashes
        up to ``end_block``): not where no tier asks a store and a full-attention group's
        block there is in neither the CPU tier nor a tier's index, since vLLM's lookup
        ends a hit there (docs/design.md, "A chain of tiers")."""
        if self._asks_store or not self._bounding:
            return True
        if first_block >= min(end_block, len(block_hashes)):
            return False
        block_hash, cpu = block_hashes[first_block], self.reads.cpu
        for g in self._bounding:
            key = make_block_hash_with_group_id(block_hash, g)
            if not cpu.holds(key) and not any(t.index.is_ready(key.hex()) for t in self.tiers):
                return False
        return True

    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               kind: RoomKind = RoomKind.PROMOTIONS, max_blocks: int | None = None) -> bool:
        """After a CPU hit: True when the request asks again later, because the nearest
        tier holding the blocks after it promotes them (or asks its store)."""
        self.release_promoted(request.request_id)
        if not self.may_extend(request.block_hashes, first_block, end_block):
            return False
        return any(tier.lookup(request, hit, first_block, end_block, kind, max_blocks)
                   for tier in self.tiers)

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        return sum(tier.held_for(req_id, promoting_only) for tier in self.tiers)

    def release_promoted(self, req_id: str) -> None:
        for tier in self.tiers:
            tier.release_promoted(req_id)

    def release_all_kept(self) -> None:
        for tier in self.tiers:
            tier.release_all_kept()

    def take_jobs(self) -> tuple[TierJobs, ...]:
        """This step's jobs, one :class:`TierJobs` per tier."""
        return tuple(tier.take_jobs() for tier in self.tiers)

    def on_reports(self, reports: dict[tuple[int, int], JobReport]) -> None:
        """Reports summed over ranks, by (the tier's place, its job id)."""
        by_tier: dict[int, dict[int, JobReport]] = defaultdict(dict)
        for (place, job_id), report in reports.items():
            by_tier[place][job_id] = report
        for place, tier_reports in by_tier.items():
            self.tiers[place].on_reports(tier_reports)

    def on_found(self, found: Sequence[tuple[int, BlockKey]], scans_done: Sequence[int],
                 ) -> None:
        """Blocks kept from before a restart, by (the tier's place, key); the places of
        the tiers a rank finished listing (once per rank)."""
        keys: dict[int, list[BlockKey]] = defaultdict(list)
        for place, key in found:
            keys[place].append(key)
        done = Counter(scans_done)
        for place in sorted({*keys, *done}):
            self.tiers[place].on_found(keys[place], done[place])

    def request_finished(self, req_id: str) -> bool:
        for tier in self.tiers:
            tier.request_finished(req_id)
        return False  # a tier never holds a request's device blocks

    def reset(self) -> None:
        for tier in self.tiers:
            tier.reset()

    def has_pending(self) -> bool:
        return any(tier.has_pending() for tier in self.tiers)
