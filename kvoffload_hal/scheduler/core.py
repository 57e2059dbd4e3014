"""Scheduler side: vLLM's scheduler-role calls, wired to the parts that decide.

The CPU tier itself is :class:`~kvoffload_hal.scheduler.cpu_tier.CpuTier` (vLLM's own
``BlockPool`` and ``KVCacheCoordinator``), the choice of blocks to store is a
:class:`~kvoffload_hal.scheduler.store_policy.StorePolicy`, and a secondary tier behind
the CPU tier is a :class:`~kvoffload_hal.scheduler.secondary.chain.TierChain` of them,
nearest first (maybe empty), built from the tiers' specs by
:meth:`~kvoffload_hal.scheduler.secondary.chain.TierChain.build`. Loads and stores are
:class:`~kvoffload_hal.scheduler.load_jobs.LoadJobs` and
:class:`~kvoffload_hal.scheduler.store_jobs.StoreJobs`. Every block they borrow
stays referenced until the copy is over:

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
from typing import TYPE_CHECKING, Any

from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from kvoffload_hal.capabilities import resolve_capabilities
from kvoffload_hal.config import OffloadConfig, check_capacity, num_cpu_blocks
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import OffloadMetadata, OffloadWorkerMetadata
from kvoffload_hal.metrics import OffloadStats, StatsLedger
from kvoffload_hal.scheduler.admission import LoadRoom
from kvoffload_hal.scheduler.cpu_tier import CpuTier
from kvoffload_hal.scheduler.landed_loads import LandedLoads
from kvoffload_hal.scheduler.load_jobs import LoadJobs
from kvoffload_hal.scheduler.parts import Parts
from kvoffload_hal.scheduler.room import CpuRoom
from kvoffload_hal.scheduler.secondary.chain import TierChain
from kvoffload_hal.scheduler.secondary.prefetch import build_prefetcher
from kvoffload_hal.scheduler.secondary.staged import StagedHits
from kvoffload_hal.scheduler.store_jobs import StoreJobs
from kvoffload_hal.scheduler.store_policy import (
    EagerPolicy,
    LazyPolicy,
    StorePolicy,
    lazy_window_blocks,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)


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
                           block_size, hash_block_size, eviction=config.eviction,
                           device_copies=config.device_copies,
                           tier_behind=bool(config.tiers))
        self.stats = StatsLedger()
        self.policy = _make_policy(config, kv_cache_config, vllm_config, self.cpu)
        # Who takes the CPU tier's free blocks first: scheduler/room.py.
        self.cpu_room = CpuRoom(self.cpu)
        self.tiers = TierChain.build(config.tiers, self.caps.tiers, kv_cache_config, self.cpu,
                                 self.world_size, self.stats, self.cpu_room)
        # Rescues into the CPU blocks of the step's loads (scheduler/hand_over.py) and
        # rescues homed at a lookup (scheduler/rescue_homes.py): not where a failed load
        # is sent again from its CPU blocks.
        retries = self.caps.vllm.reads_failed_loads_again()
        self.stores = StoreJobs(self.cpu, self.tiers, self.stats, self.world_size,
                                self.cpu_room, homes=not retries)
        notice = self.caps.vllm.recovery_notice()
        if notice is not None:
            logger.info(notice)
        self.loads = LoadJobs(self.cpu, self.stats, self.world_size, self.caps.sync_loads,
                              self.caps.vllm)
        self.staged = StagedHits(self.tiers, self.loads, self.cpu, self.stats, block_size,
                                 self.caps.vllm)
        self.tiers.bind_copies(self._copies_in_flight)
        hands_over = self.cpu.device_copies.spare_stores and not retries
        self.hand_overs = self.loads if hands_over else None
        self.prefetch = build_prefetcher(config, self.cpu, self.tiers, block_size, self.stats)
        self.room = LoadRoom(block_size, config.defer_loads_without_room
                             and len(kv_cache_config.kv_cache_groups) == 1)
        self.landed = LandedLoads(self.caps.vllm.tracks_landed_loads())
        # Every event of a request's or a step's life goes to each part, in this order.
        self._parts = Parts((self.prefetch, self.loads, self.staged, self.tiers, self.room,
                             self.landed))
        self.gpu_pool: BlockPool | None = None
        logger.info(
            "HALOffloadConnector: CPU tier of %d blocks (%.2f GiB per rank), %s stores, "
            "%s loads", self.cpu.num_blocks, config.cpu_bytes_per_rank(self.world_size) / 2**30,
            "lazy" if isinstance(self.policy, LazyPolicy) else "eager",
            "sync" if self.caps.sync_loads else "async",
        )

    @property
    def totals(self) -> OffloadStats:
        """Everything recorded since start-up (tests, the demo, logs)."""
        return self.stats.totals

    def bind_gpu_block_pool(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool
        self.cpu.bind_device(gpu_pool)
        self.policy.bind(gpu_pool)
        self.stores.bind(gpu_pool)
        for bind in self._parts.bind:
            bind(gpu_pool)

    # --------------------------------------------------------------- loads
    def on_new_request(self, request: Request) -> None:
        self.prefetch.add(request)  # scheduler/secondary/prefetch.py: looked at while it waits

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        for on_lookup in self._parts.on_lookup:
            on_lookup(req_id)
        if self.landed.holds_up_lookups():
            return None, False  # vLLM's scan goes on to the requests whose load landed
        if self.loads.in_flight(req_id):
            return None, False  # a load for this request is still in flight: ask later
        if req_id in self.loads.failed_requests and not self.caps.sync_loads:
            # vLLM keeps a request whose asynchronous load failed among the prefills
            # it reserves device blocks for: another asynchronous load of it could wait
            # for ever on its own reservation. It recomputes instead.
            return 0, False
        if request.skip_reading_prefix_cache or num_computed_tokens % self.block_size:
            return 0, False
        start = num_computed_tokens // self.cpu.hash_block_size
        # The last prompt token is always computed: the model must produce logits.
        max_hit_tokens = request.num_tokens - 1 - num_computed_tokens
        if start >= len(request.block_hashes) or max_hit_tokens <= 0:
            return 0, False
        hit, hit_tokens = self.cpu.find_hit(request.block_hashes, start, max_hit_tokens)
        if self.stores.homes is not None:  # blocks the device handed out this step
            hit, hit_tokens, waits = self.stores.homes.extend_hit(
                request.block_hashes, start, max_hit_tokens, hit, hit_tokens,
                lossless=self._hand_over_homes_rescues)
            if waits:
                return None, False  # the step's hand-over homes the rest: ask later
        if hit_tokens > 0 and self.loads.wait_for_shared_load(req_id, hit):
            return None, False  # another request's load brings these blocks: ask later
        # Without a secondary tier a CPU miss is final (most waiting requests, most steps).
        # After a failed load, the slower tiers' copy is not tried again for the request.
        if self.caps.secondary_tier and req_id not in self.loads.failed_requests:
            staged = self.staged.offer(request, hit, hit_tokens, num_computed_tokens,
                                       max_hit_tokens)
            if staged is None:
                return None, False  # a staged hit brings these blocks: ask again later
            if staged:
                self.landed.note_async(request)
                return staged, True  # longer than the CPU tier's room: loaded in rounds
            if self.tiers.lookup(
                    request, hit, (num_computed_tokens + hit_tokens) // self.block_size,
                    (num_computed_tokens + max_hit_tokens) // self.block_size):
                return None, False  # a promotion into the CPU tier is in flight: ask later
        if hit_tokens <= 0:
            return 0, False
        if self.room.defers(request, num_computed_tokens):
            return None, False  # vLLM would preempt a request next step: ask later
        self.loads.hold_hit(req_id, hit, num_computed_tokens)
        if not self.caps.sync_loads:
            self.landed.note_async(request)
        return hit_tokens, not self.caps.sync_loads

    def _hand_over_homes_rescues(self) -> bool:
        """Whether this step's hand-over can home its rescues in a load's CPU blocks
        (scheduler/rescue_homes.py)."""
        return self.hand_overs is not None and self.loads.has_planned()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.policy.on_allocated(request, len(blocks.blocks))
        self.room.on_allocated(request)
        if not self.staged.on_allocated(request.request_id, blocks, num_external_tokens):
            self.loads.on_allocated(request.request_id, blocks, num_external_tokens)

    # --------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        for req_id in scheduler_output.preempted_req_ids or ():
            self.policy.on_preempted(req_id)
            self.room.on_preempted(req_id)
        for release_unallocated in self._parts.release_unallocated:
            release_unallocated()
        # The CPU room goes by scheduler/room.py's order, whichever asks first. A
        # feature that is off (rescues, secondary tiers, prefetch) is not called (parts.py).
        rescue, load = None, self.loads.take_job()
        if self.cpu.device_copies.rescues:
            rescue, load = self.stores.rescue(self.cpu.device_copies.take_rescues(), load,
                                              self.hand_overs)
        if self.staged.active:
            self.staged.advance()
        picker = self.stores.picker()
        self.policy.select(scheduler_output, picker)
        self.stores.queue(picker)
        if self.prefetch.active:
            self.prefetch.step()
        meta = OffloadMetadata(load=load, store=self.stores.take_job(), rescue=rescue,
                               need_flush=bool(scheduler_output.preempted_req_ids))
        if self.tiers.active:
            meta.tiers = self.tiers.take_jobs()
        if self.staged.active:
            meta.rounds = self.staged.take_rounds()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        meta = meta if isinstance(meta, OffloadWorkerMetadata) else None
        if meta is not None:
            self.loads.on_failed_loads(meta.failed_loads)
            for job, report in (*meta.rounds.items(), *meta.loads.items()):
                self.loads.on_report(job, report)  # staged rounds are load jobs too
            for job, report in meta.stores.items():
                self.stores.on_report(job, report)
            if self.tiers.active:
                self.tiers.on_reports(meta.tier)
                self.tiers.on_found(meta.tier_found, meta.tier_scans_done)
        for on_transfer_results in self._parts.on_transfer_results:
            on_transfer_results(output)

    # ------------------------------------------------------------ finishing
    def request_finished(self, request: Request,
                         block_ids: Sequence[list[int]]) -> tuple[bool, None]:
        """Returns True while a load for the request is in flight (blocks freed later)."""
        req_id = request.request_id
        # Device blocks of stores are pinned by the store job, so they never
        # delay the request; a load in flight does.
        copying = [finished(req_id) for finished in self._parts.request_finished]
        picker = self.stores.picker()
        self.policy.on_finished(request, block_ids, picker)
        self.stores.queue(picker)
        return any(copying), None

    # --------------------------------------------------------------- misc
    def reset_cache(self) -> bool:
        """Forget every CPU prefix; copies in flight finish but are not published.
        Staged hits stop at the blocks already promoted and prefetches let go of what
        they hold (docs/design.md, "Resetting the cache")."""
        for reset in self._parts.reset:
            reset()
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
        return (leftovers or self.stores.has_pending()
                or any(has_pending() for has_pending in self._parts.has_pending))

    def has_pending_block_frees(self) -> bool:
        return self.stores.holds_last_references()

    def _copies_in_flight(self) -> bool:
        """Loads or stores hold CPU blocks until they end (a promotion waits for them)."""
        return (self.loads.has_pending() or self.stores.has_pending()
                or self.staged.has_pending())

    def num_jobs_in_flight(self) -> int:
        """Load and store jobs sent to the workers and not yet reported by every rank."""
        return self.loads.num_jobs_in_flight + self.stores.num_jobs_in_flight

    def num_pinned_cpu_blocks(self) -> int:
        """CPU blocks referenced by a hit or a copy (0 when the tier is idle)."""
        return self.cpu.num_pinned_blocks()


def _make_policy(config: OffloadConfig, kv_cache_config: KVCacheConfig,
                 vllm_config: VllmConfig, cpu: CpuTier) -> StorePolicy:
    """Eager or lazy, as configured; lazy for a model whose state blocks eager
    stores cannot take (they would never hit), said once at start-up."""
    lazy = config.lazy_offload
    if not lazy and cpu.unstable_groups:
        names = sorted({type(kv_cache_config.kv_cache_groups[g].kv_cache_spec).__name__
                        for g in cpu.unstable_groups})
        logger.info("HALOffloadConnector: lazy stores for this model: KV cache group(s) %s "
                    "(%s) replace their block at a position as a request runs (Mamba state "
                    "in 'align' mode), so only blocks about to be evicted can be stored; "
                    "eager stores would never hit them",
                    ", ".join(map(str, cpu.unstable_groups)), ", ".join(names))
        lazy = True
    if lazy:
        return LazyPolicy(lazy_window_blocks(
            kv_cache_config, vllm_config.scheduler_config.max_num_batched_tokens))
    return EagerPolicy(cpu.group_block_sizes, cpu.cacheable_groups)
