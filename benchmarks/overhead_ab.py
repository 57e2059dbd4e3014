"""Scheduler-side cost of two source trees of this project, side by side in one run.

For a change that must not cost the scheduler anything (a restructuring), the
question is the ratio of two revisions on the same host at the same moment. Each
round runs every point once in each tree, alternating which goes first, each in a
fresh process that imports that tree's ``kvoffload_hal`` and its
``benchmarks/scheduler_overhead.py`` (``run_point``: vLLM's real scheduler, only the
connector's scheduler calls timed). Prints, per point, the median over rounds of the
connector's seconds per step in each tree and the median of the per-round ratios.

    python benchmarks/overhead_ab.py BASE_TREE NEW_TREE [--points 10000x100 ...]
        [--rounds 7] [--steps 150] [--prefill] [--disk-tier]

A tree is a checkout (``git worktree add /tmp/base <rev>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

RUN = """
import json, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/benchmarks"]
import logging
import scheduler_overhead as so
logging.getLogger("vllm").setLevel(logging.WARNING)
model = so.build_tiny_llama(so.MODEL_DIR, so.MODEL)
p = so.run_point(model, so.OURS, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 50, 0,
                 prefill=sys.argv[5] == "1", disk_tier=sys.argv[6] == "1")
print(json.dumps(sum(p.connector_s.values()) / p.steps))
"""


def seconds_per_step(tree: str, blocks: int, live: int, steps: int, prefill: bool,
                     disk_tier: bool = False) -> float:
    out = subprocess.run([sys.executable, "-c", RUN, tree, str(blocks), str(live), str(steps),
                          "1" if prefill else "0", "1" if disk_tier else "0"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--points", nargs="+", default=["10000x100", "100000x100"],
                        help="CPU blocks x live requests")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--disk-tier", action="store_true",
                        help="with a disk tier behind the CPU tier (both trees must have "
                             "scheduler_overhead.py --disk-tier)")
    args = parser.parse_args(argv)
    points = [tuple(map(int, p.split("x"))) for p in args.points]
    times: dict[tuple[int, int], dict[str, list[float]]] = {
        p: {"base": [], "new": []} for p in points}
    for r in range(args.rounds):
        for p in points:
            order = [("base", args.base), ("new", args.new)]
            for name, tree in order if r % 2 == 0 else order[::-1]:
                times[p][name].append(seconds_per_step(tree, *p, args.steps, args.prefill,
                                                       args.disk_tier))
                print(f"round {r + 1} {p[0]}x{p[1]} {name}: "
                      f"{times[p][name][-1] * 1e3:.3f} ms/step", file=sys.stderr, flush=True)
    print("| CPU blocks | live requests | base ms/step | new ms/step | new/base (median of "
          "rounds) |")
    print("|---:|---:|---:|---:|---:|")
    for p, t in times.items():
        ratios = [n / b for b, n in zip(t["base"], t["new"])]
        print(f"| {p[0]} | {p[1]} | {statistics.median(t['base']) * 1e3:.3f} | "
              f"{statistics.median(t['new']) * 1e3:.3f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
