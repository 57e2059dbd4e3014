"""A MoE model and an fp8 KV cache, offloaded on vLLM's CPU platform.

* **Qwen3-MoE** (4 experts, 2 per token), on one worker and with tensor parallel
  2: the tokens of the same engine without the connector, every repeated
  document served from the CPU tier. Expert parallelism is not run: vLLM 0.32's
  CPU fused-MoE kernel crashes the worker (SIGSEGV in ``cpu_fused_moe.cpp``) on
  the first forward pass with ``enable_expert_parallel``, with or without a
  connector.
* **fp8 KV cache** (``kv_cache_dtype="fp8"``) of a bf16 model: the tokens of the
  same fp8 engine without the connector, served from the CPU tier, and each
  block half the bytes of the bf16 KV cache's in the tier's accounting (bytes
  copied per block, and twice the blocks in the same ``cpu_bytes_to_use``).
"""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import serve_twice

pytestmark = pytest.mark.e2e

NUM_DOCS = 6
DEVICE_BLOCKS = 20  # three documents: the second pass finds none on the device
HIT = 5 * 32  # synthetic_text(180) is 181 tokens: 5 full blocks of 32
DOCS = [synthetic_text(180, seed=i) for i in range(NUM_DOCS)]


def check_served_from_cpu(baseline, outputs, totals) -> None:
    assert all(cached == 0 for cached, _ in baseline[NUM_DOCS:])  # the device forgot
    assert [tokens for _, tokens in outputs] == [tokens for _, tokens in baseline]
    assert [cached for cached, _ in outputs[NUM_DOCS:]] == [HIT] * NUM_DOCS
    assert totals["cpu_hit_tokens"] == NUM_DOCS * HIT
    assert totals["blocks_loaded"] == NUM_DOCS * HIT // 32


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.two_cores)])
def test_a_moe_model_is_token_identical_and_served_from_cpu(tiny_qwen3_moe_dir, tp,
                                                            monkeypatch):
    if tp > 1:  # vLLM's CPU workers bind OpenMP threads per rank: one core each
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = dict(num_gpu_blocks=DEVICE_BLOCKS, dtype="float32", tensor_parallel_size=tp)
    baseline, _ = serve_twice(EngineSpec(tiny_qwen3_moe_dir, **spec), DOCS)
    outputs, totals = serve_twice(EngineSpec(tiny_qwen3_moe_dir, offload=True, **spec), DOCS)
    check_served_from_cpu(baseline, outputs, totals)


def test_an_fp8_kv_cache_is_token_identical_and_half_the_bytes(tiny_model_dir):
    spec = dict(num_gpu_blocks=DEVICE_BLOCKS, dtype="bfloat16")
    baseline, _ = serve_twice(EngineSpec(tiny_model_dir, kv_cache_dtype="fp8", **spec), DOCS)
    outputs, fp8 = serve_twice(
        EngineSpec(tiny_model_dir, offload=True, kv_cache_dtype="fp8", **spec), DOCS)
    check_served_from_cpu(baseline, outputs, fp8)
    _, bf16 = serve_twice(EngineSpec(tiny_model_dir, offload=True, **spec), DOCS)
    per_block = {name: t["worker"]["bytes_stored"] / t["blocks_stored"] for name, t in
                 (("fp8", fp8), ("bf16", bf16))}
    assert per_block["bf16"] == 2 * 2 * 2 * 64 * 32 * 2  # K,V x 2 layers x 2 heads x 64 x 32
    assert per_block["fp8"] * 2 == per_block["bf16"]
    assert fp8["cpu_blocks"] == 2 * bf16["cpu_blocks"]
