"""Scheduler-side cost of HALOffloadConnector against vLLM's SimpleCPUOffloadConnector.

No model runs. vLLM's real v1 ``Scheduler`` (with its ``KVCacheManager`` and
device ``BlockPool``) builds each connector in the SCHEDULER role and replays
one synthetic request trace, identical for both connectors:

* a closed loop of ``R`` live requests: one arrives whenever one finishes;
* prompts share prefixes: ``max(4, R)`` documents of 256 tokens, each request
  one document plus a unique 32-128 token question, 16-96 output tokens;
* the device pool holds half of what the live requests need, so vLLM evicts
  prefixes (later served from the CPU tier) and preempts running requests.

A fake model runner answers every step: one sampled token for each request whose
prompt is complete, and a ``KVConnectorOutput`` that completes in the same step
every load (``finished_recving``) and store (worker metadata) the connector
asked for, as a synchronous copy backend would.

Only the connector's scheduler calls are timed (``perf_counter`` around
``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished*``,
``take_events``, ``get_kv_connector_stats``); vLLM's own scheduling is not.
Prints a table and writes ``docs/benchmarks/scheduler_overhead.{md,png}``.

``--disk-tier`` runs ours with a disk tier behind the CPU tier (upstream has none): the
fake worker reports its jobs and staged rounds done, and no file is written.
``--prefill`` starts our CPU tier full of blocks no request reads (stored as
store jobs publish them): with ``--compare-eviction`` it compares the eviction
policies on a full tier, per step, in CPU-tier loads and in the time spent in the
policy's own calls (``Eviction.on_stored`` and the rest, timed inside the
connector's). On a busy host, ``--keep median`` reports each point's median run
instead of its fastest, and the table adds the median of the per-round ratios
(the policies run back to back in each round). ``--memory`` measures
instead the start-up time and steady-state memory of the scheduler side by
CPU-tier size (``scheduler_overhead_memory.py``; writes
``docs/benchmarks/scheduler_overhead_memory.md``).

    python benchmarks/scheduler_overhead.py [--cpu-blocks 1000 10000 100000]
                                            [--requests 10 100 1000] [--steps 150] [--repeats 3]
                                            [--prefill] [--compare-eviction] [--quick]
                                            [--disk-tier]
                                            [--keep median] [--warmup-steps 0] [--tag NAME]
    python benchmarks/scheduler_overhead.py --memory [--memory-blocks 10000 100000 1000000 4000000]
                                            [--trace] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from scheduler_overhead_engine import (
    BLOCK_SIZE,
    CONNECTORS,
    DISK_TIER_FACTOR,
    MAX_NUM_BATCHED_TOKENS,
    MODEL,
    MODEL_DIR,
    make_scheduler,
    make_vllm_config,
)
from scheduler_overhead_points import OURS, Point, Timer
from scheduler_overhead_report import (
    format_eviction_table,
    format_memory_table,
    format_table,
    machine_line,
    write_plot,
)

from kvoffload_hal.demo.tiny_model import build_tiny_llama
from kvoffload_hal.eviction.registry import DEFAULT_EVICTION, eviction_names

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
DOC_TOKENS = 256  # shared prefix: 8 full blocks
QUESTION_TOKENS = (32, 128)
OUTPUT_TOKENS = (16, 96)
DEVICE_FRACTION = 0.5  # of the blocks the live requests need: forces evictions and preemptions
SAMPLED_TOKEN = 7
EVICTION_HOOKS = ("on_loaded", "on_stored", "on_allocated", "on_dropped", "release")

class Trace:
    """The request stream: deterministic for a given (live requests, seed)."""

    def __init__(self, live_requests: int, seed: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.rng = random.Random(seed)
        num_docs = max(4, live_requests)
        self.docs = [[self.rng.randrange(2, 1000) for _ in range(DOC_TOKENS)]
                     for _ in range(num_docs)]
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.next_id = 0

    def new_request(self):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        doc = self.docs[self.rng.randrange(len(self.docs))]
        question = [self.rng.randrange(2, 1000)
                    for _ in range(self.rng.randint(*QUESTION_TOKENS))]
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=self.rng.randint(*OUTPUT_TOKENS))
        params.update_from_generation_config({}, eos_token_id=1)
        req = Request(f"r{self.next_id}", doc + question, params, None,
                      block_hasher=self.block_hasher)
        self.next_id += 1
        return req


def prefill_cpu_tier(scheduler, seed: int) -> int:
    """Fill our connector's CPU tier with blocks no request asks for, stored as a
    store job publishes them (what an earlier workload leaves behind); the count."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    cpu = scheduler.get_kv_connector().scheduler.cpu
    rng = random.Random(seed + 1)
    num_free = cpu.num_free_blocks()
    for start in range(0, num_free, 4096):
        blocks = cpu.allocate(min(4096, num_free - start))
        cpu.publish(blocks, [make_block_hash_with_group_id(rng.randbytes(32), 0)
                             for _ in blocks])
        cpu.unpin(blocks)
    return num_free


