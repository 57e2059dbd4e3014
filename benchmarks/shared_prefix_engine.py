"""The real-engine part of ``shared_prefix.py``: vLLM's ``LLM`` on the CPU.

The tiny random-weight Llama, the connector with the ``cpu`` backend and
``load_mode: async`` (the load path of every device backend). For each N, a
new prefix is read once (its blocks reach the CPU tier), the device prefix
cache is emptied, and N prompts on that prefix are generated in one call with
one output token each: the wall time of that call is the time to the last
first token.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

PREFIX_BLOCKS = 8


def make_engine():
    from kvoffload_hal.demo.inprocess import EngineSpec, make_llm
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(str(Path(tempfile.gettempdir()) / "kvoffload-bench-llama"))
    spec = EngineSpec(model=model, num_gpu_blocks=(PREFIX_BLOCKS + 2) * 16 + 16,
                      max_model_len=PREFIX_BLOCKS * 32 + 64, offload=True,
                      cpu_bytes_to_use=256 << 20, extra_config={"load_mode": "async"})
    llm = make_llm(spec)
    _case(llm, spec.block_size, 2, seed=-1)  # warm-up: the first forward passes are slow
    return llm, spec.block_size


def prompts(llm, block_size: int, n: int, repeats: int = 3) -> dict:
    """``n`` prompts on a prefix the device no longer holds, ``repeats`` times
    (a new prefix each time): the median wall time, the copies of the last."""
    rows = [_case(llm, block_size, n, 1000 * r + n) for r in range(repeats)]
    row = dict(rows[-1])
    row["seconds_first"] = sorted(r["seconds_first"] for r in rows)[len(rows) // 2]
    return row


def _case(llm, block_size: int, n: int, seed: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvoffload_hal.demo.inprocess import scheduler_connector

    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefix = [rng.randrange(10, vocab) for _ in range(PREFIX_BLOCKS * block_size)]
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=prefix + [7])], greedy, use_tqdm=False)
    _forget_device_prefixes(llm)
    before = dict(scheduler_connector(llm).scheduler.totals.data)
    batch = [TokensPrompt(prompt_token_ids=prefix + [10 + i, 11]) for i in range(n)]
    start = time.perf_counter()
    llm.generate(batch, greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = scheduler_connector(llm).scheduler.totals.data
    return {"blocks": after.get("blocks_loaded", 0) - before.get("blocks_loaded", 0),
            "waits": after.get("shared_load_waits", 0) - before.get("shared_load_waits", 0),
            "seconds_first": seconds}


def _forget_device_prefixes(llm, max_steps: int = 100) -> None:
    """Empty the device prefix cache once the last stores let go of their blocks."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    for _ in range(max_steps):
        if manager.reset_prefix_cache():
            return
        llm.llm_engine.step()  # an idle step: collects the stores in flight
        time.sleep(0.01)
    raise RuntimeError("the device prefix cache could not be emptied")
