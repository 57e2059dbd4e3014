"""The CPU backend's copy threads inside vLLM's CPU worker, on long-document QA.

``long_doc_qa.py``'s offloading engine (device cache 8 documents, CPU tier 30) runs
its measured pass with the CPU backend copying each batch on two threads
(``KVOFFLOAD_HAL_CPU_COPY_THREADS=2``, the default before) and on one (the default
now), beside the same-batch limit engine (every document in the device cache, at
most 8 requests per batch). The three run in turn, round after round, so a slow
spell of the host slows one run of each; each round's ratio to the limit is
computed within the round.

Reported per engine: the measured pass's best and median over the rounds, and the
median of the per-round ratios to the limit. Writes
``docs/benchmarks/copy_threads_engine.{md,png}``.

    python benchmarks/copy_threads_engine.py [--num-documents 32] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from long_doc_qa import (
    DEFAULT_LENGTH,
    MODEL,
    MODEL_DIR,
    OFFLOAD,
    SAME_BATCH,
    documents,
    run_one,
)

from kvoffload_hal.backends.cpu.backend import COPY_THREADS_ENV_VAR
from kvoffload_hal.demo.tiny_model import build_tiny_llama

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
ENGINES = (("offload, 2 copy threads", OFFLOAD, "2"),
           ("offload, 1 copy thread", OFFLOAD, "1"),
           ("limit at 8 seqs", SAME_BATCH, None))


def run_rounds(num_docs: int, rounds: int, model: str, vocab: int) -> dict[str, list[float]]:
    docs = documents(num_docs, DEFAULT_LENGTH, vocab)
    walls: dict[str, list[float]] = {name: [] for name, _, _ in ENGINES}
    for k in range(rounds):
        for name, config, threads in ENGINES:
            if threads is None:
                os.environ.pop(COPY_THREADS_ENV_VAR, None)
            else:
                os.environ[COPY_THREADS_ENV_VAR] = threads
            result = run_one(config, docs, 0, model)
            walls[name].append(result.wall_s)
            print(f"  round {k}: {name:26s} {result.wall_s:6.3f} s  steps {result.steps}  "
                  f"computed {result.scheduled_tokens}", flush=True)
    os.environ.pop(COPY_THREADS_ENV_VAR, None)
    return walls


def table(walls: dict[str, list[float]]) -> str:
    limit = walls[ENGINES[-1][0]]
    lines = ["| engine | best s | median s | best / best limit | median of the rounds' "
             "ratios to the limit | passes s |", "|:---|---:|---:|---:|---:|:---|"]
    for name, xs in walls.items():
        ratios = [x / y for x, y in zip(xs, limit)]
        lines.append(f"| {name} | {min(xs):.3f} | {statistics.median(xs):.3f} | "
                     f"{min(xs) / min(limit):.3f}x | {statistics.median(ratios):.3f}x | "
                     f"{', '.join(f'{x:.2f}' for x in xs)} |")
    return "\n".join(lines)


def write_plot(walls: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in walls.items():
        ax.plot(range(1, len(xs) + 1), xs, marker="o", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("measured pass, s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-documents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    model = build_tiny_llama(MODEL_DIR, MODEL)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    walls = run_rounds(args.num_documents, args.rounds, model, vocab)
    setup = (f"{args.num_documents} documents of {DEFAULT_LENGTH} tokens, long_doc_qa.py's "
             f"model and caches, {args.rounds} rounds")
    text = table(walls)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "copy_threads_engine.md").write_text(
        f"# CPU backend copy threads inside vLLM's CPU worker\n\n{setup}.\n\n{text}\n\n"
        "![plot](copy_threads_engine.png)\n")
    write_plot(walls, args.out_dir / "copy_threads_engine.png", setup)


if __name__ == "__main__":
    main()
