"""Scheduler side of a secondary tier: the index of the keys it holds.

The scheduler decides, with a :class:`TierIndex`, which hashes a secondary tier
holds, what to evict and what to promote; it never sees the bytes (the worker
half, :class:`~kvoffload_hal.tiers.spec.SecondaryTier`, moves them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvoffload_hal.tiers.spec import BlockKey


@dataclass
class _Entry:
    generation: int  # the index's generation when the entry was reserved
    ready: bool = False  # written on every rank
    readers: int = 0  # promotions in flight: not evictable


@dataclass
class TierIndex:
    """Scheduler-side view of one secondary tier: which keys it holds, LRU eviction.

    ``reserve`` makes room (evicting least recently used, unpinned, ready
    entries) and marks keys as being written; ``commit`` marks them readable;
    ``pin``/``unpin`` protect keys being promoted. Evicted keys accumulate in
    :meth:`take_evicted` for the workers to delete.

    :meth:`reset` starts a new generation: an entry from an older one is never
    readable again, and one still being read is dropped once its last reader
    is done, so nothing written before a reset is served after it.
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
        n = 0
        for key in keys:
            if not self.is_ready(key):
                break
            n += 1
        return n

    def pin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            entry = self._entries[key]
            entry.readers += 1
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
