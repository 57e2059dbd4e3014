"""Tensor parallel 2 on vLLM's CPU platform: each rank holds and copies its half of every
block, a block counts as stored or loaded once both ranks reported it, and the outputs are
token-identical to the same TP=2 engine without the connector."""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import serve_twice

pytestmark = [pytest.mark.e2e, pytest.mark.two_cores]

NUM_DOCS = 6


def _run(spec):
    return serve_twice(spec, [synthetic_text(180, seed=i) for i in range(NUM_DOCS)])


def test_tensor_parallel_2_is_token_identical_and_served_from_cpu(tiny_model_dir, monkeypatch):
    # vLLM's CPU workers bind OpenMP threads per rank: one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = dict(num_gpu_blocks=20, tensor_parallel_size=2, dtype="float32")
    baseline, _ = _run(EngineSpec(tiny_model_dir, **spec))
    assert all(cached == 0 for cached, _ in baseline[NUM_DOCS:])  # the device really forgot
    outputs, totals = _run(EngineSpec(tiny_model_dir, offload=True, **spec))
    assert [tokens for _, tokens in outputs] == [tokens for _, tokens in baseline]
    assert all(cached == 5 * 32 for cached, _ in outputs[NUM_DOCS:])
    assert totals["cpu_hit_tokens"] == NUM_DOCS * 5 * 32
    assert totals["blocks_loaded"] == NUM_DOCS * 5  # each counted once both ranks loaded it
