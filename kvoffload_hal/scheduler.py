"""Scheduler side: the CPU tier as a second vLLM ``BlockPool``.

The CPU tier is driven by a ``KVCacheCoordinator`` built from a CPU
``KVCacheConfig`` (the device one with fewer blocks), so prefix matching, LRU
eviction, reference counts, the hash->block map, HMA group semantics and KV
events all come from vLLM. This module only decides *which* blocks move and
keeps every block it borrows referenced until the copy is over:

* a CPU hit is pinned (``touch``) the moment ``get_num_new_matched_tokens``
  finds it, so LRU eviction cannot take it before ``update_state_after_alloc``;
* device and CPU blocks of a job in flight are pinned until the job's result
  arrives, so a finished, aborted or preempted request never frees a block a
  copy still reads or writes;
* a stored block is published in the CPU prefix cache only after every rank
  reported its copy done, and a failed store is never published.

No device is touched here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput

from kvoffload_hal.config import OffloadConfig, num_cpu_blocks, num_disk_blocks
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import NO_JOB, OffloadMetadata, OffloadWorkerMetadata
from kvoffload_hal.metrics import OffloadStats
from kvoffload_hal.tiers.base import TierIndex
from kvoffload_hal.tiers.cascade import TierCascade

if TYPE_CHECKING:
    from vllm.config import VllmConfig
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
    job_id: int = NO_JOB


@dataclass
class _SyncLoadJob:
    """Reports of a synchronous load job, counted over ranks like a store's."""

    req_ids: list[str]
    reports: int = 0
    failed: bool = False


@dataclass
class _Store:
    """A device->CPU copy job; ``hashes`` are the device blocks' hashes at submission."""

    gpu_ids: list[int]
    cpu_ids: list[int]
    hashes: list[Any]
    reports: int = 0
    failed: bool = False
    abandoned: bool = False  # reset_cache() ran while in flight: do not publish


@dataclass
class _EagerCursor:
    """Per running request (eager mode): its device blocks and how many were considered.

    ``next_boundary`` is the confirmed-token count at which some group gets a
    full block not yet considered; below it a step has nothing to look at.
    """

    request: "Request"
    block_ids: list[list[int]]
    num_scanned: list[int] = field(default_factory=list)
    next_boundary: int = 0


