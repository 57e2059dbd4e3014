"""Long-document QA: the workload shape of vLLM's long-document-QA throughput benchmark.

``N`` documents of ``L`` random tokens each. A warm-up pass sends every document
once; the measured pass sends each document twice, in a seeded random order.
Every request asks for 10 greedy output tokens. The requests of one pass are
submitted together, in one ``llm.generate`` call, as the upstream benchmark does:
the engine batches them as its KV cache allows, so each request's TTFT includes
its time in the queue.

Four engines run side by side for each ``N`` (same model, same prompts):

1. ``no-prefix-cache``: every prompt is computed in full;
2. ``prefix-cache``: device prefix cache sized for 8 documents;
3. ``prefix-cache+offload``: (2) plus ``HALOffloadConnector`` with a CPU tier of
   30 documents (the connector requires prefix caching);
4. ``prefix-cache-limit``: a device cache big enough for every document.

With ``--same-batch-limit`` another engine runs: ``limit-at-8-seqs``, (4) with at
most 8 requests in a batch, about what a device cache of 8 documents admits. It
separates what the copies cost from what the small batches cost: (3) computes
the same tokens as (4), but in several times more, smaller steps.

With ``--disk`` a fifth engine runs: ``prefix-cache+offload+disk``, (3) plus a
disk tier behind the CPU tier big enough for every document (write-through, so
the warm-up pass fills it). It matters where the working set outgrows the CPU
tier: at 64 documents a CPU tier of 30 serves few hits in a random order.

Reported per engine: wall time of the measured pass, TTFT mean/p50/p99 (from
``RequestOutput.metrics.first_token_latency``: vLLM fills it offline when stats
logging is enabled), prompt tokens served from a cache, and the connector's CPU
tier hits. Prints a table and writes ``docs/benchmarks/long_doc_qa.{md,png}``.

    python benchmarks/long_doc_qa.py [--num-documents 16 32 64] [--document-length 256]
                                     [--repeats 1] [--disk [--disk-dir DIR]]
                                     [--same-batch-limit] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload_hal.inprocess import (
    EngineSpec,
    close_llm,
    scheduler_connector,
    set_inprocess_env,
)
from kvoffload_hal.tiny_model import TinyModelSpec, build_tiny_llama

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
MODEL_DIR = os.path.expanduser("~/.cache/kvoffload_hal/long_doc_qa_llama")
# ~27M parameters in 8 layers: big enough that prefill dominates a step on a CPU,
# small enough to build in seconds. head_dim 64 (vLLM's CPU attention supports 64/128).
MODEL = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=4096)
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
BF16_BYTES = 2
OUTPUT_TOKENS = 10
DEFAULT_LENGTH = 256  # tokens per document
DEVICE_DOCS = 8  # the device cache of engines (1)-(3) holds this many documents
CPU_DOCS = 30  # the CPU tier holds this many documents
TOKEN_ID_FLOOR = 2  # ids 0 and 1 are <s> and </s> in the tiny tokenizer
# Targets: (3) vs (2) speed-up at <= 32 documents, (3) vs (4) slowdown; with a disk
# tier, (5) vs (2) speed-up at the largest document counts.
TARGET_SPEEDUP, TARGET_VS_LIMIT, SMALL_N = 3.0, 1.25, 32
TARGET_DISK_SPEEDUP = 1.5

CONFIGS = ("no-prefix-cache", "prefix-cache", "prefix-cache+offload", "prefix-cache-limit")
DISK = "prefix-cache+offload+disk"
SAME_BATCH = "limit-at-8-seqs"
EXTRA_CONFIGS = (DISK, SAME_BATCH)


@dataclass
class Result:
    num_docs: int
    config: str
    wall_s: float
    ttft_s: list[float]
    cached_tokens: int
    prompt_tokens: int
    cpu_hit_tokens: int = 0
    steps: int = 0  # engine steps of the measured pass
    scheduled_tokens: int = 0  # tokens computed in the measured pass (prefill + decode)
    preemptions: int = 0
    extra: dict = field(default_factory=dict)

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(self.ttft_s)


def block_bytes(spec: TinyModelSpec) -> int:
    """Device KV bytes per block: K and V x layers x kv heads x head_dim x tokens x bf16."""
    return (2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim
            * BLOCK_SIZE * BF16_BYTES)


def num_params(spec: TinyModelSpec, vocab: int) -> int:
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return spec.num_hidden_layers * per_layer + 2 * vocab * h + h


def documents(num_docs: int, length: int, vocab: int) -> list[list[int]]:
    docs = []
    for i in range(num_docs):
        rng = random.Random(1000 + i)
        docs.append([rng.randrange(TOKEN_ID_FLOOR, vocab) for _ in range(length)])
    return docs


def engine_spec(config: str, num_docs: int, length: int, model: str,
                disk_dir: str | None = None) -> EngineSpec:
    blocks_per_doc = -(-(length + OUTPUT_TOKENS) // BLOCK_SIZE)
    extra = {}
    if config == DISK:
        # Room for every document's full blocks, with a spare document.
        extra = dict(disk_path=disk_dir,
                     disk_bytes_to_use=(num_docs + 1) * blocks_per_doc * block_bytes(MODEL))
    if config in ("prefix-cache-limit", SAME_BATCH):
        # A full copy for each of the 2N requests of the measured pass: nothing
        # is ever evicted and nothing is preempted, whatever the batching.
        num_gpu_blocks = 2 * num_docs * blocks_per_doc
    else:
        num_gpu_blocks = DEVICE_DOCS * blocks_per_doc
    return EngineSpec(
        model=model,
        num_gpu_blocks=num_gpu_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=length + OUTPUT_TOKENS + BLOCK_SIZE,
        offload=config in ("prefix-cache+offload", DISK),
        cpu_bytes_to_use=CPU_DOCS * (length // BLOCK_SIZE) * block_bytes(MODEL),
        enable_prefix_caching=config != "no-prefix-cache",
        extra_config=extra,
        max_num_seqs=DEVICE_DOCS if config == SAME_BATCH else 256,
    )


def run_one(config: str, docs: list[list[int]], seed: int, model: str,
            disk_root: str | None = None) -> Result:
    set_inprocess_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    disk_dir = None
    if config == DISK:  # a fresh, empty directory per run
        disk_dir = tempfile.mkdtemp(prefix="long_doc_qa_disk_", dir=disk_root)
    spec = engine_spec(config, len(docs), len(docs[0]), model, disk_dir)
    # Stats logging on: RequestOutput.metrics carries each request's TTFT.
    llm = LLM(**spec.llm_kwargs(), disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    try:
        warm = [TokensPrompt(prompt_token_ids=d) for d in docs]
        llm.generate(warm, params, use_tqdm=False)
        order = [i for i in range(len(docs)) for _ in range(2)]
        random.Random(seed).shuffle(order)
        prompts = [TokensPrompt(prompt_token_ids=docs[i]) for i in order]
        conn = scheduler_connector(llm) if spec.offload else None
        totals = conn.scheduler.totals.data if conn else {}
        hits_before = totals.get("cpu_hit_tokens", 0)
        promoted_before = totals.get("blocks_from_disk", 0)
        counter = _count_steps(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        ttft = [o.metrics.first_token_latency for o in outputs if o.metrics is not None]
        hits = totals.get("cpu_hit_tokens", 0) - hits_before
        result = Result(len(docs), config, wall, ttft,
                      cached_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                      prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                      cpu_hit_tokens=hits, steps=counter[0], scheduled_tokens=counter[1],
                        preemptions=sum(o.metrics.num_preemptions for o in outputs
                                        if o.metrics is not None))
        if config == DISK:
            result.extra["blocks_from_disk"] = totals.get("blocks_from_disk", 0) - promoted_before
        return result
    finally:
        close_llm(llm)
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _count_steps(llm) -> list[int]:
    """Count engine steps and scheduled tokens from now on: [steps, tokens]."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counter = [0, 0]
    schedule = scheduler.schedule
    trace = os.environ.get("LONG_DOC_QA_STEP_TRACE")

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            counter[0] += 1
            counter[1] += out.total_num_scheduled_tokens
        if trace:  # one line per step: time, scheduled tokens, running requests
            with open(trace, "a") as f:
                f.write(f"{time.perf_counter():.4f} {out.total_num_scheduled_tokens} "
                        f"{len(out.num_scheduled_tokens)} {len(scheduler.running)} "
                        f"{len(scheduler.waiting)}\n")
        return out

    scheduler.schedule = counting_schedule
    return counter


