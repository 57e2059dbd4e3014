"""Worker side of a secondary tier: the data-mover interface every tier implements.

The CPU tier is the only tier that talks to the device. A secondary tier (local
disk today; an object store or a remote KV store later) holds copies of CPU-tier
blocks, keyed by block hash, and moves bytes only between itself and CPU-tier
blocks. Its work is split like the connector's:

* the **scheduler** decides, with an index, which hashes the tier
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
``take_found()``, ``wait_found(timeout_s)`` (tiers that outlive a server)
    The blocks kept from before a restart, handed over once each; ``wait_found``
    blocks until all are found (at most ``timeout_s``), once, at start-up, so
    that the first request already finds them.
``shutdown(timeout_s, flush_s)``
    Stop: writes already submitted get at most ``flush_s`` to finish, and those
    unfinished then are dropped whole (never left half-written); then wait at
    most ``timeout_s`` for jobs in flight. True when no job still runs; False
    when one may still read or write CPU-tier memory.

Runs in each worker process. The scheduler process keeps an index of what the tier
holds (``scheduler/cascade/``); :mod:`kvoffload_hal.tiers.spec` ties both halves together.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload_hal.tiers.spec import BlockKey, TierItem

__all__ = ["BlockKey", "NullTier", "SecondaryTier", "TierItem", "TierJobResult"]


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

    def take_found(self) -> tuple[list[BlockKey], bool]:
        """Blocks a restarted tier found from before the restart, since the last call
        (oldest first), and True once when it has found them all (or never looks)."""
        return [], False

    def wait_found(self, timeout_s: float) -> None:
        """Block until :meth:`take_found` has every block kept from before a restart
        (at most ``timeout_s``); at start-up, before the first request."""

    def take_found_at_start(self, timeout_s: float) -> tuple[list[BlockKey], int]:
        """At start-up: every block found so far, waiting at most ``timeout_s`` for the
        listing, and 1 when the tier has found them all (else the rest comes later)."""
        self.wait_found(timeout_s)
        keys: list[BlockKey] = []
        done = 0
        while True:
            found, finished = self.take_found()
            keys += found
            done += finished
            if not found:
                return keys, done

    def shutdown(self, timeout_s: float = 10.0, flush_s: float = 0.0) -> bool:
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
