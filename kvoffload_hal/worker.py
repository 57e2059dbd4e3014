"""Worker side: block views of the KV caches, one store and one load job per step.

Device-agnostic: the backend comes from the registry (``KVOFFLOAD_HAL_BACKEND``)
and every KV tensor is described as block regions from its shape and strides,
whatever the attention backend's layout. Jobs are launched in ``get_finished``,
after the step's forward pass was enqueued; the backend fences stores behind
the compute already enqueued, so a store never reads a block being written.
Where the forward pass has already finished by then (``synchronous_compute``,
vLLM's CPU platform), the worker waits for the step's jobs and reports them in
the same step.
A job's requests and device blocks travel with the job as its tag, so a
completion observed any number of steps later still finds its requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvoffload_hal.config import OffloadConfig, num_cpu_blocks
from kvoffload_hal.hal import Direction, DmaCopyBackend, JobResult, TransferJob, create_backend
from kvoffload_hal.hal.regions import BlockRegion, host_regions_for
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import NO_JOB, OffloadMetadata, OffloadWorkerMetadata
from kvoffload_hal.metrics import OffloadStats
from kvoffload_hal.tiers.base import SecondaryTier
from kvoffload_hal.tiers.disk import DiskTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


class OffloadWorker:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 config: OffloadConfig) -> None:
        world_size = vllm_config.parallel_config.world_size
        self.num_gpu_blocks = kv_cache_config.num_blocks
        # vLLM maps block-level load errors back to requests only with one KV
        # cache group (block ids are per group); HMA configs report requests.
        self.report_failed_blocks = len(kv_cache_config.kv_cache_groups) == 1
        self.num_cpu_blocks = num_cpu_blocks(kv_cache_config, config.cpu_bytes_per_rank(world_size))
        self.config = config
        self.rank = _rank()
        self.backend: DmaCopyBackend | None = None
        self.tier: SecondaryTier | None = None
        self.host_buffer: torch.Tensor | None = None
        self._metadata: OffloadMetadata | None = None
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_error_blocks: set[int] = set()
        self._stores_done: dict[int, int] = {}
        self._stores_failed: dict[int, int] = {}
        self._loads_done: dict[int, int] = {}
        self._loads_failed: dict[int, int] = {}
        self._tier_reports: dict[int, int] = {}
        self._tier_failed: dict[int, list[str]] = {}
        self._last_tier_job = NO_JOB
        self._stats = OffloadStats()  # drained by get_stats() every step
        self.totals = OffloadStats()  # since start-up

    # ------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> None:
        tensors = _unique_tensors(kv_caches)
        if not tensors:
            raise ValueError("HALOffloadConnector: no KV cache tensors to offload")
        backend = create_backend(device=tensors[0].device)
        regions = _unique_regions(
            r for t in tensors for r in backend.describe_kv_tensor(t, self.num_gpu_blocks))
        bytes_per_block = sum(r.block_bytes for r in regions)
        self.host_buffer = backend.allocate_host(self.num_cpu_blocks * bytes_per_block)
        host_regions = host_regions_for(regions, self.host_buffer.data_ptr(), self.num_cpu_blocks)
        backend.bind(regions, host_regions)
        self.backend = backend
        if self.config.disk_enabled and self.report_failed_blocks:
            views, offset = [], 0
            for r in regions:
                n = self.num_cpu_blocks * r.block_bytes
                views.append(self.host_buffer[offset:offset + n].view(self.num_cpu_blocks, -1))
                offset += n
            self.tier = DiskTier(self.config.disk_path, self.rank, views, self.config.disk_o_direct)
        logger.info(
            "HALOffloadConnector worker: %d KV tensors -> %d block regions, %d B per block; "
            "CPU tier %d blocks (%.2f GiB) on the %r backend",
            len(tensors), len(regions), bytes_per_block, self.num_cpu_blocks,
            self.num_cpu_blocks * bytes_per_block / 2**30, backend.name,
        )

    # ------------------------------------------------------------ per step
    def bind_connector_metadata(self, metadata: OffloadMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def handle_preemptions(self, metadata: OffloadMetadata) -> None:
        # Blocks of preempted requests are about to be reused: nothing may be in flight.
        if metadata.need_flush and self.backend is not None:
            self._collect(self.backend.flush())

    def start_load_kv(self) -> None:
        """Run a synchronous load before the forward pass that reads it.

        vLLM calls this before the forward pass on steps with synchronous loads
        (and after it otherwise, where there is nothing to do here).
        """
        meta = self._metadata
        if (self.backend is None or meta is None or not meta.load_sync
                or meta.load_job_id == NO_JOB):
            return
        self._submit_load(meta)
        # The forward pass reads these blocks next: wait for them (this also
        # collects anything else that finished meanwhile).
        self._collect(self.backend.flush())

    def _submit_load(self, meta: OffloadMetadata) -> None:
        assert self.backend is not None
        self.backend.submit(TransferJob(
            meta.load_job_id, Direction.LOAD, meta.load_cpu_blocks, meta.load_gpu_blocks,
            tag=(tuple(meta.load_req_ids), tuple(meta.load_gpu_blocks), meta.load_sync)))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Launch this step's jobs, collect finished ones.

        Returns ``(finished_sending, finished_recving, failed_recving)``; a failed
        load is in both of the last two, so the request leaves its wait state.
        """
        if self.backend is None:
            return set(), set(), set()
        meta = self._metadata
        submitted = False
        if meta is not None:
            submitted = meta.store_job_id != NO_JOB or meta.load_job_id != NO_JOB
            # Job ids are idempotent in the backend: a second call with the same
            # metadata launches nothing twice.
            if meta.store_job_id != NO_JOB:
                self.backend.submit(TransferJob(
                    meta.store_job_id, Direction.STORE,
                    meta.store_gpu_blocks, meta.store_cpu_blocks))
            if meta.load_job_id != NO_JOB:
                self._submit_load(meta)  # a synchronous one was launched already: no-op
            if self.tier is not None:
                self._submit_tier_jobs(meta)
        if submitted and self.backend.synchronous_compute:
            self._collect(self.backend.flush())  # nothing to overlap: report this step
        else:
            self._collect(self.backend.poll())
        if self.tier is not None:
            for result in self.tier.poll():
                self._tier_reports[result.job_id] = 1
                if result.failed_keys:
                    self._tier_failed[result.job_id] = list(result.failed_keys)
        finished, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return set(), finished, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_error_blocks = self._load_error_blocks, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        if not (self._stores_done or self._stores_failed or self._loads_done
                or self._loads_failed or self._tier_reports):
            return None
        meta = OffloadWorkerMetadata(self._stores_done, self._stores_failed, self._loads_done,
                                     self._loads_failed, self._tier_reports, self._tier_failed)
        self._stores_done, self._stores_failed = {}, {}
        self._loads_done, self._loads_failed = {}, {}
        self._tier_reports, self._tier_failed = {}, {}
        return meta

    def _submit_tier_jobs(self, meta: OffloadMetadata) -> None:
        assert self.tier is not None
        # Tier job ids increase across steps: a second call on the same
        # metadata submits nothing twice.
        for job_id, items, load in ((meta.spill_job_id, meta.spill_items, False),
                                    (meta.promote_job_id, meta.promote_items, True)):
            if job_id == NO_JOB or job_id <= self._last_tier_job:
                continue
            self._last_tier_job = job_id
            (self.tier.submit_load if load else self.tier.submit_store)(job_id, items)
        if meta.tier_evictions:
            self.tier.evict(meta.tier_evictions)
            meta.tier_evictions = []

    def get_stats(self) -> OffloadStats | None:
        if self._stats.is_empty():  # called every step: most steps have nothing
            return None
        stats, self._stats = self._stats, OffloadStats()
        return stats

    def shutdown(self) -> None:
        if self.tier is not None:
            self.tier.shutdown()
            self.tier = None
        if self.backend is None:
            return
        self.backend.shutdown()
        if self.backend.num_pending == 0 and self.host_buffer is not None:
            self.backend.free_host(self.host_buffer)
        self.host_buffer = None
        self.backend = None

    # ------------------------------------------------------------ helpers
    def _collect(self, results: list[JobResult]) -> None:
        for r in results:
            for stats in (self._stats, self.totals):
                stats.record_transfer(r.direction is Direction.STORE, r.num_bytes, r.seconds, r.ok)
            if r.direction is Direction.LOAD:
                req_ids, gpu_blocks, sync = r.tag
                if sync:
                    # The request is running: report the job, and on failure the
                    # blocks, which vLLM recomputes (this step's output is dropped).
                    (self._loads_done if r.ok else self._loads_failed)[r.job_id] = 1
                    if not r.ok:
                        logger.error("synchronous load job %d failed (%s); %d blocks will be "
                                     "recomputed", r.job_id, r.error, len(gpu_blocks))
                        self._load_error_blocks.update(gpu_blocks)
                    continue
                # Reported finished even on failure, so the request leaves the
                # waiting state; vLLM then recomputes what did not arrive.
                self._finished_recving.update(req_ids)
                if not r.ok:
                    logger.error("load job %d failed (%s); %d blocks will be recomputed",
                                 r.job_id, r.error, len(gpu_blocks))
                    if self.report_failed_blocks:
                        self._load_error_blocks.update(gpu_blocks)
                    else:
                        self._failed_recving.update(req_ids)
            elif r.ok:
                self._stores_done[r.job_id] = 1
            else:
                logger.error("store job %d failed (%s); its blocks are not offloaded",
                             r.job_id, r.error)
                self._stores_failed[r.job_id] = 1


def _unique_tensors(kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> list[torch.Tensor]:
    """Flatten per-layer entries (a tensor, or a list of tensors for K/V or state) and
    drop views that alias one another (layers of HMA groups share tensors)."""
    seen: set[tuple] = set()
    out = []
    for value in kv_caches.values():
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out


def _unique_regions(regions) -> list[BlockRegion]:
    return list(dict.fromkeys(regions))


def _rank() -> int:
    """This worker's global rank (0 outside a distributed run)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank
    except (ImportError, AssertionError, AttributeError):
        return 0
