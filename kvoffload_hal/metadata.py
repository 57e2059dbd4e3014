"""Messages between the scheduler side and the worker side.

Block ids are flat lists over all KV-cache groups: groups share one block id
space per pool, so the worker needs no request or group knowledge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

NO_JOB = -1


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step: at most one load and one store job."""

    load_job_id: int = NO_JOB
    load_cpu_blocks: list[int] = field(default_factory=list)
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_req_ids: list[str] = field(default_factory=list)
    # The load feeds this step's forward pass: the worker runs it in start_load_kv,
    # before the forward, and reports it in OffloadWorkerMetadata (the request is
    # running, not waiting for it).
    load_sync: bool = False
    store_job_id: int = NO_JOB
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    # A request was preempted: wait for every transfer before blocks are reused.
    need_flush: bool = False
    # Secondary (disk) tier: (key, CPU block id) pairs, and keys to delete.
    spill_job_id: int = NO_JOB
    spill_items: list[tuple[str, int]] = field(default_factory=list)
    promote_job_id: int = NO_JOB
    promote_items: list[tuple[str, int]] = field(default_factory=list)
    tier_evictions: list[str] = field(default_factory=list)


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: jobs finished on this rank (summed over ranks)."""

    stores_done: dict[int, int] = field(default_factory=dict)
    stores_failed: dict[int, int] = field(default_factory=dict)
    loads_done: dict[int, int] = field(default_factory=dict)  # synchronous loads
    loads_failed: dict[int, int] = field(default_factory=dict)
    tier_reports: dict[int, int] = field(default_factory=dict)
    tier_failed: dict[int, list[str]] = field(default_factory=dict)  # keys that failed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "OffloadWorkerMetadata":
        assert isinstance(other, OffloadWorkerMetadata)
        failed = {job: list(keys) for job, keys in self.tier_failed.items()}
        for job, keys in other.tier_failed.items():
            failed[job] = sorted(set(failed.get(job, [])) | set(keys))
        return OffloadWorkerMetadata(
            _sum(self.stores_done, other.stores_done),
            _sum(self.stores_failed, other.stores_failed),
            _sum(self.loads_done, other.loads_done),
            _sum(self.loads_failed, other.loads_failed),
            _sum(self.tier_reports, other.tier_reports),
            failed,
        )


def _sum(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for key, n in b.items():
        out[key] = out.get(key, 0) + n
    return out
