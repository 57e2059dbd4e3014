"""The one slot planner: which blocks a hit over the CPU tier and a secondary tier takes.

vLLM's own lookup decides (:meth:`~kvoffload_hal.scheduler.cpu_tier.CpuTier.find_hit_with`):
the CPU tier's coordinator looks the request up as if the blocks the tier holds, and
those another request's read brings, were cached there, each KV cache group by its own
rules (a window's last blocks, a Mamba state at the hit's end). The hit it finds is the
plan: the slots (position, group) the CPU tier holds, and those the tier brings. A
staged hit (:mod:`.staged`) serves the plan as it is; a promotion reads it, plus the
entries right after it (see :meth:`SlotPlanner.entries`), or is planned again for
fewer positions when all do not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.metadata import LoadSpec
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.secondary.chain import TierChain
    from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
    from kvoffload_hal.scheduler.secondary.reads import TierRead

Entry = tuple[BlockKey, Any]  # (tier key, block hash with group id)
Slot = tuple[int, int]  # (position, KV cache group): one device block to fill


class GroupKeys:
    """The KV cache groups a tier keeps for one model (a tier holds one entry per group
    and block), and the keys of a request's blocks."""

    def __init__(self, groups: Sequence[int], dense: Sequence[int]) -> None:
        self.groups = list(groups)
        # Every group kept needs every block before a hit's end: a prefix of a hit is a hit.
        self.all_dense = all(g in dense for g in self.groups)
        self.dense = [g for g in dense if g in self.groups] or list(self.groups)

    @classmethod
    def of(cls, cpu: CpuTier) -> GroupKeys:
        return cls(cpu.prefix_groups, cpu.dense_groups)

    def at(self, block_hash: Any, groups: Sequence[int] | None = None) -> list[Entry]:
        """The entries of one block position, for ``groups`` (default: every group kept)."""
        out = []
        for g in self.groups if groups is None else groups:
            h = make_block_hash_with_group_id(block_hash, g)
            out.append((h.hex(), h))
        return out

    def keys(self, block_hashes: Sequence[Any]) -> list[BlockKey]:
        """Every group's key at each of these positions, position by position."""
        return [key for bh in block_hashes for key, _ in self.at(bh)]


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
        """What a promotion of ``plan`` reads, the run ending at block ``end``: its tier
        slots and, at the position right after the hit, every group's entry the tier
        holds there when every dense group's block there is readable (a lookup that
        drops its hit's last block, EAGLE's, finds the same hit again only then)."""
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


# ------------------------------------------------------------------ staged hits
@dataclass
class Staged:
    """One request's staged hit (:mod:`.staged`). Positions count blocks from its first
    computed token on; lists go slot by slot."""

    req_id: str
    source: PromotingTier  # the tier its blocks come from
    cpu: list[tuple[Slot, KVCacheBlock]]  # slots the CPU tier holds, pinned
    tier: list[tuple[Slot, BlockKey, Any]]  # slots the tier brings: (slot, key, hash)
    num_tokens: int  # offered
    num_computed_tokens: int
    read: TierRead | None = None  # of ``tier``'s entries, in order
    gpu_ids: dict[Slot, int] = field(default_factory=dict)  # once allocated
    ready: list[tuple[KVCacheBlock, int]] = field(default_factory=list)  # (CPU, device)
    loaded: list[int] = field(default_factory=list)  # device blocks of rounds sent
    final_blocks: list[KVCacheBlock] = field(default_factory=list)  # with the last round
    final_gpu_ids: list[int] = field(default_factory=list)
    rounds: int = 0  # rounds sent and not reported
    failed_at: int | None = None  # the first position not served
    final_sent: bool = False
    aborted: bool = False

    def slots(self) -> list[Slot]:
        return [slot for slot, _ in self.cpu] + [slot for slot, _, _ in self.tier]

    def stops(self) -> bool:
        """No more reads: all queued, a failure, or the request is gone."""
        return self.failed_at is not None or self.aborted or self.read.left() == 0

    def reading(self) -> bool:
        return self.read.part is not None

    def fail_from(self, position: int) -> None:
        self.failed_at = position if self.failed_at is None else min(self.failed_at, position)

    def note_stop(self) -> None:
        """Where the read stopped (a failed key, its deadline), the hit ends."""
        at = self.read.stopped_at
        if at is not None and at < len(self.tier):
            self.fail_from(self.tier[at][0][0])

    def take_round(self) -> Round:
        """A round of the blocks ready in the CPU tier."""
        cpu_blocks, gpu_ids = [b for b, _ in self.ready], [g for _, g in self.ready]
        self.ready = []
        self.rounds += 1
        self.loaded += gpu_ids
        return Round(self.req_id, cpu_blocks, gpu_ids)

    def take_final(self) -> Round:
        """The request's load: what is ready, and the device blocks nothing fills."""
        self.final_blocks = [b for b, _ in self.ready]
        self.final_gpu_ids = gpu_ids = [g for _, g in self.ready]
        self.ready = []
        self.final_sent = True
        served = {*gpu_ids, *self.loaded}
        failed = tuple(g for g in self.gpu_ids.values() if g not in served)
        return Round(self.req_id, self.final_blocks, gpu_ids, failed)


