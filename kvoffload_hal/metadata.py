"""Messages between the scheduler side and the worker side.

Block ids are flat lists over all KV-cache groups: groups share one block id
space per pool, so the worker needs no request or group knowledge.

Scheduler -> worker, once per engine step: :class:`OffloadMetadata`, holding at
most one job of each kind, each ``None`` when the step has none. Job specs are
immutable ``NamedTuple``s: built every step, so cheap to make, and safe to
share (the worker launches them, never edits them). Worker ->
scheduler: :class:`OffloadWorkerMetadata`, the jobs this rank finished; vLLM
sums it over ranks with :meth:`OffloadWorkerMetadata.aggregate`. Worker ->
scheduler, once at start-up (vLLM's KV connector handshake, before the first
request): :class:`OffloadHandshake`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload_hal.tiers.spec import BlockKey, TierItem


class LoadSpec(NamedTuple):
    """CPU->device copies for the requests of ``req_ids`` (their blocks, flattened).

    The spec travels with the copy job as its tag, so a completion observed
    any number of steps later still names its requests and device blocks.
    ``sync``: the load feeds this step's forward pass; the worker runs it in
    ``start_load_kv`` and reports it in the worker metadata (the requests are
    running, not waiting for it).
    """

    job_id: int
    req_ids: tuple[str, ...]
    cpu_blocks: list[int]
    gpu_blocks: list[int]
    sync: bool = False
    # A round of a staged hit (scheduler/secondary/staged.py, one request): ``final`` is the
    # request's asynchronous load, reported in finished_recving once it and every
    # earlier round of the request landed, failed if any of them failed or
    # ``failed_gpu_blocks`` (blocks no round filled) is not empty; an earlier round
    # is reported in the worker metadata's ``rounds``.
    staged: bool = False
    final: bool = True
    failed_gpu_blocks: tuple[int, ...] = ()
    # Rescues into the CPU blocks of this load (scheduler/hand_over.py), in order: each
    # runs once the load's blocks before it landed, and before the ones after it.
    hand_overs: tuple[HandOver, ...] = ()


class HandOver(NamedTuple):
    """After a load's first ``upto`` blocks landed, ``rescue`` copies device blocks the
    rest of it fills into CPU blocks those first blocks were read from; the load goes on
    as job ``next_job_id`` (a copy backend takes each job id once)."""

    upto: int
    rescue: StoreSpec
    next_job_id: int


class StoreSpec(NamedTuple):
    """Device->CPU copies: ``gpu_blocks[k]`` into ``cpu_blocks[k]``."""

    job_id: int
    gpu_blocks: list[int]
    cpu_blocks: list[int]


class TierJobSpec(NamedTuple):
    """One secondary-tier job: ``(key, CPU block id)`` pairs to write or to read."""

    job_id: int
    items: list[TierItem]


class TierJobs(NamedTuple):
    """A step's secondary-tier work: write-through spills, promotions, keys to delete,
    and existence queries of a shared tier (items ``(key, -1)``; missing keys fail)."""

    spill: TierJobSpec | None = None
    promote: TierJobSpec | None = None
    evictions: tuple[BlockKey, ...] = ()
    probe: TierJobSpec | None = None


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step: at most one load, one rescue and one
    store job."""

    load: LoadSpec | None = None
    store: StoreSpec | None = None
    # Device blocks this step reuses that the CPU tier has no copy of: copied before
    # the step's forward pass (scheduler/device_copies.py), ahead of ``store``.
    rescue: StoreSpec | None = None
    tiers: tuple[TierJobs, ...] = ()  # one per secondary tier, nearest first
    rounds: tuple[LoadSpec, ...] = ()  # staged hits' loads, after ``load`` in job order
    # A request was preempted: wait for every transfer before blocks are reused.
    need_flush: bool = False
    # Finished requests whose blocks vLLM may free now: kept at their finish until
    # the last writes were done (exit_flush.py), reported in finished_sending.
    release_requests: tuple[str, ...] = ()


class JobReport(NamedTuple):
    """One job's outcome, summed over the ranks that reported it."""

    ranks: int = 1
    failed: bool = False
    failed_keys: tuple[BlockKey, ...] = ()  # secondary tiers: the keys that failed

    def merge(self, other: JobReport) -> JobReport:
        keys = tuple(sorted(set(self.failed_keys) | set(other.failed_keys)))
        return JobReport(self.ranks + other.ranks, self.failed or other.failed, keys)


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: jobs finished on this rank (summed over ranks by vLLM).

    The worker accumulates into one instance over a step and hands it over in
    ``build_connector_worker_meta``.
    """

    stores: dict[int, JobReport] = field(default_factory=dict)
    loads: dict[int, JobReport] = field(default_factory=dict)  # synchronous loads only
    rounds: dict[int, JobReport] = field(default_factory=dict)  # staged rounds but the last
    # Secondary tiers' jobs: (the tier's place in the chain, its job id) -> report.
    tier: dict[tuple[int, int], JobReport] = field(default_factory=dict)
    # Requests whose asynchronous load failed on this rank, for a model with several
    # KV cache groups: vLLM is told per request, or the load is sent again
    # (VllmStrategy.settle_load decides, VllmStrategy.on_failed_loads reads it).
    failed_loads: set[str] = field(default_factory=set)
    # A restarted secondary tier: blocks found from before the restart, (its place in
    # the chain, key) once per rank that holds it, and the places of the tiers whose
    # listing a rank finished (once per rank).
    tier_found: list[tuple[int, BlockKey]] = field(default_factory=list)
    tier_scans_done: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.rounds or self.tier or self.failed_loads
                    or self.tier_found or self.tier_scans_done)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerMetadata:
        assert isinstance(other, OffloadWorkerMetadata)
        return OffloadWorkerMetadata(_merge(self.stores, other.stores),
                                     _merge(self.loads, other.loads),
                                     _merge(self.rounds, other.rounds),
                                     _merge(self.tier, other.tier),
                                     self.failed_loads | other.failed_loads,
                                     self.tier_found + other.tier_found,
                                     self.tier_scans_done + other.tier_scans_done)


@dataclass
class OffloadHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once, after the KV caches are registered and before the
    first request (vLLM's connector handshake):

    * the CPU blocks this rank holds: ranks of different pipeline stages hold different
      layers, so the same share of ``cpu_bytes_to_use`` makes different block counts,
      and the scheduler, which sized its tier from the first stage's layers, never
      hands out a block id the smallest of them lacks;
    * the blocks a restarted tier kept from before the restart (as in
      :attr:`OffloadWorkerMetadata.tier_found`), so that the first request finds them,
      and the tiers whose listing this rank finished (the rest then comes with steps).
    """

    tier_found: list[tuple[int, BlockKey]] = field(default_factory=list)
    tier_scans_done: list[int] = field(default_factory=list)
    num_cpu_blocks: int = 0  # 0: not said


def _merge(a: dict[Any, JobReport], b: dict[Any, JobReport]) -> dict[Any, JobReport]:
    out = dict(a)
    for job, report in b.items():
        out[job] = out[job].merge(report) if job in out else report
    return out


