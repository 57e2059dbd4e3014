"""Counting a job's reports until every rank has answered.

Every TP/PP rank copies its own shard of a block, so a job is over only when
all ``world_size`` ranks reported it; one failed rank fails the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankTally:
    world_size: int
    reports: int = 0
    failed: bool = False

    def report(self, ranks: int, failed: bool = False) -> bool:
        """Count ``ranks`` more reports; True once every rank has reported."""
        self.reports += ranks
        self.failed |= failed
        return self.reports >= self.world_size
