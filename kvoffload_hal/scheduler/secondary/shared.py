"""Scheduler side of a tier every instance shares (``shared_across_instances``: Mooncake).

A shared store also holds what other instances wrote, and loses objects its master
evicts, so :class:`SharedTierIndex` is only what this instance *knows* it holds: its own
writes and the keys an existence query found. Forgetting an entry deletes nothing
(``deletes_evicted`` aside); a stale entry makes one read fail, and that block is
recomputed. :class:`SharedTier` asks the store (a probe job, run by the workers) when
a lookup misses and the index knows nothing of the next blocks, bounds every wait by
the tier's ``wait_s``, and skips a store that stopped answering (:class:`CircuitBreaker`).
While the breaker is not closed, jobs in flight are no pending work: an idle engine does
not step for jobs stuck on a frozen store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import TierJobs, TierJobSpec
from kvoffload_hal.scheduler.jobs import RankTally
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.index import TierIndex, _Entry
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.spill import JobKind, TierNames, TierStep
from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.secondary.reads import TierReads

logger = init_logger(__name__)

BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# Errors (a failed write or read reported by every key of a job) in a row that
# open the breaker: one failed job may be a single bad value, three are not.
MAX_ERRORS = 3


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(eq=False)
class CircuitBreaker:
    """Skips a tier that stopped answering, then probes it with one caller.

    **Closed**: the tier is used; a timeout opens the breaker at once, errors after
    ``max_errors`` in a row, and any success resets the count. **Open**: the tier is
    skipped (lookups miss at once, spills are not sent) for a backoff window, doubled at
    each reopening up to ``max_backoff_s``. **Half-open**: the window passed; one caller
    (the *probe*) goes through: its success closes the breaker, its failure or no answer
    within ``probe_timeout_s`` reopens it. Each transition is logged once and reported to
    ``on_transition(old, new)``.
    """

    label: str  # how log lines name the tier
    probe_timeout_s: float
    on_transition: Callable[[BreakerState, BreakerState], None] | None = None
    base_backoff_s: float = BASE_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    max_errors: int = MAX_ERRORS
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = field(default=BreakerState.CLOSED, init=False)
    backoff_s: float = field(default=0.0, init=False)  # the current (last) open window
    _since: float = field(default=0.0, init=False)  # when the current state began
    _errors: int = field(default=0, init=False)
    _probe: str | None = field(default=None, init=False)  # let through while half-open

    def __post_init__(self) -> None:
        self._since = self.clock()

    def allow(self, caller: str) -> bool:
        """Whether ``caller`` may use the tier now; an open breaker whose window
        passed lets this caller through as its probe (half-open)."""
        if self.state is BreakerState.CLOSED:
            return True
        if (self.state is BreakerState.HALF_OPEN
                and self.clock() - self._since > self.probe_timeout_s):
            self._open(f"the probe had no answer within {self.probe_timeout_s:g} s")
        if self.state is BreakerState.OPEN:
            if self.clock() - self._since < self.backoff_s:
                return False
            self._move(BreakerState.HALF_OPEN, "probing with one request")
        if self._probe is None:
            self._probe, self._since = caller, self.clock()
        return caller == self._probe

    def cancel(self, caller: str) -> None:
        """``caller`` was let through but sent nothing: the next caller probes instead."""
        if self.state is BreakerState.HALF_OPEN and self._probe == caller:
            self._probe = None

    def success(self) -> None:
        """The tier answered in time."""
        self._errors = 0
        if self.state is not BreakerState.CLOSED:
            self.backoff_s = 0.0
            self._probe = None
            self._move(BreakerState.CLOSED, "the tier answered")

    def timeout(self) -> None:
        """A request stopped waiting for the tier: opens the breaker now."""
        if self.state is not BreakerState.OPEN:
            self._open("a request waited its full timeout")

    def error(self) -> None:
        """A job failed as a whole (every key)."""
        if self.state is BreakerState.HALF_OPEN:
            self._open("the probe failed")
        elif self.state is BreakerState.CLOSED:
            self._errors += 1
            if self._errors >= self.max_errors:
                self._open(f"{self._errors} failed jobs in a row")

    def _open(self, why: str) -> None:
        self.backoff_s = (self.base_backoff_s if self.backoff_s == 0
                          else min(self.backoff_s * 2, self.max_backoff_s))
        self._errors = 0
        self._probe = None
        self._move(BreakerState.OPEN, f"{why}; skipped for {self.backoff_s:g} s")

    def _move(self, new: BreakerState, why: str) -> None:
        old, self.state, self._since = self.state, new, self.clock()
        log = logger.warning if new is BreakerState.OPEN else logger.info
        log("%s: circuit breaker %s -> %s (%s)", self.label, old.value, new.value, why)
        if self.on_transition is not None:
            self.on_transition(old, new)


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


# The breaker's name for spills when they are its probe: a request id never is.
SPILLS = "(spills)"


class SharedTier(PromotingTier):
    def __init__(self, index: SharedTierIndex, cpu: CpuTier, world_size: int,
                 stats: StatsLedger, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 names: TierNames = TierNames(), rebuild: bool = False,
                 reads: TierReads | None = None) -> None:
        """``rebuild``: the workers report blocks kept from before a restart."""
        super().__init__(index, cpu, world_size, stats, rebuild=rebuild, clock=clock,
                         names=names, reads=reads)
        self.timeout_s = timeout_s
        self.read_wait_s = timeout_s  # every read's part: promotions, staged, checks
        self._probes: dict[str, _Probe] = {}
        self._waiting_since: dict[str, float] = {}  # on another request's promotion
        self._sent_at: dict[int, float] = {}  # jobs in flight not yet found overdue
        self.breaker = CircuitBreaker(names.label, timeout_s, self._on_breaker,
                                      clock=clock)

    # ------------------------------------------------------- the breaker
    def _on_breaker(self, old: BreakerState, new: BreakerState) -> None:
        if new is BreakerState.OPEN:
            self._sent_at.clear()  # what is in flight now is the frozen store's: counted
            opened = old is BreakerState.CLOSED
            self.stats.record_breaker(self.names.name, opened=int(opened),
                                      reopened=int(not opened))
        elif new is BreakerState.CLOSED:
            self.stats.record_breaker(self.names.name, closed=1)

    def _skip(self, req_id: str) -> bool:
        """The breaker is open: a miss at once, and stop waiting for what was sent (a
        timeout for a request that was waiting for the store, a skip for the others)."""
        probe = self._probes.pop(req_id, None)
        waited = (probe is not None and not probe.answered) or req_id in self._promoting
        self._stop_promoting(req_id)
        self.release_promoted(req_id)
        self._no_promotion.add(req_id)
        if waited:
            self.stats.record_tier(self.names.name, timeouts=1)
        else:
            self.stats.record_breaker(self.names.name, skipped=1)
        return False

    def _note_overdue(self) -> None:
        """A job in flight past the timeout opens a closed breaker, once per job (a
        half-open one times its probe out itself)."""
        if self.breaker.state is not BreakerState.CLOSED:
            return
        now = self._clock()
        for job_id, sent_at in list(self._sent_at.items()):
            if job_id not in self._sent:
                del self._sent_at[job_id]
            elif now - sent_at > self.timeout_s:
                del self._sent_at[job_id]
                self.breaker.timeout()
                if self.breaker.state is not BreakerState.CLOSED:
                    return

    def on_published(self, blocks: list[KVCacheBlock], hashes: list[Any]) -> None:
        if not self.breaker.allow(SPILLS):  # not written: recomputed if wanted
            self.stats.record_breaker(self.names.name, skipped=1)
            return
        queued = len(self._queued)
        super().on_published(blocks, hashes)
        if len(self._queued) == queued:
            self.breaker.cancel(SPILLS)  # nothing to write: a later caller probes

    def may_stage(self) -> bool:
        # Else lookups go the breaker's way: skipped, or one of them probes.
        return self.breaker.state is BreakerState.CLOSED

    # ----------------------------------------------------------- lookups
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
        req_id = request.request_id
        now = self._clock()
        read = self._promoting.get(req_id)
        if read is not None:
            if not self.reads.overdue(read):
                return True
            self._stop_promoting(req_id)  # completes (and is published) without it
            return self._give_up(req_id)
        probe = self._probes.get(req_id)
        if probe is not None and not probe.answered:
            if now - probe.sent_at <= self.timeout_s:
                return True
            del self._probes[req_id]
            return self._give_up(req_id)
        keys = self.groups.keys(request.block_hashes[first_block:end_block])
        if probe is None and keys and not self.index.ready_run(keys):
            self._probes[req_id] = _Probe(keys, now)
            return True  # ask the store (once per request); the request asks again later
        if super()._promote(request, hit, first_block, end_block, kind, max_blocks):
            if (req_id not in self._promoting
                    and now - self._waiting_since.setdefault(req_id, now) > self.timeout_s):
                return self._give_up(req_id)  # another request's read, too slow
            return True
        self._no_promotion.add(req_id)  # the store holds nothing more for it
        return False

    def _give_up(self, req_id: str) -> bool:
        self.release_promoted(req_id)  # what it kept while waiting
        self._no_promotion.add(req_id)
        self.stats.record_tier(self.names.name, timeouts=1)
        self.breaker.timeout()
        return False

    def request_finished(self, req_id: str) -> bool:
        self._probes.pop(req_id, None)
        self._waiting_since.pop(req_id, None)
        return super().request_finished(req_id)

    # ---------------------------------------------------------- per step
    def take_jobs(self) -> TierJobs:
        self._note_overdue()
        jobs = super().take_jobs()
        new = [p for p in self._probes.values() if p.job_id is None]
        if new:
            job_id = self._sent.send(TierStep(JobKind.PROBE, new))
            for probe in new:
                probe.job_id = job_id
            keys = list(dict.fromkeys(k for p in new for k in p.keys))
            jobs = jobs._replace(probe=TierJobSpec(job_id, [(k, -1) for k in keys]))
        now = self._clock()
        for spec in (jobs.spill, jobs.promote, jobs.probe):
            if spec is not None:
                self._sent_at[spec.job_id] = now
        return jobs

    def _on_done(self, step: TierStep, tally: RankTally) -> None:
        if step.kind is not JobKind.PROBE:
            keys = {k for job in step.jobs for k in job.keys}
            failed_as_a_whole = bool(keys) and keys <= tally.failed_keys
            (self.breaker.error if failed_as_a_whole else self.breaker.success)()
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
        self._note_overdue()
        unsent = bool(self._queued) or any(p.job_id is None for p in self._probes.values())
        if self.breaker.state is not BreakerState.CLOSED:
            return unsent  # jobs stuck on a broken store are no work: module docstring
        return unsent or super().has_pending()
