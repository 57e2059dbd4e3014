"""Scheduler side: the life of every load and store job.

The CPU tier itself is :class:`~kvoffload_hal.scheduler.cpu_tier.CpuTier` (vLLM's own
``BlockPool`` and ``KVCacheCoordinator``), the choice of blocks to store is a
:class:`~kvoffload_hal.scheduler.store_policy.StorePolicy`, and a secondary tier behind
the CPU tier is a :class:`~kvoffload_hal.tiers.scheduler_cascade.TierCascade` (or the
do-nothing :class:`~kvoffload_hal.tiers.scheduler_cascade.NullCascade`). This module
keeps every block it borrows referenced until the copy is over:

* a CPU hit is pinned the moment ``get_num_new_matched_tokens`` finds it, so
  LRU eviction cannot take it before ``update_state_after_alloc``;
* device and CPU blocks of a job in flight are pinned until the job's result
  arrives, so a finished, aborted or preempted request never frees a block a
  copy still reads or writes;
* a stored block is published in the CPU prefix cache only after every rank
  reported its copy done, and a failed store is never published.

No device is touched here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.utils.math_utils import cdiv
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from kvoffload_hal.capabilities import resolve_capabilities
from kvoffload_hal.config import OffloadConfig, check_capacity, num_cpu_blocks, num_disk_blocks
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import (
    JobReport,
    LoadSpec,
    OffloadMetadata,
    OffloadWorkerMetadata,
)
from kvoffload_hal.metrics import OffloadStats, StatsLedger
from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit, pin_ids, unpin_ids
from kvoffload_hal.scheduler.jobs import RankTally
from kvoffload_hal.scheduler.store_jobs import StoreJobs
from kvoffload_hal.scheduler.store_policy import (
    EagerPolicy,
    LazyPolicy,
    StorePolicy,
    lazy_window_blocks,
)
from kvoffload_hal.tiers.scheduler_cascade import NullCascade, TierCascade
from kvoffload_hal.tiers.scheduler_index import TierIndex
from kvoffload_hal.tiers.scheduler_shared import make_shared_cascade

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Load:
    """A CPU->device copy for one request; both block lists stay pinned until it ends."""

    gpu_ids: list[int]
    cpu_ids: list[int]
    num_tokens: int
    job_id: int | None = None  # None until sent to the workers


class _PendingHit(NamedTuple):
    """A CPU hit found by a lookup, pinned until the request's allocation."""

    blocks: Hit
    num_computed_tokens: int


