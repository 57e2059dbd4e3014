"""One engine of the shared-disk test, run as its own process.

``python shared_disk_engine.py MODEL DISK_PATH SYNC_DIR NAME PEER`` serves the
documents twice with a disk tier at ``DISK_PATH``, meeting its peer (the other
engine, on the same ``DISK_PATH``) before each pass, and prints one JSON line:
the tokens of both passes, the cached tokens of the second and the blocks read
back from disk.
"""

import json
import os
import sys
import time

from disk_engine import NUM_DOCS, disk_tier_llm

from kvoffload_hal.demo.inprocess import close_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text


def meet(sync_dir: str, name: str, peer: str, stage: str, timeout_s: float = 240) -> None:
    open(os.path.join(sync_dir, f"{name}.{stage}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(sync_dir, f"{peer}.{stage}")):
        if time.monotonic() > deadline:
            raise SystemExit(f"{peer} did not reach {stage}")
        time.sleep(0.05)


def main(model: str, disk_path: str, sync_dir: str, name: str, peer: str) -> None:
    llm, params = disk_tier_llm(model, disk_path)
    docs = [synthetic_text(180, seed=i) for i in range(NUM_DOCS)]
    passes = []
    try:
        for stage in ("first", "second"):
            meet(sync_dir, name, peer, stage)  # both engines write before either reads
            outs = [llm.generate([d], params, use_tqdm=False)[0] for d in docs]
            passes.append(outs)
        totals = scheduler_connector(llm).scheduler.totals.data
        print(json.dumps({
            "first": [list(o.outputs[0].token_ids) for o in passes[0]],
            "second": [list(o.outputs[0].token_ids) for o in passes[1]],
            "cached": [o.num_cached_tokens for o in passes[1]],
            "blocks_from_disk": totals["blocks_from_disk"],
        }))
    finally:
        close_llm(llm)


if __name__ == "__main__":
    main(*sys.argv[1:6])
