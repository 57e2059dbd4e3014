"""Long-document QA on a GPU at a real model's shape: our connector beside vLLM's.

The workload of ``long_doc_qa.py`` (``N`` random documents, a warm-up pass, then each
document twice in a seeded order, 10 greedy output tokens, one ``generate`` call
per pass), on random bf16 weights of a real model's shape built here, with four
engines side by side in one run:

1. ``prefix-cache``: the device cache holds 8 documents;
2. ``hal-offload``: (1) plus ``HALOffloadConnector``, a CPU tier of 30 documents;
3. ``vllm-offloading``: (1) plus vLLM's ``OffloadingConnector`` (``CPUOffloadingSpec``)
   with the same CPU bytes (``cpu_bytes_to_use``, LRU);
4. ``limit-at-8-seqs``: a device cache for every request, at most 8 requests a batch
   (what the small batches cost, apart from what copies cost).

One engine per configuration serves every document count in turn (smallest first,
each count with documents of its own):
an engine's start costs more GPU time than its passes. Reported per engine and
count: the measured pass's wall time, TTFT mean/p50/p99, prompt tokens served from
a cache, the bytes each connector copied in both passes with the bandwidth its
copies saw (bytes over the seconds its copies took), and
whether the engine generated the same tokens as ``prefix-cache`` (a digest).
Writes ``gpu_long_doc_qa.{md,json,png}`` to ``--out-dir``.

    python benchmarks/gpu_long_doc_qa.py --out-dir DIR [--shape llama-3.2-1b]
        [--num-documents 8 16 32] [--document-length 2048] [--configs ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from long_doc_qa import CPU_DOCS, DEVICE_DOCS, OUTPUT_TOKENS, TOKEN_ID_FLOOR
from long_doc_qa_probes import count_steps
from long_doc_qa_report import write_plot

from kvoffload_hal.demo.inprocess import EngineSpec, offload_transfer_config
from kvoffload_hal.demo.tiny_model import TinyModelSpec

BLOCK_SIZE = 32  # the CPU lane's block size; FlashAttention takes any multiple of 16
BF16_BYTES = 2
#: Real models' attention shapes (vocabulary: the small offline tokenizer's).
SHAPES = {
    "llama-3.2-1b": TinyModelSpec(hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=16, num_attention_heads=32,
                                  num_key_value_heads=8, max_position_embeddings=8192),
    "qwen3-1.7b": TinyModelSpec(hidden_size=2048, intermediate_size=6144,
                                num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, max_position_embeddings=8192),
    # A smoke run on vLLM's CPU platform (without vllm-offloading: its copies need CUDA).
    "tiny": TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4),
}
PREFIX, HAL, UPSTREAM, SAME_BATCH = ("prefix-cache", "hal-offload", "vllm-offloading",
                                     "limit-at-8-seqs")
CONFIGS = (PREFIX, HAL, UPSTREAM, SAME_BATCH)


@dataclass
class GpuEngineSpec(EngineSpec):
    """An :class:`EngineSpec` that may name another KV connector's config."""

    connector: dict[str, Any] | None = None  # KVTransferConfig fields
    gpu_memory_utilization: float = 0.8

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs = super().llm_kwargs()
        kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.connector is not None:
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(**self.connector)
        return kwargs


def block_bytes(shape: TinyModelSpec) -> int:
    return (2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim
            * BLOCK_SIZE * BF16_BYTES)