def ratio(results: list[Result], n: int, a: str, b: str) -> float:
    by = {r.config: r.wall_s for r in results if r.num_docs == n}
    return by[a] / by[b]


def format_table(results: list[Result], ns: list[int]) -> str:
    lines = [
        "| docs | engine | measured pass s | TTFT mean ms | TTFT p50 ms | TTFT p99 ms "
        "| cached prompt tokens | CPU-tier hit tokens | steps | computed tokens | preemptions |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.num_docs} | {r.config} | {r.wall_s:.2f} | {r.ttft_mean * 1e3:.0f} | "
            f"{r.ttft(0.5) * 1e3:.0f} | {r.ttft(0.99) * 1e3:.0f} | "
            f"{r.cached_tokens}/{r.prompt_tokens} | {r.cpu_hit_tokens} | {r.steps} | "
            f"{r.scheduled_tokens} | {r.preemptions} |")
    lines += ["", "| docs | (2)/(3) speed-up | target | (3)/(4) slowdown | target | met |",
              "|---:|---:|---:|---:|---:|:---|"]
    for n in ns:
        speedup = ratio(results, n, "prefix-cache", "prefix-cache+offload")
        vs_limit = ratio(results, n, "prefix-cache+offload", "prefix-cache-limit")
        if n <= SMALL_N:
            met = speedup >= TARGET_SPEEDUP and vs_limit <= TARGET_VS_LIMIT
            lines.append(f"| {n} | {speedup:.2f}x | >= {TARGET_SPEEDUP:.0f}x | {vs_limit:.2f}x | "
                         f"<= {TARGET_VS_LIMIT}x | {'yes' if met else 'no'} |")
        else:
            met = speedup >= 1.0
            lines.append(f"| {n} | {speedup:.2f}x | >= 1x | {vs_limit:.2f}x | - | "
                         f"{'yes' if met else 'no'} |")
    if any(r.config == SAME_BATCH for r in results):
        lines += ["", f"| docs | (3)/({SAME_BATCH}) | (4)/({SAME_BATCH}) |", "|---:|---:|---:|"]
        for n in ns:
            lines.append(f"| {n} | {ratio(results, n, 'prefix-cache+offload', SAME_BATCH):.2f}x "
                         f"| {ratio(results, n, 'prefix-cache-limit', SAME_BATCH):.2f}x |")
    if any(r.config == DISK for r in results):
        lines += ["", "| docs | (2)/(5) speed-up with the disk tier | target | blocks promoted "
                  "from disk | met |", "|---:|---:|---:|---:|:---|"]
        for n in ns:
            speedup = ratio(results, n, "prefix-cache", DISK)
            promoted = next(r for r in results if r.num_docs == n and r.config == DISK
                            ).extra.get("blocks_from_disk", 0)
            target = f">= {TARGET_DISK_SPEEDUP}x" if n > SMALL_N else "-"
            met = ("yes" if speedup >= TARGET_DISK_SPEEDUP else "no") if n > SMALL_N else "-"
            lines.append(f"| {n} | {speedup:.2f}x | {target} | {promoted} | {met} |")
    return "\n".join(lines)


