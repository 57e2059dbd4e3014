"""The tier contract: one secondary tier, from its configuration keys to both of its halves.

The CPU tier is the only tier that talks to the device. A secondary tier (a local
disk, a remote KV store) holds copies of CPU-tier blocks, keyed by block hash, and
moves bytes only between itself and CPU-tier blocks.

Imported in every process; imports nothing of the scheduler or the worker.

A :class:`TierSpec` is to a secondary tier what vLLM's ``OffloadingSpec`` is to
an offloading medium: one object, built from ``kv_connector_extra_config``, that
validates the tier's own keys, says what the tier needs, and describes its two
halves. The connector, the scheduler and the worker find specs through
:mod:`kvoffload_hal.tiers.registry` and never name a tier.

* **Scheduler half**: a :class:`SchedulerHalf`, a description of what the scheduler
  keeps for the tier (how many blocks, whether it rebuilds its index after a restart,
  how long a request waits on a shared tier). The scheduler process builds the
  machinery from it (``scheduler/secondary/``): spills, promotions, staged hits,
  prefetch, and for a tier ``shared_across_instances``, existence queries and the
  circuit breaker. A tier author writes none of that.
* **Worker half**: a :class:`SecondaryTier` (usually a
  :class:`~kvoffload_hal.tiers.worker_pool.PooledTier`) moving bytes between
  CPU-tier blocks and the tier, asynchronously, in each worker process (where the
  CPU-tier memory lives); :class:`NullTier` where no tier runs.

``from_extra_config`` runs in every process; it returns None when the tier's
switch key is unset, and raises ``ValueError`` naming the key, the value and
what was expected for anything wrong. Counters (``blocks_to_<name>``,
``blocks_from_<name>``, ``<name>_timeouts``, ...) and log lines take the tier's
``name`` and ``label``.

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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from kvoffload_hal.config_values import whole_blocks

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

BlockKey = str  # hex of vLLM's block hash (with group id): file-name safe, picklable
TierItem = tuple[BlockKey, int]  # (key, CPU-tier block id)


class CapacityClaim(NamedTuple):
    """Room a tier takes on this host, checked before anything is allocated."""

    key: str  # the kv_connector_extra_config key that asks for it
    per_rank: int  # bytes
    available: int  # bytes
    where: str  # e.g. "free in /data/kv"


@dataclass(frozen=True)
class SchedulerTierContext:
    """What a tier's scheduler half is described from."""

    kv_cache_config: KVCacheConfig
    world_size: int  # ranks of this instance (TP x PP); each keeps its own shard
    block_bytes: int  # one KV block of every group, on one rank

    def blocks_for(self, key: str, bytes_per_rank: int) -> int:
        """Whole blocks in ``bytes_per_rank``; ``ValueError`` naming ``key`` below one."""
        return whole_blocks(key, bytes_per_rank, self.block_bytes)


@dataclass(frozen=True)
class SchedulerHalf:
    """What the scheduler keeps for a tier; the scheduler process builds the rest."""

    # Blocks the tier holds for this instance, per rank. For a tier shared across
    # instances: the keys the scheduler remembers the store holds (the store evicts
    # by itself; past it, the least recently used are asked for again when needed).
    capacity_blocks: int
    # The worker half reports blocks it kept from before a restart (take_found).
    rebuild: bool = False
    # How long a read or a write of the tier is waited for: past it the request
    # recomputes and the tier's circuit breaker opens (a tier shared across instances:
    # also an existence query, and another request's read of the same blocks).
    wait_s: float = 2.0
    # A tier shared across instances that does not evict by itself (a disk every
    # instance writes its own files into): the entries the scheduler evicts are
    # deleted by the worker, from what this instance wrote only.
    deletes_evicted: bool = False


@dataclass(frozen=True)
class WorkerTierContext:
    """What a tier's worker half is built from, in each worker."""

    rank: int
    world_size: int
    host_chunks: tuple[torch.Tensor, ...]  # the CPU tier's host memory, 1-D uint8 buffers
    host_views: list[torch.Tensor]  # one uint8 [num_cpu_blocks, block_bytes] view per region
    fingerprint: bytes  # what a block's bytes depend on (tiers/identity.py)
    block_hash_algo: str | None = None  # vLLM's prefix-caching hash (restarts need its seed)


class TierSpec(ABC):
    """One secondary tier; see the module docstring."""

    name: ClassVar[str]  # the registry's name for it; counters are named after it
    label: ClassVar[str] = ""  # how logs name it ("disk tier"); "<name> tier" when empty
    switch_key: ClassVar[str]  # the key that turns the tier on
    keys: ClassVar[tuple[str, ...]]  # every kv_connector_extra_config key it owns
    # Needs: block keys are per KV cache group and failed blocks are reported
    # per block, so a tier may accept models with one group only.
    one_group_only: ClassVar[bool] = True
    # Instances read each other's blocks: vLLM's block hashes must agree across
    # processes (PYTHONHASHSEED set alike everywhere).
    shared_across_instances: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> TierSpec | None:
        """The validated spec, or None when ``switch_key`` is not set."""

    def capacity_claims(self, world_size: int) -> list[CapacityClaim]:
        """What a worker must find on this host before it allocates (none by default)."""
        return []

    @classmethod
    def display_name(cls) -> str:
        return cls.label or f"{cls.name} tier"

    @abstractmethod
    def scheduler_half(self, ctx: SchedulerTierContext) -> SchedulerHalf | None:
        """What the scheduler keeps for the tier; None when the tier cannot run now
        (after saying why, once)."""

    @abstractmethod
    def worker_half(self, ctx: WorkerTierContext) -> SecondaryTier:
        """One worker's side."""


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
