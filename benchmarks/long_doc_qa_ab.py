"""Long-document QA's offloading engine from two source trees, side by side in one run.

For a change to what the engine caches (where a block goes, what is stored), the
question is what each tree computes on the same prompts. Each round runs
``long_doc_qa.run_one`` for ``prefix-cache+offload`` once in each tree, alternating which
goes first, each in a fresh process that imports that tree's package and benchmarks.
``--lazy``: both with lazy stores (``lazy_offload: true``); ``--output-tokens``: each
request's output length (long_doc_qa's default otherwise). Prints, per document count and
tree, the prompt tokens computed (the medians of the rounds), those served by the device
prefix cache and by the CPU tier, and the measured pass's wall time.

    python benchmarks/long_doc_qa_ab.py BASE_TREE NEW_TREE [--num-documents 16 32]
        [--document-length 256] [--rounds 3] [--lazy] [--output-tokens N]
        [--out docs/benchmarks/NAME]

``--out``: also writes the table (``NAME.md``, with ``lscpu``) and a plot (``NAME.png``).

A tree is a checkout (``git worktree add /tmp/base <rev>``). Record ``lscpu`` with the
figures; token counts are the same on any host, times only compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RUN = """
import dataclasses, json, logging, sys
tree, num_docs, length, lazy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
sys.path[:0] = [tree, tree + "/benchmarks"]
import long_doc_qa as q
q.OUTPUT_TOKENS = int(sys.argv[5]) or q.OUTPUT_TOKENS
logging.getLogger("vllm").setLevel(logging.WARNING)
spec_of = q.engine_spec
q.engine_spec = lambda *a, **k: dataclasses.replace(spec_of(*a, **k), lazy_offload=lazy)
model = q.build_tiny_llama(q.MODEL_DIR, q.MODEL)
from transformers import AutoTokenizer
vocab = len(AutoTokenizer.from_pretrained(model))
r = q.run_one(q.OFFLOAD, q.documents(num_docs, length, vocab), 0, model)
print(json.dumps(dict(computed=r.prompt_tokens - r.cached_tokens, cpu=r.cpu_hit_tokens,
                      device=r.cached_tokens - r.cpu_hit_tokens, wall_s=r.wall_s)))
"""
FIELDS = ("computed", "device", "cpu", "wall_s")


def run(tree: str, num_docs: int, length: int, lazy: bool,
        output_tokens: int = 0) -> dict[str, float]:
    """One engine pass of ``tree`` (``output_tokens`` 0: long_doc_qa's default)."""
    out = subprocess.run([sys.executable, "-c", RUN, tree, str(num_docs), str(length),
                          "1" if lazy else "0", str(output_tokens)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--num-documents", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--document-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lazy", action="store_true", help="both trees with lazy stores")
    parser.add_argument("--output-tokens", type=int, default=0,
                        help="output tokens per request (default: long_doc_qa's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write OUT.md and OUT.png (a path without suffix)")
    args = parser.parse_args(argv)
    trees = {"base": args.base, "new": args.new}
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for n in args.num_documents:
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                result = run(trees[name], n, args.document_length, args.lazy,
                             args.output_tokens)
                results.setdefault((n, name), []).append(result)
                print(f"round {r + 1} N={n} {name}: {result}", file=sys.stderr, flush=True)
    table = report(results)
    print(table)
    if args.out is not None:
        from scheduler_overhead_report import machine_line

        mode = "lazy" if args.lazy else "eager"
        n_out = args.output_tokens
        outputs = f", {n_out} output token{'s' * (n_out != 1)}" if n_out else ""
        title = (f"Long-document QA, {args.document_length}-token documents{outputs}, "
                 f"{mode} stores: "
                 f"base {revision(args.base)}, new {revision(args.new)}")
        args.out.with_suffix(".md").write_text(
            f"# {title}\n\n`python benchmarks/long_doc_qa_ab.py`, {args.rounds} rounds; "
            f"{machine_line()}.\n\n{table}\n\n![plot]({args.out.name}.png)\n")
        plot(results, args.out.with_suffix(".png"), title)


def revision(tree: str) -> str:
    """The tree's commit (and ``+`` where it has changes), or its path outside git."""
    git = ["git", "-C", tree]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return (head + ("+" if dirty else "")) if head else tree


def report(results: dict[tuple[int, str], list[dict[str, float]]]) -> str:
    lines = ["| documents | tree | prompt tokens computed | from the device | from the CPU "
             "tier | wall s | computed, each round |", "|---:|:---|---:|---:|---:|---:|:---|"]
    for (n, name), runs in results.items():
        med = {f: statistics.median(x[f] for x in runs) for f in FIELDS}
        each = ", ".join(str(int(x["computed"])) for x in runs)
        lines.append(f"| {n} | {name} | {med['computed']:.0f} | {med['device']:.0f} | "
                     f"{med['cpu']:.0f} | {med['wall_s']:.2f} | {each} |")
    return "\n".join(lines)


def plot(results: dict[tuple[int, str], list[dict[str, float]]], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({n for n, _ in results})
    bars = [(n, name) for n in counts for name in ("base", "new")]
    xs = [k + (i - 0.5) * 0.4 for k in range(len(counts)) for i in range(2)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(bars)
    for field, label in (("computed", "computed"), ("cpu", "from the CPU tier"),
                         ("device", "from the device")):
        values = [statistics.median(x[field] for x in results[bar]) for bar in bars]
        ax.bar(xs, values, 0.35, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(xs, [f"{n} documents\n{name}" for n, name in bars], fontsize=8)
    ax.set_ylabel("prompt tokens (median)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

if __name__ == "__main__":
    main()
