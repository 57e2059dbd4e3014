"""The one slot planner: which blocks a hit over the CPU tier and a secondary tier takes.

Runs in the scheduler process. vLLM's own lookup decides
(:meth:`~kvoffload_hal.scheduler.cpu_tier.CpuTier.find_hit_with`): the CPU tier's
coordinator looks the request up as if the blocks the tier holds, and those another
request's read brings, were cached in the CPU tier, each KV cache group by its own
rules (a window's last blocks, a Mamba state at the hit's end). The hit it finds is
the plan: its slots (position, group) the CPU tier holds, and those the tier brings.

A staged hit (:mod:`.staged`) serves the plan as it is. A promotion
(:mod:`.promotions`) reads the plan's tier blocks and, at the position right after
the hit, every group's entry the tier holds there, when every dense group's block
there is readable: a lookup that drops its hit's last block (EAGLE's) finds the same
hit again over the CPU tier only once the block after it is there too. A promotion
shorter than the plan is planned again for fewer positions, so that each group's
rules hold at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload_hal.scheduler.secondary.groups import Entry, GroupKeys
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cpu_tier import CpuTier

Slot = tuple[int, int]  # (position, KV cache group): one device block to fill


class TierBlock(NamedTuple):
    """A block the tier holds, as the union lookup sees it (never the null block);
    ``coming``: another request's read brings it into the CPU tier."""

    key: BlockKey
    block_hash: Any
    is_null: bool = False
    coming: bool = False


@dataclass
class SlotPlan:
    """vLLM's hit over the CPU tier and the tier from block ``start`` on; positions
    count blocks from ``start``."""

    start: int
    blocks: list[list[Any]]  # per group: KVCacheBlock or TierBlock, position by position
    num_tokens: int

    def tier_slots(self) -> list[tuple[Slot, BlockKey, Any]]:
        """The slots the tier brings (not those another read brings), slot by slot."""
        return sorted(((pos, g), b.key, b.block_hash)
                      for g, group in enumerate(self.blocks) for pos, b in enumerate(group)
                      if isinstance(b, TierBlock) and not b.coming)

    def cpu_slots(self) -> list[tuple[Slot, KVCacheBlock]]:
        """The slots the CPU tier holds, slot by slot."""
        return sorted((((pos, g), b) for g, group in enumerate(self.blocks)
                       for pos, b in enumerate(group)
                       if not isinstance(b, TierBlock) and not b.is_null),
                      key=lambda x: x[0])


@dataclass
class SlotPlanner:
    """Plans over one tier's index: :meth:`plan` for a staged hit, :meth:`promotion`."""

    cpu: CpuTier
    groups: GroupKeys
    readable: Callable[[BlockKey], bool]  # the tier holds the key, ready to read
    coming: Callable[[BlockKey], bool]  # another request's read brings the key

    def plan(self, block_hashes: Sequence[Any], start: int, max_tokens: int,
             with_coming: bool = True) -> SlotPlan:
        """The hit from block ``start`` on, at most ``max_tokens``."""
        def in_tier(block_hash: Any) -> TierBlock | None:
            key = block_hash.hex()
            if with_coming and self.coming(key):
                return TierBlock(key, block_hash, coming=True)
            return TierBlock(key, block_hash) if self.readable(key) else None

        blocks, num_tokens = self.cpu.find_hit_with(block_hashes, start, max_tokens, in_tier)
        return SlotPlan(start, [list(g) for g in blocks], num_tokens)

    def promotion(self, plan: SlotPlan, block_hashes: Sequence[Any], end: int,
                  budget: int) -> list[Entry]:
        """The entries a promotion of ``plan``'s run, ending at block ``end``, reads: at
        most ``budget`` (the plan for fewer positions where all do not fit)."""
        entries = self.entries(plan, block_hashes, end)
        if len(entries) <= budget:
            return entries
        bs, start = self.cpu.hash_block_size, plan.start
        low, high, best = 0, plan.num_tokens // bs, []
        while low < high:  # the most positions whose entries fit
            mid = (low + high + 1) // 2
            fewer = self.entries(self.plan(block_hashes, start, mid * bs), block_hashes,
                                 start + mid)
            if len(fewer) <= budget:
                low, best = mid, fewer
            else:
                high = mid - 1
        return best

    def entries(self, plan: SlotPlan, block_hashes: Sequence[Any], end: int) -> list[Entry]:
        """What a promotion of ``plan`` reads, the run ending at block ``end``."""
        entries = [(key, h) for _, key, h in plan.tier_slots()]
        after = plan.start + plan.num_tokens // self.cpu.hash_block_size
        if after < min(end, len(block_hashes)):
            at = block_hashes[after]
            if all(self.readable(k) or self.cpu.holds(h) or self.coming(k)
                   for k, h in self.groups.at(at, self.groups.dense)):
                entries += [(k, h) for k, h in self.groups.at(at)
                            if self.readable(k) and not self.cpu.holds(h)
                            and not self.coming(k)]
        return entries
