"""One engine of the speculative-decoding tests, run as a process of its own.

``python spec_engine.py MODEL METHOD [--draft PATH] [--offload] [--corrupt-from N]``
serves :data:`NUM_DOCS` documents one by one, then each again once the device
forgot it, and prints one JSON line: for each pass, every request's tokens and
cached prompt tokens and the drafts proposed and accepted in that pass (vLLM's
speculative-decoding counters); with ``--offload``, the connector's counters
and the CPU blocks the scheduler and the worker each hold. ``--corrupt-from N``
loads through a backend that damages what it loads into the KV regions from
``N`` on (a draft model's layers come after the target's). Where this vLLM
cannot run speculative decoding on CPU at all (0.23: its rejection sampler
passes its CPU kernel a parameter that kernel lacks), it prints
``{"cannot_run": reason}``.

A process of its own: on vLLM 0.32's CPU platform an engine fails to start in a
process where an ``ngram`` engine ran before. Each engine's start rebinds
Triton kernels to CPU code by scanning every loaded module, and trips on the
``llvmlite`` binding that the ngram proposer's numba loads
(``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``, in
``vllm/triton_utils/dispatcher.py``), with or without a connector.
"""

import argparse
import json
import os
import sys

from kvoffload_hal.demo.inprocess import (
    EngineSpec,
    close_llm,
    scheduler_connector,
    set_inprocess_env,
)
from kvoffload_hal.demo.tiny_model import synthetic_text

NUM_DOCS = 4
DEVICE_BLOCKS = 14  # two documents (6 blocks each): the second pass finds none on the device
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def document(seed: int) -> str:
    """A passage said three times (181 tokens): the ngram proposer finds the
    continuation of what was just generated earlier in the prompt."""
    return " ".join([synthetic_text(60, seed=seed)] * 3)


def speculative_config(method: str, model: str, draft: str | None) -> dict:
    if method == "ngram":
        # One token of context is enough to propose: a random model's continuation
        # rarely repeats longer runs of the prompt.
        return dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                    prompt_lookup_max=3)
    return dict(method=method, model=draft or model, num_speculative_tokens=3)


def spec_counters(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    values = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    return {k: values.get(f"vllm:spec_decode_{k}") or 0 for k in COUNTERS}


def run(args) -> dict:
    from vllm import LLM, SamplingParams

    from support.engines import drain_transfers, worker_connector

    spec = EngineSpec(args.model, num_gpu_blocks=DEVICE_BLOCKS, dtype="float32", max_model_len=256,
                      offload=args.offload,
                      speculative_config=speculative_config(args.method, args.model, args.draft))
    llm = LLM(**spec.llm_kwargs(), disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    docs = [document(i) for i in range(NUM_DOCS)]
    try:
        passes = []
        for _ in range(2):
            before = spec_counters(llm)
            outs = [llm.generate([d], params, use_tqdm=False)[0] for d in docs]
            after = spec_counters(llm)
            passes.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                           "cached": [o.num_cached_tokens for o in outs],
                           **{k: after[k] - before[k] for k in COUNTERS}})
        result = {"passes": passes}
        conn = scheduler_connector(llm)
        if conn is not None:
            assert drain_transfers(llm)
            result.update(totals=dict(conn.scheduler.totals.data),
                          scheduler_cpu_blocks=conn.scheduler.cpu.num_blocks,
                          worker_cpu_blocks=worker_connector().worker.num_cpu_blocks)
        return result
    finally:
        close_llm(llm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("method")
    parser.add_argument("--draft")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--corrupt-from", type=int)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    set_inprocess_env()
    if args.corrupt_from is not None:
        from kvoffload_hal.hal import register_backend

        register_backend("tail-corrupting-cpu", "corrupting_backend:TailCorruptingCpuBackend",
                         synchronous_compute=True)
        os.environ["KVOFFLOAD_HAL_BACKEND"] = "tail-corrupting-cpu"
        os.environ["KVOFFLOAD_TEST_CORRUPT_FROM"] = str(args.corrupt_from)
    try:
        outcome = run(args)
    except TypeError as exc:  # vLLM 0.23: its CPU kernel lacks a parameter the sampler passes
        if "USE_FP64_GUMBEL" not in str(exc):
            raise
        outcome = {"cannot_run": "this vLLM's CPU platform cannot run speculative decoding, "
                                 f"with or without a connector ({exc})"}
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
