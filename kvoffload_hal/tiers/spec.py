"""The tier contract: one secondary tier, from its configuration keys to both of its halves.

Imported in every process; imports nothing of the scheduler or the worker.

A :class:`TierSpec` is to a secondary tier what vLLM's ``OffloadingSpec`` is to
an offloading medium: one object, built from ``kv_connector_extra_config``, that
validates the tier's own keys, says what the tier needs, and describes its two
halves. The connector, the scheduler and the worker find specs through
:mod:`kvoffload_hal.tiers.registry` and never name a tier.

* **Scheduler half**: a :class:`SchedulerHalf`, a description of what the scheduler
  keeps for the tier (how many blocks, whether it rebuilds its index after a restart,
  how long a request waits on a shared tier). The scheduler process builds the
  machinery from it (``scheduler/cascade/``): spills, promotions, staged hits,
  prefetch, and for a tier ``shared_across_instances``, existence queries and the
  circuit breaker. A tier author writes none of that.
* **Worker half**: a :class:`~kvoffload_hal.tiers.worker_tier.SecondaryTier`
  (usually a :class:`~kvoffload_hal.tiers.worker_pool.PooledTier`) moving
  bytes between CPU-tier blocks and the tier, in each worker.

``from_extra_config`` runs in every process; it returns None when the tier's
switch key is unset, and raises ``ValueError`` naming the key, the value and
what was expected for anything wrong. Counters (``blocks_to_<name>``,
``blocks_from_<name>``, ``<name>_timeouts``, ...) and log lines take the tier's
``name`` and ``label``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from kvoffload_hal.config_values import whole_blocks

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvoffload_hal.tiers.worker_tier import SecondaryTier

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
    # A tier shared across instances: how long a request waits for an existence
    # query or a read before it recomputes; also the circuit breaker's first window.
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
