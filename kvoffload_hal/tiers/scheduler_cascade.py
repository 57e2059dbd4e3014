"""Scheduler side of a secondary tier: write-through spills and asynchronous promotions.

* **Spill (write-through).** When a device->CPU store is published, its blocks
  are also queued for the tier (those the tier has room for). The CPU block stays
  referenced until every rank wrote it, so it cannot be reused mid-write.
  Write-through was chosen over write-on-evict because vLLM's BlockPool evicts
  inside ``get_new_blocks`` without a hook: by the time a block is known to be
  evicted its bytes are already being overwritten.
* **Promotion.** When a lookup finds the CPU hit continued by blocks the tier
  holds, fresh CPU blocks are allocated and a tier->CPU job is queued; the
  request is told to ask again later (``None``) so the engine step does not
  wait. Once every rank read its blocks, they are published in the CPU prefix
  cache and kept referenced for that request; its next lookup finds a longer
  CPU hit and loads it to the device as usual. A model with several KV cache
  groups promotes every group's entries of the run
  (:mod:`~kvoffload_hal.tiers.scheduler_groups`). When no CPU block is free
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload_hal.hal.plumbing import log_once
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import JobReport, TierJobs, TierJobSpec
from kvoffload_hal.scheduler.jobs import JobBook, RankTally
from kvoffload_hal.tiers.scheduler_groups import GroupKeys
from kvoffload_hal.tiers.scheduler_index import TierIndex
from kvoffload_hal.tiers.scheduler_rebuild import IndexRebuild
from kvoffload_hal.tiers.worker_tier import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit

NO_TIER_JOBS = TierJobs()
# The longest a request waits for CPU blocks that copies in flight hold before it
# recomputes instead: spills finish in milliseconds unless the disk is stuck.
MAX_ROOM_WAIT_S = 10.0

logger = init_logger(__name__)


class NullCascade:
    """No secondary tier: the scheduler's calls, each doing nothing.

    The interface a secondary tier offers the scheduler, with
    :class:`TierCascade` the real one.
    """

    stages = False  # whether hits longer than the CPU tier's room are staged (staged.py)

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        """``copies_in_flight()``: whether the CPU tier's own loads or stores hold CPU
        blocks that they release when they end."""

    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        """Blocks were just published in the CPU tier (write-through)."""

    def on_found(self, keys: list[BlockKey], ranks_done: int) -> None:
        """Blocks the workers found from before a restart; ranks done looking."""

    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               max_blocks: int | None = None) -> bool:
        """After a CPU hit ``hit``: True when the request must ask again later.
        ``max_blocks``: promote at most that many CPU blocks (a prefetch's budget)."""
        return False

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        """CPU blocks promoted (unless ``promoting_only``), or being promoted, for the
        request and kept for it."""
        return 0

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on blocks promoted for the request (it pinned its hit)."""

    def request_finished(self, req_id: str) -> None:
        """Forget the request; a promotion in flight completes without it."""

    def take_jobs(self) -> TierJobs:
        """This step's jobs for the workers."""
        return NO_TIER_JOBS

    def on_reports(self, reports: dict[int, JobReport]) -> None:
        """Job reports from the workers, summed over ranks."""

    def reset(self) -> None:
        """Forget every entry; jobs in flight finish but are not published."""

    def has_pending(self) -> bool:
        return False


@dataclass
class _TierJob:
    promote: bool
    keys: list[BlockKey]
    blocks: list[KVCacheBlock]
    hashes: list[Any]
    req_id: str | None = None
    failed: set[BlockKey] = field(default_factory=set)
    abandoned: bool = False
    # A staged hit's round (tiers/staged.py): takes the blocks and how many read.
    on_done: Callable[[list[KVCacheBlock], int], None] | None = None


@dataclass
class TierStep:
    """The jobs of one kind sent in one step: they share one id and one tally."""

    kind: str  # "spill", "promote", or a subclass's own kind (a shared tier's "probe")
    jobs: list[Any]


def _no_copies() -> bool:
    return False


def _blocks(hit: Hit) -> list[KVCacheBlock]:
    return [b for group in hit for b in group if not b.is_null]


class TierCascade(NullCascade):
    stages = True  # not a shared tier: it answers existence asynchronously

    def __init__(self, index: TierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, rebuild: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``rebuild``: the workers report blocks kept from before a restart."""
        self._clock = clock
        self._room_wait_since: dict[str, float] = {}
        self.index = index
        self.rebuild = IndexRebuild(index, world_size) if rebuild else None
        self.cpu = cpu
        self.world_size = world_size
        self.stats = stats
        self._queued: list[_TierJob] = []
        self._sent: JobBook[TierStep] = JobBook(world_size)
        self._promoting: dict[str, _TierJob] = {}
        self._promoted: dict[str, list[KVCacheBlock]] = {}
        self._no_promotion: set[str] = set()
        self._keys_promoting: set[BlockKey] = set()  # one promotion per key at a time
        self._copies_in_flight: Callable[[], bool] = _no_copies
        self._max_blocks: int | None = None  # during a lookup with a budget
        self.groups = GroupKeys.of(cpu)

    def bind_copies(self, copies_in_flight: Callable[[], bool]) -> None:
        self._copies_in_flight = copies_in_flight

    # --------------------------------------------------------------- spill
    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        keys = [h.hex() for h in hashes]
        accepted = set(self.index.reserve(keys))
        chosen = [(k, b, h) for k, b, h in zip(keys, blocks, hashes) if k in accepted]
        if not chosen:
            return
        keys, blocks, hashes = map(list, zip(*chosen))
        self.cpu.pin(blocks)  # read by the tier until every rank wrote it
        self._queued.append(_TierJob(False, keys, blocks, hashes))

    # ----------------------------------------------------------- promotion
    def lookup(self, request: Request, hit: Hit, first_block: int, end_block: int,
               max_blocks: int | None = None) -> bool:
        """Start or await a promotion of blocks ``[first_block, end_block)``.

        Blocks promoted for this request were pinned until now; the CPU lookup
        found the ones still wanted. The hit stays pinned while room is made, so
        a promotion never evicts the blocks it extends (a run longer than the room
        is staged instead, tiers/staged.py, where that can be done).
        """
        self.cpu.pin_hit(hit)
        self._max_blocks = max_blocks
        try:
            self.release_promoted(request.request_id)
            return self._promote(request, hit, first_block, end_block)
        finally:
            self._max_blocks = None
            self.cpu.unpin_hit(hit)

    def held_for(self, req_id: str, promoting_only: bool = False) -> int:
        job = self._promoting.get(req_id)
        held = 0 if promoting_only else len(self._promoted.get(req_id, ()))
        return held + (len(job.blocks) if job else 0)

    def queue_promotion(self, keys: list[BlockKey], hashes: list[Any], req_id: str | None,
                        on_done: Callable[[list[KVCacheBlock], int], None] | None = None,
                        ) -> _TierJob:
        """Promote ``keys`` (at most :meth:`room`) into fresh CPU blocks, for request
        ``req_id``, or for a staged hit: then once every rank read them, the blocks that
        read are published and ``on_done(blocks, n_ok)`` owns every block, still pinned."""
        self.index.pin(keys)
        job = _TierJob(True, keys, self.cpu.allocate(len(keys)), hashes, req_id, on_done=on_done)
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
            log_once(logger, logging.WARNING, "disk tier: a request waited %.0f s for CPU "
                     "blocks held by copies in flight (a stuck disk?); such requests are "
                     "recomputed", MAX_ROOM_WAIT_S)
            return False
        self.cpu.pin(own)
        self._promoted[req_id] = own  # released by its next lookup, as promoted blocks are
        return True

    def _spills(self) -> Iterator[_TierJob]:
        """Spill jobs queued or in flight: each keeps its CPU blocks until it ends."""
        yield from (j for j in self._queued if not j.promote)
        for step in self._sent.payloads():
            if step.kind == "spill":
                yield from step.jobs

    def release_promoted(self, req_id: str) -> None:
        """Drop the pins kept on promoted blocks once the request looked them up again."""
        blocks = self._promoted.pop(req_id, None)
        if blocks:
            self.cpu.unpin(blocks)

    def request_finished(self, req_id: str) -> None:
        self._room_wait_since.pop(req_id, None)
        self.release_promoted(req_id)
        self._no_promotion.discard(req_id)
        job = self._promoting.pop(req_id, None)
        if job is not None:
            job.req_id = None  # completes normally, but nobody keeps the blocks

    # ---------------------------------------------------------- per step
    def take_jobs(self) -> TierJobs:
        spill, promote = (self._take(promote) for promote in (False, True))
        self._queued.clear()
        return TierJobs(spill, promote, tuple(self.index.take_evicted()))

    def _take(self, promote: bool) -> TierJobSpec | None:
        jobs = [j for j in self._queued if j.promote == promote]
        if not jobs:
            return None
        job_id = self._sent.send(TierStep("promote" if promote else "spill", jobs))
        return TierJobSpec(job_id, [(k, b.block_id) for j in jobs
                                    for k, b in zip(j.keys, j.blocks)])

    def on_reports(self, reports: dict[int, JobReport]) -> None:
        for job_id, report in reports.items():
            done = self._sent.report(job_id, report)
            if done is not None:
                self._on_done(done.payload, done.tally)

    def _on_done(self, step: TierStep, tally: RankTally) -> None:
        """Every rank reported the step's jobs; a key failed if it failed on any rank."""
        for job in step.jobs:
            job.failed.update(tally.failed_keys.intersection(job.keys))
            (self._finish_promotion if job.promote else self._finish_spill)(job)

    def _finish_spill(self, job: _TierJob) -> None:
        ok = [k for k in job.keys if k not in job.failed]
        if job.abandoned:
            self.index.drop(job.keys)
        else:
            self.index.commit(ok)
            self.index.drop(job.failed)
            self._record_moved(len(ok), 0)
        self.cpu.unpin(job.blocks)

    def _finish_promotion(self, job: _TierJob) -> None:
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

    def _record_moved(self, spilled: int, promoted: int) -> None:
        self.stats.record_disk(spilled=spilled, promoted=promoted)

    # --------------------------------------------------------------- misc
    def reset(self) -> None:
        for step in self._sent.payloads():
            if step.kind in ("spill", "promote"):  # a subclass's own kinds reset theirs
                for job in step.jobs:
                    job.abandoned = True
        for job in self._queued:  # never sent: release now
            if job.promote:
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

    def on_found(self, keys: list[BlockKey], ranks_done: int) -> None:
        if self.rebuild is not None:
            self.rebuild.on_found(keys, ranks_done)

    def has_pending(self) -> bool:
        # A restarted tier's index fills while the engine steps, idle or not.
        return bool(self._queued or len(self._sent)
                    or (self.rebuild is not None and self.rebuild.pending))
