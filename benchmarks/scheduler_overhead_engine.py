"""The scheduler-overhead benchmarks' engine: vLLM's real v1 ``Scheduler`` built with
either connector in the SCHEDULER role over a tiny Llama's config (no model runs).
``scheduler_overhead.py`` times it; ``scheduler_overhead_memory.py`` weighs it."""

from __future__ import annotations

import os

from scheduler_overhead_points import OURS, UPSTREAM

from kvoffload_hal.demo.inprocess import set_inprocess_env
from kvoffload_hal.demo.tiny_model import TinyModelSpec
from kvoffload_hal.eviction.registry import DEFAULT_EVICTION

MODEL_DIR = os.path.expanduser("~/.cache/kvoffload_hal/scheduler_bench_llama")
MODEL = TinyModelSpec()  # only its config is read: 2 layers, 2 KV heads, head_dim 64
BLOCK_SIZE = 32
MAX_NUM_BATCHED_TOKENS = 8192

DISK_TIER_FACTOR = 8  # a disk tier (--disk-tier) of this many CPU tiers

CONNECTORS = {
    OURS: dict(kv_connector=OURS, kv_connector_module_path="kvoffload_hal.connector"),
    UPSTREAM: dict(kv_connector=UPSTREAM),
}


def make_vllm_config(model: str, connector: str, max_num_seqs: int,
                     eviction: str = DEFAULT_EVICTION, disk_path: str | None = None):
    """``disk_path`` (ours): a disk tier there behind the CPU tier (see make_scheduler)."""
    set_inprocess_env()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model, dtype="bfloat16", block_size=BLOCK_SIZE, enable_prefix_caching=True,
        max_model_len=2048, max_num_seqs=max_num_seqs, enforce_eager=True,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, async_scheduling=False,
        # Asynchronous loads for both: the same protocol, and the one used on devices
        # (on the CPU platform ours defaults to synchronous loads).
        kv_transfer_config=KVTransferConfig(
            kv_role="kv_both", **CONNECTORS[connector],
            # allow_overcommit: the scheduler side allocates no KV bytes, and a tier
            # of 1M blocks of 32 KiB (32 GiB) is more than this 24 GiB host has.
            kv_connector_extra_config=({"load_mode": "async", "eviction": eviction,
                                        "allow_overcommit": True}
                                       if connector == "HALOffloadConnector" else {})),
    )
    if disk_path is not None and connector == "HALOffloadConnector":
        args.kv_transfer_config.kv_connector_extra_config["disk_path"] = disk_path
    config = args.create_engine_config()
    # The engine core resolves the layout from the attention backend; no backend runs here.
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def make_scheduler(vllm_config, num_gpu_blocks: int, num_cpu_blocks: int):
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvoffload_hal.vllm_compat import get_kv_cache_configs

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=MODEL.num_key_value_heads,
                             head_size=MODEL.head_dim, dtype=torch.bfloat16)
    layers = {f"model.layers.{i}.self_attn.attn": spec for i in range(MODEL.num_hidden_layers)}
    bytes_per_block = spec.page_size_bytes * MODEL.num_hidden_layers
    vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks
    kv_cache_config = get_kv_cache_configs(
        vllm_config, [layers], [num_gpu_blocks * bytes_per_block])[0]
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    # Both connectors size the CPU tier as bytes // (device bytes per block).
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["cpu_bytes_to_use"] = num_cpu_blocks * bytes_per_block
    if "disk_path" in extra:  # no block is written: the workers' reports are faked
        extra["disk_bytes_to_use"] = DISK_TIER_FACTOR * num_cpu_blocks * bytes_per_block
    return Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE)
