"""The bookkeeping every job kind shares: ids, and counting rank reports.

Every TP/PP rank copies its own shard of a block, so a job is over only when
all ``world_size`` ranks reported it; one failed rank fails the whole job, and
a key that failed on any rank failed. Loads (:mod:`.load_jobs`), stores
(:mod:`.store_jobs`) and the secondary tiers' jobs
(:mod:`kvoffload_hal.scheduler.secondary.promotions`) each keep one :class:`JobBook`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvoffload_hal.metadata import JobReport

T = TypeVar("T")


@dataclass
class RankTally:
    world_size: int
    reports: int = 0
    failed: bool = False
    failed_keys: set[str] = field(default_factory=set)

    def report(self, ranks: int, failed: bool = False, failed_keys=()) -> bool:
        """Count ``ranks`` more reports; True once every rank has reported."""
        self.reports += ranks
        self.failed |= failed
        self.failed_keys.update(failed_keys)
        return self.reports >= self.world_size


@dataclass(frozen=True)
class Done(Generic[T]):
    """A job every rank has reported: what was sent, and the ranks' verdict."""

    job_id: int
    payload: T
    tally: RankTally


class JobBook(Generic[T]):
    """Jobs of one kind: a new id per job, and those sent held until every rank reported.

    ``payload`` is whatever the owner needs back when the job is over (its
    blocks, the requests it serves). Reports for an id the book does not hold
    (a job of another book, or one already over) are ignored.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ids = itertools.count()
        self._sent: dict[int, tuple[T, RankTally]] = {}

    def new_id(self) -> int:
        """An id for a job whose result does not come back as a report."""
        return next(self._ids)

    def send(self, payload: T) -> int:
        """Hold ``payload`` under a new id until every rank reported it."""
        job_id = self.new_id()
        self._sent[job_id] = (payload, RankTally(self.world_size))
        return job_id

    def report(self, job_id: int, report: JobReport) -> Done[T] | None:
        """Count a report; the job once every rank has reported, else None."""
        entry = self._sent.get(job_id)
        if entry is None:
            return None
        payload, tally = entry
        if not tally.report(report.ranks, report.failed, report.failed_keys):
            return None
        del self._sent[job_id]
        return Done(job_id, payload, tally)

    def get(self, job_id: int) -> T | None:
        """What job ``job_id`` carries while it is in flight."""
        entry = self._sent.get(job_id)
        return None if entry is None else entry[0]

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._sent

    def __len__(self) -> int:
        return len(self._sent)

    def payloads(self) -> Iterator[T]:
        """What every job still in flight carries."""
        return (payload for payload, _ in self._sent.values())
