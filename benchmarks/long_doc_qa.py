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
most 8 requests in a batch (about what a device cache of 8 documents admits): what
the small batches cost, apart from what the copies cost.

With ``--disk`` a fifth engine runs: ``prefix-cache+offload+disk``, (3) plus a
disk tier behind the CPU tier big enough for every document (write-through, so
the warm-up pass fills it). It matters where the working set outgrows the CPU
tier: at 64 documents a CPU tier of 30 serves few hits in a random order.

Engine (3) runs once per ``--eviction`` policy, ``--device-copies`` mode and
``--load-room`` (``defer``: ``defer_loads_without_room``); the first of each is named
``prefix-cache+offload``, others ``prefix-cache+offload[<what differs>]``
(``adaptive-no-ends``: ``adaptive`` without its rule for blocks that end a prompt,
``eviction_variants.py``). Its CPU tier records its block access trace; the
eviction summary gives its hit blocks as a fraction of Belady's optimum on that
trace, next to LRU's and vLLM's offloading policies' replays of it, and its
computed tokens against the minimum (every prefix served from a cache). The
hierarchy summary gives, for every engine, the prompt blocks any of its caches
served against Belady's optimum of all of them together (device cache, CPU tier,
disk tier), on the requests in the order the engine admitted them
(``long_doc_qa_hierarchy.py``), and against the same cache told how many more times
each block will be read but not when; each engine's line prints the tokens it would
compute at either one's hits.

Reported per engine: wall time of the measured pass, TTFT mean/p50/p99 (from
``RequestOutput.metrics.first_token_latency``: vLLM fills it offline when stats
logging is enabled), prompt tokens served from a cache, and the connector's CPU
tier hits. Prints a table and writes ``docs/benchmarks/long_doc_qa.{md,png}``.

    python benchmarks/long_doc_qa.py [--num-documents 16 32 64] [--document-length 256]
                                     [--eviction adaptive adaptive-no-ends lru]
                                     [--device-copies drop keep] [--load-room off defer]
                                     [--repeats 1] [--disk [--disk-dir DIR]]
                                     [--same-batch-limit] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import eviction_variants  # noqa: F401  (registers adaptive-no-ends)
from long_doc_qa_hierarchy import Admissions, hierarchy_table
from long_doc_qa_probes import ConnectorTime, count_steps
from long_doc_qa_report import (
    CONFIGS,
    DISK,
    EXTRA_CONFIGS,
    OFFLOAD,
    SAME_BATCH,
    connector_table,
    eviction_table,
    format_table,
    num_params,
    offload_label,
    print_result,
    write_plot,
)

from kvoffload_hal.demo.eviction_replay import recorded_trace_hits
from kvoffload_hal.demo.inprocess import (
    EngineSpec,
    close_llm,
    scheduler_connector,
    set_inprocess_env,
)
from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama
from kvoffload_hal.eviction.registry import (
    DEFAULT_DEVICE_COPIES,
    DEFAULT_EVICTION,
    DEVICE_COPY_MODES,
    eviction_names,
)

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
    policy: str = "-"  # the CPU tier's eviction policy, where it has one
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


def documents(num_docs: int, length: int, vocab: int) -> list[list[int]]:
    docs = []
    for i in range(num_docs):
        rng = random.Random(1000 + i)
        docs.append([rng.randrange(TOKEN_ID_FLOOR, vocab) for _ in range(length)])
    return docs