def derive_cpu_kv_cache_config(gpu_config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """The device config with ``num_blocks`` blocks (same groups, so same HMA semantics).

    Only the groups and the block count drive the CPU coordinator; tensor sizes
    are scaled for consistency but nothing is allocated from them.
    """
    tensors = [replace(t, size=t.size // gpu_config.num_blocks * num_blocks)
               for t in gpu_config.kv_cache_tensors]
    return replace(gpu_config, num_blocks=num_blocks, kv_cache_tensors=tensors)


class OffloadScheduler:
    """Decides loads and stores between the device pool and the CPU pool."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: KVCacheConfig,
                 config: OffloadConfig) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        self.config = config
        self.world_size = vllm_config.parallel_config.world_size
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config)
        self.num_cpu_blocks = num_cpu_blocks(
            kv_cache_config, config.cpu_bytes_per_rank(self.world_size))
        self.cpu_kv_cache_config = derive_cpu_kv_cache_config(kv_cache_config, self.num_cpu_blocks)
        events = vllm_config.kv_events_config
        self.emit_kv_events = bool(events and events.enable_kv_cache_events)
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=self.cpu_kv_cache_config,
            max_model_len=vllm_config.model_config.max_model_len,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            use_eagle=False,
            enable_caching=True,
            enable_kv_cache_events=self.emit_kv_events,
            dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
            pcp_world_size=1,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            # Copies are whole blocks, so hits must end on a block boundary.
            allow_partial_hash_hits=False,
        )
        self.cpu_pool: BlockPool = self.coordinator.block_pool
        # Evictions from this pool are evictions from CPU memory: label its KV
        # events so a KV-aware router does not take them for device ones.
        self.cpu_pool.medium = MEDIUM_CPU
        self.group_block_sizes = self.coordinator.group_block_sizes
        self.cacheable_groups = [
            g for g in self.cpu_kv_cache_config.prefix_cacheable_group_ids
            if getattr(self.coordinator.single_type_managers[g],
                       "has_positionally_stable_blocks", True)
        ]
        # One full-attention group hashed at its own block size: a miss on the
        # first block beyond the device hit is a miss, and the lookup can stop
        # at one dict probe (most waiting requests, most steps).
        groups = self.cpu_kv_cache_config.kv_cache_groups
        self._probe_first_block = (
            len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
            and self.block_size == self.hash_block_size)
        self._cpu_hash_map = self.cpu_pool.cached_block_hash_to_block
        self.gpu_pool: BlockPool | None = None
        self.lazy_target_blocks = (
            _lazy_target_blocks(kv_cache_config, vllm_config.scheduler_config.max_num_batched_tokens)
            if config.lazy_offload else 0
        )

        self._pending_hits: dict[str, tuple[tuple[list[KVCacheBlock], ...], int]] = {}
        self._loads: dict[str, _Load] = {}
        self._sync_load_jobs: dict[int, _SyncLoadJob] = {}
        self.sync_loads = _use_sync_loads(config.load_mode, kv_cache_config)
        self._stores: dict[int, _Store] = {}
        self._queued_stores: list[tuple[list[int], list[int], list[Any]]] = []
        self._in_flight_gpu: set[int] = set()  # device blocks with a store queued or running
        self._in_flight_hashes: set[Any] = set()
        self._cursors: dict[str, _EagerCursor] = {}
        self._next_load_job = 0
        self._next_store_job = 0
        self.disk: TierCascade | None = None
        if config.disk_enabled:
            if len(kv_cache_config.kv_cache_groups) != 1:
                logger.warning("HALOffloadConnector: the disk tier supports models with one KV "
                               "cache group; it is disabled for this model")
            else:
                index = TierIndex(num_disk_blocks(
                    kv_cache_config, config.disk_bytes_to_use // max(1, self.world_size)))
                self.disk = TierCascade(index, self.cpu_pool, self.block_size,
                                        self.world_size, _publish)
                logger.info("HALOffloadConnector: disk tier of %d blocks at %s",
                            index.capacity_blocks, config.disk_path)
        self._stats = OffloadStats()  # drained by get_stats() every step
        self.totals = OffloadStats()  # since start-up, for tests, the demo and logs
        logger.info(
            "HALOffloadConnector: CPU tier of %d blocks (%.2f GiB per rank), %s stores, "
            "%s loads", self.num_cpu_blocks, config.cpu_bytes_per_rank(self.world_size) / 2**30,
            "lazy" if config.lazy_offload else "eager", "sync" if self.sync_loads else "async",
        )

    # ------------------------------------------------------------ binding
    def bind_gpu_block_pool(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool

    # --------------------------------------------------------------- loads
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._release_pending_hit(request.request_id)
        if request.request_id in self._loads:
            return None, False  # a load for this request is still in flight: ask later
        if request.skip_reading_prefix_cache or num_computed_tokens % self.block_size:
            return 0, False
        start = num_computed_tokens // self.hash_block_size
        block_hashes = request.block_hashes
        # The last prompt token is always computed: the model must produce logits.
        max_hit_tokens = request.num_tokens - 1 - num_computed_tokens
        if start >= len(block_hashes) or max_hit_tokens <= 0:
            return 0, False
        if (self._probe_first_block and self.disk is None
                and self._cpu_hash_map.get_one_block(
                    make_block_hash_with_group_id(block_hashes[start], 0)) is None):
            return 0, False
        hashes = block_hashes[start:]
        hit_blocks, hit_tokens, _ = self.coordinator.find_longest_cache_hit(hashes, max_hit_tokens)
        if self.disk is not None:
            # Blocks promoted for this request were pinned until now; the lookup
            # above found (and the touch below keeps) the ones still wanted.
            self.cpu_pool.touch([b for group in hit_blocks for b in group if not b.is_null])
            self.disk.release_promoted(request.request_id)
            self._unpin(hit_blocks)
            first = (num_computed_tokens + hit_tokens) // self.block_size
            last = (num_computed_tokens + max_hit_tokens) // self.block_size
            if self.disk.lookup(request, first, last):
                return None, False  # a promotion disk->CPU is in flight: ask again later
        if hit_tokens <= 0:
            return 0, False
        # Pin now: LRU eviction between this lookup and the allocation must not
        # take the hit away (the lookup/allocation race).
        self.cpu_pool.touch([b for group in hit_blocks for b in group if not b.is_null])
        self._pending_hits[request.request_id] = (hit_blocks, num_computed_tokens)
        return hit_tokens, not self.sync_loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        gpu_ids_by_group = blocks.get_block_ids()
        if not self.config.lazy_offload and req_id not in self._cursors:
            n = len(gpu_ids_by_group)
            self._cursors[req_id] = _EagerCursor(request, [[] for _ in range(n)], [0] * n)
        pending = self._pending_hits.pop(req_id, None)
        if pending is None or num_external_tokens == 0:
            if pending is not None:
                self._unpin(pending[0])
            return
        hit_blocks, num_computed_tokens = pending
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        taken: list[KVCacheBlock] = []
        for g, group_hit in enumerate(hit_blocks):
            bs = self.group_block_sizes[g]
            # The scheduler may accept fewer tokens than offered: take the prefix.
            n_take = cdiv(num_external_tokens, bs)
            first = num_computed_tokens // bs
            for i, cpu_block in enumerate(group_hit[:n_take]):
                if cpu_block.is_null:
                    continue
                gpu_ids.append(gpu_ids_by_group[g][first + i])
                cpu_ids.append(cpu_block.block_id)
                taken.append(cpu_block)
        self.cpu_pool.touch(taken)
        self._unpin(hit_blocks)
        assert self.gpu_pool is not None, "bind_gpu_block_pool() was not called"
        # The request could be aborted mid-copy: keep its device blocks ours.
        self.gpu_pool.touch([self.gpu_pool.blocks[b] for b in gpu_ids])
        self._loads[req_id] = _Load(gpu_ids, cpu_ids, num_external_tokens)

    # --------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata(need_flush=bool(scheduler_output.preempted_req_ids))
        for req_id in scheduler_output.preempted_req_ids or ():
            cursor = self._cursors.get(req_id)
            if cursor is not None:  # it restarts with a fresh block table
                cursor.block_ids = [[] for _ in cursor.block_ids]
                cursor.num_scanned = [0] * len(cursor.block_ids)
                cursor.next_boundary = 0

        if self.config.lazy_offload:
            self._select_lazy_stores()
        else:
            self._select_eager_stores(scheduler_output)
        if self._queued_stores:
            job = self._next_store_job
            self._next_store_job += 1
            store = _Store([], [], [])
            for gpu_ids, cpu_ids, hashes in self._queued_stores:
                store.gpu_ids += gpu_ids
                store.cpu_ids += cpu_ids
                store.hashes += hashes
            self._queued_stores.clear()
            self._stores[job] = store
            meta.store_job_id = job
            meta.store_gpu_blocks = store.gpu_ids
            meta.store_cpu_blocks = store.cpu_ids

        if self.disk is not None:
            (meta.spill_job_id, meta.spill_items), (meta.promote_job_id, meta.promote_items), \
                meta.tier_evictions = self.disk.take_jobs()

        new_loads = [(r, ld) for r, ld in self._loads.items() if ld.job_id == NO_JOB]
        if new_loads:
            job = self._next_load_job
            self._next_load_job += 1
            meta.load_job_id = job
            meta.load_sync = self.sync_loads
            if self.sync_loads:
                self._sync_load_jobs[job] = _SyncLoadJob([r for r, _ in new_loads])
            for req_id, load in new_loads:
                load.job_id = job
                meta.load_req_ids.append(req_id)
                meta.load_gpu_blocks += load.gpu_ids
                meta.load_cpu_blocks += load.cpu_ids
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        invalid = output.invalid_block_ids or set()
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            load = self._loads.pop(req_id, None)
            if load is None:
                continue
            if req_id in failed or invalid.intersection(load.gpu_ids):
                # vLLM recomputes the request's KV. Stop offering this copy, or
                # the retry would hit it and fail the same way again.
                self.cpu_pool.evict_blocks(set(load.cpu_ids))
                self._release_load(load)
                continue
            self._release_load(load)
            for stats in (self._stats, self.totals):
                stats.record_load(len(load.gpu_ids), load.num_tokens)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata):
            for job, n in meta.stores_failed.items():
                if job in self._stores:
                    self._stores[job].failed = True
                    self._count_store_report(job, n)
            for job, n in meta.stores_done.items():
                self._count_store_report(job, n)
            for job, n in meta.loads_failed.items():
                self._count_sync_load_report(job, n, failed=True)
            for job, n in meta.loads_done.items():
                self._count_sync_load_report(job, n, failed=False)
            if self.disk is not None and meta.tier_reports:
                before = (self.disk.blocks_spilled, self.disk.blocks_promoted)
                self.disk.on_reports(meta.tier_reports, meta.tier_failed)
                for stats in (self._stats, self.totals):
                    stats.record_disk(self.disk.blocks_spilled - before[0],
                                      self.disk.blocks_promoted - before[1])

    def _count_store_report(self, job: int, n: int) -> None:
        store = self._stores.get(job)
        if store is None:
            return
        store.reports += n
        if store.reports < self.world_size:
            return  # every TP/PP rank must have copied its shard
        del self._stores[job]
        self._in_flight_gpu.difference_update(store.gpu_ids)
        self._in_flight_hashes.difference_update(store.hashes)
        cpu_blocks = [self.cpu_pool.blocks[b] for b in store.cpu_ids]
        if store.failed:
            logger.warning("store job %d failed on a rank; %d blocks not offloaded",
                           job, len(cpu_blocks))
        elif not store.abandoned:
            for block, block_hash in zip(cpu_blocks, store.hashes):
                _publish(self.cpu_pool, block, block_hash)
            if self.emit_kv_events:
                self._queue_stored_events(store.hashes)
            for stats in (self._stats, self.totals):
                stats.record_store(len(cpu_blocks))
            if self.disk is not None:
                self.disk.on_published(cpu_blocks, store.hashes)
        self.cpu_pool.free_blocks(cpu_blocks)
        self._release_gpu(store.gpu_ids)

    def _count_sync_load_report(self, job: int, n: int, failed: bool) -> None:
        entry = self._sync_load_jobs.get(job)
        if entry is None:
            return
        entry.reports += n
        entry.failed |= failed
        if entry.reports < self.world_size:
            return  # the blocks stay pinned until every rank has read them
        del self._sync_load_jobs[job]
        for req_id in entry.req_ids:
            load = self._loads.pop(req_id)
            if entry.failed:
                # vLLM recomputes these blocks (reported as load errors by the
                # worker); stop offering the copy, as for an asynchronous load.
                self.cpu_pool.evict_blocks(set(load.cpu_ids))
            else:
                for stats in (self._stats, self.totals):
                    stats.record_load(len(load.gpu_ids), load.num_tokens)
            self._release_load(load)

    # ------------------------------------------------------------ finishing
    def request_finished(self, request: "Request",
                         block_ids: tuple[list[int], ...] | list[int]) -> tuple[bool, None]:
        """Returns True while a load for the request is in flight (blocks freed later)."""
        req_id = request.request_id
        self._release_pending_hit(req_id)
        if self.disk is not None:
            self.disk.request_finished(req_id)
        cursor = self._cursors.pop(req_id, None)
        if cursor is not None and block_ids and isinstance(block_ids[0], list):
            # The request's last full block may have been computed in this very
            # step: store it now, from the final block table, or it is lost.
            self._queue_eager_blocks(cursor, list(block_ids), request.num_computed_tokens)
        load = self._loads.get(req_id)
        if load is not None and load.job_id == NO_JOB:
            del self._loads[req_id]  # never sent to a worker: nothing in flight
            self._release_load(load)
            load = None
        elif load is not None and self.sync_loads:
            # Done before the forward pass that used it; its pins go when the
            # job's reports arrive. Nothing for vLLM to wait for.
            load = None
        # A load in flight will still be reported in finished_recving: vLLM must
        # keep the request (and free its blocks) until then. Device blocks of
        # stores are pinned by the store job, so they never delay the request.
        return load is not None, None

    # -------------------------------------------------------------- stores
    def _select_eager_stores(self, scheduler_output: SchedulerOutput) -> None:
        # Runs for every scheduled request on every step: most have no newly
        # completed block, and leave after two comparisons.
        cursors = self._cursors
        cached = scheduler_output.scheduled_cached_reqs
        new_reqs = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        for req_id, new_block_ids in chain(new_reqs, zip(cached.req_ids, cached.new_block_ids)):
            cursor = cursors.get(req_id)
            if cursor is None:
                continue
            if new_block_ids:
                for ids, new_ids in zip(cursor.block_ids, new_block_ids):
                    if new_ids:
                        ids.extend(new_ids)
            request = cursor.request
            # Built before the step runs: num_computed_tokens counts only KV
            # written by earlier steps, which have finished.
            confirmed = request.num_computed_tokens - request.num_output_placeholders
            if confirmed >= cursor.next_boundary:
                self._queue_eager_blocks(cursor, cursor.block_ids, confirmed)

    def _queue_eager_blocks(self, cursor: _EagerCursor, block_ids: list[list[int]],
                            confirmed_tokens: int) -> None:
        assert self.gpu_pool is not None
        gpu_ids: list[int] = []
        hashes: list[Any] = []
        budget = self.cpu_pool.get_num_free_blocks()
        for g in self.cacheable_groups:
            ids = block_ids[g]
            ready = min(len(ids), confirmed_tokens // self.group_block_sizes[g])
            i = cursor.num_scanned[g]
            while i < ready and len(gpu_ids) < budget:
                block = self.gpu_pool.blocks[ids[i]]
                if self._storable(block):
                    gpu_ids.append(block.block_id)
                    hashes.append(block.block_hash)
                    self._in_flight_hashes.add(block.block_hash)
                i += 1
            cursor.num_scanned[g] = i
        cursor.next_boundary = min(
            ((cursor.num_scanned[g] + 1) * self.group_block_sizes[g]
             for g in self.cacheable_groups), default=1 << 62)
        self._queue_store(gpu_ids, hashes)

    def _select_lazy_stores(self) -> None:
        """Store the device blocks next in line for eviction (the free queue's head)."""
        if self.gpu_pool is None:
            return
        budget = self.cpu_pool.get_num_free_blocks()
        gpu_ids: list[int] = []
        hashes: list[Any] = []
        for n, block in enumerate(self.gpu_pool.free_block_queue.iter_blocks_after(None)):
            if n >= self.lazy_target_blocks or len(gpu_ids) >= budget:
                break
            if self._storable(block):
                gpu_ids.append(block.block_id)
                hashes.append(block.block_hash)
                self._in_flight_hashes.add(block.block_hash)
        self._queue_store(gpu_ids, hashes)

    def _storable(self, block: "KVCacheBlock") -> bool:
        h = block.block_hash
        return (not block.is_null and h is not None
                and block.block_id not in self._in_flight_gpu
                and h not in self._in_flight_hashes
                and self.cpu_pool.cached_block_hash_to_block.get_one_block(h) is None)

    def _queue_store(self, gpu_ids: list[int], hashes: list[Any]) -> None:
        if not gpu_ids:
            return
        assert self.gpu_pool is not None
        cpu_blocks = self.cpu_pool.get_new_blocks(len(gpu_ids))  # LRU eviction happens here
        self.gpu_pool.touch([self.gpu_pool.blocks[b] for b in gpu_ids])
        self._in_flight_gpu.update(gpu_ids)
        self._queued_stores.append((gpu_ids, [b.block_id for b in cpu_blocks], hashes))

    # --------------------------------------------------------------- misc
    def reset_cache(self) -> bool:
        """Forget every CPU prefix; copies in flight finish but are not published."""
        for req_id in list(self._pending_hits):
            self._release_pending_hit(req_id)
        for store in self._stores.values():
            store.abandoned = True
        if self.disk is not None:
            self.disk.reset()
        self.cpu_pool.evict_blocks(set(range(self.num_cpu_blocks)))
        for gpu_ids, cpu_ids, hashes in self._queued_stores:
            self.cpu_pool.free_blocks([self.cpu_pool.blocks[b] for b in cpu_ids])
            self._release_gpu(gpu_ids)
            self._in_flight_gpu.difference_update(gpu_ids)
            self._in_flight_hashes.difference_update(hashes)
        self._queued_stores.clear()
        for cursor in self._cursors.values():
            cursor.num_scanned = [0] * len(cursor.num_scanned)
            cursor.next_boundary = 0
        return True

    def _queue_stored_events(self, hashes: list[Any]) -> None:
        """One ``BlockStored`` (medium CPU) per published block.

        Blocks are published one by one, not as a chain of one request's
        blocks, so parent hash and token ids are not known here; consumers key
        on the block hash, as for blocks offloaded by vLLM's own CPU offload.
        """
        queue = self.cpu_pool.kv_event_queue
        for key in hashes:
            group = get_group_id(key)
            queue.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                parent_block_hash=None, token_ids=[],
                block_size=self.group_block_sizes[group], lora_id=None,
                medium=MEDIUM_CPU, lora_name=None, group_idx=group, locality="LOCAL"))

    def take_events(self) -> Iterable[Any]:
        return self.cpu_pool.take_events()

    def get_stats(self) -> OffloadStats | None:
        if self._stats.is_empty():  # called every step: most steps have nothing
            return None
        stats, self._stats = self._stats, OffloadStats()
        return stats

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self._stores or self._queued_stores
                    or (self.disk is not None and self.disk.has_pending()))

    def num_pinned_cpu_blocks(self) -> int:
        """CPU blocks referenced by a hit or a copy (0 when the tier is idle)."""
        return sum(1 for b in self.cpu_pool.blocks if b.ref_cnt > 0 and not b.is_null)

    # ------------------------------------------------------------ helpers
    def _release_pending_hit(self, req_id: str) -> None:
        pending = self._pending_hits.pop(req_id, None)
        if pending is not None:
            self._unpin(pending[0])

    def _unpin(self, hit_blocks: tuple[list["KVCacheBlock"], ...]) -> None:
        self.cpu_pool.free_blocks([b for group in hit_blocks for b in group if not b.is_null])

    def _release_load(self, load: _Load) -> None:
        self.cpu_pool.free_blocks([self.cpu_pool.blocks[b] for b in load.cpu_ids])
        self._release_gpu(load.gpu_ids)

    def _release_gpu(self, gpu_ids: list[int]) -> None:
        assert self.gpu_pool is not None
        self.gpu_pool.free_blocks([self.gpu_pool.blocks[b] for b in gpu_ids])


