"""N requests on one prefix that left the device: how many times is it copied back?

Two parts, both in one run:

* **Engine harness** (vLLM's real scheduler, both connector roles, a fake model
  checking every KV read) with the ``bandwidth-bound`` copy double: loads are
  asynchronous, take time in proportion to their bytes and queue on one copy
  thread, as on a saturated link. N requests arrive together, or one per step
  (staggered). Each case runs with the connector as it is and with a request
  never waiting for another's load (``without sharing``: what every request
  did before), so the two columns are side by side.
* **A real engine** (vLLM's ``LLM`` on the CPU, the tiny random-weight Llama,
  the ``cpu`` backend with ``load_mode: async``): N prompts sharing a prefix
  that was pushed out of the device cache, in one ``generate`` call.

Reported: blocks and bytes copied CPU->device, most device blocks in use,
steps and wall time to the first token.

    python benchmarks/shared_prefix.py [--out-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the engine harness and the backend doubles
sys.path.insert(0, str(ROOT / "benchmarks"))

from shared_prefix_report import write_report  # noqa: E402

PREFIX_BLOCKS, BS = 8, 16
COUNTS = (1, 4, 16, 64)


@contextlib.contextmanager
def without_sharing(enabled: bool):
    """Every request loads its own copy (the connector before one copy per block)."""
    from kvoffload_hal.scheduler.load_jobs import LoadJobs

    if not enabled:
        yield
        return
    original = LoadJobs.wait_for_shared_load
    LoadJobs.wait_for_shared_load = lambda self, req_id, hit: False
    try:
        yield
    finally:
        LoadJobs.wait_for_shared_load = original


def harness_case(model_dir: str, n: int, staggered: bool, sharing: bool) -> dict:
    import os

    from support import backend_doubles  # noqa: F401 (registers the doubles)
    from support.engine_harness import Engine

    os.environ["KVOFFLOAD_HAL_BACKEND"] = "bandwidth-bound"
    engine = Engine(model_dir, block_size=BS, num_gpu_blocks=(PREFIX_BLOCKS + 2) * n + 16,
                    cpu_blocks=64, max_num_seqs=max(n, 8), max_num_batched_tokens=4096)
    rng = random.Random(n)
    prefix = [rng.randrange(1, 90) for _ in range(PREFIX_BLOCKS * BS)]
    try:
        engine.add("seed", prefix + [1])
        engine.run_until_done()
        engine.drain()
        engine.scheduler.kv_cache_manager.reset_prefix_cache()  # the prefix left the device
        with without_sharing(not sharing):
            return _run_case(engine, prefix, n, staggered)
    finally:
        engine.close()


def _run_case(engine, prefix: list[int], n: int, staggered: bool) -> dict:
    pool = engine.scheduler.kv_cache_manager.block_pool
    arrived: dict[str, tuple[int, float]] = {}  # request -> (step, time) of its arrival
    first: dict[str, tuple[int, float]] = {}  # request -> (steps, seconds) to its first token
    peak = 0
    pending = [f"r{i}" for i in range(n)]
    while engine.scheduler.has_requests() or pending:
        for _ in range(1 if staggered else len(pending)):
            if pending:
                req_id = pending.pop(0)
                engine.add(req_id, prefix + [2 + int(req_id[1:]) % 80, 3])
                arrived[req_id] = (engine.steps, time.perf_counter())
        engine.step()
        peak = max(peak, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        now = time.perf_counter()
        first.update((r, (engine.steps - s, now - t)) for r, (s, t) in arrived.items()
                     if r not in first and engine.outputs[r])
    engine.drain()
    totals = engine.offload.totals.data
    return {"blocks": totals.get("blocks_loaded", 0),
            "bytes": engine.worker.worker.totals.data.get("bytes_loaded", 0),
            "device_blocks": peak,
            "steps_first": max(s for s, _ in first.values()),
            "steps_behind": max(s + arrived[r][0] for r, (s, _) in first.items())
            - min(s + arrived[r][0] for r, (s, _) in first.items()),
            "seconds_first": max(t for _, t in first.values()),
            "waits": totals.get("shared_load_waits", 0)}


def harness_rows(model_dir: str, repeats: int = 3) -> list[dict]:
    """Every case ``repeats`` times: the median of its times and step counts (the
    steps of an asynchronous copy depend on how long each step takes)."""
    rows = []
    for staggered in (False, True):
        for n in COUNTS:
            for sharing in (True, False):
                runs = [harness_case(model_dir, n, staggered, sharing) for _ in range(repeats)]
                row = {key: sorted(r[key] for r in runs)[repeats // 2] for key in runs[0]}
                row.update(n=n, arrival="one per step" if staggered else "together",
                           sharing=sharing)
                print(row, flush=True)
                rows.append(row)
    return rows


def engine_rows(counts=(1, 4, 16)) -> list[dict]:
    """The real engine: tiny Llama, CPU backend, asynchronous loads."""
    from shared_prefix_engine import make_engine, prompts

    from kvoffload_hal.demo.inprocess import close_llm

    rows = []
    for sharing in (False, True, False, True):  # twice each, alternating
        with without_sharing(not sharing):
            llm, block_size = make_engine()
            try:
                for n in counts:
                    row = prompts(llm, block_size, n)
                    row.update(n=n, sharing=sharing)
                    print(row, flush=True)
                    rows.append(row)
            finally:
                close_llm(llm)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-harness", action="store_true")
    args = parser.parse_args()
    from kvoffload_hal.demo.inprocess import set_inprocess_env
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    set_inprocess_env()
    model_dir = build_tiny_llama(str(Path(tempfile.gettempdir()) / "kvoffload-bench-llama"))
    harness = [] if args.skip_harness else harness_rows(model_dir)
    engine = [] if args.skip_engine else engine_rows()
    write_report(harness, engine, args.out_dir)


if __name__ == "__main__":
    main()
