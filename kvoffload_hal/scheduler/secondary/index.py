"""The index of the keys a secondary tier holds, and its rebuild after a restart.

The scheduler decides with it what the tier holds, evicts and promotes; it never sees
the bytes (the worker half, :class:`~kvoffload_hal.tiers.spec.SecondaryTier`, moves them).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvoffload_hal.logger import init_logger
from kvoffload_hal.tiers.spec import BlockKey

logger = init_logger(__name__)


@dataclass
class _Entry:
    generation: int  # the index's generation when the entry was reserved
    ready: bool = False  # written on every rank
    readers: int = 0  # promotions in flight: not evictable


@dataclass
class TierIndex:
    """Which keys one tier holds, evicting the least recently used ready, unpinned one.

    Evicted keys wait in :meth:`take_evicted` for the workers to delete. :meth:`reset`
    starts a new generation: an older entry is never readable again, and one being read
    is dropped after its last reader, so nothing written before a reset is served after.
    """

    capacity_blocks: int
    generation: int = 0
    _entries: OrderedDict[BlockKey, _Entry] = field(default_factory=OrderedDict)
    _evicted: list[BlockKey] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def is_ready(self, key: BlockKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready and entry.generation == self.generation

    def reserve(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Claim space for new keys; returns those accepted (space may run out)."""
        accepted = []
        for key in keys:
            if key in self._entries:
                continue
            if len(self._entries) >= self.capacity_blocks and not self._evict_one():
                break
            self._entries[key] = _Entry(self.generation)
            accepted.append(key)
        return accepted

    def adopt(self, keys: Iterable[BlockKey]) -> int:
        """Take in keys a tier holds from before a restart, as readable, oldest first:
        each goes in as the most recently used, and a full index evicts its least
        recently used (so the oldest adopted go first). Returns how many went in."""
        adopted = 0
        for key in keys:
            if key in self._entries:
                continue  # written again since the restart
            if len(self._entries) >= self.capacity_blocks and not self._evict_one():
                self._evicted.append(key)  # no room: the worker deletes the file
                continue
            self._entries[key] = _Entry(self.generation, ready=True)
            adopted += 1
        return adopted

    def forget_unindexed(self, keys: Iterable[BlockKey]) -> None:
        """Keys the index never held whose files the workers should delete."""
        self._evicted.extend(k for k in keys if k not in self._entries)

    def commit(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if key in self._entries:
                self._entries[key].ready = True

    def drop(self, keys: Iterable[BlockKey]) -> None:
        """Forget keys (a failed write or a corrupt read); workers delete them."""
        for key in keys:
            if self._entries.pop(key, None) is not None:
                self._evicted.append(key)

    def ready_run(self, keys: Sequence[BlockKey]) -> int:
        """Length of the leading run of ``keys`` that is readable."""
        return next((i for i, key in enumerate(keys) if not self.is_ready(key)), len(keys))

    def pin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._entries[key].readers += 1
            self._entries.move_to_end(key)  # a use: most recently used

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.readers -= 1
            if not entry.readers and entry.generation != self.generation:
                self.drop([key])  # from before a reset: its last reader is done

    def reset(self) -> None:
        """Start a new generation: drop what nobody reads, retire the rest."""
        self.generation += 1
        for key in [k for k, e in self._entries.items() if e.ready and not e.readers]:
            self.drop([key])

    def take_evicted(self) -> list[BlockKey]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if entry.ready and not entry.readers:
                self.drop([key])
                return True
        return False


class IndexRebuild:
    """Counts the ranks' reports of the blocks a restarted tier found (each rank its own
    shard, oldest first): a key enters the index once every rank reported it, and when
    every rank finished looking, the keys some ranks lack are deleted from the others."""

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
        seen = self._seen
        seen.update(keys)
        complete = [k for k in dict.fromkeys(keys) if seen[k] >= self.world_size]
        for key in complete:
            del seen[key]
        self.adopted += self.index.adopt(complete)
        self._ranks_done += ranks_done
        if ranks_done and not self.pending:
            self._finish()

    def _finish(self) -> None:
        if self._seen:
            logger.info("%s: %d blocks from before the restart are missing on some "
                        "rank; they are deleted", self.label, len(self._seen))
            self.index.forget_unindexed(self._seen)
            self._seen.clear()
        if self.adopted:
            logger.info("%s: %d blocks from before the restart are served again",
                        self.label, self.adopted)
