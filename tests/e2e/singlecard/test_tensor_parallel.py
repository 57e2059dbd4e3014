"""Tensor parallel 2 on vLLM's CPU platform: each rank holds and copies its half of every
block, a block counts as stored or loaded once both ranks reported it, and the outputs are
token-identical to the same TP=2 engine without the connector."""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text

pytestmark = pytest.mark.e2e

NUM_DOCS = 6


def _run(spec):
    from vllm import SamplingParams

    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    docs = [synthetic_text(180, seed=i) for i in range(NUM_DOCS)]
    try:
        outs = [llm.generate([d], params, use_tqdm=False)[0] for d in docs + docs]
        conn = scheduler_connector(llm)
        totals = dict(conn.scheduler.totals.data) if conn is not None else {}
        return [(o.num_cached_tokens, list(o.outputs[0].token_ids)) for o in outs], totals
    finally:
        close_llm(llm)


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
