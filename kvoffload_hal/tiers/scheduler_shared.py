"""Scheduler side of a tier shared by every instance (Mooncake Store).

A local tier's :class:`~kvoffload_hal.tiers.scheduler_index.TierIndex` knows everything
the tier holds: only this instance writes it. A shared store also holds what
other instances wrote, and loses objects the master evicts. So:

* :class:`SharedTierIndex` is what this instance *knows* the store holds: its
  own writes, and keys an existence query found. Forgetting an entry deletes
  nothing (other instances may read it); a stale entry only makes one read
  fail, and that block is recomputed.
* :class:`SharedTierCascade` asks the store when a lookup misses the CPU tier
  and the index knows nothing of the next blocks: it queues an **existence
  query** (a probe job, run by the workers, which hold the store clients; the
  scheduler never touches the network) and tells the request to ask again.
  When every rank answered, the keys present on all ranks are learned (every
  group's, for a model with several) and promoted as for any tier.
* Every wait is bounded: a request whose probe or promotion is older than
  ``mooncake_timeout_s`` stops waiting and recomputes (counted in
  ``mooncake_timeouts``). A promotion it stopped waiting for keeps its CPU
  blocks referenced until the workers report it, so a late read never writes
  into a reused block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload_hal.metadata import JobReport, TierJobs, TierJobSpec
from kvoffload_hal.scheduler.jobs import RankTally
from kvoffload_hal.tiers.scheduler_cascade import TierCascade, TierStep
from kvoffload_hal.tiers.scheduler_index import TierIndex, _Entry
from kvoffload_hal.tiers.worker_tier import BlockKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit

class SharedTierIndex(TierIndex):
    """What this instance knows a shared store holds; see the module docstring."""

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
        self._evicted = []  # forgotten here, kept in the store for the others
        return []


@dataclass
class _Probe:
    req_id: str
    keys: list[BlockKey]
    sent_at: float
    job_id: int | None = None  # None until sent
    answered: bool = False
    missing: set[BlockKey] = field(default_factory=set)  # on any rank


class SharedTierCascade(TierCascade):
    def __init__(self, index: SharedTierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(index, cpu, world_size, stats)
        self.timeout_s = timeout_s
        self._clock = clock
        self._probes: dict[str, _Probe] = {}
        self._promote_started: dict[str, float] = {}
        self._waiting_since: dict[str, float] = {}  # on another request's promotion

    def _promote(self, request: Request, hit: Hit, first_block: int, end_block: int) -> bool:
        req_id = request.request_id
        now = self._clock()
        if req_id in self._promoting:
            if now - self._promote_started.get(req_id, now) <= self.timeout_s:
                return True
            job = self._promoting.pop(req_id)
            job.req_id = None  # completes (and is published) without the request
            return self._give_up(req_id)
        if req_id in self._no_promotion:
            return False
        probe = self._probes.get(req_id)
        if probe is not None and not probe.answered:
            if now - probe.sent_at <= self.timeout_s:
                return True
            del self._probes[req_id]
            return self._give_up(req_id)
        keys = self.groups.keys(request.block_hashes[first_block:end_block])
        if probe is None and keys and not self.index.ready_run(keys):
            self._probes[req_id] = _Probe(req_id, keys, now)
            return True  # ask the store (once per request); the request asks again later
        if super()._promote(request, hit, first_block, end_block):
            if req_id in self._promoting:
                self._promote_started[req_id] = now
            elif now - self._waiting_since.setdefault(req_id, now) > self.timeout_s:
                return self._give_up(req_id)  # another request's promotion, too slow
            return True
        self._no_promotion.add(req_id)  # the store holds nothing more for it
        return False

    def _give_up(self, req_id: str) -> bool:
        self._release_promoted(req_id)  # what it kept while waiting
        self._no_promotion.add(req_id)
        self.stats.record_mooncake(timeouts=1)
        return False

    def request_finished(self, req_id: str) -> None:
        super().request_finished(req_id)
        self._probes.pop(req_id, None)
        self._promote_started.pop(req_id, None)
        self._waiting_since.pop(req_id, None)

    # ---------------------------------------------------------- per step
    def take_jobs(self) -> TierJobs:
        jobs = super().take_jobs()
        new = [p for p in self._probes.values() if p.job_id is None]
        if not new:
            return jobs
        job_id = self._sent.send(TierStep("probe", new))
        for probe in new:
            probe.job_id = job_id
        keys = list(dict.fromkeys(k for p in new for k in p.keys))
        return jobs._replace(probe=TierJobSpec(job_id, [(k, -1) for k in keys]))

    def on_reports(self, reports: dict[int, JobReport]) -> None:
        failed_blocks = sum(len(r.failed_keys) for j, r in reports.items()
                            if (step := self._sent.get(j)) is not None and step.kind != "probe")
        self.stats.record_mooncake(failed=failed_blocks)
        super().on_reports(reports)

    def _on_done(self, step: TierStep, tally: RankTally) -> None:
        if step.kind != "probe":
            super()._on_done(step, tally)
            return
        for probe in step.jobs:  # a block is readable when every rank holds its shard
            probe.missing.update(tally.failed_keys)
            self.index.learn(k for k in probe.keys if k not in probe.missing)
            probe.answered = True

    def _record_moved(self, spilled: int, promoted: int) -> None:
        self.stats.record_mooncake(spilled=spilled, promoted=promoted)

    def reset(self) -> None:
        """Forget what this instance knows; the shared store keeps its objects."""
        super().reset()
        self._probes.clear()
        for step in self._sent.payloads():
            if step.kind == "probe":
                for probe in step.jobs:
                    probe.keys = []  # answered after the reset: learn nothing

    def has_pending(self) -> bool:
        return super().has_pending() or any(p.job_id is None for p in self._probes.values())
