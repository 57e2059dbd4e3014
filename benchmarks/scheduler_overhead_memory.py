"""Start-up time and steady-state memory of the scheduler side, by CPU-tier size.

For each size and eviction policy a fresh process builds vLLM's ``Scheduler``
with our connector (as ``scheduler_overhead.py`` does; the tier's capacity check
passes with ``allow_overcommit``, since the scheduler side allocates no KV bytes
and a tier of 1M blocks of 32 KiB is larger than most hosts) and times it: the
*start-up*. It then drives the CPU tier as store and load jobs do, to its steady
state: every block stored ``--steady-tiers`` times over (new hashes, 256 per
job; the tier full, then each store evicting one), and one job in four loading
16 blocks stored a little earlier. Reported, against the process before the
scheduler was built:

* RSS (``VmRSS``) after start-up and at steady state;
* with ``--trace`` (a second process: tracemalloc slows Python about twice),
  the Python memory allocated by the scheduler side at steady state, and the part
  held by the eviction modules themselves (``kvoffload_hal/scheduler/eviction*.py``).

With ``--repeats N`` each (size, policy) runs in N processes, the policies
alternating, and the median of each figure is reported: RSS moves by a few
hundred KiB between processes (allocator arenas), which at 10 000 blocks is tens
of bytes per block.

    python benchmarks/scheduler_overhead.py --memory [--memory-blocks 10000 100000 1000000]
                                             [--steady-tiers 2] [--trace] [--repeats 3]
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

EVICTION_MODULES = "*/kvoffload_hal/scheduler/eviction*.py"
STORE_JOB_BLOCKS = 256
LOAD_BLOCKS = 16
DEVICE_BLOCKS = 128  # the device pool: enough for one request of the maximum length
#: Figures of one process that vary between processes: the median over the repeats is kept.
MEDIAN_KEYS = ("startup_s", "rss_startup", "fill_s", "rss_steady", "rss_peak")


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def drive_to_steady_state(cpu, num_stores: int, seed: int = 0) -> None:
    """Store ``num_stores`` blocks under new hashes in jobs of 256 (evicting once
    the tier is full), and load 16 recently stored blocks every fourth job."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    rng = random.Random(seed)
    recent: deque[list] = deque(maxlen=8)
    for job, start in enumerate(range(0, num_stores, STORE_JOB_BLOCKS)):
        if job % 4 == 3 and recent:
            blocks = cpu.cached(recent[0])
            cpu.pin(blocks)
            cpu.record_load([b.block_id for b in blocks])
            cpu.unpin(blocks)
        count = min(STORE_JOB_BLOCKS, num_stores - start, cpu.num_free_blocks())
        blocks = cpu.allocate(count)
        hashes = [make_block_hash_with_group_id(rng.randbytes(32), 0) for _ in range(count)]
        cpu.publish(blocks, hashes)
        cpu.unpin(blocks)
        recent.append(hashes[:LOAD_BLOCKS])


def _eviction_bytes() -> int:
    import tracemalloc

    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, EVICTION_MODULES)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def measure_one(eviction: str, cpu_blocks: int, steady_tiers: float, trace: bool) -> dict:
    """One policy at one size, in this process (see the module docstring)."""
    import logging

    from scheduler_overhead_engine import MODEL, MODEL_DIR, make_scheduler, make_vllm_config

    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    logging.getLogger("vllm").setLevel(logging.WARNING)
    from scheduler_overhead_points import OURS

    config = make_vllm_config(build_tiny_llama(MODEL_DIR, MODEL), OURS, 16, eviction)
    if trace:
        import tracemalloc

        tracemalloc.start()
    base = rss_bytes()
    start = time.perf_counter()
    scheduler = make_scheduler(config, DEVICE_BLOCKS, cpu_blocks)
    startup_s = time.perf_counter() - start
    out = dict(eviction=eviction, cpu_blocks=cpu_blocks, startup_s=startup_s,
               rss_startup=rss_bytes() - base)
    cpu = scheduler.get_kv_connector().scheduler.cpu
    start = time.perf_counter()
    drive_to_steady_state(cpu, int(steady_tiers * cpu.num_blocks))
    out.update(fill_s=time.perf_counter() - start, rss_steady=rss_bytes() - base,
               rss_peak=rss_bytes("VmHWM") - base)
    if trace:
        import tracemalloc

        out.update(traced_steady=tracemalloc.get_traced_memory()[0],
                   eviction_traced=_eviction_bytes())
        tracemalloc.stop()
    return out


def run_child(eviction: str, cpu_blocks: int, steady_tiers: float, trace: bool) -> dict:
    """:func:`measure_one` in a fresh process, so RSS is this size's alone."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", eviction, str(cpu_blocks),
           str(steady_tiers)] + (["--trace"] if trace else [])
    # The script's own folder is on the child's path: it imports scheduler_overhead.
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_row(runs: list[dict]) -> dict:
    """One row from ``runs`` of one (size, policy): the median of each measured figure."""
    row = dict(runs[0], repeats=len(runs))
    for key in MEDIAN_KEYS:
        row[key] = statistics.median(r[key] for r in runs)
    return row


def measure_memory(sizes: list[int], evictions: list[str], steady_tiers: float,
                   trace: bool, repeats: int = 1) -> list[dict]:
    """Every (size, policy): RSS and start-up in ``repeats`` processes (the policies
    alternating; medians kept), tracemalloc in one more (it does not vary)."""
    rows = []
    for cpu_blocks in sizes:
        runs: dict[str, list[dict]] = {e: [] for e in evictions}
        for _ in range(repeats):
            for eviction in evictions:
                runs[eviction].append(run_child(eviction, cpu_blocks, steady_tiers, False))
                print(json.dumps(runs[eviction][-1]), flush=True)
        for eviction in evictions:
            row = median_row(runs[eviction])
            if trace:
                traced = run_child(eviction, cpu_blocks, steady_tiers, True)
                row.update(traced_steady=traced["traced_steady"],
                           eviction_traced=traced["eviction_traced"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _, _, policy, blocks, tiers, *rest = sys.argv
    print(json.dumps(measure_one(policy, int(blocks), float(tiers), rest == ["--trace"])))