@dataclass
class Round:
    """A round decided this step, sent with the step's metadata; ``failed`` is set
    (maybe empty) on the request's last round."""

    req_id: str
    cpu_blocks: list[KVCacheBlock]
    gpu_ids: list[int]
    failed: tuple[int, ...] | None = None

    def spec(self, job_id: int) -> LoadSpec:
        """The round as the workers get it."""
        return LoadSpec(job_id, (self.req_id,), [b.block_id for b in self.cpu_blocks],
                        self.gpu_ids, staged=True, final=self.failed is not None,
                        failed_gpu_blocks=self.failed or ())


class NotStaged(Enum):
    """Why :func:`plan_hit` stages nothing."""

    FITS = "a promotion serves the run whole"
    NOTHING = "the tier holds nothing vLLM's lookup would take after the CPU hit"


def plan_chain_hit(tiers: TierChain, cpu: CpuTier, req_id: str, hit: Hit,
                   block_hashes: Sequence[Any], first: int, max_tokens: int,
                   ) -> Staged | NotStaged:
    """The staged hit of the nearest tier that holds the blocks after the CPU hit, or why
    there is none."""
    for tier in tiers:
        if not tier.may_stage():
            return NotStaged.FITS  # the lookup goes the breaker's way
        staged = plan_hit(tier, cpu, req_id, hit, block_hashes, first, max_tokens)
        if staged is not NotStaged.NOTHING:
            return staged
    return NotStaged.NOTHING


def plan_hit(tier: PromotingTier, cpu: CpuTier, req_id: str, hit: Hit,
             block_hashes: Sequence[Any], first: int, max_tokens: int,
             ) -> Staged | NotStaged:
    """The hit over the CPU tier and the tier together from block ``first`` on, when
    the tier's part of it is more than a promotion has room for; else why not."""
    if tier.held_for(req_id, promoting_only=True):
        return NotStaged.FITS  # its promotion (a prefetch) is in flight: the tier waits
    plan = tier.planner.plan(block_hashes, first, max_tokens, with_coming=False)
    staged = Staged(req_id, tier, plan.cpu_slots(), plan.tier_slots(), plan.num_tokens, 0)
    if not staged.tier:
        return NotStaged.NOTHING
    # The room a promotion has once the CPU blocks of the hit and the plan are pinned.
    held = {b.block_id: b for b in [*(b for g in hit for b in g if not b.is_null),
                                    *(b for _, b in staged.cpu)]}
    room = tier.room.grant(RoomKind.STAGED)
    wanted = tier.planner.entries(plan, block_hashes, first + max_tokens // cpu.hash_block_size)
    if len(wanted) <= room - sum(1 for b in held.values() if b.ref_cnt == 0):
        return NotStaged.FITS
    return staged
