"""``HALOffloadConnector``: vLLM KV connector offloading KV blocks to CPU memory.

A thin façade: the scheduler role delegates to
:class:`~kvoffload_hal.scheduler.core.OffloadScheduler` (no device code), the worker
role to :class:`~kvoffload_hal.worker.core.OffloadWorker` (copies through the HAL).
Use it with ``kv_connector="HALOffloadConnector"`` (registered by this package's
``vllm.general_plugins`` entry point) or with
``kv_connector_module_path="kvoffload_hal.connector"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvoffload_hal import vllm_compat
from kvoffload_hal.capabilities import sleep_refusal
from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.exit_flush import ExitFlush
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import OffloadHandshake
from kvoffload_hal.metrics import OffloadPromMetrics, OffloadStats
from kvoffload_hal.scheduler.core import OffloadScheduler
from kvoffload_hal.worker.core import OffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class HALOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("HALOffloadConnector needs the KVCacheConfig (vLLM >= 0.23)")
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "HALOffloadConnector needs prefix caching: set enable_prefix_caching=True "
                "(--enable-prefix-caching); the CPU tier is looked up by block hash"
            )
        config = OffloadConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = OffloadScheduler(vllm_config, kv_cache_config, config)
            caps = self.scheduler.caps
            self.exit_flush = ExitFlush.for_engine(config.shutdown_flush_timeout_s,
                                                   caps.secondary_tier, caps.vllm)
            # Every hit is loaded from host memory (blocks promoted from disk reach the
            # device through the CPU tier too), where vLLM counts hits by source.
            self._cache_hit_source = caps.vllm.hit_source()
        else:
            self.worker = OffloadWorker(vllm_config, kv_cache_config, config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33 asks (older releases have no sleep with connectors).

        Supported with the CPU and disk tiers: the worker drains its copies and
        rebinds the KV cache's addresses on wake-up (``unregister_kv_caches``,
        ``restore_kv_caches``), and vLLM resets the connector's cache before a
        sleep, so no KV computed with the old weights is served after it.
        Refused with a tier shared across instances (:func:`sleep_refusal`).
        """
        config = OffloadConfig.from_extra_config(kv_transfer_config.kv_connector_extra_config)
        refusal = sleep_refusal(config)
        if refusal is not None:
            logger.warning("%s", refusal)
        return refusal is None

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache (vLLM >= 0.33 asks): a store cut short by a preemption
        is a future miss, and the device blocks a copy reads stay pinned by its job
        whatever vLLM frees, so a preempted request's output need not be dropped."""
        return False

    # ---------------------------------------------------------- scheduler
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        meta.release_requests = self.exit_flush.take_released(
            self.scheduler.has_pending_transfers())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        delayed, params = self.scheduler.request_finished(request, block_ids)
        # The last request may be held for the last writes (exit_flush.py).
        return self.exit_flush.on_finished(request.request_id, delayed,
                                           self.scheduler.has_pending_transfers()), params

    def has_pending_block_frees(self) -> bool:
        """vLLM >= 0.33: device blocks that only a store in flight holds return to
        the free pool when it ends; the scheduler then waits for them instead of
        preempting a running request."""
        return self.scheduler.has_pending_block_frees()

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        """Keeps an idle engine stepping until the last stores and spills are confirmed,
        for at most ``shutdown_flush_timeout_s`` after its last request finished
        (exit_flush.py); the engine core also asks while it shuts down.

        Until a step collects a store's result, its device blocks stay pinned and
        its CPU copy unpublished. vLLM < 0.32 never asks: there the last request is
        held instead, with a secondary tier; without one the last stores of an
        engine that goes idle are confirmed by its next step (the next request).
        That is safe: the pinned device blocks keep their hashes, so the device
        prefix cache still serves them meanwhile, and nothing unconfirmed is ever
        loaded from the CPU tier.
        """
        return self.scheduler is not None and self.exit_flush.steps_for_writes(
            self.scheduler.has_pending_transfers())

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]
                                             ) -> None:
        """Every rank's :class:`OffloadHandshake` (vLLM's KV connector handshake), keyed
        by (PP rank, TP rank), taken after the workers registered their KV caches and
        before the first request."""
        self.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        if self.scheduler is None:
            return
        handshakes = [h for h in metadata.values() if isinstance(h, OffloadHandshake)]
        self._fit_cpu_tier_to_ranks(h.num_cpu_blocks for h in handshakes if h.num_cpu_blocks)
        for handshake in handshakes:  # a restarted tier's blocks: the first request finds them
            self.scheduler.tiers.on_found(handshake.tier_found, handshake.tier_scans_done)

    def _fit_cpu_tier_to_ranks(self, counts: Iterable[int]) -> None:
        """The scheduler sized its CPU tier from the first pipeline stage's layers
        (vLLM gives it that rank's KV cache config); a stage with more layers (an
        uneven split, a draft model's layers on the last stage) holds fewer blocks
        in its share of ``cpu_bytes_to_use``. Use no block id that rank lacks."""
        counts = list(counts)
        cpu = self.scheduler.cpu if self.scheduler is not None else None
        if cpu is None or not counts or min(counts) >= cpu.num_blocks:
            return
        logger.info("HALOffloadConnector: a rank holds %d CPU blocks, fewer than the %d sized "
                    "from the first pipeline stage's layers: the CPU tier uses %d",
                    min(counts), cpu.num_blocks, min(counts))
        cpu.keep_below(min(counts))

    # ------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before sleep frees the KV cache: copies drained, none launched."""
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33, after wake-up: the KV cache's addresses bound anew."""
        self.worker.restore_kv_caches()

    def finish_forward(self) -> None:
        """vLLM >= 0.33: the step's forward pass is enqueued; its copies fence on it."""
        self.worker.finish_forward()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``KVConnectorTransferResults`` (vLLM >= 0.32; older releases call get_finished)."""
        sending, recving, failed = self.worker.get_finished(finished_req_ids)
        return vllm_compat.transfer_results(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker.build_connector_worker_meta()

    def get_handshake_metadata(self) -> OffloadHandshake | None:
        """Once, at start-up: this rank's CPU blocks, and the blocks its tier kept from
        before a restart."""
        return self.worker.handshake() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv()  # synchronous loads; asynchronous ones go in get_finished

    # Copies are whole-step batches: the per-layer hooks have nothing to do.

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # ------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> OffloadStats | None:
        side = self.scheduler or self.worker
        return side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