def worker_output(connector: str, scheduler_output, first_step: bool = False):
    """What a synchronous worker would report for this step's transfers: (the output,
    the loads that ended, whether a store ended)."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = scheduler_output.kv_connector_metadata
    if connector == "HALOffloadConnector":
        from kvoffload_hal.metadata import JobReport, OffloadWorkerMetadata

        recving = set(meta.load.req_ids) if meta.load is not None else set()
        worker_meta = OffloadWorkerMetadata(
            stores={meta.store.job_id: JobReport()} if meta.store is not None else {},
            # A disk tier (--disk-tier): every job and staged round done, the listing of
            # the tier's files (empty) finished in the first step.
            tier={(place, spec.job_id): JobReport() for place, jobs in enumerate(meta.tiers)
                  for spec in (jobs.spill, jobs.promote, jobs.probe) if spec is not None},
            rounds={r.job_id: JobReport() for r in meta.rounds if not r.final},
            tier_scans_done=[place for place in range(len(meta.tiers)) if first_step])
        recving.update(r.req_ids[0] for r in meta.rounds if r.final)
        stored, worker_meta = meta.store is not None, worker_meta or None
    else:
        from vllm.v1.simple_kv_offload.metadata import (
            INVALID_JOB_ID,
            SimpleCPUOffloadWorkerMetadata,
        )

        recving = {r for reqs in meta.load_event_to_reqs.values() for r in reqs}
        stored = meta.store_event != INVALID_JOB_ID
        worker_meta = SimpleCPUOffloadWorkerMetadata({meta.store_event: 1}) if stored else None
    return KVConnectorOutput(finished_recving=recving or None,
                             kv_connector_worker_meta=worker_meta), len(recving), stored


def run_point(model: str, connector: str, cpu_blocks: int, live: int, steps: int,
              warmup_steps: int, seed: int, eviction: str = DEFAULT_EVICTION,
              prefill: bool = False, time_eviction: bool = False,
              disk_tier: bool = False) -> Point:
    from vllm.v1.outputs import ModelRunnerOutput

    blocks_per_request = -(-(DOC_TOKENS + QUESTION_TOKENS[1] + OUTPUT_TOKENS[1]) // BLOCK_SIZE)
    num_gpu_blocks = max(2 * blocks_per_request, int(DEVICE_FRACTION * live * blocks_per_request))
    disk_dir = tempfile.mkdtemp(prefix="overhead-disk-") if disk_tier else None
    vllm_config = make_vllm_config(model, connector, max_num_seqs=max(live, 16),
                                   eviction=eviction, disk_path=disk_dir)
    scheduler = make_scheduler(vllm_config, num_gpu_blocks, cpu_blocks)
    if prefill and connector == OURS:
        prefill_cpu_tier(scheduler, seed)
    timer = Timer(scheduler.get_kv_connector())
    # The eviction policy's own calls (inside the connector's): what a policy costs.
    # Only when asked: their timers would be charged to the connector's calls.
    hooks = Timer(scheduler.get_kv_connector().scheduler.cpu.eviction, EVICTION_HOOKS) \
        if connector == OURS and time_eviction else None
    trace = Trace(live, seed)
    point = Point(connector, cpu_blocks, live, steps, {}, {})
    for step in range(warmup_steps + steps):
        measuring = step >= warmup_steps
        if step == warmup_steps:
            # A collection inside a timed call would be charged to that call.
            gc.collect()
            gc.disable()
        timer.enabled = measuring
        if hooks is not None:
            hooks.enabled = measuring
        while len(scheduler.requests) < live:
            scheduler.add_request(trace.new_request())
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED_TOKEN] if (r := scheduler.requests[rid]).num_computed_tokens
                   >= r.num_tokens else [] for rid in req_ids]
        kv_output, num_loads, stored = worker_output(connector, out, step == 0)
        before = len(scheduler.requests)
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_output))
        if measuring:
            point.loads += num_loads
            point.stores += stored
            point.preemptions += len(out.preempted_req_ids or ())
            point.finished += before - len(scheduler.requests)
    gc.enable()
    point.connector_s = dict(timer.seconds)
    point.calls = dict(timer.calls)
    if hooks is not None:
        point.extra["eviction_s"] = sum(hooks.seconds.values())
    if disk_dir is not None:
        shutil.rmtree(disk_dir)
    return point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-blocks", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--requests", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--steps", type=int, default=150, help="measured steps per point")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eviction", choices=eviction_names(), default=DEFAULT_EVICTION,
                        help="the CPU tier's eviction policy (ours)")
    parser.add_argument("--compare-eviction", action="store_true",
                        help="also run ours with every other eviction policy, alternating")
    parser.add_argument("--prefill", action="store_true",
                        help="start with our CPU tier full of blocks no request uses "
                             "(ours only: compare eviction policies on a full tier)")
    parser.add_argument("--disk-tier", action="store_true",
                        help="ours with a disk tier behind the CPU tier (upstream has none); "
                             "the workers' reports of its jobs are faked, no file is written")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per point, connectors alternating (--memory: processes per "
                             "row, policies alternating, medians kept)")
    parser.add_argument("--keep", choices=("fastest", "median"), default="fastest",
                        help="which of a point's repeats is reported: the fastest, or the "
                             "median run (on a noisy host)")
    parser.add_argument("--memory", action="store_true",
                        help="instead: start-up time and steady-state memory of the scheduler "
                             "side by CPU-tier size (scheduler_overhead_memory.py)")
    parser.add_argument("--memory-blocks", type=int, nargs="+",
                        default=[10_000, 100_000, 1_000_000, 4_000_000])
    parser.add_argument("--steady-tiers", type=float, default=9.0,
                        help="--memory: blocks stored before measuring, in tier sizes (9: past the "
                             "8 tier sizes of hashes the first adaptive policy kept)")
    parser.add_argument("--trace", action="store_true",
                        help="--memory: also measure with tracemalloc (a second process each)")
    parser.add_argument("--quick", action="store_true",
                        help="1000 CPU blocks, 10 and 100 requests, 40 steps; no files written")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--tag", default="", help="appended to the names of the files written")
    args = parser.parse_args(argv)
    if args.quick:
        args.cpu_blocks, args.requests, args.steps, args.warmup_steps = [1000], [10, 100], 40, 20
        args.repeats = 1
    return args


def measure(args: argparse.Namespace, model: str) -> tuple[list[Point], list[Point]]:
    """Every point, the fastest or the median of the repeats (``--keep``): (both
    connectors with ``--eviction``, ours with each eviction policy where
    ``--compare-eviction``)."""
    variants = [(name, args.eviction) for name in CONNECTORS]
    if args.compare_eviction:
        variants += [(OURS, e) for e in eviction_names() if e != args.eviction]
    points, by_eviction = [], []
    for nb in args.cpu_blocks:
        for live in args.requests:
            runs: dict[tuple[str, str], list[Point]] = defaultdict(list)
            for _ in range(args.repeats):  # alternate the variants
                for name, eviction in variants:
                    p = run_point(model, name, nb, live, args.steps, args.warmup_steps,
                                  args.seed, eviction, args.prefill, args.compare_eviction,
                                  args.disk_tier)
                    p.extra["eviction"] = eviction
                    runs[name, eviction].append(p)
            for (name, eviction), ps in runs.items():
                in_order = [q.us_per_step for q in ps]  # repeat i of each variant: one round
                ps = sorted(ps, key=lambda q: q.us_per_step)
                p = ps[0] if args.keep == "fastest" else ps[(len(ps) - 1) // 2]
                p.extra["us_per_step_runs"] = in_order
                if name == OURS and args.compare_eviction:  # the policy's calls: median
                    p.extra["eviction_us"] = statistics.median(
                        q.extra["eviction_s"] / q.steps * 1e6 for q in ps)
                if eviction == args.eviction:
                    points.append(p)
                if name == OURS and args.compare_eviction:
                    by_eviction.append(p)
                print(f"{name:26s} {nb:7d} CPU blocks {live:5d} live: {p.us_per_step:9.0f} µs/step"
                      f"  eviction {eviction}  loads {p.loads}  stores {p.stores}"
                      f"  preempted {p.preemptions}  finished {p.finished}", flush=True)
    return points, by_eviction


def main_memory(args: argparse.Namespace) -> None:
    from scheduler_overhead_memory import measure_memory

    sizes = [10_000] if args.quick else args.memory_blocks
    repeats = 1 if args.quick else args.repeats
    rows = measure_memory(sizes, list(eviction_names()), args.steady_tiers, args.trace, repeats)
    table = format_memory_table(rows)
    print(table)
    if args.quick:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = (f"each CPU block stored {args.steady_tiers:g} times over in jobs of 256 new hashes, "
             f"16 blocks loaded every fourth job; one process per run, {repeats} runs per row "
             "(policies alternating), the median of each figure (RSS against the process "
             f"before the scheduler was built); tracemalloc in one more process; {machine_line()}")
    (args.out_dir / "scheduler_overhead_memory.md").write_text(
        f"# Scheduler side: start-up and steady-state memory\n\n{setup}.\n\n{table}\n")
    print(f"wrote {args.out_dir / 'scheduler_overhead_memory.md'}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory:
        main_memory(args)
        return
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    points, by_eviction = measure(args, build_tiny_llama(MODEL_DIR, MODEL))
    table = format_table(points)
    if by_eviction:
        table += ("\n\nOurs with each eviction policy (alternating in the same run), µs per "
                  f"step ({args.keep} run; by round: the median of the ratios of the runs "
                  "back to back), CPU-tier loads (requests), and µs per step in the policy's "
                  "own calls (median):\n\n"
                  + format_eviction_table(by_eviction, "lru"))
    print(table)
    if args.quick:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = (f"{args.steps} measured steps after {args.warmup_steps} warm-up steps per point; "
             f"{MAX_NUM_BATCHED_TOKENS} tokens per step; block {BLOCK_SIZE} tokens; device pool "
             f"{DEVICE_FRACTION:.0%} of the live requests' need; {args.keep} of {args.repeats} "
             f"runs (connectors alternating); garbage collection off while timing; seed "
             f"{args.seed}; eviction {args.eviction}; {machine_line()}")
    # A run on a full tier goes beside the main table, not over it.
    name, title = "scheduler_overhead", "Scheduler-side connector overhead"
    if args.prefill:
        name, title = "scheduler_overhead_full_tier", title + ", CPU tier full of unused blocks"
        setup += "; our CPU tier starts full of blocks no request reads"
    if args.disk_tier:
        name, title = name + "_disk_tier", title + ", ours with a disk tier"
        setup += (f"; ours with a disk tier of {DISK_TIER_FACTOR} CPU tiers behind the CPU "
                  "tier (its jobs reported done, no file written)")
    name += f"_{args.tag}" if args.tag else ""
    (args.out_dir / f"{name}.md").write_text(
        f"# {title}\n\n{setup}.\n\n{table}\n\n![plot]({name}.png)\n")
    write_plot(points, args.out_dir / f"{name}.png")
    print(f"wrote {args.out_dir / name}.md and .png")


if __name__ == "__main__":
    main()
