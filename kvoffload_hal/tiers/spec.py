"""One secondary tier, from its configuration keys to both of its halves.

A :class:`TierSpec` is to a secondary tier what vLLM's ``OffloadingSpec`` is to
an offloading medium: one object, built from ``kv_connector_extra_config``, that
validates the tier's own keys, says what the tier needs, and hands out its
scheduler half and its worker half. The connector, the scheduler and the worker
find specs through :mod:`kvoffload_hal.tiers.registry` and never name a tier.

* **Scheduler half**: a :class:`~kvoffload_hal.tiers.scheduler_cascade.NullCascade`
  (usually a ``TierCascade`` over the tier's
  :class:`~kvoffload_hal.tiers.scheduler_index.TierIndex`): which keys the tier
  holds, spills and promotions. Built in the scheduler process: it must not
  import a device runtime, nor move bytes.
* **Worker half**: a :class:`~kvoffload_hal.tiers.worker_tier.SecondaryTier`
  (usually a :class:`~kvoffload_hal.tiers.worker_pool.PooledTier`) moving
  bytes between CPU-tier blocks and the tier, in each worker.

``from_extra_config`` runs in every process; it returns None when the tier's
switch key is unset, and raises ``ValueError`` naming the key, the value and
what was expected for anything wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.tiers.scheduler_cascade import NullCascade
    from kvoffload_hal.tiers.worker_tier import SecondaryTier


class CapacityClaim(NamedTuple):
    """Room a tier takes on this host, checked before anything is allocated."""

    key: str  # the kv_connector_extra_config key that asks for it
    per_rank: int  # bytes
    available: int  # bytes
    where: str  # e.g. "free in /data/kv"


@dataclass(frozen=True)
class SchedulerTierContext:
    """What a tier's scheduler half is built from."""

    kv_cache_config: KVCacheConfig
    cpu: CpuTier
    world_size: int
    stats: StatsLedger


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

    name: ClassVar[str]  # the registry's name for it
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

    @abstractmethod
    def scheduler_half(self, ctx: SchedulerTierContext) -> NullCascade:
        """The scheduler side; a ``NullCascade`` when the tier cannot run now."""

    @abstractmethod
    def worker_half(self, ctx: WorkerTierContext) -> SecondaryTier:
        """One worker's side."""
