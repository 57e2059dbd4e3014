"""``LLM.reset_prefix_cache()`` empties the device prefix cache, not the CPU tier: the same
prompt right after is served from the CPU tier, with the same tokens, every time."""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text

pytestmark = pytest.mark.e2e

ATTEMPTS = 5


def test_a_prompt_after_a_prefix_cache_reset_comes_back_from_the_cpu_tier(tiny_model_dir):
    from vllm import SamplingParams

    llm = make_llm(EngineSpec(tiny_model_dir, num_gpu_blocks=24, offload=True))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    prompt = synthetic_text(180, seed=3)  # 5 full blocks of 32 tokens and a partial one
    try:
        cold = llm.generate([prompt], params, use_tqdm=False)[0]
        for attempt in range(ATTEMPTS):
            assert llm.reset_prefix_cache(), f"attempt {attempt}: reset refused"
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.num_cached_tokens == 5 * 32, f"attempt {attempt}"
            assert out.outputs[0].token_ids == cold.outputs[0].token_ids
        totals = scheduler_connector(llm).scheduler.totals.data
        assert totals["cpu_hit_tokens"] == ATTEMPTS * 5 * 32  # all from the CPU tier
    finally:
        close_llm(llm)