class OffloadScheduler:
    """Decides loads and stores between the device pool and the CPU pool."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: OffloadConfig) -> None:
        self.world_size = vllm_config.parallel_config.world_size
        check_capacity(config, self.world_size, before_allocating=False)
        self.config = config
        self.caps = resolve_capabilities(kv_cache_config, config)
        # Through the module, at use time: platforms may patch it.
        block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config)
        self.block_size = block_size
        self.cpu = CpuTier(vllm_config, kv_cache_config,
                           num_cpu_blocks(kv_cache_config,
                                          config.cpu_bytes_per_rank(self.world_size)),
                           block_size, hash_block_size, eviction=config.eviction)
        self.stats = StatsLedger()
        self.policy = _make_policy(config, kv_cache_config, vllm_config, self.cpu)
        self.cascade = self._make_cascade(kv_cache_config)
        self.stores = StoreJobs(self.cpu, self.cascade, self.stats, self.world_size)
        self.gpu_pool: BlockPool | None = None
        self._pending_hits: dict[str, _PendingHit] = {}
        self._loads: dict[str, _Load] = {}
        self._sync_load_jobs: dict[int, tuple[list[str], RankTally]] = {}
        self._next_load_job = 0
        logger.info(
            "HALOffloadConnector: CPU tier of %d blocks (%.2f GiB per rank), %s stores, "
            "%s loads", self.cpu.num_blocks, config.cpu_bytes_per_rank(self.world_size) / 2**30,
            "lazy" if config.lazy_offload else "eager", "sync" if self.caps.sync_loads else "async",
        )

    def _make_cascade(self, kv_cache_config: KVCacheConfig) -> NullCascade:
        if self.config.mooncake is not None:
            return make_shared_cascade(self.config.mooncake, self.caps.mooncake_tier, self.cpu,
                                       self.world_size, self.stats)
        if not self.caps.disk_tier:
            if self.config.disk_enabled:
                logger.warning("HALOffloadConnector: the disk tier supports models with one KV "
                               "cache group; it is disabled for this model")
            return NullCascade()
        index = TierIndex(num_disk_blocks(
            kv_cache_config, self.config.disk_bytes_to_use // max(1, self.world_size)))
        logger.info("HALOffloadConnector: disk tier of %d blocks at %s",
                    index.capacity_blocks, self.config.disk_path)
        return TierCascade(index, self.cpu, self.world_size, self.stats)

    @property
    def totals(self) -> OffloadStats:
        """Everything recorded since start-up (tests, the demo, logs)."""
        return self.stats.totals

    def bind_gpu_block_pool(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool
        self.policy.bind(gpu_pool)
        self.stores.bind(gpu_pool)

    # --------------------------------------------------------------- loads
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._release_pending_hit(req_id)
        if req_id in self._loads:
            return None, False  # a load for this request is still in flight: ask later
        if request.skip_reading_prefix_cache or num_computed_tokens % self.block_size:
            return 0, False
        start = num_computed_tokens // self.cpu.hash_block_size
        # The last prompt token is always computed: the model must produce logits.
        max_hit_tokens = request.num_tokens - 1 - num_computed_tokens
        if start >= len(request.block_hashes) or max_hit_tokens <= 0:
            return 0, False
        hit, hit_tokens = self.cpu.find_hit(request.block_hashes, start, max_hit_tokens)
        # Without a disk tier a CPU miss is final (most waiting requests, most steps).
        if self.caps.secondary_tier and self.cascade.lookup(
                request, hit, (num_computed_tokens + hit_tokens) // self.block_size,
                (num_computed_tokens + max_hit_tokens) // self.block_size):
            return None, False  # a promotion into the CPU tier is in flight: ask again later
        if hit_tokens <= 0:
            return 0, False
        # Pin now: LRU eviction between this lookup and the allocation must not
        # take the hit away (the lookup/allocation race).
        self.cpu.pin_hit(hit)
        self._pending_hits[req_id] = _PendingHit(hit, num_computed_tokens)
        return hit_tokens, not self.caps.sync_loads

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        gpu_ids_by_group = blocks.get_block_ids()
        self.policy.on_allocated(request, len(gpu_ids_by_group))
        pending = self._pending_hits.pop(req_id, None)
        if pending is None:
            return
        if num_external_tokens == 0:
            self.cpu.unpin_hit(pending.blocks)
            return
        gpu_ids: list[int] = []
        taken: list[KVCacheBlock] = []
        for g, group_hit in enumerate(pending.blocks):
            bs = self.cpu.group_block_sizes[g]
            # The scheduler may accept fewer tokens than offered: take the prefix.
            first = pending.num_computed_tokens // bs
            for i, cpu_block in enumerate(group_hit[:cdiv(num_external_tokens, bs)]):
                if not cpu_block.is_null:
                    gpu_ids.append(gpu_ids_by_group[g][first + i])
                    taken.append(cpu_block)
        self.cpu.pin(taken)
        self.cpu.unpin_hit(pending.blocks)
        # The request could be aborted mid-copy: keep its device blocks ours.
        pin_ids(self._gpu_pool(), gpu_ids)
        self._loads[req_id] = _Load(gpu_ids, [b.block_id for b in taken], num_external_tokens)

    def _release_pending_hit(self, req_id: str) -> None:
        pending = self._pending_hits.pop(req_id, None)
        if pending is not None:
            self.cpu.unpin_hit(pending.blocks)

    # --------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        for req_id in scheduler_output.preempted_req_ids or ():
            self.policy.on_preempted(req_id)
        picker = self.stores.picker()
        self.policy.select(scheduler_output, picker)
        self.stores.queue(picker)
        return OffloadMetadata(load=self._take_load_job(), store=self.stores.take_job(),
                               tier=self.cascade.take_jobs(),
                               need_flush=bool(scheduler_output.preempted_req_ids))

    def _take_load_job(self) -> LoadSpec | None:
        new_loads = [(r, ld) for r, ld in self._loads.items() if ld.job_id is None]
        if not new_loads:
            return None
        job = self._next_load_job
        self._next_load_job += 1
        req_ids = [r for r, _ in new_loads]
        if self.caps.sync_loads:
            self._sync_load_jobs[job] = (req_ids, RankTally(self.world_size))
        cpu_blocks: list[int] = []
        gpu_blocks: list[int] = []
        for _, load in new_loads:
            load.job_id = job
            cpu_blocks += load.cpu_ids
            gpu_blocks += load.gpu_ids
        return LoadSpec(job, tuple(req_ids), cpu_blocks, gpu_blocks, self.caps.sync_loads)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        invalid = output.invalid_block_ids or set()
        failed = getattr(output, "failed_recving", None) or set()  # vLLM >= 0.32
        for req_id in output.finished_recving or ():
            load = self._loads.pop(req_id, None)
            if load is not None:
                ok = req_id not in failed and not invalid.intersection(load.gpu_ids)
                self._finish_load(load, ok)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata):
            for job, report in meta.stores.items():
                self.stores.on_report(job, report)
            for job, report in meta.loads.items():
                self._on_sync_load_report(job, report)
            self.cascade.on_reports(meta.tier)

    def _finish_load(self, load: _Load, ok: bool) -> None:
        if ok:
            self.stats.record_load(len(load.gpu_ids), load.num_tokens)
            self.cpu.record_load(load.cpu_ids)
        else:
            # vLLM recomputes the request's KV. Stop offering this copy, or the
            # retry would hit it and fail the same way again.
            self.cpu.drop(load.cpu_ids)
        self._release_load(load)

    def _release_load(self, load: _Load) -> None:
        self.cpu.unpin_ids(load.cpu_ids)
        unpin_ids(self._gpu_pool(), load.gpu_ids)

    def _on_sync_load_report(self, job: int, report: JobReport) -> None:
        entry = self._sync_load_jobs.get(job)
        if entry is None:
            return
        req_ids, tally = entry
        if not tally.report(report.ranks, report.failed):
            return  # the blocks stay pinned until every rank has read them
        del self._sync_load_jobs[job]
        for req_id in req_ids:
            # A failure was reported to vLLM as load errors by the workers.
            self._finish_load(self._loads.pop(req_id), not tally.failed)

    # ------------------------------------------------------------ finishing
    def request_finished(self, request: Request,
                         block_ids: Sequence[list[int]]) -> tuple[bool, None]:
        """Returns True while a load for the request is in flight (blocks freed later)."""
        req_id = request.request_id
        self._release_pending_hit(req_id)
        self.cascade.request_finished(req_id)
        picker = self.stores.picker()
        self.policy.on_finished(request, block_ids, picker)
        self.stores.queue(picker)
        load = self._loads.get(req_id)
        if load is None:
            return False, None
        if load.job_id is None:
            del self._loads[req_id]  # never sent to a worker: nothing in flight
            self._release_load(load)
            return False, None
        # A synchronous load was done before the forward pass that used it; its
        # pins go when the job's reports arrive. An asynchronous one in flight
        # will still be reported in finished_recving: vLLM must keep the request
        # (and free its blocks) until then. Device blocks of stores are pinned
        # by the store job, so they never delay the request.
        return not self.caps.sync_loads, None

    # --------------------------------------------------------------- misc
    def reset_cache(self) -> bool:
        """Forget every CPU prefix; copies in flight finish but are not published."""
        for req_id in list(self._pending_hits):
            self._release_pending_hit(req_id)
        self.cascade.reset()
        self.cpu.drop_all()
        self.stores.reset()
        self.policy.reset()
        return True

    def take_events(self) -> Iterable[Any]:
        return self.cpu.take_events()

    def get_stats(self) -> OffloadStats | None:
        return self.stats.take_step()

    def has_pending_transfers(self) -> bool:
        # Blocks left to store keep an idle engine stepping only while the CPU
        # tier has room for them (with none and no copy in flight, nothing changes).
        leftovers = self.policy.has_pending() and self.cpu.num_free_blocks() > 0
        return bool(self._loads or self.stores.has_pending() or self.cascade.has_pending()
                    or leftovers)

    def num_jobs_in_flight(self) -> int:
        """Load and store jobs sent to the workers and not yet reported by every rank."""
        loads = {ld.job_id for ld in self._loads.values() if ld.job_id is not None}
        return len(loads) + self.stores.num_jobs_in_flight

    def num_pinned_cpu_blocks(self) -> int:
        """CPU blocks referenced by a hit or a copy (0 when the tier is idle)."""
        return self.cpu.num_pinned_blocks()

    def _gpu_pool(self) -> BlockPool:
        assert self.gpu_pool is not None, "bind_gpu_block_pool() was not called"
        return self.gpu_pool


def _make_policy(config: OffloadConfig, kv_cache_config: KVCacheConfig,
                 vllm_config: VllmConfig, cpu: CpuTier) -> StorePolicy:
    if config.lazy_offload:
        return LazyPolicy(lazy_window_blocks(
            kv_cache_config, vllm_config.scheduler_config.max_num_batched_tokens))
    return EagerPolicy(cpu.group_block_sizes, cpu.cacheable_groups)
