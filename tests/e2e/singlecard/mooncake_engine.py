"""One engine of the Mooncake tests, run as its own process.

``python mooncake_engine.py MODEL MASTER SYNC_DIR NAME ROLE`` with ROLE

* ``writer``: serves the documents (cold), waits until its blocks are in the
  store, says ``NAME.stored``, then waits for the readers (its memory is part
  of the store's pool);
* ``reader``: waits for the writer, serves the documents (``warm``: whatever
  the store gives), then its own cold run (no prefix cache read at all);

then every engine waits for ``master.killed`` (the test kills the master),
forgets its prefix caches and serves the documents again (``after_kill``).
Prints one JSON line: tokens of each pass, cached tokens, the connector's
counters after each stage, and the after-kill pass's seconds.
"""

import json
import os
import sys
import time

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text

NUM_DOCS = 3
BLOCK_BYTES = 2 * 32 * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
WAIT_S = 400


def wait_for(sync_dir: str, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(sync_dir, name)):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not appear")
        time.sleep(0.05)


def say(sync_dir: str, name: str) -> None:
    open(os.path.join(sync_dir, name), "w").close()


def drain(llm, params) -> None:
    """Step until the connector has nothing in flight (spills written to the store)."""
    connector = scheduler_connector(llm)
    for _ in range(200):
        if not connector.scheduler.has_pending_transfers():
            return
        llm.generate(["drain"], params, use_tqdm=False)
        time.sleep(0.02)
    raise SystemExit("spills still in flight")


def main(model: str, master: str, sync_dir: str, name: str, role: str) -> None:
    from vllm import SamplingParams

    spec = EngineSpec(model, num_gpu_blocks=24, offload=True, cpu_bytes_to_use=24 * BLOCK_BYTES,
                      extra_config={"mooncake_master": master,
                                    "mooncake_segment_bytes": 32 << 20,
                                    "mooncake_buffer_bytes": 16 << 20,
                                    "mooncake_timeout_s": 2.0})
    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                          skip_reading_prefix_cache=True)
    docs = [synthetic_text(180, seed=100 + i) for i in range(NUM_DOCS)]
    totals = scheduler_connector(llm).scheduler.totals.data
    out: dict = {}

    def serve(stage: str, sampling) -> None:
        outs = [llm.generate([d], sampling, use_tqdm=False)[0] for d in docs]
        out[stage] = [list(o.outputs[0].token_ids) for o in outs]
        out[f"{stage}_cached"] = [o.num_cached_tokens for o in outs]
        out["prompt_tokens"] = [len(o.prompt_token_ids) for o in outs]
        drain(llm, params)
        out[f"{stage}_totals"] = dict(totals)

    try:
        if role == "writer":
            serve("cold", params)
            say(sync_dir, f"{name}.stored")
            for reader in ("b", "c"):
                wait_for(sync_dir, f"{reader}.read")
        else:
            wait_for(sync_dir, "a.stored")
            serve("warm", params)
            llm.reset_prefix_cache(reset_connector=True)
            serve("cold", cold)
            say(sync_dir, f"{name}.read")
        wait_for(sync_dir, "master.killed")
        llm.reset_prefix_cache(reset_connector=True)
        started = time.monotonic()
        serve("after_kill", params)
        out["after_kill_s"] = time.monotonic() - started
        print(json.dumps(out))
    finally:
        close_llm(llm)


if __name__ == "__main__":
    main(*sys.argv[1:6])
