"""A secondary tier's jobs to the workers, and its write-through spills.

A block published in the CPU tier is queued for the tier too (when the tier has room),
and stays referenced until every rank wrote it. Write-through, because vLLM's BlockPool
evicts inside ``get_new_blocks`` without a hook: by the time a block is known to be
evicted, its bytes are being overwritten.

The tier's circuit breaker (:mod:`.breaker`) sees every job: one in flight past the
tier's ``wait_s`` opens it, one that failed as a whole is an error (on a shared tier),
any other a success. While it is not closed, spills are not sent but by its probe, and
the jobs in flight are no pending work (they keep their CPU blocks until they end).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload_hal.metadata import JobReport, TierJobs, TierJobSpec
from kvoffload_hal.scheduler.jobs import JobBook, RankTally
from kvoffload_hal.scheduler.parts import RequestPart
from kvoffload_hal.scheduler.secondary.breaker import BreakerState, CircuitBreaker
from kvoffload_hal.scheduler.secondary.index import IndexRebuild, TierIndex
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier


class TierNames(NamedTuple):
    """How counters (``blocks_to_<name>``, ...) and log lines (``label``) name a tier."""

    name: str = "tier"
    label: str = "secondary tier"


class JobKind(Enum):
    """What a tier job does; one job per kind per step."""

    SPILL = "spill"  # CPU tier -> tier
    PROMOTE = "promote"  # tier -> CPU tier
    PROBE = "probe"  # a shared tier's existence query


@dataclass
class TierJob:
    kind: JobKind
    keys: list[BlockKey]
    blocks: list[KVCacheBlock]
    hashes: list[Any]
    failed: set[BlockKey] = field(default_factory=set)
    abandoned: bool = False  # a reset came while it was out: nothing it read is published
    cancelled: bool = False  # a reset took it back before it was sent
    # A promotion's part: told, once every rank reported it, how many keys read (reads.py).
    on_done: Callable[[TierJob, int], None] | None = None


@dataclass
class TierStep:
    """The jobs of one kind sent in one step: they share one id and one tally."""

    kind: JobKind
    jobs: list[Any]


# The longest a tier built without a wait of its own (SchedulerHalf.wait_s) is waited for.
DEFAULT_WAIT_S = 10.0
# The breaker's name for spills when they are its probe: a request id never is.
SPILLS = "(spills)"


class SpillingTier(RequestPart):
    """The tier's jobs, spills and breaker; promotions are the subclass's
    (``_finish_promotion``)."""

    # Whether jobs that fail as a whole open the breaker (a store that stopped taking
    # calls), or only jobs past the wait do: a local tier's failures are its blocks'
    # (missing, damaged, a full disk), and each drops its keys.
    errors_open_breaker = False

    def __init__(self, index: TierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, rebuild: bool = False,
                 names: TierNames = TierNames(), wait_s: float = DEFAULT_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.names = names
        self.rebuild = IndexRebuild(index, world_size, names.label) if rebuild else None
        self.cpu = cpu
        self.stats = stats
        self.wait_s = wait_s
        self._clock = clock
        self._queued: list[TierJob] = []
        self._sent: JobBook[TierStep] = JobBook(world_size)
        self._sent_at: dict[int, float] = {}  # jobs in flight not yet found overdue
        self.breaker = CircuitBreaker(names.label, wait_s, self._on_breaker, clock=clock)

    # ------------------------------------------------------- the breaker
    def _on_breaker(self, old: BreakerState, new: BreakerState) -> None:
        if new is BreakerState.OPEN:
            self._sent_at.clear()  # what is in flight now is the frozen tier's: counted
            opened = old is BreakerState.CLOSED
            self.stats.record_breaker(self.names.name, opened=int(opened),
                                      reopened=int(not opened))
        elif new is BreakerState.CLOSED:
            self.stats.record_breaker(self.names.name, closed=1)

    def _note_overdue(self) -> None:
        """A job in flight past the wait opens a closed breaker, once per job (a
        half-open one times its probe out itself)."""
        if self.breaker.state is not BreakerState.CLOSED:
            return
        now = self._clock()
        for job_id, sent_at in list(self._sent_at.items()):
            if job_id not in self._sent:
                del self._sent_at[job_id]
            elif now - sent_at > self.wait_s:
                del self._sent_at[job_id]
                self.breaker.timeout()
                if self.breaker.state is not BreakerState.CLOSED:
                    return

    # ------------------------------------------------------------ spills
    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        if not self.breaker.allow(SPILLS):  # not written: recomputed if wanted
            self.stats.record_breaker(self.names.name, skipped=1)
            return
        queued = len(self._queued)
        self._spill(blocks, hashes)
        if len(self._queued) == queued:
            self.breaker.cancel(SPILLS)  # nothing to write: a later caller probes

    def _spill(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        keys = [h.hex() for h in hashes]
        accepted = set(self.index.reserve(keys))
        chosen = [(k, b, h) for k, b, h in zip(keys, blocks, hashes) if k in accepted]
        if not chosen:
            return
        keys, blocks, hashes = map(list, zip(*chosen))
        self.cpu.pin(blocks)  # read by the tier until every rank wrote it
        self._queued.append(TierJob(JobKind.SPILL, keys, blocks, hashes))

    def queue(self, job: TierJob) -> None:
        """Send ``job`` with this step's tier jobs."""
        self._queued.append(job)

    def _spills(self) -> Iterator[TierJob]:
        """Spill jobs queued or in flight: each keeps its CPU blocks until it ends."""
        yield from (j for j in self._queued if j.kind is JobKind.SPILL)
        for step in self._sent.payloads():
            if step.kind is JobKind.SPILL:
                yield from step.jobs

    def take_jobs(self) -> TierJobs:
        self._note_overdue()
        spill, promote = (self._take(kind) for kind in (JobKind.SPILL, JobKind.PROMOTE))
        self._queued.clear()
        return TierJobs(spill, promote, tuple(self.index.take_evicted()))

    def _take(self, kind: JobKind) -> TierJobSpec | None:
        jobs = [j for j in self._queued if j.kind is kind]
        if not jobs:
            return None
        job_id = self._sent.send(TierStep(kind, jobs))
        self._sent_at[job_id] = self._clock()
        return TierJobSpec(job_id, [(k, b.block_id) for j in jobs
                                    for k, b in zip(j.keys, j.blocks)])

    def on_reports(self, reports: dict[int, JobReport]) -> None:
        """Reports summed over ranks; the keys a write or a read failed on are counted
        (``<name>_failed_blocks``), a probe's missing keys are answers."""
        failed_blocks = sum(len(r.failed_keys) for j, r in reports.items()
                            if (step := self._sent.get(j)) is not None
                            and step.kind is not JobKind.PROBE)
        if failed_blocks:
            self.stats.record_tier(self.names.name, failed=failed_blocks)
        for job_id, report in reports.items():
            done = self._sent.report(job_id, report)
            if done is not None:
                self._on_done(done.payload, done.tally)

    def _on_done(self, step: TierStep, tally: RankTally) -> None:
        """Every rank reported the step's jobs; a key failed if it failed on any rank."""
        failed = tally.failed_keys  # empty unless a key failed: no set built then
        if failed and self._all_failed(step, failed):
            if self.errors_open_breaker:
                self.breaker.error()
        else:
            self.breaker.success()  # a key read or written: the tier answers
        for job in step.jobs:
            job.failed.update(tally.failed_keys.intersection(job.keys))
            if job.kind is JobKind.PROMOTE:
                self._finish_promotion(job)
            else:
                self._finish_spill(job)

    @staticmethod
    def _all_failed(step: TierStep, failed: set[BlockKey]) -> bool:
        """Whether every key of the step's jobs failed (and it had one)."""
        keys = {k for job in step.jobs for k in job.keys}
        return bool(keys) and keys <= failed

    def _finish_spill(self, job: TierJob) -> None:
        ok = [k for k in job.keys if k not in job.failed]
        if job.abandoned:
            self.index.drop(job.keys)
        else:
            self.index.commit(ok)
            self.index.drop(job.failed)
            self.stats.record_tier(self.names.name, spilled=len(ok))
        self.cpu.unpin(job.blocks)

    def on_found(self, keys: list[BlockKey], ranks_done: int) -> None:
        if self.rebuild is not None:
            self.rebuild.on_found(keys, ranks_done)

    def has_pending(self) -> bool:
        self._note_overdue()
        if self.breaker.state is not BreakerState.CLOSED:
            return bool(self._queued)  # jobs stuck on a broken tier are no work
        # A restarted tier's index fills while the engine steps, idle or not.
        return bool(self._queued or len(self._sent)
                    or (self.rebuild is not None and self.rebuild.pending))
