"""Run vLLM in-process with and without the connector (the demo, benchmarks, tests).

One process, one engine at a time: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor keep the scheduler-side and worker-side connectors in this
process, where they can be inspected. :func:`close_llm` tears an engine down
fully (including vLLM's global KV-transfer group) so the next one starts clean.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Any

CONNECTOR = "HALOffloadConnector"


def set_inprocess_env() -> None:
    """Environment for a single-process engine on vLLM's CPU platform, no hub access."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class EngineSpec:
    model: str
    num_gpu_blocks: int
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    max_model_len: int = 512
    offload: bool = False
    cpu_bytes_to_use: int = 64 << 20
    lazy_offload: bool = False
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1  # > 1: worker processes ("mp" executor), one per rank
    pipeline_parallel_size: int = 1  # > 1: likewise
    max_num_batched_tokens: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = True  # False: torch.compile (slower start)
    speculative_config: dict[str, Any] | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
            block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager, seed=0,
            distributed_executor_backend="uni" if self.world_size == 1 else "mp",
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            num_gpu_blocks_override=self.num_gpu_blocks, max_num_seqs=self.max_num_seqs,
        )
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.speculative_config is not None:
            kwargs["speculative_config"] = dict(self.speculative_config)
        if self.offload:
            kwargs["kv_transfer_config"] = offload_transfer_config(
                cpu_bytes_to_use=self.cpu_bytes_to_use, lazy_offload=self.lazy_offload,
                **self.extra_config)
        return kwargs


def offload_transfer_config(**extra_config: Any):
    """``KVTransferConfig`` selecting this connector, with ``kv_connector_extra_config``.

    Failed loads are recomputed (``kv_load_failure_policy="recompute"``).
    """
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR,
                            kv_connector_module_path="kvoffload_hal.connector",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra_config)


def make_llm(spec: EngineSpec):
    set_inprocess_env()
    from vllm import LLM

    return LLM(**spec.llm_kwargs())


def scheduler_connector(llm):
    """The scheduler-role HALOffloadConnector of an in-process engine, or None."""
    return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()


def close_llm(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
