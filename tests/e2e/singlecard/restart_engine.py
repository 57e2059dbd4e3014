"""One engine of the warm-restart tests: a user's script, run as its own process.

``python restart_engine.py MODEL DISK_PATH END [FLUSH_S]`` builds vLLM's ``LLM``
with the connector and a disk tier at ``DISK_PATH`` (its engine core in a process of
its own, vLLM's default; ``shutdown_flush_timeout_s`` ``FLUSH_S`` when given),
generates each document once, one request at a time, prints one line (``RESULT``
and JSON: each request's tokens and cached tokens) and ends as ``END`` says:

* ``exit``: at once, the interpreter exiting with the ``LLM`` still alive;
* ``delete``: the ``LLM`` deleted first;
* ``killed``: it waits to be killed (``SIGKILL`` to its whole session).

The last request asks for one token: it finishes in the step that computes its
prompt, so every block of it is stored and written after its ``generate`` returned,
in the engine's last steps. Nothing else: no step, wait or call a user would not
make. ``PYTHONHASHSEED``
comes from the caller (block hashes must match across processes).
"""

import gc
import json
import sys
import time

from disk_engine import BLOCK_BYTES, NUM_DOCS

from kvoffload_hal.demo.inprocess import EngineSpec
from kvoffload_hal.demo.tiny_model import synthetic_text

RESULT = "restart-engine: "


def prompts() -> list[str]:
    return [synthetic_text(180, seed=i) + " question" for i in range(NUM_DOCS)]


def main(model: str, disk_path: str, end: str, flush_s: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    extra = {"disk_path": disk_path, "disk_bytes_to_use": 100 * BLOCK_BYTES}
    if flush_s is not None:
        extra["shutdown_flush_timeout_s"] = float(flush_s)
    spec = EngineSpec(model, num_gpu_blocks=24, offload=True,
                      cpu_bytes_to_use=12 * BLOCK_BYTES,  # ~2 of the 8 documents
                      extra_config=extra)
    llm = LLM(**spec.llm_kwargs())
    docs = prompts()
    outs = [llm.generate([p], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=(
        1 if i == len(docs) - 1 else 12)), use_tqdm=False)[0] for i, p in enumerate(docs)]
    print(RESULT + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                               "cached": [o.num_cached_tokens or 0 for o in outs]}), flush=True)
    if end == "delete":
        del llm
        gc.collect()
    elif end == "killed":
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:5])
