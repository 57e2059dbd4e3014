"""The device cache and the CPU tier as one cache, over many shapes, against Belady.

``long_doc_qa.py`` measures one workload shape with a real model; a placement rule
tuned to it may lose elsewhere. This sweep runs vLLM's real scheduler with the
connector and the model that checks every KV read (``tests/support/engine_harness.py``:
no model compute, so a shape takes a second or two) over a grid of shapes, for each
``device_copies`` mode, and reports the prompt blocks served from either cache in the
measured pass against Belady's optimum of the two caches together (MIN with bypass,
capacity device + CPU tier, on the requests in the order vLLM admitted them). Token
and block counts are exact on any host.

Workloads (``N`` documents of ``B`` blocks; a warm-up pass sends every document once):

* ``waves``: the measured pass sends each document twice, in a seeded random order,
  all at once (vLLM admits them in waves that fill the device: ``long_doc_qa.py``);
* ``serial``: the same order, one request at a time;
* ``zipf``: ``3 N`` requests by Zipf popularity (s = 1.1), in batches of 4.

Sizes: the device holds a quarter of the documents' blocks, the CPU tier 60 % to
90 % of them: the CPU tier alone never holds them all, the two together hold them
from 80 % on (less the device's blocks of running requests).

``--modes`` takes ``device_copies`` values and three ablations of ``drop``:
``drop-no-homes``, whose rescues are never published at a lookup of their own step (what
``scheduler/rescue_homes.py`` gains); ``drop-no-hand-over``, that and rescues never into
the CPU blocks of the step's own loads (what ``scheduler/hand_over.py`` gains); and
``drop-evicting``, that and stores that evict blocks only the CPU tier holds, as
``keep``'s do (what spare room for stores gains).

    python benchmarks/one_cache_sweep.py [--modes keep drop-evicting drop-no-hand-over
                                                  drop-no-homes drop]
                                         [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from long_doc_qa_hierarchy import Admissions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # support.engine_harness
OUT_DIR = ROOT / "docs" / "benchmarks"
BS = 16
WORKLOADS = ("waves", "serial", "zipf")
DOCS_X_BLOCKS = ((12, 4), (16, 8), (12, 16))
CPU_FRACTIONS = (0.6, 0.7, 0.8, 0.9)
DEVICE_FRACTION = 0.25
# Ablations of ``drop``, each with the ones before it: no rescue published at a lookup
# of its step; no rescue into the CPU blocks of the step's loads; stores that evict
# blocks only the CPU tier holds, as with ``keep`` (without ``DeviceCopies.spare_stores``).
NO_HOMES, NO_HAND_OVER, EVICTING = "-no-homes", "-no-hand-over", "-evicting"
ABLATIONS = (NO_HOMES, NO_HAND_OVER, EVICTING)


@dataclass(frozen=True)
class Shape:
    workload: str
    docs: int
    blocks: int  # per document
    device_blocks: int
    cpu_blocks: int

    @property
    def label(self) -> str:
        return (f"{self.workload} {self.docs}x{self.blocks}, device {self.device_blocks}, "
                f"CPU {self.cpu_blocks}")


def shapes(quick: bool) -> list[Shape]:
    out = []
    for workload in WORKLOADS:
        for docs, blocks in DOCS_X_BLOCKS[:1] if quick else DOCS_X_BLOCKS:
            total = docs * blocks
            # The device also holds each running request's partial last block.
            device = max(blocks + 2, int(total * DEVICE_FRACTION) + docs // 4 + 1)
            for fraction in CPU_FRACTIONS[1::2] if quick else CPU_FRACTIONS:
                out.append(Shape(workload, docs, blocks, device, int(total * fraction) + 1))
    return out


def requests(shape: Shape, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up pass, measured pass): lists of batches of document indices."""
    docs = list(range(shape.docs))
    warm = [docs]
    rng = random.Random(seed)
    if shape.workload == "zipf":
        weights = [1 / (i + 1) ** 1.1 for i in docs]
        picks = rng.choices(docs, weights, k=3 * shape.docs)
        return warm, [picks[i:i + 4] for i in range(0, len(picks), 4)]
    order = [d for d in docs for _ in range(2)]
    rng.shuffle(order)
    return warm, ([order] if shape.workload == "waves" else [[d] for d in order])