def blocks_per_doc(length: int) -> int:
    return -(-(length + OUTPUT_TOKENS) // BLOCK_SIZE)


def cpu_bytes(shape: TinyModelSpec, length: int) -> int:
    """The CPU tier of both connectors: 30 documents' full blocks."""
    return CPU_DOCS * (length // BLOCK_SIZE) * block_bytes(shape)


def engine_spec(config: str, shape: TinyModelSpec, model: str, length: int,
                max_docs: int) -> GpuEngineSpec:
    """The engine of ``config``; sized for ``max_docs`` documents where it matters."""
    if config not in CONFIGS:
        raise ValueError(f"config={config!r}: expected one of {', '.join(CONFIGS)}")
    per_doc = blocks_per_doc(length)
    limit = config == SAME_BATCH
    spec = GpuEngineSpec(
        model=model, block_size=BLOCK_SIZE, max_model_len=length + OUTPUT_TOKENS + BLOCK_SIZE,
        # + 1: vLLM's null block. The limit engine holds every request of a pass.
        num_gpu_blocks=2 * max_docs * per_doc + 1 if limit else DEVICE_DOCS * per_doc + 1,
        max_num_seqs=DEVICE_DOCS if limit else 256,
        offload=config == HAL, cpu_bytes_to_use=cpu_bytes(shape, length))
    if config == UPSTREAM:
        spec.connector = dict(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "CPUOffloadingSpec",
                                       "cpu_bytes_to_use": cpu_bytes(shape, length),
                                       "eviction_policy": "lru"})
    return spec


def hal_config_dict(spec: GpuEngineSpec) -> dict:
    """The HAL engine's connector config, as the run passes it (for the report)."""
    cfg = offload_transfer_config(cpu_bytes_to_use=spec.cpu_bytes_to_use,
                                  lazy_offload=spec.lazy_offload, **spec.extra_config)
    return dict(kv_connector=cfg.kv_connector, extra=cfg.kv_connector_extra_config)


def documents(num_docs: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    """``long_doc_qa.documents``' documents, with a salt: each count has its own."""
    out = []
    for i in range(num_docs):
        rng = random.Random(1_000_000 * salt + 1000 + i)
        out.append([rng.randrange(TOKEN_ID_FLOOR, vocab) for _ in range(length)])
    return out


class CopyMeter:
    """Bytes each connector's worker copied and the seconds its copies took."""

    def __init__(self, config: str):
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        self.conn = get_kv_transfer_group() if has_kv_transfer_group() else None
        self.config, self.sums = config, {}
        if config == UPSTREAM and self.conn is not None:
            worker = self.conn.connector_worker
            original = worker.get_kv_connector_stats

            def counted():
                stats = original()
                if stats is not None:
                    stats.data = as_sent(stats.data)
                    add_upstream_ops(self.sums, stats.data)
                return stats

            worker.get_kv_connector_stats = counted

    def totals(self) -> dict[str, float]:
        if self.config == HAL and self.conn is not None:
            return copy_totals_hal(dict(self.conn.worker.totals.data))
        return copy_totals_upstream(self.sums)


def copy_totals_hal(data: dict) -> dict[str, float]:
    return dict(load_bytes=data.get("bytes_loaded", 0), load_s=data.get("load_seconds", 0.0),
                store_bytes=data.get("bytes_stored", 0), store_s=data.get("store_seconds", 0.0))


def as_sent(data: dict) -> dict:
    """vLLM's per-copy records as another process receives them: dicts. In one process
    (``LLM`` runs the engine in its own) they stay dataclasses, which vLLM 0.23's own
    ``reduce()`` and Prometheus logger refuse (``assert isinstance(op, dict)``)."""
    return {kind: [op if isinstance(op, dict) else dataclasses.asdict(op) for op in ops]
            for kind, ops in data.items()}


def add_upstream_ops(sums: dict, data: dict) -> None:
    """Add the records (``{"CPU_to_GPU": [{"op_size", "op_time"}, ...]}``) to ``sums``
    under the names of vLLM's ``reduce()``."""
    for kind, ops in data.items():
        for op in ops:
            sums[f"{kind}_total_bytes"] = sums.get(f"{kind}_total_bytes", 0) + op["op_size"]
            sums[f"{kind}_total_time"] = sums.get(f"{kind}_total_time", 0.0) + op["op_time"]


def copy_totals_upstream(sums: dict) -> dict[str, float]:
    return dict(load_bytes=sums.get("CPU_to_GPU_total_bytes", 0),
                load_s=sums.get("CPU_to_GPU_total_time", 0.0),
                store_bytes=sums.get("GPU_to_CPU_total_bytes", 0),
                store_s=sums.get("GPU_to_CPU_total_time", 0.0))


def measured_pass(llm, docs: list[list[int]], seed: int, meter: CopyMeter) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    before = meter.totals()  # copies of both passes: the warm-up's stores too
    llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs], params, use_tqdm=False)
    order = [i for i in range(len(docs)) for _ in range(2)]
    random.Random(seed).shuffle(order)
    counter = count_steps(llm)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=docs[i]) for i in order], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    after = meter.totals()
    ttft = sorted(o.metrics.first_token_latency for o in outs if o.metrics is not None)
    return dict(wall_s=wall, ttft_mean=sum(ttft) / len(ttft), ttft_p50=ttft[len(ttft) // 2],
                ttft_p99=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                cached_tokens=sum(o.num_cached_tokens or 0 for o in outs),
                prompt_tokens=sum(len(o.prompt_token_ids) for o in outs), steps=counter[0],
                copies={k: after[k] - before[k] for k in after},
                tokens=tokens_digest([list(o.outputs[0].token_ids) for o in outs]))


def tokens_digest(outputs: list[list[int]]) -> str:
    """A digest of every request's output tokens, in order: equal across engines when
    each generated the same tokens."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12]


def run_config(config: str, args: argparse.Namespace, shape: TinyModelSpec, model: str,
               vocab: int) -> list[dict]:
    """One engine of ``config`` serves every document count; one row per count."""
    from vllm import LLM

    from kvoffload_hal.demo.inprocess import close_llm, set_inprocess_env

    set_inprocess_env()
    spec = engine_spec(config, shape, model, args.document_length, max(args.num_documents))
    start = time.perf_counter()
    llm = LLM(**spec.llm_kwargs(), disable_log_stats=False)
    rows = []
    try:
        meter = CopyMeter(config)
        started = time.perf_counter() - start
        for salt, n in enumerate(sorted(args.num_documents)):
            docs = documents(n, args.document_length, vocab, salt)
            row = dict(config=config, num_docs=n, engine_start_s=round(started, 1),
                       **measured_pass(llm, docs, args.seed, meter))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        close_llm(llm)
    return rows


def gbps(num_bytes: float, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.1f}" if seconds > 0 and num_bytes else "-"


def format_table(rows: list[dict]) -> str:
    """One line per count and engine; pass time also as a multiple of prefix-cache's."""
    lines = ["| docs | engine | pass s | x prefix-cache | TTFT mean ms | p50 | p99 | "
             "cached tokens | loaded GiB | load GB/s | stored GiB | store GB/s | tokens |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = {r["num_docs"]: r["wall_s"] for r in rows if r["config"] == PREFIX}
    same = {r["num_docs"]: r["tokens"] for r in rows if r["config"] == PREFIX}
    for r in sorted(rows, key=lambda r: (r["num_docs"], CONFIGS.index(r["config"]))):
        c = r["copies"]
        ratio = f"{r['wall_s'] / base[r['num_docs']]:.2f}" if r["num_docs"] in base else "-"
        lines.append(
            f"| {r['num_docs']} | {r['config']} | {r['wall_s']:.3f} | {ratio} | "
            f"{r['ttft_mean'] * 1e3:.1f} | {r['ttft_p50'] * 1e3:.1f} | "
            f"{r['ttft_p99'] * 1e3:.1f} | {r['cached_tokens']}/{r['prompt_tokens']} | "
            f"{c['load_bytes'] / 2**30:.2f} | {gbps(c['load_bytes'], c['load_s'])} | "
            f"{c['store_bytes'] / 2**30:.2f} | {gbps(c['store_bytes'], c['store_s'])} | "
            f"{_same(r, same)} |")
    return "\n".join(lines)


def _same(row: dict, base: dict) -> str:
    """Whether the row's engine generated prefix-cache's tokens (same count)."""
    if row["num_docs"] not in base or row["config"] == PREFIX:
        return row["tokens"]
    return "same" if row["tokens"] == base[row["num_docs"]] else f"DIFFER {row['tokens']}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--num-documents", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--document-length", type=int, default=2048,
                        help="tokens per document (a multiple of 32 keeps blocks full)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--seed", type=int, default=0, help="order of the measured pass")
    parser.add_argument("--model-dir", default="/tmp/gpu_long_doc_qa_model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    shape = SHAPES[args.shape]
    model = build_tiny_llama(f"{args.model_dir}-{args.shape}", shape)
    vocab = len(AutoTokenizer.from_pretrained(model))
    rows, failed = [], []
    for config in args.configs:  # one engine failing leaves the others' rows
        try:
            rows += run_config(config, args, shape, model, vocab)
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            print(f"{config} failed: {e!r}", flush=True)
            failed.append(f"{config}: {type(e).__name__}: {e}")
    setup = (f"{args.shape} shape, random bf16 weights (vocabulary {vocab}), block "
             f"{BLOCK_SIZE} tokens = {block_bytes(shape) >> 10} KiB KV; "
             f"{args.document_length}-token documents, {OUTPUT_TOKENS} output tokens; device "
             f"cache {DEVICE_DOCS} documents, CPU tier {CPU_DOCS} documents "
             f"({cpu_bytes(shape, args.document_length) / 2**30:.2f} GiB) for both connectors")
    table = format_table(rows) + "".join(f"\n\nFailed: {f}" for f in failed)
    print(setup + "\n\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_long_doc_qa.md").write_text(
        f"# Long-document QA on a GPU\n\n{setup}.\n\n{table}\n")
    (args.out_dir / "gpu_long_doc_qa.json").write_text(
        json.dumps(dict(setup=setup, shape=asdict(shape), rows=rows), indent=1) + "\n")
    plot(rows, args.out_dir / "gpu_long_doc_qa.png", f"long-document QA on a GPU; {setup}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """``long_doc_qa``'s plot (measured pass, TTFT mean) of these rows."""
    ns = sorted({r["num_docs"] for r in rows})
    results = [SimpleNamespace(**{k: r[k] for k in ("num_docs", "config", "wall_s",
                                                     "ttft_mean")}) for r in rows]
    write_plot(results, ns, path, title)


if __name__ == "__main__":
    main()
