"""CPU-tier eviction on several block traces, against the offline optimum.

Scheduler side only: no model runs. Each trace is replayed through Belady's
optimum, the real CPU tier with each eviction policy (vLLM's ``BlockPool`` and
coordinator; :mod:`kvoffload_hal.demo.eviction_replay`), and vLLM's own offloading
policies (``LRU``, ``ARC``) where installed, at tier sizes from 50 % to 150 %
of the trace's working set (the blocks it uses more than once). Hit blocks are
reported as a fraction of the optimum's. Each policy has a trace it loses on,
hence three:

* ``long-doc``: the long-document benchmark (``long_doc_qa.py``): every
  document once, then each twice in a seeded random order; a device cache of
  8 documents in front (LRU, whole documents) hides its hits from the tier.
  A document read for the third time is dead, so favouring frequency keeps
  the wrong blocks; LRU evicts the documents next in line.
* ``zipf-chat``: multi-turn chat over shared system prompts; conversations
  and system prompts picked by Zipf popularity; each turn re-reads the system
  prompt and the conversation so far and adds two blocks.
* ``hot+scan``: a hot set of shared prefixes (uniform) while a long scan of
  one-off documents passes through (half the requests).

Prints a table and writes ``docs/benchmarks/eviction_traces.{md,png}``.

    python benchmarks/eviction_traces.py [--quick] [--seed N] [--scale K] [--policies NAME ...]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import Counter, OrderedDict
from pathlib import Path

from kvoffload_hal.demo.eviction_replay import (
    Trace,
    belady_hits,
    make_replay_tier,
    replay_tier,
    replay_vllm_policy,
    vllm_policy_class,
)

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SIZES = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)  # tier size / working set
# Targets of the default policy: geometric mean of the fraction of the optimum,
# and the most it may fall below LRU at any trace and size (fraction points).
TARGET_GEOMEAN, MAX_BELOW_LRU = 0.9, 0.02
TIER_POLICIES = ("lru", "adaptive")
DEFAULT = "adaptive"  # the policy judged against the targets


def long_doc_trace(num_docs: int = 32, blocks_per_doc: int = 32, device_docs: int = 8,
                   seed: int = 0) -> Trace:
    order = [d for d in range(num_docs) for _ in range(2)]
    random.Random(seed).shuffle(order)
    device: OrderedDict[int, None] = OrderedDict()
    trace = []
    for doc in [*range(num_docs), *order]:
        if doc in device:
            device.move_to_end(doc)
            continue  # a device hit: the tier sees nothing
        device[doc] = None
        if len(device) > device_docs:
            device.popitem(last=False)
        trace.append([doc * blocks_per_doc + i for i in range(blocks_per_doc)])
    return trace


def _zipf_picker(n: int, s: float, rng: random.Random):
    weights = [1 / (i + 1) ** s for i in range(n)]
    return lambda: rng.choices(range(n), weights)[0]


def zipf_chat_trace(num_requests: int = 1500, num_prompts: int = 24, prompt_blocks: int = 8,
                    num_convs: int = 300, max_turns: int = 8, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    pick_prompt, pick_conv = _zipf_picker(num_prompts, 1.0, rng), _zipf_picker(num_convs, 0.8, rng)
    prompt_of = [pick_prompt() for _ in range(num_convs)]
    history: list[list[int]] = [[] for _ in range(num_convs)]
    next_key = num_prompts * prompt_blocks
    trace = []
    for _ in range(num_requests):
        c = pick_conv()
        if len(history[c]) >= 2 * max_turns:
            history[c] = []  # the conversation ends; a new one takes its slot
        history[c] += [next_key, next_key + 1]
        next_key += 2
        p = prompt_of[c]
        trace.append([*range(p * prompt_blocks, (p + 1) * prompt_blocks), *history[c]])
    return trace


def hot_scan_trace(num_requests: int = 1200, num_hot: int = 16, hot_blocks: int = 12,
                   scan_blocks: int = 24, seed: int = 2) -> Trace:
    rng = random.Random(seed)
    next_key = num_hot * hot_blocks
    trace = []
    for _ in range(num_requests):
        if rng.random() < 0.5:
            h = rng.randrange(num_hot)
            trace.append([*range(h * hot_blocks, (h + 1) * hot_blocks), next_key])
            next_key += 1
        else:
            trace.append(list(range(next_key, next_key + scan_blocks)))
            next_key += scan_blocks
    return trace


TRACES = {"long-doc": long_doc_trace, "zipf-chat": zipf_chat_trace, "hot+scan": hot_scan_trace}
# What --scale multiplies in each trace: its documents, prompts, conversations or
# hot prefixes, and its requests, so the tier sizes grow by about that factor.
SCALED = {"long-doc": ("num_docs", "device_docs"),
          "zipf-chat": ("num_requests", "num_prompts", "num_convs"),
          "hot+scan": ("num_requests", "num_hot")}


def make_trace(name: str, seed: int, scale: int = 1) -> Trace:
    """Trace ``name`` with its counts multiplied by ``scale`` (1: the published suite)."""
    make = TRACES[name]
    defaults = make.__defaults__
    params = dict(zip(make.__code__.co_varnames[:len(defaults)], defaults))
    return make(**{k: params[k] * scale for k in SCALED[name]}, seed=seed)


def working_set(trace: Trace) -> int:
    """Blocks the trace uses more than once."""
    counts = Counter(k for request in trace for k in request)
    return sum(1 for c in counts.values() if c > 1)


def replay_all(trace: Trace, capacity: int,
               policies: tuple[str, ...] = TIER_POLICIES) -> dict[str, int]:
    hits = {"belady": belady_hits(trace, capacity)}
    for name in policies:
        hits[name] = replay_tier(make_replay_tier(capacity, name), trace)
    for name in ("lru", "arc"):
        hits[f"vllm-{name}"] = replay_vllm_policy(vllm_policy_class(name), trace, capacity)
    return hits


def run_suite(sizes=SIZES, seed: int = 0, scale: int = 1,
              policies: tuple[str, ...] = TIER_POLICIES) -> list[dict]:
    rows = []
    for i, trace_name in enumerate(TRACES):
        trace = make_trace(trace_name, seed + i, scale)
        ws = working_set(trace)
        for size in sizes:
            capacity = max(1, round(size * ws))
            hits = replay_all(trace, capacity, policies)
            rows.append(dict(trace=trace_name, size=size, capacity=capacity, hits=hits))
    return rows


def fraction(row: dict, policy: str) -> float:
    return row["hits"][policy] / max(1, row["hits"]["belady"])


def geomean(rows: list[dict], policy: str) -> float:
    return math.exp(sum(math.log(max(1e-9, fraction(r, policy))) for r in rows) / len(rows))


def format_table(rows: list[dict]) -> str:
    policies = [p for p in rows[0]["hits"] if p != "belady"]
    lines = ["| trace | tier / working set | blocks | Belady hit blocks | "
             + " | ".join(policies) + f" | {DEFAULT} - lru |",
             "|:---|---:|---:|---:|" + "---:|" * (len(policies) + 1)]
    for r in rows:
        fr = " | ".join(f"{fraction(r, p):.3f}" for p in policies)
        lines.append(f"| {r['trace']} | {r['size']:.0%} | {r['capacity']} | "
                     f"{r['hits']['belady']} | {fr} | "
                     f"{fraction(r, DEFAULT) - fraction(r, 'lru'):+.3f} |")
    means = " | ".join(f"**{geomean(rows, p):.3f}**" for p in policies)
    lines.append(f"| geometric mean | | | | {means} | |")
    worst = min(fraction(r, DEFAULT) - fraction(r, "lru") for r in rows)
    met = geomean(rows, DEFAULT) >= TARGET_GEOMEAN and worst >= -MAX_BELOW_LRU
    lines += ["", f"`{DEFAULT}`: geometric mean {geomean(rows, DEFAULT):.3f} of the "
              f"optimum (target >= {TARGET_GEOMEAN}), worst point {worst:+.3f} against LRU "
              f"(target >= {-MAX_BELOW_LRU:+.2f}): {'met' if met else 'NOT met'}."]
    return "\n".join(lines)


def write_plot(rows: list[dict], path: Path, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(TRACES)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6))
    for i, (ax, name) in enumerate(zip(axes, names)):
        mine = [r for r in rows if r["trace"] == name]
        xs = [r["size"] * 100 for r in mine]
        total = sum(len(req) for req in TRACES[name](seed=seed + i))
        for policy, style in (("belady", "k-"), ("lru", "C0o-"), (DEFAULT, "C3s-"),
                              ("vllm-arc", "C2^--")):
            if policy in mine[0]["hits"]:
                ax.plot(xs, [r["hits"][policy] / total for r in mine], style, label=policy)
        ax.set_title(name)
        ax.set_xlabel("CPU tier / working set (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("block hit ratio")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three sizes, no files written")
    parser.add_argument("--seed", type=int, default=0,
                        help="the traces' seeds are SEED, SEED+1, SEED+2 (0: the published table)")
    parser.add_argument("--scale", type=int, default=1,
                        help="traces and tiers SCALE times larger (no files written unless 1): "
                             "the shadows' key cap and the sketch's buckets at work")
    parser.add_argument("--policies", nargs="+", default=list(TIER_POLICIES),
                        help="the CPU tier's policies replayed, by registry name (a plug-in's "
                             "too); lru and adaptive are always among them (no files written "
                             "unless just those)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    policies = tuple(dict.fromkeys([*TIER_POLICIES, *args.policies]))
    start = time.perf_counter()
    rows = run_suite((0.5, 1.0, 1.5) if args.quick else SIZES, args.seed, args.scale, policies)
    table = format_table(rows)
    print(table)
    print(f"replayed in {time.perf_counter() - start:.1f} s")
    if args.quick or args.scale != 1 or policies != TIER_POLICIES:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "eviction_traces.md").write_text(
        "# CPU-tier eviction against the offline optimum\n\nHit blocks as a fraction of "
        "Belady's (MIN with bypass) on the same trace and tier size.\n\n"
        f"{table}\n\n![plot](eviction_traces.png)\n")
    write_plot(rows, args.out_dir / "eviction_traces.png", args.seed)
    print(f"wrote {args.out_dir / 'eviction_traces'}.md and .png")


if __name__ == "__main__":
    main()
