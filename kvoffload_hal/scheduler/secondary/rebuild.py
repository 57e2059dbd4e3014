"""Scheduler side of a restarted tier: its index refilled from what the workers found.

A disk tier that adopted a stopped server's directory reports the blocks it
finds there (:mod:`~kvoffload_hal.tiers.disk.rebuild`), each rank for its own
shard, oldest first: all of them in vLLM's KV connector handshake, before the
first request, and what a listing longer than the handshake's wait finds later
with the steps. A block is readable only when every rank holds its shard,
so a key enters the index (:meth:`TierIndex.adopt`) once ``world_size`` ranks
reported it. When every rank has finished looking, keys some ranks lack are
deleted from the ranks that have them: no request could use them, and they
would hold disk space outside the index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvoffload_hal.logger import init_logger
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.tiers.spec import BlockKey

logger = init_logger(__name__)


class IndexRebuild:
    """Counts the ranks' reports of blocks found after a restart; see the module docstring."""

    def __init__(self, index: TierIndex, world_size: int, label: str = "tier") -> None:
        self.index = index
        self.label = label
        self.world_size = world_size
        self._seen: Counter[BlockKey] = Counter()  # keys some, not yet all, ranks reported
        self._ranks_done = 0
        self.adopted = 0

    @property
    def pending(self) -> bool:
        """Some rank has not finished looking (a new tier finishes in its first step)."""
        return self._ranks_done < self.world_size

    def on_found(self, keys: Sequence[BlockKey], ranks_done: int) -> None:
        if keys:
            if self.world_size == 1:
                self.adopted += self.index.adopt(keys)
            else:
                self._count(keys)
        if ranks_done:
            self._ranks_done += ranks_done
            if not self.pending:
                self._finish()

    def _count(self, keys: Sequence[BlockKey]) -> None:
        seen = self._seen
        seen.update(keys)
        complete = [k for k in dict.fromkeys(keys) if seen[k] >= self.world_size]
        for key in complete:
            del seen[key]
        self.adopted += self.index.adopt(complete)

    def _finish(self) -> None:
        if self._seen:
            logger.info("%s: %d blocks from before the restart are missing on some "
                        "rank; they are deleted", self.label, len(self._seen))
            self.index.forget_unindexed(self._seen)
            self._seen.clear()
        if self.adopted:
            logger.info("%s: %d blocks from before the restart are served again",
                        self.label, self.adopted)
