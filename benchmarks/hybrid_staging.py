"""What staging a hybrid model's long tier hit gives users, on the running vLLM.

Tiny Gemma 3 (``kvoffload_hal.demo.tiny_hybrid``, float32): a global layer and three
sliding-window layers (64-token window), four KV cache groups of 32-token blocks. The
connector has a CPU tier smaller than a document's hit and a disk tier behind it. A
document is served, pushed out of the device and the CPU tier by two others, and served
again, three ways, one engine after the other in this process:

* ``none``: without the connector (the reference tokens);
* ``staged``: the connector as it ships. A hit longer than the CPU tier's room is staged
  (brought through the CPU tier in rounds); on vLLM 0.23 each such hit is read once
  before it is offered (``scheduler/secondary/staged_check.py``);
* ``promotions``: staging turned off once the engine is up (``StagedHits.enabled``):
  each lookup promotes what the CPU tier has room for. That is what a model with
  several KV cache groups gets on vLLM 0.23 without the check, since that vLLM cannot
  be told that a staged load of such a model failed.

Reported per shape, the median of three rounds (the arms alternating): tokens of the
second serving found cached (device, CPU tier and disk) against its full blocks, and
each round's; the connector's ``blocks_from_disk``, ``blocks_loaded``
and ``staged_hits`` over the run; whether the second serving's tokens equal those
without the connector; its wall time (a tiny model on a CPU: the compute saved is
small, the figure to read is the tokens).

    python benchmarks/hybrid_staging.py [--out-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.engines.drain_transfers
sys.path.insert(0, str(ROOT / "benchmarks"))

BLOCK = 32
PAGE = BLOCK * 1 * 64 * 2 * 4  # one layer's block: KV heads x head_dim x K+V x float32
SHAPES = ((400, 12), (1000, 12), (1000, 24), (1000, 64))  # (document words, CPU blocks)
ARMS = ("none", "staged", "promotions")
COUNTERS = ("blocks_from_disk", "blocks_loaded", "staged_hits")


def serve_twice(model_dir: str, disk: str, words: int, cpu_blocks: int, arm: str) -> dict:
    """One engine: the document, two others, the document again."""
    from vllm import SamplingParams

    from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
    from kvoffload_hal.demo.tiny_model import synthetic_text
    from support.engines import drain_transfers

    positions = words // BLOCK + 1
    llm = make_llm(EngineSpec(
        model_dir, num_gpu_blocks=2 * positions + 16, block_size=BLOCK,
        max_model_len=2 * positions * BLOCK, dtype="float32", max_num_batched_tokens=2 * BLOCK,
        max_num_seqs=2, offload=arm != "none", cpu_bytes_to_use=cpu_blocks * PAGE,
        extra_config={"disk_path": disk, "disk_bytes_to_use": 40 * positions * PAGE}))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    doc = synthetic_text(words, seed=100)
    try:
        conn = scheduler_connector(llm)
        if arm == "promotions":
            conn.scheduler.staged.enabled = False
        first = llm.generate([doc], params, use_tqdm=False)[0]
        for seed in range(2):
            llm.generate([synthetic_text(words, seed=seed)], params, use_tqdm=False)
        drain_transfers(llm)
        start = time.perf_counter()
        again = llm.generate([doc], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        drain_transfers(llm)
        data = conn.scheduler.totals.data if conn is not None else {}
        checks = conn is not None and conn.scheduler.caps.vllm.checks_staged_hits_first()
    finally:
        close_llm(llm)
    return {"cached": again.num_cached_tokens or 0, "wall_s": wall, "checks_first": checks,
            "full_blocks": (len(again.prompt_token_ids) - 1) // BLOCK,
            "tokens": list(again.outputs[0].token_ids),
            "first_tokens": list(first.outputs[0].token_ids),
            **{k: int(data.get(k, 0)) for k in COUNTERS}}


def measure(model_dir: str, repeats: int) -> list[dict]:
    """Every shape, the arms alternating, ``repeats`` rounds: one row per shape and arm,
    the median of the rounds (each round's cached tokens kept: the disk holds what the
    CPU tier had room to store, which varies with the timing of its writes)."""
    rows = []
    for words, cpu_blocks in SHAPES:
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(repeats):
            for arm in ARMS:
                with tempfile.TemporaryDirectory(prefix="hybrid_staging_") as work:
                    runs[arm].append(serve_twice(model_dir, str(Path(work, "kv")), words,
                                                 cpu_blocks, arm))
        reference = runs["none"][0]
        for arm in ARMS:
            done = runs[arm]
            row = {k: statistics.median(r[k] for r in done)
                   for k in ("cached", "wall_s", *COUNTERS)}
            row.update(arm=arm, words=words, cpu_blocks=cpu_blocks,
                       full_blocks=done[0]["full_blocks"],
                       each_cached=[r["cached"] for r in done],
                       same=all(r["tokens"] == reference["tokens"]
                                and r["first_tokens"] == reference["first_tokens"]
                                for r in done))
            rows.append(row)
            print(f"{words} words, {cpu_blocks} CPU blocks, {arm}: cached {row['each_cached']} "
                  f"of {row['full_blocks'] * BLOCK} tokens, same tokens {row['same']}",
                  flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| document tokens (full blocks) | CPU-tier blocks | run | tokens cached on the "
             "second serving (each round) | blocks from disk | blocks loaded | staged hits "
             "| same tokens | second serving s |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        each = ", ".join(str(c) for c in r["each_cached"])
        lines.append(f"| {r['full_blocks'] * BLOCK} ({r['full_blocks']}) | {r['cpu_blocks']} | "
                     f"{r['arm']} | {r['cached']:.0f} ({each}) | {r['blocks_from_disk']:.0f} | "
                     f"{r['blocks_loaded']:.0f} | {r['staged_hits']:.0f} | "
                     f"{'yes' if r['same'] else 'NO'} | {r['wall_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [(w, c) for w, c in SHAPES]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.25
    for i, arm in enumerate(ARMS):
        values = [next(r["cached"] / (r["full_blocks"] * BLOCK) for r in rows
                       if (r["words"], r["cpu_blocks"]) == s and r["arm"] == arm)
                  for s in shapes]
        ax.bar([x + (i - 1) * width for x in range(len(shapes))], values, width, label=arm)
    ax.set_xticks(range(len(shapes)),
                  [f"{w} words\n{c} CPU blocks" for w, c in shapes])
    ax.set_ylabel("second serving: cached / full blocks")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the arms alternating")
    parser.add_argument("--plot-from", type=Path, default=None,
                        help="only draw the plot of an earlier run's .json (a vLLM "
                             "environment without matplotlib writes no plot)")
    args = parser.parse_args(argv)
    if args.plot_from is not None:
        saved = json.loads(args.plot_from.read_text())
        plot(saved["rows"], args.plot_from.with_suffix(".png"), saved["title"])
        return
    import logging

    import vllm
    from scheduler_overhead_report import machine_line

    from kvoffload_hal.demo.tiny_hybrid import build_tiny_gemma3

    logging.getLogger("vllm").setLevel(logging.WARNING)
    model_dir = build_tiny_gemma3(str(Path(tempfile.gettempdir(), "kvoffload-tiny-gemma3")))
    rows = measure(model_dir, args.repeats)
    table = format_table(rows)
    print(table)
    if args.out_dir is None:
        return
    version = vllm.__version__.split("+")[0]
    name = f"hybrid_staging_vllm{version.replace('.', '')}"
    title = f"vLLM {version}: a hybrid model's disk hit longer than the CPU tier"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps({"title": title, "rows": rows}))
    try:
        plot(rows, args.out_dir / f"{name}.png", title)
    except ImportError:
        print(f"no matplotlib here: plot it with --plot-from {args.out_dir / name}.json")
    (args.out_dir / f"{name}.md").write_text(
        f"# {title}\n\n`python benchmarks/hybrid_staging.py`; {machine_line()}.\n\n"
        f"{table}\n\n![plot]({name}.png)\n")


if __name__ == "__main__":
    main()
