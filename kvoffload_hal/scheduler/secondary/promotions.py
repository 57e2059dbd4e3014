"""Promotions at a lookup: a tier's blocks read into the CPU tier for one request.

When a lookup finds the CPU hit continued by blocks the tier holds, a read of them (as
many as the room broker grants) starts and the request asks again later; once every rank
read them they are published in the CPU prefix cache and kept for the request's next
lookup. When no CPU block is free because copies in flight hold them, the request waits
for those copies instead of recomputing. A key that failed to read ends the request's
promotions there (it recomputes the rest).

Every tier bounds its waits by its ``wait_s`` and has a circuit breaker
(:mod:`.breaker`): a promotion in flight past the wait is given up (the request
recomputes), a job in flight past it opens the breaker, and while the breaker is not
closed the tier is skipped (lookups miss, spills are not sent) and its jobs in flight
are no pending work: an idle engine does not step for a tier that stopped answering.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvoffload_hal.scheduler.room import CpuRoom, RoomKind
from kvoffload_hal.scheduler.secondary.breaker import BreakerState
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.plan import GroupKeys, SlotPlan, SlotPlanner
from kvoffload_hal.scheduler.secondary.reads import Entry, TierRead, TierReads, starved
from kvoffload_hal.scheduler.secondary.spill import (
    DEFAULT_WAIT_S,
    JobKind,
    SpillingTier,
    TierJob,
    TierNames,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.tiers.spec import BlockKey


class PromotingTier(SpillingTier):
    """A tier's scheduler half: its spills, its promotions, the source of staged hits."""

    def __init__(self, index: TierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, rebuild: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 names: TierNames = TierNames(), reads: TierReads | None = None,
                 wait_s: float = DEFAULT_WAIT_S) -> None:
        """``rebuild``: the workers report blocks kept from before a restart; ``reads``:
        the chain's reads and room broker (of its own when alone); ``wait_s``: the
        longest a read or a job of this tier is waited for (module docstring)."""
        super().__init__(index, cpu, world_size, stats, rebuild, names, wait_s, clock)
        self.reads = reads if reads is not None else TierReads(cpu, CpuRoom(cpu), stats, clock)
        self.room = self.reads.room
        self._room_wait_since: dict[str, float] = {}
        self._promoting: dict[str, TierRead] = {}  # a request's promotion in flight
        self._kept: dict[str, list[KVCacheBlock]] = {}  # until the request's next lookup
        self._no_promotion: set[str] = set()
        self._copies_in_flight: Callable[[], bool] = lambda: False
        self.groups = GroupKeys.of(cpu)
        self.planner = SlotPlanner(cpu, self.groups, index.is_ready, self._coming)

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        """``copies_in_flight()``: whether the CPU tier's own loads or stores hold CPU
        blocks that they release when they end."""
        self._copies_in_flight = copies_in_flight

    def may_stage(self) -> bool:
        """Whether a hit may be staged now: while the breaker is closed (else lookups go
        the breaker's way: skipped, or one of them probes)."""
        return self.breaker.state is BreakerState.CLOSED

    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               kind: RoomKind = RoomKind.PROMOTIONS, max_blocks: int | None = None) -> bool:
        """Start or await a promotion of blocks ``[first_block, end_block)``; the hit
        stays pinned while room is made, so a promotion never evicts what it extends."""
        self.cpu.pin_hit(hit)
        try:
            self.release_promoted(request.request_id)
            return self._promote(request, hit, first_block, end_block, kind, max_blocks)
        finally:
            self.cpu.unpin_hit(hit)

    def release_all_kept(self) -> None:
        """Let go of the blocks kept for requests not looked up again: a kind before
        promotions claims the CPU room, and vLLM cannot admit those requests while staged
        hits hold the device. The blocks stay cached until evicted."""
        for req_id in list(self._kept):
            self.release_promoted(req_id)

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        read = self._promoting.get(req_id)
        held = 0 if promoting_only else len(self._kept.get(req_id, ()))
        return held + (len(read.entries) if read else 0)

    def _promote(self, request: Request, hit: Hit, first_block: int, end_block: int,
                 kind: RoomKind, max_blocks: int | None) -> bool:
        req_id = request.request_id
        if req_id in self._no_promotion:
            return False
        if not self.breaker.allow(req_id):
            return self._skip(req_id)
        waits = self._promote_or_wait(request, hit, first_block, end_block, kind, max_blocks)
        if not waits:
            self.breaker.cancel(req_id)  # sent nothing: another request probes
        return waits

    def _promote_or_wait(self, request: Request, hit: Hit, first_block: int,
                         end_block: int, kind: RoomKind, max_blocks: int | None) -> bool:
        """Whether the request waits for its promotion, another request's, or room."""
        read = self._promoting.get(request.request_id)
        if read is not None:
            if not self.reads.overdue(read):
                return True
            self._stop_promoting(request.request_id)  # completes (and is published) alone
            return self._give_up(request.request_id)
        return self._start_promotion(request, hit, first_block, end_block, kind, max_blocks)

    def _give_up(self, req_id: str) -> bool:
        """The request waited the tier's whole wait: it recomputes the rest."""
        self.release_promoted(req_id)  # what it kept while waiting
        self._no_promotion.add(req_id)
        self.stats.record_tier(self.names.name, timeouts=1)
        self.breaker.timeout()
        return False

    def _skip(self, req_id: str, waited: bool = False) -> bool:
        """The breaker is open: a miss at once, and stop waiting for what was sent (a
        timeout for a request that was waiting for the tier, a skip for the others)."""
        waited = waited or req_id in self._promoting
        self._stop_promoting(req_id)
        self.release_promoted(req_id)
        self._no_promotion.add(req_id)
        if waited:
            self.stats.record_tier(self.names.name, timeouts=1)
        else:
            self.stats.record_breaker(self.names.name, skipped=1)
        return False

    def _start_promotion(self, request: Request, hit: Hit, first_block: int,
                         end_block: int, kind: RoomKind, max_blocks: int | None) -> bool:
        req_id = request.request_id
        hashes = request.block_hashes
        hit_length = max((len(group) for group in hit), default=0)  # blocks, every group
        plan = self.planner.plan(hashes, first_block - hit_length,
                                 (end_block - first_block + hit_length)
                                 * self.cpu.hash_block_size)
        if self.room.held_back(kind):  # a kind before this one claims the room
            return bool(self.planner.entries(plan, hashes, end_block))
        # Blocks of the run after the hit already in the CPU tier stay there while room
        # is made (the hit is pinned by the caller).
        held = [b for (pos, _), b in plan.cpu_slots() if pos >= hit_length]
        self.cpu.pin(held)
        try:
            # A block another request's read brings counts as on its way.
            chosen = self.planner.promotion(plan, hashes, end_block,
                                            self.room.grant(kind, max_blocks))
            if not chosen:  # another request's read brings blocks of the run, or room
                keys = self.groups.keys(hashes[first_block:end_block])
                return (self.reads.brings_for_another(keys, req_id)
                        or self._waits_for_room(req_id, plan, end_block, held, hit, hashes))
            self._promoting[req_id] = read = self.reads.start(
                self, req_id, chosen, self._promoted, kind, "a promotion")
            self.reads.advance(read, len(chosen))
        finally:
            self.cpu.unpin(held)
        return True

    def _coming(self, key: BlockKey) -> bool:
        """Whether another request's read brings ``key`` into the CPU tier."""
        return bool(self.reads.owners) and key in self.reads.owners

    def _waits_for_room(self, req_id: str, plan: SlotPlan, end_block: int,
                        held: list[KVCacheBlock], hit: Hit, hashes: list[Any]) -> bool:
        """Whether only CPU room is missing, held by copies in flight: the request asks
        again when they end, its own blocks (the hit, the run's ``held``) kept until then."""
        if not self.planner.entries(plan, hashes, end_block):
            return False  # nothing to promote, whatever the room
        own = [*held, *(b for group in hit for b in group if not b.is_null)]
        # Loads and stores hold fresh blocks or other requests' hits; a spill of the
        # request's own blocks frees nothing for it.
        own_ids = {b.block_id for b in own}
        if not (self._copies_in_flight() or any(
                b.block_id not in own_ids for job in self._spills() for b in job.blocks)):
            return False
        now = self._clock()
        if starved(self._room_wait_since.setdefault(req_id, now), now, self.names.label,
                   "a request waiting for CPU blocks that copies in flight hold"):
            return False
        self.cpu.pin(own)
        self._kept[req_id] = own  # released by its next lookup, as promoted blocks are
        return True

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on promoted blocks once the request looked them up again."""
        if blocks := self._kept.pop(req_id, None):
            self.cpu.unpin(blocks)

    def _promoted(self, read: TierRead, part: list[Entry], blocks: list[KVCacheBlock],
                  n_ok: int) -> None:
        """Every rank read a promotion: what read stays referenced for the request until
        its next lookup; a failed key ends its promotions (it recomputes the rest)."""
        self.reads.end(read)
        if self._promoting.get(read.reader) is not read:  # the request is gone
            self.cpu.unpin(blocks)
            return
        del self._promoting[read.reader]
        if n_ok < len(part) and not read.cancelled:
            self._no_promotion.add(read.reader)
        self._kept[read.reader] = blocks[:n_ok]
        self.cpu.unpin(blocks[n_ok:])

    def _stop_promoting(self, req_id: str) -> None:
        """The request no longer waits for its promotion, which completes (and is
        published) without it."""
        read = self._promoting.pop(req_id, None)
        if read is not None:
            self.reads.end(read)

    def request_finished(self, req_id: str) -> bool:
        self._room_wait_since.pop(req_id, None)
        self.release_promoted(req_id)
        self._no_promotion.discard(req_id)
        self._stop_promoting(req_id)
        return False

    def _finish_promotion(self, job: TierJob) -> None:
        self.reads.finish(job, self)

    def reset(self) -> None:
        """Forget every entry; jobs in flight finish but are not published, and blocks
        kept for requests' next lookups are let go (their hashes are gone)."""
        self.release_all_kept()
        for step in self._sent.payloads():
            if step.kind is not JobKind.PROBE:  # a shared tier resets its probes
                for job in step.jobs:
                    job.abandoned = True
        queued = list(self._queued)
        self._queued.clear()
        for job in queued:  # never sent: release now
            if job.kind is JobKind.PROMOTE:
                self.reads.cancel(job)
            else:
                self.index.drop(job.keys)
                self.cpu.unpin(job.blocks)
        self.index.reset()
