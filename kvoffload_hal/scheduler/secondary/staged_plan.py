"""What a staged hit is, and how a lookup decides one: its slots (position, group), its rounds.

Runs in the scheduler process; :mod:`.staged` serves the hits decided here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvoffload_hal.metadata import LoadSpec
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.plan import Slot
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.secondary.chain import TierChain
    from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
    from kvoffload_hal.scheduler.secondary.reads import TierRead


@dataclass
class Staged:
    """One request's staged hit. A slot is a (position, group) the hit fills, positions
    counting blocks from its first computed token on; lists go slot by slot."""

    req_id: str
    source: PromotingTier  # the tier its blocks come from
    cpu: list[tuple[Slot, KVCacheBlock]]  # slots the CPU tier holds, pinned
    tier: list[tuple[Slot, BlockKey, Any]]  # slots the tier brings: (slot, key, hash)
    num_tokens: int  # offered
    num_computed_tokens: int
    read: TierRead | None = None  # of ``tier``'s entries, in order (reads.py)
    gpu_ids: dict[Slot, int] = field(default_factory=dict)  # once allocated
    ready: list[tuple[KVCacheBlock, int]] = field(default_factory=list)  # (CPU, device)
    loaded: list[int] = field(default_factory=list)  # device blocks of rounds sent
    final_blocks: list[KVCacheBlock] = field(default_factory=list)  # with the last round
    final_gpu_ids: list[int] = field(default_factory=list)
    rounds: int = 0  # rounds sent and not reported
    failed_at: int | None = None  # the first position not served
    final_sent: bool = False
    aborted: bool = False

    @property
    def keys(self) -> list[BlockKey]:
        return [key for _, key, _ in self.tier]

    def slots(self) -> list[Slot]:
        return [slot for slot, _ in self.cpu] + [slot for slot, _, _ in self.tier]

    def stops(self) -> bool:
        """No more reads: all queued, a failure, or the request is gone."""
        return self.failed_at is not None or self.aborted or self.read.left() == 0

    def reading(self) -> bool:
        return self.read.part is not None

    def fail_from(self, position: int) -> None:
        self.failed_at = position if self.failed_at is None else min(self.failed_at, position)

    def fail_rest(self) -> None:
        """Read nothing more: the hit ends before the next slot to read."""
        self.read.stop(self.read.next)
        self.note_stop()

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


class NotStaged(Enum):
    """Why :func:`plan_hit` stages nothing."""

    FITS = "a promotion serves the run whole"
    NOTHING = "the tier holds nothing vLLM's lookup would take after the CPU hit"


def plan_chain_hit(tiers: TierChain, cpu: CpuTier, req_id: str, hit: Hit,
                   block_hashes: Sequence[Any], first: int, max_tokens: int,
                   ) -> Staged | NotStaged:
    """The staged hit of the nearest tier that holds the blocks after the CPU hit, or why
    there is none (a promotion of that tier's blocks serves them, see :func:`plan_hit`)."""
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
    the tier's part of it is more than a promotion has room for; else why not.

    The slots are the one planner's (:mod:`.plan`): a promotion would read the same
    blocks, one position more at most."""
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
