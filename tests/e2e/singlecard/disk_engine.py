"""The engine the warm-restart and shared-disk engines run (each in its own process).

A tiny model's engine with a CPU tier of about 2 of the :data:`NUM_DOCS` documents
and a disk tier at ``disk_path`` holding them all, and greedy sampling of 12 tokens.
"""

from kvoffload_hal.demo.inprocess import EngineSpec, make_llm

NUM_DOCS = 8
BLOCK_BYTES = 2 * 32 * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16


def disk_tier_llm(model: str, disk_path: str):
    """``(llm, sampling params)``."""
    from vllm import SamplingParams

    spec = EngineSpec(model, num_gpu_blocks=24, offload=True,
                      cpu_bytes_to_use=12 * BLOCK_BYTES,  # ~2 of the 8 documents
                      extra_config={"disk_path": disk_path,
                                    "disk_bytes_to_use": 100 * BLOCK_BYTES})
    return make_llm(spec), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
