"""One engine of the warm-restart tests, run as its own process.

``python restart_engine.py MODEL DISK_PATH STAGE`` serves the documents once with
a disk tier at ``DISK_PATH`` and prints one JSON line: each request's tokens and
cached tokens, and the blocks promoted from disk. ``STAGE``:

* ``write``: serve, wait for the last spills, stop cleanly;
* ``write-then-wait``: serve, then print and wait to be killed (``SIGKILL``),
  spills possibly still in flight;
* ``read``: wait until the index is rebuilt from the files a stopped server
  kept, then serve.

``PYTHONHASHSEED`` comes from the caller (block hashes must match across
processes), and ``PYTHONPATH`` holds ``tests/`` (``support.engines``).
"""

import json
import sys
import time

from disk_engine import NUM_DOCS, disk_tier_llm

from kvoffload_hal.demo.inprocess import close_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import drain_transfers


def prompts() -> list[str]:
    return [synthetic_text(180, seed=i) + " question" for i in range(NUM_DOCS)]


def main(model: str, disk_path: str, stage: str) -> None:
    llm, params = disk_tier_llm(model, disk_path)
    try:
        if stage == "read":
            assert drain_transfers(llm, timeout_s=120)  # the index is rebuilt
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts()]
        if stage == "write":
            assert drain_transfers(llm, timeout_s=120)
        totals = scheduler_connector(llm).scheduler.totals.data
        print(json.dumps({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "blocks_from_disk": totals.get("blocks_from_disk", 0),
            "blocks_to_disk": totals.get("blocks_to_disk", 0),
        }), flush=True)
        if stage == "write-then-wait":
            time.sleep(600)  # killed here
    finally:
        close_llm(llm)


if __name__ == "__main__":
    main(*sys.argv[1:4])
