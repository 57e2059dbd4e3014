"""Scheduler side of a tier every instance shares (``shared_across_instances``: Mooncake).

A shared store also holds what other instances wrote, and loses objects its master
evicts, so :class:`SharedTierIndex` is only what this instance *knows* it holds: its own
writes and the keys an existence query found. Forgetting an entry deletes nothing
(``deletes_evicted`` aside); a stale entry makes one read fail, and that block is
recomputed. :class:`SharedTier` asks the store (a probe job, run by the workers) when
a lookup misses and the index knows nothing of the next blocks, and bounds by the
tier's ``wait_s`` a request's wait for its query and for another request's promotion,
besides what every tier bounds (:mod:`.promotions`: its own reads, its jobs, the
breaker).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload_hal.metadata import TierJobs, TierJobSpec
from kvoffload_hal.scheduler.jobs import RankTally
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.index import TierIndex, _Entry
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.spill import JobKind, TierNames, TierStep
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.secondary.reads import TierReads


@dataclass
class SharedTierIndex(TierIndex):
    """What this instance knows a shared store holds. ``deletes_evicted``: the store
    does not evict by itself (a shared disk): what is forgotten here goes to the workers,
    which delete only the files this instance wrote."""

    deletes_evicted: bool = False

    def learn(self, keys: Iterable[BlockKey]) -> None:
        """Keys an existence query found: readable now."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.ready = entry.ready or entry.generation == self.generation
                continue
            if len(self._entries) >= self.capacity_blocks and not self._evict_one():
                return
            self._entries[key] = _Entry(self.generation, ready=True)

    def take_evicted(self) -> list[BlockKey]:
        if self.deletes_evicted:
            return super().take_evicted()
        self._evicted = []  # forgotten here, kept in the store for the others
        return []


@dataclass
class _Probe:
    keys: list[BlockKey]
    sent_at: float
    job_id: int | None = None  # None until sent
    answered: bool = False


class SharedTier(PromotingTier):
    """A tier's scheduler half, plus existence queries and bounded waits on the others'
    promotions (see the module docstring)."""

    errors_open_breaker = True  # a store whose calls all fail is unreachable

    def __init__(self, index: SharedTierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 names: TierNames = TierNames(), rebuild: bool = False,
                 reads: TierReads | None = None) -> None:
        """``rebuild``: the workers report blocks kept from before a restart."""
        super().__init__(index, cpu, world_size, stats, rebuild=rebuild, clock=clock,
                         names=names, reads=reads, wait_s=timeout_s)
        self._probes: dict[str, _Probe] = {}
        self._waiting_since: dict[str, float] = {}  # on another request's promotion

    def _skip(self, req_id: str, waited: bool = False) -> bool:
        probe = self._probes.pop(req_id, None)
        return super()._skip(req_id, waited or (probe is not None and not probe.answered))

    # ----------------------------------------------------------- lookups
    def _promote_or_wait(self, request: Request, hit: Hit, first_block: int,
                         end_block: int, kind: RoomKind, max_blocks: int | None) -> bool:
        req_id = request.request_id
        if req_id in self._promoting:  # its own promotion: bounded by the read's wait
            return super()._promote_or_wait(request, hit, first_block, end_block, kind,
                                            max_blocks)
        now = self._clock()
        probe = self._probes.get(req_id)
        if probe is not None and not probe.answered:
            if now - probe.sent_at <= self.wait_s:
                return True
            del self._probes[req_id]
            return self._give_up(req_id)
        keys = self.groups.keys(request.block_hashes[first_block:end_block])
        if probe is None and keys and not self.index.ready_run(keys):
            self._probes[req_id] = _Probe(keys, now)
            return True  # ask the store (once per request); the request asks again later
        if self._start_promotion(request, hit, first_block, end_block, kind, max_blocks):
            if (req_id not in self._promoting
                    and now - self._waiting_since.setdefault(req_id, now) > self.wait_s):
                return self._give_up(req_id)  # another request's read, too slow
            return True
        self._no_promotion.add(req_id)  # the store holds nothing more for it
        return False

    def request_finished(self, req_id: str) -> bool:
        self._probes.pop(req_id, None)
        self._waiting_since.pop(req_id, None)
        return super().request_finished(req_id)

    # ---------------------------------------------------------- per step
    def take_jobs(self) -> TierJobs:
        jobs = super().take_jobs()
        new = [p for p in self._probes.values() if p.job_id is None]
        if new:
            job_id = self._sent.send(TierStep(JobKind.PROBE, new))
            self._sent_at[job_id] = self._clock()
            for probe in new:
                probe.job_id = job_id
            keys = list(dict.fromkeys(k for p in new for k in p.keys))
            jobs = jobs._replace(probe=TierJobSpec(job_id, [(k, -1) for k in keys]))
        return jobs

    def _on_done(self, step: TierStep, tally: RankTally) -> None:
        if step.kind is not JobKind.PROBE:
            super()._on_done(step, tally)
            return
        self.breaker.success()  # answered (a key it lacks is an answer too)
        for probe in step.jobs:  # a block is readable when every rank holds its shard
            self.index.learn(k for k in probe.keys if k not in tally.failed_keys)
            probe.answered = True

    def reset(self) -> None:
        """Forget what this instance knows; the shared store keeps its objects."""
        super().reset()
        self._probes.clear()
        for step in self._sent.payloads():
            if step.kind is JobKind.PROBE:
                for probe in step.jobs:
                    probe.keys = []  # answered after the reset: learn nothing

    def has_pending(self) -> bool:
        return (any(p.job_id is None for p in self._probes.values())
                or super().has_pending())