def engine_spec(config: str, num_docs: int, length: int, model: str,
                disk_dir: str | None = None, eviction: str = DEFAULT_EVICTION,
                device_copies: str = DEFAULT_DEVICE_COPIES, load_room: str = "off") -> EngineSpec:
    blocks_per_doc = -(-(length + OUTPUT_TOKENS) // BLOCK_SIZE)
    extra = {}
    if config in (OFFLOAD, DISK):
        extra.update(eviction=eviction, device_copies=device_copies,
                     defer_loads_without_room=load_room == "defer")
    if config == DISK:
        # Room for every document's full blocks, with a spare document.
        extra.update(disk_path=disk_dir, disk_bytes_to_use=disk_blocks(num_docs, length)
                     * block_bytes(MODEL))
    if config in ("prefix-cache-limit", SAME_BATCH):
        # A full copy for each of the 2N requests of the measured pass: nothing
        # is ever evicted and nothing is preempted, whatever the batching.
        num_gpu_blocks = 2 * num_docs * blocks_per_doc
    else:
        # + 1: vLLM's null block; without it 8 whole requests do not fit, and preempt.
        num_gpu_blocks = DEVICE_DOCS * blocks_per_doc + 1
    return EngineSpec(
        model=model,
        num_gpu_blocks=num_gpu_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=length + OUTPUT_TOKENS + BLOCK_SIZE,
        offload=config in (OFFLOAD, DISK),
        cpu_bytes_to_use=CPU_DOCS * (length // BLOCK_SIZE) * block_bytes(MODEL),
        enable_prefix_caching=config != "no-prefix-cache",
        extra_config=extra,
        max_num_seqs=DEVICE_DOCS if config == SAME_BATCH else 256,
    )


def disk_blocks(num_docs: int, length: int) -> int:
    """The disk tier of engine (5): every document's blocks, and a spare document."""
    return (num_docs + 1) * -(-(length + OUTPUT_TOKENS) // BLOCK_SIZE)


def minimum_computed_tokens(num_docs: int, length: int) -> int:
    """Tokens the measured pass computes when every prefix comes from a cache:
    per request, the tokens after its last full block before the last prompt
    token (which is always computed), and every output token but the last."""
    cached = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    return 2 * num_docs * (length - cached + OUTPUT_TOKENS - 1)


def run_one(config: str, docs: list[list[int]], seed: int, model: str,
            disk_root: str | None = None, eviction: str = DEFAULT_EVICTION,
            device_copies: str = DEFAULT_DEVICE_COPIES, load_room: str = "off") -> Result:
    set_inprocess_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    disk_dir = None
    if config == DISK:  # a fresh, empty directory per run
        disk_dir = tempfile.mkdtemp(prefix="long_doc_qa_disk_", dir=disk_root)
    spec = engine_spec(config, len(docs), len(docs[0]), model, disk_dir, eviction,
                       device_copies, load_room)
    # Stats logging on: RequestOutput.metrics carries each request's TTFT.
    llm = LLM(**spec.llm_kwargs(), disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    try:
        conn = scheduler_connector(llm) if spec.offload else None
        if conn is not None:  # every CPU-tier access from the start, warm-up included
            conn.scheduler.cpu.eviction.trace = []
        admissions = Admissions(llm.llm_engine.engine_core.engine_core.scheduler, BLOCK_SIZE)
        warm = [TokensPrompt(prompt_token_ids=d) for d in docs]
        llm.generate(warm, params, use_tqdm=False)
        measured_from = len(admissions.requests)
        order = [i for i in range(len(docs)) for _ in range(2)]
        random.Random(seed).shuffle(order)
        prompts = [TokensPrompt(prompt_token_ids=docs[i]) for i in order]
        totals = conn.scheduler.totals.data if conn else {}
        hits_before = totals.get("cpu_hit_tokens", 0)
        promoted_before = totals.get("blocks_from_disk", 0)
        counter = count_steps(llm)
        timer = ConnectorTime() if spec.offload else None
        with timer.measuring() if timer else contextlib.nullcontext():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        ttft = [o.metrics.first_token_latency for o in outputs if o.metrics is not None]
        hits = totals.get("cpu_hit_tokens", 0) - hits_before
        result = Result(len(docs), config, wall, ttft,
                        cached_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                        cpu_hit_tokens=hits, steps=counter[0], scheduled_tokens=counter[1],
                        preemptions=sum(o.metrics.num_preemptions for o in outputs if o.metrics))
        if config == DISK:
            result.extra["blocks_from_disk"] = totals.get("blocks_from_disk", 0) - promoted_before
        result.extra["hierarchy"] = dict(
            admissions.optimum(_cache_blocks(spec, conn, len(docs), len(docs[0])),
                               measured_from),
            hits=sum((o.num_cached_tokens or 0) // BLOCK_SIZE for o in outputs))
        if conn is not None:
            result.extra["connector_s"] = dict(timer.seconds)
            cpu = conn.scheduler.cpu
            defer = ", defer" if load_room == "defer" else ""
            result.policy = f"{eviction}, {device_copies}{defer}"
            # The pool's block 0 is vLLM's null block: it never caches.
            result.extra["trace_hits"] = recorded_trace_hits(cpu.eviction.trace,
                                                             cpu.num_blocks - 1)
        return result
    finally:
        close_llm(llm)
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _cache_blocks(spec: EngineSpec, conn, num_docs: int, length: int) -> int:
    """Blocks every cache of the engine holds together (vLLM's null block aside)."""
    blocks = spec.num_gpu_blocks - 1
    if conn is not None:
        blocks += conn.scheduler.cpu.num_blocks - 1
    if spec.extra_config.get("disk_path"):
        blocks += disk_blocks(num_docs, length)
    return blocks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-documents", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--document-length", type=int, default=DEFAULT_LENGTH,
                        help="tokens per document (a multiple of 32 keeps blocks full)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine; the fastest measured pass is kept")
    parser.add_argument("--seed", type=int, default=0, help="order of the measured pass")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        choices=(*CONFIGS, *EXTRA_CONFIGS))
    parser.add_argument("--eviction", nargs="+", default=[DEFAULT_EVICTION],
                        choices=eviction_names(),
                        help=f"CPU-tier eviction of {OFFLOAD}, one run each (the first is "
                             "the one compared in the main table)")
    parser.add_argument("--device-copies", nargs="+", default=[DEFAULT_DEVICE_COPIES],
                        choices=DEVICE_COPY_MODES,
                        help=f"what the CPU tier of {OFFLOAD} does with copies of blocks the "
                             "device holds, one run each with each --eviction (the first is "
                             "the one compared in the main table)")
    parser.add_argument("--load-room", nargs="+", default=["off"], choices=("off", "defer"),
                        help=f"{OFFLOAD}'s defer_loads_without_room (defer: on), one run each")
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
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
    results = run_all(args, model, vocab)
    if not {"prefix-cache", OFFLOAD, "prefix-cache-limit"} <= set(args.configs):
        return  # the tables compare these three; each engine's line is printed above
    write_report(args, results, shape, setup)


def run_all(args: argparse.Namespace, model: str, vocab: int) -> list[Result]:
    """Each engine (and each eviction policy of the offloading one) for each N.

    With ``--repeats`` above 1 the runs are interleaved: each round runs every
    engine once, so a slow spell of the host slows one run of each, not all the
    runs of one engine."""
    results: list[Result] = []
    for n in args.num_documents:
        docs = documents(n, args.document_length, vocab)
        first = (args.eviction[0], args.device_copies[0], args.load_room[0])
        runs_of = [(c, p, m, d) for c in args.configs
                   for p in (args.eviction if c == OFFLOAD else first[:1])
                   for m in (args.device_copies if c == OFFLOAD else first[1:2])
                   for d in (args.load_room if c == OFFLOAD else first[2:])]
        rounds = [[run_one(config, docs, args.seed, model, args.disk_dir, *choice)
                   for config, *choice in runs_of] for _ in range(args.repeats)]
        for k, (config, *choice) in enumerate(runs_of):
            runs = [r[k] for r in rounds]
            best = min(runs, key=lambda r: r.wall_s)
            best.extra["all_wall_s"] = [round(r.wall_s, 3) for r in runs]
            if config == OFFLOAD:
                best.config = offload_label(tuple(choice), first)
            results.append(best)
            print_result(n, best, config, BLOCK_SIZE)
    return results


def write_report(args: argparse.Namespace, results: list[Result], shape: str,
                 setup: str) -> None:
    minimum = {n: minimum_computed_tokens(n, args.document_length) for n in args.num_documents}
    table = (format_table(results, args.num_documents) + "\n\n"
             + eviction_table(results, args.num_documents, minimum) + "\n\n"
             + hierarchy_table(results, args.num_documents, BLOCK_SIZE) + "\n\n"
             + connector_table(results))
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