def _publish(pool: BlockPool, block: "KVCacheBlock", block_hash: Any) -> None:
    """Make ``block`` findable under ``block_hash`` in ``pool``'s prefix cache."""
    # vLLM 0.32 has no public "insert this hash" call; this is the one place
    # coupled to a private BlockPool method.
    pool._insert_block_hash(block_hash, block, num_tokens=None)


def _use_sync_loads(load_mode: str, kv_cache_config: KVCacheConfig) -> bool:
    """``load_mode`` resolved: synchronous loads need one KV cache group.

    vLLM maps a failed synchronous load back to its requests through block ids,
    which are per group; with one group that mapping is exact.
    """
    num_groups = len(kv_cache_config.kv_cache_groups)
    if load_mode == "auto":
        from vllm.platforms import current_platform

        # On the CPU platform the forward pass cannot overlap a copy anyway.
        return current_platform.is_cpu() and num_groups == 1
    if load_mode == "sync" and num_groups != 1:
        raise ValueError(
            f"kv_connector_extra_config['load_mode']='sync': expected a model with one KV "
            f"cache group, this one has {num_groups}; use 'async' or 'auto'")
    return load_mode == "sync"


def _lazy_target_blocks(kv_cache_config: KVCacheConfig, max_num_batched_tokens: int) -> int:
    """Device blocks to keep offloaded ahead of eviction: two steps' worth of allocations."""
    target = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            target += 2
        elif isinstance(spec, SlidingWindowSpec):
            target += cdiv(spec.sliding_window, spec.block_size) + 1
        else:
            target += cdiv(max_num_batched_tokens, spec.block_size)
    return 2 * target