def write_plot(results: list[Result], ns: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in (*CONFIGS, *EXTRA_CONFIGS) if any(r.config == c for r in results)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(configs)
    for k, config in enumerate(configs):
        rows = [next(r for r in results if r.num_docs == n and r.config == config) for n in ns]
        xs = [i + (k - (len(configs) - 1) / 2) * width for i in range(len(ns))]
        axes[0].bar(xs, [r.wall_s for r in rows], width, label=config)
        axes[1].bar(xs, [r.ttft_mean * 1e3 for r in rows], width, label=config)
    for ax, ylabel in zip(axes, ("measured pass (s)", "TTFT mean (ms)")):
        ax.set_xticks(range(len(ns)), [f"{n} docs" for n in ns])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-documents", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--document-length", type=int, default=DEFAULT_LENGTH,
                        help="tokens per document (a multiple of 32 keeps blocks full)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine; the fastest measured pass is kept")
    parser.add_argument("--seed", type=int, default=0, help="order of the measured pass")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        choices=(*CONFIGS, *EXTRA_CONFIGS))
    parser.add_argument("--disk", action="store_true",
                        help=f"also run {DISK}: a disk tier holding every document")
    parser.add_argument("--same-batch-limit", action="store_true",
                        help=f"also run {SAME_BATCH}: the limit engine with at most "
                             f"{DEVICE_DOCS} requests per batch")
    parser.add_argument("--disk-dir", default=None,
                        help="where the disk tier's temporary directories go (default: $TMPDIR)")
    parser.add_argument("--quick", action="store_true",
                        help="8 documents of 256 tokens, no files written")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_documents, args.document_length = [8], 256
    if args.disk and DISK not in args.configs:
        args.configs.append(DISK)
    if args.same_batch_limit and SAME_BATCH not in args.configs:
        args.configs.append(SAME_BATCH)

    model = build_tiny_llama(MODEL_DIR, MODEL)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    shape = (f"random-weight Llama: {num_params(MODEL, vocab) / 1e6:.1f}M params, "
             f"{MODEL.num_hidden_layers} layers, hidden {MODEL.hidden_size}, "
             f"{MODEL.num_attention_heads} heads ({MODEL.num_key_value_heads} KV, head_dim "
             f"{MODEL.head_dim}), bf16, block {BLOCK_SIZE} tokens = "
             f"{block_bytes(MODEL) // 1024} KiB KV")
    setup = (f"{args.document_length} tokens per document, {OUTPUT_TOKENS} output tokens, "
             f"device cache {DEVICE_DOCS} documents (limit engine: all), CPU tier "
             f"{CPU_DOCS} documents, best of {args.repeats}")
    print(shape)
    print(setup)

    results: list[Result] = []
    for n in args.num_documents:
        docs = documents(n, args.document_length, vocab)
        for config in args.configs:
            runs = [run_one(config, docs, args.seed, model, args.disk_dir)
                    for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r.wall_s)
            best.extra["all_wall_s"] = [round(r.wall_s, 3) for r in runs]
            results.append(best)
            disk_note = (f"  from disk {best.extra['blocks_from_disk']} blocks"
                         if config == DISK else "")
            print(f"  {n:3d} docs  {config:25s} {best.wall_s:7.2f} s  "
                  f"TTFT mean {best.ttft_mean * 1e3:7.0f} ms  cpu hits {best.cpu_hit_tokens}  "
                  f"steps {best.steps}  computed {best.scheduled_tokens}  "
                  f"preempted {best.preemptions}{disk_note}"
                  f"  runs {best.extra['all_wall_s']}", flush=True)

    if not set(CONFIGS) <= set(args.configs):
        return
    table = format_table(results, args.num_documents)
    print(table)
    if args.quick:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # The default document length writes long_doc_qa.*, others long_doc_qa_<L>.*
    stem = ("long_doc_qa" if args.document_length == DEFAULT_LENGTH
            else f"long_doc_qa_{args.document_length}")
    (args.out_dir / f"{stem}.md").write_text(
        f"# Long-document QA, {args.document_length}-token documents\n\n{shape}.\n\n"
        f"{setup}.\n\n{table}\n\n![plot]({stem}.png)\n")
    write_plot(results, args.num_documents, args.out_dir / f"{stem}.png",
               f"long-document QA, {args.document_length}-token documents; {shape}")
    print(f"wrote {args.out_dir / stem}.md and {stem}.png")

if __name__ == "__main__":
    main()
