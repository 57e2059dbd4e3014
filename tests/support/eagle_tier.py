"""A CPU tier whose coordinator follows an EAGLE drafter's rule (a hit drops its last
block), built beside a harness engine's own CPU tier."""

from __future__ import annotations

BS = 16


def eagle_cpu_tier(engine, model_dir: str, eagle_dir: str, num_blocks: int = 8):
    from vllm.engine.arg_utils import EngineArgs

    from kvoffload_hal.scheduler.cpu_tier import CpuTier

    config = EngineArgs(
        model=model_dir, block_size=BS, enable_prefix_caching=True, enforce_eager=True,
        max_model_len=2048, speculative_config={
            "method": "eagle", "model": eagle_dir, "num_speculative_tokens": 1},
    ).create_engine_config()
    return CpuTier(config, engine.kv_cache_config, num_blocks, BS, BS)
