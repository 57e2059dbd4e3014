"""Worker side: block views of the KV caches, one store and one load job per step.

Device-agnostic: the backend comes from the registry (``KVOFFLOAD_HAL_BACKEND``)
and every KV tensor is described as block regions from its shape and strides,
whatever the attention backend's layout. Jobs are launched in ``get_finished``,
after the step's forward pass was enqueued; the backend fences stores behind
the compute already enqueued, so a store never reads a block being written.
Where the forward pass has already finished by then (``synchronous_compute``,
vLLM's CPU platform), the worker waits for the step's jobs and reports them in
the same step. A synchronous load runs earlier, in ``start_load_kv``.

Each job of a step's metadata is launched once: binding the metadata makes its
jobs pending, and launching one takes it off that list.

Sleep mode (vLLM >= 0.33): ``unregister_kv_caches`` waits for every copy in
flight (their results go to the next report) and launches no device copy until
``restore_kv_caches`` has described the KV tensors again and rebound the backend
to where they are now; a copy bound meanwhile fails (a load is recomputed).
A load job carries its :class:`~kvoffload_hal.metadata.LoadSpec` as its tag, so
a completion observed any number of steps later still finds its requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvoffload_hal import vllm_compat
from kvoffload_hal.capabilities import resolve_capabilities
from kvoffload_hal.config import (
    OffloadConfig,
    check_capacity,
    check_replicas,
    local_replicas,
    num_cpu_blocks,
)
from kvoffload_hal.hal import Direction, DmaCopyBackend, JobResult, TransferJob, create_backend
from kvoffload_hal.hal.host import HostChunks
from kvoffload_hal.hal.layouts import describe_kv_caches, flatten_kv_caches
from kvoffload_hal.hal.regions import host_bytes_per_block
from kvoffload_hal.host_memory import available_at_start
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import (
    JobReport,
    LoadSpec,
    OffloadHandshake,
    OffloadMetadata,
    OffloadWorkerMetadata,
    StoreSpec,
    TierJobs,
)
from kvoffload_hal.metrics import CopyPathWatch, OffloadStats, StatsLedger
from kvoffload_hal.tiers.identity import kv_fingerprint, rank_in_replica
from kvoffload_hal.tiers.registry import build_worker_half
from kvoffload_hal.tiers.spec import WorkerTierContext
from kvoffload_hal.worker.hand_over import (
    LoadParts,
    Unfilled,
    launch_load,
    rescue_now,
    whole_load,
)
from kvoffload_hal.worker.loads import LoadOutcomes
from kvoffload_hal.worker.shutdown import shut_down
from kvoffload_hal.worker.tiers import WorkerTiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

STATS_CARRIER_STEPS = 2  # see OffloadWorker.get_stats

# How long start-up waits for a restarted tier to list the blocks it kept (about
# 0.3 s per 100 000 files on a local disk); what it lists later comes with the steps.
FOUND_AT_START_WAIT_S = 120.0


@dataclass
class _Unlaunched:
    """The jobs of the bound metadata not launched yet."""

    load: LoadSpec | None = None
    store: StoreSpec | None = None
    tiers: tuple[TierJobs, ...] = ()  # one per secondary tier, nearest first
    rounds: tuple[LoadSpec, ...] = ()  # staged hits' rounds, launched after ``load``


class OffloadWorker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: OffloadConfig) -> None:
        world_size = vllm_config.parallel_config.world_size
        self.caps = resolve_capabilities(kv_cache_config, config)
        self.num_gpu_blocks = kv_cache_config.num_blocks
        self.kv_cache_config = kv_cache_config
        self.num_cpu_blocks = num_cpu_blocks(kv_cache_config, config.cpu_bytes_per_rank(world_size))
        self.config = config
        self.vllm_config = vllm_config
        self.world_size = world_size
        self.rank = _rank()
        self.backend: DmaCopyBackend | None = None
        self.tiers = WorkerTiers()  # the secondary tiers, nearest first (worker/tiers.py)
        self.host: HostChunks | None = None  # the CPU tier's host memory
        self._kv_caches: dict | None = None  # as registered: described again on a restore
        self._asleep = False  # between unregister_kv_caches and restore_kv_caches
        self._unlaunched = _Unlaunched()
        self._release: set[str] = set()  # requests the scheduler held for its last writes
        self._unfilled = Unfilled()  # blocks published at a lookup, whose rescue failed
        self.loads = LoadOutcomes(self.caps)
        self._reports = OffloadWorkerMetadata()
        self.stats = StatsLedger()
        self._stats_carriers = 0  # steps left that report stats even when empty

    @property
    def totals(self) -> OffloadStats:
        return self.stats.totals

    # ------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> None:
        tensors = _unique_tensors(kv_caches)
        if not tensors:
            raise ValueError("HALOffloadConnector: no KV cache tensors to offload")
        check_capacity(self.config, self.world_size, before_allocating=True)
        check_replicas(self.config, local_replicas(self.vllm_config.parallel_config),
                       available_at_start())
        backend = create_backend(device=tensors[0].device)
        regions = describe_kv_caches(kv_caches, self.num_gpu_blocks, backend.describe_kv_tensor)
        bytes_per_block = host_bytes_per_block(regions)
        self.host = backend.allocate_host_regions(regions, self.num_cpu_blocks)
        backend.bind(regions, self.host.regions)
        self.backend, self._kv_caches = backend, kv_caches
        self._copy_path = CopyPathWatch(backend)
        if self.caps.secondary_tier:
            self.tiers = _build_tiers(self, tensors)
        logger.info(
            "HALOffloadConnector worker: %d KV tensors -> %d block regions, %d B per block; "
            "CPU tier %d blocks (%.2f GiB in %d host allocation(s)) on the %r backend",
            len(tensors), len(regions), bytes_per_block, self.num_cpu_blocks,
            self.num_cpu_blocks * bytes_per_block / 2**30, len(self.host.chunks), backend.name,
        )

    def handshake(self) -> OffloadHandshake:
        """Once, before the first request: how many CPU blocks this rank holds, and
        every block a restarted tier kept (waiting at most :data:`FOUND_AT_START_WAIT_S`
        for it to list them), for the scheduler's index."""
        found, done = self.tiers.take_found_at_start(FOUND_AT_START_WAIT_S)
        return OffloadHandshake(found, done, num_cpu_blocks=self.num_cpu_blocks)

    def unregister_kv_caches(self) -> None:
        """Before the KV cache is freed for sleep: no copy may touch it from now on."""
        if self.backend is None or self._asleep:
            return
        self._collect(self.backend.flush())  # vLLM drains; a copy still queued ends here
        self._asleep = True

    def restore_kv_caches(self) -> None:
        """After wake-up: the KV tensors may live elsewhere; bind their addresses anew."""
        if self.backend is None or not self._asleep:
            return
        self.backend.rebind(describe_kv_caches(self._kv_caches, self.num_gpu_blocks,
                                               self.backend.describe_kv_tensor))
        self._asleep = False

    # ------------------------------------------------------------ per step
    def bind_connector_metadata(self, metadata: OffloadMetadata) -> None:
        if self.backend is not None:
            self.backend.step_done()  # a load before this step's forward fences on its own
            if metadata.rescue is not None:
                self._rescue(metadata.rescue)
        self._unlaunched = _Unlaunched(metadata.load, metadata.store, metadata.tiers,
                                       metadata.rounds)
        self._release.update(metadata.release_requests)

    def _rescue(self, spec: StoreSpec) -> None:
        """Copy out device blocks this step reuses before its loads and forward pass."""
        if self._asleep:  # fails unlaunched, as the step's other copies
            self._unlaunched = _Unlaunched(store=spec)
            self._fail_asleep()
        else:
            rescue_now(self.backend, spec, self._collect)
        report = self._reports.stores.get(spec.job_id)
        self._unfilled.rescued(spec, report is None or not report.failed)

    def clear_connector_metadata(self) -> None:
        self._unlaunched = _Unlaunched()

    def handle_preemptions(self, metadata: OffloadMetadata) -> None:
        # Blocks of preempted requests are about to be reused: nothing may be in flight.
        if metadata.need_flush and self.backend is not None:
            self._collect(self.backend.flush())

    def finish_forward(self) -> None:
        """The step's forward pass is enqueued (vLLM >= 0.33): the step's copies,
        launched next, are ordered after it (the backend's ``forward_done``)."""
        if self.backend is not None and not self._asleep:
            self.backend.forward_done()

    def start_load_kv(self) -> None:
        """Run a synchronous load before the forward pass that reads it.

        vLLM calls this before the forward pass on steps with synchronous loads
        (and after it otherwise, where there is nothing to do here).
        """
        load = self._unlaunched.load
        if self.backend is None or load is None or not load.sync:
            return
        if self._asleep:
            self._fail_asleep()
            return
        self._launch_load()
        # The forward pass reads these blocks next: wait for them (this also
        # collects anything else that finished meanwhile).
        self._collect(self.backend.flush())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Launch this step's jobs, collect finished ones.

        Returns ``(finished_sending, finished_recving, failed_recving)``; a failed
        load is in both of the last two, so the request leaves its wait state.
        ``finished_sending``: requests the scheduler held for its last writes and
        releases now (exit_flush.py).
        """
        released, self._release = self._release, set()
        if self.backend is None:
            return released, set(), set()
        self.loads.forget(finished_req_ids)
        if self._asleep:
            self._fail_asleep()
        launched = self._launch_pending()
        self.backend.step_done()
        if launched and self.backend.synchronous_compute:
            self._collect(self.backend.flush())  # nothing to overlap: report this step
        else:
            self._collect(self.backend.poll())
        self.tiers.collect(self._reports)
        finished, failed = self.loads.take()
        return released, finished, failed

    def _launch_pending(self) -> bool:
        """Launch what the bound metadata holds and was not launched yet."""
        assert self.backend is not None
        pending = self._unlaunched
        launched = pending.store is not None or pending.load is not None or bool(pending.rounds)
        if pending.load is not None and pending.load.hand_overs:
            self._launch_load()  # its rescues' job ids come before the store's
        if pending.store is not None:
            store, pending.store = pending.store, None
            self._unfilled.filled(store.cpu_blocks)
            self.backend.submit(TransferJob(store.job_id, Direction.STORE,
                                            store.gpu_blocks, store.cpu_blocks))
        if pending.load is not None:
            self._launch_load()
        rounds, pending.rounds = pending.rounds, ()
        for spec in rounds:  # in job order, after the step's load
            if self._unfilled.read_by(spec):
                self._fail_load(spec)
            elif spec.cpu_blocks:
                self.backend.submit(TransferJob(spec.job_id, Direction.LOAD, spec.cpu_blocks,
                                                spec.gpu_blocks, tag=spec))
            else:
                self.loads.on_result(spec, spec.job_id, True, self._reports)  # nothing to copy
        tiers, pending.tiers = pending.tiers, ()
        self._unfilled.promoted(tiers)
        self.tiers.submit(tiers)
        return launched

    def _fail_asleep(self) -> None:
        """Device copies bound while the KV cache is unregistered fail, unlaunched."""
        pending = self._unlaunched
        if pending.store is not None:
            self.stats.record_transfer(True, 0, 0.0, False)
            self._reports.stores[pending.store.job_id] = JobReport(failed=True)
        for spec in ((pending.load,) if pending.load is not None else ()) + pending.rounds:
            self._fail_load(spec)
        pending.store, pending.load, pending.rounds = None, None, ()

    def _fail_load(self, spec: LoadSpec) -> None:
        self.stats.record_transfer(False, 0, 0.0, False)
        self.loads.fail_unlaunched(spec, self._reports)

    def _launch_load(self) -> None:
        assert self.backend is not None and self._unlaunched.load is not None
        load, self._unlaunched.load = self._unlaunched.load, None
        if self._unfilled.read_by(load):
            return self._fail_load(load)
        launch_load(self.backend, load, self._collect)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_error_blocks()

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, OffloadWorkerMetadata()
        self._stats_carriers = STATS_CARRIER_STEPS
        return reports

    def get_stats(self) -> OffloadStats | None:
        """This step's stats; an empty report in the two steps after a job report: a
        vLLM that takes the scheduler's stats only with the workers' (0.23) then gets
        what the scheduler counted from that report (whichever it asks for first)."""
        stats = self.stats.take_step()
        if stats is None and self._stats_carriers > 0:
            stats = OffloadStats()
        self._stats_carriers = max(0, self._stats_carriers - 1)
        return stats

    def shutdown(self) -> None:
        """Stop the tier and the backend; free the host buffer once nothing can use it
        (:func:`~kvoffload_hal.worker.shutdown.shut_down`)."""
        tiers, backend, host = self.tiers, self.backend, self.host
        self.tiers, self.backend, self.host = WorkerTiers(), None, None
        shut_down(tiers, backend, host, self.config.shutdown_flush_timeout_s)

    # ------------------------------------------------------------ helpers
    def _collect(self, results: list[JobResult]) -> None:
        self._copy_path.check(self.stats)
        for r in results:
            self.stats.record_transfer(r.direction is Direction.STORE, r.num_bytes,
                                       r.seconds, r.ok)
            if r.direction is Direction.LOAD:
                self._on_load_result(r, r.tag)
            elif r.ok:
                self._reports.stores[r.job_id] = JobReport()
            else:
                logger.error("store job %d failed (%s); its blocks are not offloaded",
                             r.job_id, r.error)
                self._reports.stores[r.job_id] = JobReport(failed=True)

    def _on_load_result(self, r: JobResult, tag: LoadSpec | LoadParts) -> None:
        if (whole := whole_load(r, tag)) is None:
            return  # a part of a load, not its last one back
        load, r = whole
        if not r.ok:
            logger.error("%s load job %d failed (%s); %d blocks will be recomputed",
                         "synchronous" if load.sync else "asynchronous", r.job_id, r.error,
                         len(load.gpu_blocks))
        self.loads.on_result(load, r.job_id, r.ok, self._reports)


def _build_tiers(worker: OffloadWorker, tensors: list[torch.Tensor]) -> WorkerTiers:
    """The worker halves of the secondary tiers this engine runs, nearest first."""
    assert worker.host is not None
    ctx = WorkerTierContext(
        worker.rank, worker.world_size, worker.host.chunks, worker.host.region_views(),
        kv_fingerprint(worker.vllm_config, tensors, worker.num_gpu_blocks,
                       rank_in_replica(worker.rank, worker.world_size), worker.kv_cache_config),
        vllm_compat.prefix_caching_hash_algo(worker.vllm_config))
    return WorkerTiers([build_worker_half(spec, True, ctx) for spec in worker.config.tiers
                        if spec.name in worker.caps.tiers])


def _unique_tensors(kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> list[torch.Tensor]:
    """Flatten per-layer entries (a tensor, or a list/tuple of tensors for K/V, MLA,
    sparse indexers or state) and drop exact aliases (layers of HMA groups share
    tensors). Views that only overlap are kept here; their regions are merged by
    :func:`~kvoffload_hal.hal.layouts.describe_kv_caches`."""
    seen: set[tuple] = set()
    out = []
    for _, t in flatten_kv_caches(kv_caches):
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _rank() -> int:
    """This worker's global rank (0 outside a distributed run)."""
    from vllm.distributed.parallel_state import get_world_group

    try:
        return get_world_group().rank
    except AssertionError:  # no world group: not a distributed run
        return 0
