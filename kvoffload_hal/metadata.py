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
    store_job_id: int = NO_JOB
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    # A request was preempted: wait for every transfer before blocks are reused.
    need_flush: bool = False


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: store jobs finished on this rank (summed over ranks)."""

    stores_done: dict[int, int] = field(default_factory=dict)
    stores_failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "OffloadWorkerMetadata":
        assert isinstance(other, OffloadWorkerMetadata)
        done = dict(self.stores_done)
        for job, n in other.stores_done.items():
            done[job] = done.get(job, 0) + n
        failed = dict(self.stores_failed)
        for job, n in other.stores_failed.items():
            failed[job] = failed.get(job, 0) + n
        return OffloadWorkerMetadata(done, failed)