def run_shape(shape: Shape, mode: str, model_dir: str, seed: int) -> dict:
    """One engine: hit blocks of the measured pass, and Belady's on its admissions."""
    from kvoffload_hal.demo.eviction_replay import belady_hits
    from support.engine_harness import Engine

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 90) for _ in range(shape.blocks * BS + 1)]
               for _ in range(shape.docs)]
    engine = Engine(model_dir, block_size=BS, num_gpu_blocks=shape.device_blocks,
                    cpu_blocks=shape.cpu_blocks, max_num_batched_tokens=2048,
                    extra_config={"device_copies": mode.split("-")[0]})
    if mode.endswith(ABLATIONS):
        engine.offload.stores.homes = None
    if mode.endswith(ABLATIONS[1:]):
        engine.offload.hand_overs = None
    if mode.endswith(EVICTING):  # stores evict as with keep
        engine.offload.cpu.device_copies.spare_stores = False
    try:
        admissions = Admissions(engine.scheduler, BS)
        warm, measured = requests(shape, seed)
        ids = _send(engine, warm, prompts, "w")
        counted_from = len(admissions.requests)
        ids = _send(engine, measured, prompts, "m")
        hits = sum(engine.cached_tokens[r] // BS for r in ids)
        keys: dict = {}
        trace = [[keys.setdefault(h, len(keys)) for h in r] for r in admissions.requests]
        capacity = (shape.device_blocks - 1) + (engine.offload.cpu.num_blocks - 1)
        best = belady_hits(trace, capacity, counted_from=counted_from)
        return {"hits": hits, "belady": best,
                "possible": sum(len(r) for r in trace[counted_from:]),
                "computed": engine.computed_tokens}
    finally:
        engine.close()


def _send(engine, batches: list[list[int]], prompts: list[list[int]], tag: str) -> list[str]:
    ids = []
    for b, batch in enumerate(batches):
        for k, doc in enumerate(batch):
            ids.append(engine.add(f"{tag}{b}.{k}", prompts[doc], max_tokens=2).request_id)
        engine.run_until_done()
    return ids


def table(rows: list[tuple[Shape, dict[str, dict]]], modes: list[str]) -> str:
    head = ("| shape | possible | Belady | " + " | ".join(f"`{m}` hits (fraction)" for m in modes)
            + " |\n|:---|---:|---:|" + "---:|" * len(modes))
    lines = [head]
    fractions: dict[str, list[float]] = {m: [] for m in modes}
    for shape, by_mode in rows:
        best = max(1, by_mode[modes[0]]["belady"])
        cells = []
        for m in modes:
            f = by_mode[m]["hits"] / best
            fractions[m].append(max(f, 1e-3))
            cells.append(f"{by_mode[m]['hits']} ({f:.3f})")
        lines.append(f"| {shape.label} | {by_mode[modes[0]]['possible']} | "
                     f"{by_mode[modes[0]]['belady']} | " + " | ".join(cells) + " |")
    geo = [math.exp(statistics.fmean(math.log(f) for f in fractions[m])) for m in modes]
    worst = [min(fractions[m]) for m in modes]
    lines.append("| **geometric mean** | | | " + " | ".join(f"**{g:.3f}**" for g in geo) + " |")
    lines.append("| lowest | | | " + " | ".join(f"{w:.3f}" for w in worst) + " |")
    return "\n".join(lines)


def write_plot(rows: list[tuple[Shape, dict[str, dict]]], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.45), 4.5))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ys = [r[m]["hits"] / max(1, r[modes[0]]["belady"]) for _, r in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([s.label.split(",")[0] + f"\nCPU {s.cpu_blocks}" for s, _ in rows],
                       rotation=90, fontsize=7)
    ax.set_ylabel("hit blocks / Belady (device + CPU tier)")
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+",
                        default=["keep", "drop-evicting", "drop-no-hand-over", "drop-no-homes",
                                 "drop"])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a few shapes, nothing written")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    os.environ.setdefault("KVOFFLOAD_HAL_BACKEND", "cpu")
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tempfile.mkdtemp(prefix="one_cache_sweep_"))
    rows = []
    for shape in shapes(args.quick):
        by_mode = {m: run_shape(shape, m, model_dir, args.seed) for m in args.modes}
        rows.append((shape, by_mode))
        print(shape.label, {m: (r["hits"], r["belady"]) for m, r in by_mode.items()}, flush=True)
    text = table(rows, args.modes)
    print(text)
    if args.quick:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "one_cache_sweep.md").write_text(
        "# The device cache and the CPU tier as one cache: a sweep of shapes\n\n"
        f"`python benchmarks/one_cache_sweep.py --modes {' '.join(args.modes)} --seed "
        f"{args.seed}`: prompt blocks served from either cache in the measured pass, and "
        "as a fraction of Belady's optimum of the two together (exact on any host).\n\n"
        f"{text}\n\n![plot](one_cache_sweep.png)\n")
    write_plot(rows, args.modes, args.out_dir / "one_cache_sweep.png")
    print(f"wrote {args.out_dir / 'one_cache_sweep.md'} and one_cache_sweep.png")


if __name__ == "__main__":
    main()
