"""Secondary tiers behind the CPU tier: the interface and the scheduler-side index.

The CPU tier is the only tier that talks to the device. A secondary tier (local
disk today; an object store or a remote KV store later) holds copies of CPU-tier
blocks, keyed by block hash, and moves bytes only between itself and CPU-tier
blocks. Its work is split like the connector's:

* the **scheduler** decides, with a :class:`TierIndex`, which hashes the tier
  holds, what to evict and what to promote; it never sees the bytes;
* the **worker**, where the CPU-tier memory lives, runs a :class:`SecondaryTier`
  that copies blocks between CPU memory and the tier, asynchronously.

Contract of :class:`SecondaryTier` (every method on the engine thread):

``submit_store(job_id, items)``
    Persist each ``(key, cpu_block_id)``: read the CPU block (its bytes in every
    host region) and write it under ``key``. The CPU blocks are kept unchanged
    by the caller until the job's result is polled.
``submit_load(job_id, items)``
    Read each key into its CPU block. Integrity is checked: a torn, corrupted
    or missing entry fails that key (the caller recomputes), never yields
    wrong bytes. The destination blocks are untouched by anyone else until
    the result is polled.
``poll()``
    Non-blocking: results of finished jobs, each once, with the keys that
    failed.
``evict(keys)``
    Forget and delete entries; never called for a key with a job in flight.
``submit_probe(job_id, keys)`` (shared tiers only)
    Ask which keys the tier holds now, for blocks other instances wrote; the
    job's result fails the keys it does not hold.
``shutdown(timeout_s)``
    Stop, waiting at most ``timeout_s`` for jobs in flight. True when no job
    still runs; False when one may still read or write CPU-tier memory.

To add a tier: implement :class:`SecondaryTier`, and give it a capacity in
blocks for the scheduler's :class:`TierIndex`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockKey = str  # hex of vLLM's block hash (with group id): file-name safe, picklable
TierItem = tuple[BlockKey, int]  # (key, CPU-tier block id)


@dataclass(frozen=True)
class TierJobResult:
    job_id: int
    failed_keys: tuple[BlockKey, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed_keys


class SecondaryTier(ABC):
    """Worker-side data mover of one secondary tier; see the module docstring."""

    name = ""

    @abstractmethod
    def submit_store(self, job_id: int, items: Sequence[TierItem]) -> None: ...

    @abstractmethod
    def submit_load(self, job_id: int, items: Sequence[TierItem]) -> None: ...

    @abstractmethod
    def poll(self) -> list[TierJobResult]: ...

    @abstractmethod
    def evict(self, keys: Iterable[BlockKey]) -> None: ...

    def submit_probe(self, job_id: int, keys: Sequence[BlockKey]) -> None:
        """A shared tier only: ask which ``keys`` the tier holds now; the job's
        result fails the keys it does not hold."""
        raise NotImplementedError(f"the {self.name} tier answers no existence queries")

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        return True


class NullTier(SecondaryTier):
    """No secondary tier: nothing is ever submitted to it, so it never has results."""

    name = "none"
    num_pending = 0

    def submit_store(self, job_id: int, items: Sequence[TierItem]) -> None:
        raise RuntimeError("no secondary tier is configured")

    submit_load = submit_store

    def poll(self) -> list[TierJobResult]:
        return []

    def evict(self, keys: Iterable[BlockKey]) -> None:
        pass


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
