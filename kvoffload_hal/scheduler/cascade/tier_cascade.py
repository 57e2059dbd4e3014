"""Scheduler side of a secondary tier: asynchronous promotions.

Spills (write-through) and the jobs' transport are
:class:`~kvoffload_hal.scheduler.cascade.spill.SpillCascade`'s; :class:`TierCascade` adds:

* **Promotion.** When a lookup finds the CPU hit continued by blocks the tier
  holds, fresh CPU blocks are allocated and a tier->CPU job is queued; the
  request is told to ask again later (``None``) so the engine step does not
  wait. Once every rank read its blocks, they are published in the CPU prefix
  cache and kept referenced for that request; its next lookup finds a longer
  CPU hit and loads it to the device as usual. A model with several KV cache
  groups promotes every group's entries of the run
  (:mod:`~kvoffload_hal.scheduler.cascade.groups`). When no CPU block is free
  because copies in flight hold them (spills, the CPU tier's loads and stores),
  the request waits for those copies instead of recomputing: its answer would
  otherwise depend on whether a disk write had been collected yet.
* **Integrity.** A key that failed to read (missing, torn, corrupted) is dropped
  from the index; blocks after it in the request are not published, and the
  request stops promoting (it recomputes instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvoffload_hal.hal.plumbing import log_once
from kvoffload_hal.logger import init_logger
from kvoffload_hal.scheduler.cascade.base import NullCascade, TierNames
from kvoffload_hal.scheduler.cascade.groups import GroupKeys
from kvoffload_hal.scheduler.cascade.index import TierIndex
from kvoffload_hal.scheduler.cascade.spill import JobKind, SpillCascade, TierJob, TierStep
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit

# The longest a request waits for CPU blocks that copies in flight hold before it
# recomputes instead: spills finish in milliseconds unless the disk is stuck.
MAX_ROOM_WAIT_S = 10.0

logger = init_logger(__name__)

__all__ = ["MAX_ROOM_WAIT_S", "NullCascade", "TierCascade", "TierStep"]


def _no_copies() -> bool:
    return False


def _blocks(hit: Hit) -> list[KVCacheBlock]:
    return [b for group in hit for b in group if not b.is_null]


class TierCascade(SpillCascade):
    stages = True

    def __init__(self, index: TierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, rebuild: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 names: TierNames = TierNames()) -> None:
        """``rebuild``: the workers report blocks kept from before a restart."""
        super().__init__(index, cpu, world_size, stats, rebuild, names)
        self._clock = clock
        self._room_wait_since: dict[str, float] = {}
        self._promoting: dict[str, TierJob] = {}
        self._promoted: dict[str, list[KVCacheBlock]] = {}
        self._no_promotion: set[str] = set()
        self._keys_promoting: set[BlockKey] = set()  # one promotion per key at a time
        self._copies_in_flight: Callable[[], bool] = _no_copies
        self._max_blocks: int | None = None  # during a lookup with a budget
        self._suspended = False  # see suspend_promotions
        self.groups = GroupKeys.of(cpu)

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        self._copies_in_flight = copies_in_flight

    # ----------------------------------------------------------- promotion
    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               max_blocks: int | None = None) -> bool:
        """Start or await a promotion of blocks ``[first_block, end_block)``.

        Blocks promoted for this request were pinned until now; the CPU lookup
        found the ones still wanted. The hit stays pinned while room is made, so
        a promotion never evicts the blocks it extends (a run longer than the room
        is staged instead, scheduler/cascade/staged.py, where that can be done).
        """
        self.cpu.pin_hit(hit)
        self._max_blocks = max_blocks
        try:
            self.release_promoted(request.request_id)
            return self._promote(request, hit, first_block, end_block)
        finally:
            self._max_blocks = None
            self.cpu.unpin_hit(hit)

    def suspend_promotions(self, suspended: bool) -> None:
        """While a staged hit finds no free CPU block, other requests' promotions wait,
        and the blocks kept for requests not looked up again are let go: vLLM cannot
        admit those while staged hits hold the device, and they would keep the CPU room
        the staged hits need for ever. The blocks stay cached until evicted."""
        if suspended and not self._suspended:
            for req_id in list(self._promoted):
                self.release_promoted(req_id)
        self._suspended = suspended

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        job = self._promoting.get(req_id)
        held = 0 if promoting_only else len(self._promoted.get(req_id, ()))
        return held + (len(job.blocks) if job else 0)

    def queue_promotion(self, keys: list[BlockKey], hashes: list[Any], req_id: str | None,
                        on_done: Callable[[list[KVCacheBlock], int], None] | None = None,
                        ) -> TierJob:
        """Promote ``keys`` (at most :meth:`room`) into fresh CPU blocks, for request
        ``req_id``, or for a staged hit: then once every rank read them, the blocks that
        read are published and ``on_done(blocks, n_ok)`` owns every block, still pinned."""
        self.index.pin(keys)
        job = TierJob(JobKind.PROMOTE, keys, self.cpu.allocate(len(keys)), hashes, req_id,
                      on_done=on_done)
        self._queued.append(job)
        self._keys_promoting.update(keys)
        return job

    def is_promoting(self, key: BlockKey) -> bool:
        return key in self._keys_promoting

    def room(self) -> int:
        """CPU blocks a promotion may take now."""
        free = self.cpu.num_free_blocks()
        return free if self._max_blocks is None else min(free, self._max_blocks)

    def _promote(self, request: Request, hit: Hit, first_block: int, end_block: int) -> bool:
        req_id = request.request_id
        if req_id in self._promoting:
            return True
        if req_id in self._no_promotion:
            return False
        positions = request.block_hashes[first_block:end_block]
        if self._suspended:  # a staged hit takes the room first; wait, holding nothing
            return bool(self.groups.plan(positions, self.index.is_ready, self._in_cpu_soon,
                                         len(self.groups.groups)))
        # Blocks of the run already in the CPU tier stay there while room is made.
        held = self.cpu.cached(h for bh in positions for _, h in self.groups.at(bh))
        self.cpu.pin(held)
        try:
            # A block another request's promotion brings counts as on its way.
            chosen = self.groups.plan(positions, self.index.is_ready, self._in_cpu_soon,
                                      self.room())
            if not chosen:
                return (self._waits_for_others(positions)
                        or self._waits_for_room(req_id, positions, [*held, *_blocks(hit)]))
            keys, hashes = (list(x) for x in zip(*chosen))
            self._promoting[req_id] = self.queue_promotion(keys, hashes, req_id)
        finally:
            self.cpu.unpin(held)
        return True

    def _in_cpu_soon(self, block_hash: Any) -> bool:
        return self.cpu.holds(block_hash) or (
            bool(self._keys_promoting) and block_hash.hex() in self._keys_promoting)

    def _waits_for_others(self, positions: list[Any]) -> bool:
        """Whether another request's promotion brings blocks of ``positions``: this
        request asks again once they are in the CPU tier, and loads them from there."""
        promoting = self._keys_promoting
        return bool(promoting) and any(k in promoting for k in self.groups.keys(positions))

    def _waits_for_room(self, req_id: str, positions: list[Any],
                        own: list[KVCacheBlock]) -> bool:
        """Whether only CPU room is missing, held by copies in flight: the request asks
        again when they end, its ``own`` blocks (hit and run) kept until then. As a miss
        it would recompute its whole prompt whenever the last spills had not been
        collected yet (an offline engine stops stepping after its last request)."""
        if not self.groups.plan(positions, self.index.is_ready, self._in_cpu_soon,
                                len(self.groups.groups)):
            return False  # nothing to promote, whatever the room
        # Loads and stores hold fresh blocks or other requests' hits; a spill of the
        # request's own blocks frees nothing for it.
        own_ids = {b.block_id for b in own}
        if not (self._copies_in_flight() or any(
                b.block_id not in own_ids for job in self._spills() for b in job.blocks)):
            return False
        now = self._clock()
        if now - self._room_wait_since.setdefault(req_id, now) > MAX_ROOM_WAIT_S:
            log_once(logger, logging.WARNING, "%s: a request waited %.0f s for CPU "
                     "blocks held by copies in flight (a stuck tier?); such requests are "
                     "recomputed", self.names.label, MAX_ROOM_WAIT_S)
            return False
        self.cpu.pin(own)
        self._promoted[req_id] = own  # released by its next lookup, as promoted blocks are
        return True

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on promoted blocks once the request looked them up again."""
        blocks = self._promoted.pop(req_id, None)
        if blocks:
            self.cpu.unpin(blocks)

    def request_finished(self, req_id: str) -> bool:
        self._room_wait_since.pop(req_id, None)
        self.release_promoted(req_id)
        self._no_promotion.discard(req_id)
        job = self._promoting.pop(req_id, None)
        if job is not None:
            job.req_id = None  # completes normally, but nobody keeps the blocks
        return False

    def _finish_promotion(self, job: TierJob) -> None:
        self._keys_promoting.difference_update(job.keys)
        self.index.unpin(job.keys)
        self.index.drop(job.failed)
        # Publish up to the first failed key: a prefix hit must be contiguous.
        n_ok = next((i for i, k in enumerate(job.keys) if k in job.failed), len(job.keys))
        if not job.abandoned:
            self.cpu.publish(job.blocks[:n_ok], job.hashes[:n_ok])
            self._record_moved(0, n_ok)
        if job.on_done is not None:
            job.on_done(job.blocks, n_ok)
        elif job.req_id is not None:
            self._promoting.pop(job.req_id, None)
            if job.failed:
                self._no_promotion.add(job.req_id)
            # Published blocks stay referenced until the request's next lookup.
            self._promoted[job.req_id] = job.blocks[:n_ok]
            self.cpu.unpin(job.blocks[n_ok:])
        else:
            self.cpu.unpin(job.blocks)

    # --------------------------------------------------------------- misc
    def reset(self) -> None:
        """Forget every entry; jobs in flight finish but are not published, and blocks
        kept for requests' next lookups are let go (their hashes are gone)."""
        for req_id in list(self._promoted):
            self.release_promoted(req_id)
        for step in self._sent.payloads():
            if step.kind is not JobKind.PROBE:  # a shared tier resets its probes
                for job in step.jobs:
                    job.abandoned = True
        for job in self._queued:  # never sent: release now
            if job.kind is JobKind.PROMOTE:
                self._keys_promoting.difference_update(job.keys)
                self.index.unpin(job.keys)
                if job.req_id is not None:
                    self._promoting.pop(job.req_id, None)
            else:
                self.index.drop(job.keys)
            if job.on_done is not None:
                job.on_done(job.blocks, 0)  # nothing read: the staged hit stops there
            else:
                self.cpu.unpin(job.blocks)
        self._queued.clear()
        self.index.reset()
