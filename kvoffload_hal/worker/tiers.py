"""Worker side: the chain of secondary tiers behind the CPU tier, nearest first.

Runs in each worker process. The scheduler sends each tier of the chain its own jobs
(``OffloadMetadata.tiers``, by the tier's place in the chain) and gets the reports back
the same way (``OffloadWorkerMetadata.tier``: ``(place, job id) -> report``);
:class:`WorkerTiers` routes them. Every tier keeps its own threads, files or store
client, and is shut down with the same bounds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload_hal.metadata import JobReport, OffloadWorkerMetadata
from kvoffload_hal.tiers.spec import NullTier, SecondaryTier

if TYPE_CHECKING:
    from kvoffload_hal.metadata import TierJobs
    from kvoffload_hal.tiers.spec import BlockKey


class WorkerTiers:
    """This rank's halves of the chain's tiers (maybe none)."""

    def __init__(self, tiers: Sequence[SecondaryTier] = ()) -> None:
        self.tiers = list(tiers)

    @property
    def nearest(self) -> SecondaryTier:
        """The first tier behind the CPU tier (a :class:`NullTier` without one)."""
        return self.tiers[0] if self.tiers else NullTier()

    def submit(self, jobs: Sequence[TierJobs]) -> None:
        """A step's jobs, one :class:`TierJobs` per tier of the chain."""
        for tier, job in zip(self.tiers, jobs):
            if job.spill is not None:
                tier.submit_store(job.spill.job_id, job.spill.items)
            if job.promote is not None:
                tier.submit_load(job.promote.job_id, job.promote.items)
            if job.evictions:
                tier.evict(job.evictions)
            if job.probe is not None:
                tier.submit_probe(job.probe.job_id, [k for k, _ in job.probe.items])

    def collect(self, reports: OffloadWorkerMetadata) -> None:
        """Jobs that ended, and blocks a restarted tier found, into ``reports``."""
        for place, tier in enumerate(self.tiers):
            for result in tier.poll():
                reports.tier[place, result.job_id] = JobReport(failed_keys=result.failed_keys)
            found, scan_done = tier.take_found()
            reports.tier_found += [(place, key) for key in found]
            if scan_done:
                reports.tier_scans_done.append(place)

    def take_found_at_start(self, timeout_s: float,
                            ) -> tuple[list[tuple[int, BlockKey]], list[int]]:
        """Every tier's blocks kept from before a restart (each waits ``timeout_s`` at
        most), and the places of the tiers that finished listing them."""
        found: list[tuple[int, BlockKey]] = []
        done: list[int] = []
        for place, tier in enumerate(self.tiers):
            keys, finished = tier.take_found_at_start(timeout_s)
            found += [(place, key) for key in keys]
            done += [place] * finished
        return found, done

    def shutdown(self, timeout_s: float, flush_s: float) -> bool:
        """Stop every tier (see :meth:`SecondaryTier.shutdown`) within the same bounds
        as one: the tiers' IO runs side by side, so each later tier gets what is left of
        them. True when every tier is idle."""
        start = time.monotonic()
        idle = True
        for tier in self.tiers:
            spent = time.monotonic() - start
            idle &= tier.shutdown(max(0.0, timeout_s - spent), max(0.0, flush_s - spent))
        return idle
