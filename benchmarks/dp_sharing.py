"""Data-parallel ranks of one server sharing what they computed, in the spirit of vLLM #58240.

One OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with
``--data-parallel-size 2``, one engine core per rank, each rank bound to one core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``). ``N`` long documents (long_doc_qa's model and
documents) are sent to rank 0, one by one, then each to rank 1, one by one (vLLM's
``X-data-parallel-rank`` header picks the rank, as a router would). Measured, per
request: the time to its first streamed token (TTFT) and the prompt tokens the rank
computed (prompt tokens minus the cached ones vLLM reports). Configurations, each
its own server, one after the other:

* ``no sharing``: the connector with a CPU tier on each rank; rank 1 has seen none
  of the documents and computes them;
* ``mooncake``: plus the Mooncake tier, both ranks on one local ``mooncake_master``
  (TCP, loopback): rank 1 reads what rank 0 stored;
* ``shared /dev/shm disk``: instead, a disk tier both ranks share (``disk_shared``) in
  a fresh private directory under ``/dev/shm``, no master: rank 1 reads the files rank
  0 wrote.

Prints a table and writes ``docs/benchmarks/dp_sharing.{md,png}``.

    python benchmarks/dp_sharing.py [--num-documents 8] [--document-length 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from long_doc_qa import MODEL, MODEL_DIR, block_bytes, documents  # noqa: E402

from kvoffload_hal.demo.inprocess import CONNECTOR  # noqa: E402
from kvoffload_hal.selfcheck.environment import cpu_model  # noqa: E402

OUT = HERE.parent / "docs" / "benchmarks" / "dp_sharing.md"
CONFIGS = ("no sharing", "mooncake", "shared /dev/shm disk")
WRITTEN = {"mooncake": "blocks_to_mooncake", "shared /dev/shm disk": "blocks_to_disk"}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONHASHSEED": "0"}


def transfer_config(num_blocks: int, master: str | None, disk: str | None = None) -> dict:
    extra = {"cpu_bytes_to_use": 2 * num_blocks * block_bytes(MODEL)}
    if master is not None:
        extra.update(mooncake_master=master, mooncake_required=True,
                     mooncake_segment_bytes=max(16 << 20, 2 * num_blocks * block_bytes(MODEL)))
    if disk is not None:
        extra.update(disk_path=disk, disk_bytes_to_use=2 * num_blocks * block_bytes(MODEL),
                     disk_shared=True, disk_retention="remove")
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def start(model: str, log: Path, args, master: str | None, disk: str | None = None):
    from support.openai_server import Server

    num_blocks = args.num_documents * (args.document_length // 32 + 1)
    server = Server(model, log, num_gpu_blocks=num_blocks + 16, offload=False, env=ENV,
                    extra_args=["--data-parallel-size", "2", "--dtype", "bfloat16",
                                "--max-model-len", str(args.document_length + 64),
                                "--kv-transfer-config",
                                json.dumps(transfer_config(num_blocks, master, disk))])
    server.wait_ready()
    return server


def ask(client, model: str, prompt: list[int], rank: int) -> tuple[float, int, int]:
    """(seconds to the first streamed token, prompt tokens, those the rank computed)."""
    start = time.perf_counter()
    ttft, usage = None, None
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"X-data-parallel-rank": str(rank)})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return ttft, usage.prompt_tokens, usage.prompt_tokens - cached


def store_settled(server, engine: int, counter: str, timeout_s: float = 120) -> float:
    """Blocks rank ``engine`` wrote to the tier (``counter``), once that count stops
    growing."""
    from support.mooncake_server import Probe

    probe, last, deadline = Probe(server), -1.0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = probe.counters(engine).get(counter, 0)
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    return last


def measure(config: str, model: str, docs: list[list[int]], args, tmp: Path) -> dict:
    from support.mooncake_master import MooncakeMaster

    master = MooncakeMaster(str(tmp / "master.log")).start() if config == "mooncake" else None
    # A fresh private directory in memory, as the ranks of a host would share it.
    shm = tempfile.mkdtemp(prefix="kvoffload-dp-", dir="/dev/shm") if "disk" in config \
        else None
    server = None
    try:
        server = start(model, tmp / f"{config.replace(' ', '-').replace('/', '')}.log", args,
                       master.address if master else None, shm and f"{shm}/kv")
        client = server.client()
        for rank in (0, 1):  # warm both ranks up
            ask(client, model, [7, 8, 9], rank)
        first = [ask(client, model, d, 0) for d in docs]
        written = store_settled(server, 0, WRITTEN[config]) if config in WRITTEN else 0
        second = [ask(client, model, d, 1) for d in docs]
        return {"config": config, "written_blocks": written,
                "prompt_tokens": sum(p for _, p, _ in second),
                "rank0_ttft": [t for t, _, _ in first],
                "rank0_computed": sum(c for _, _, c in first),
                "rank1_ttft": [t for t, _, _ in second],
                "rank1_computed": sum(c for _, _, c in second)}
    finally:
        if server is not None:
            server.kill()
        if master is not None:
            master.stop()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def table(rows: list[dict], args) -> str:
    lines = [f"{args.num_documents} documents of {args.document_length} tokens, each sent to "
             "rank 0, then to rank 1 (measured)", "",
             "| configuration | rank 0 TTFT s (mean) | rank 1 TTFT s (mean) | rank 1 TTFT s "
             "(sum) | rank 1 prompt tokens computed |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {statistics.fmean(r['rank0_ttft']):.3f} | "
                     f"{statistics.fmean(r['rank1_ttft']):.3f} | {sum(r['rank1_ttft']):.2f} | "
                     f"{r['rank1_computed']} of {r['prompt_tokens']} |")
    return "\n".join(lines) + "\n"


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    names = [r["config"].replace("shared ", "shared\n") for r in rows]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [statistics.fmean(r["rank0_ttft"]) for r in rows], 0.4,
             label="rank 0 (first)", color="tab:gray")
    left.bar([i + 0.2 for i in x], [statistics.fmean(r["rank1_ttft"]) for r in rows], 0.4,
             label="rank 1 (second)", color="tab:blue")
    left.set_xticks(list(x), names)
    left.set_ylabel("mean TTFT s")
    left.legend(fontsize=7)
    right.bar(names, [r["rank1_computed"] for r in rows], color="tab:green")
    right.set_ylabel("prompt tokens rank 1 computed")
    fig.suptitle("a document served by DP rank 0, then sent to rank 1", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-documents", type=int, default=8)
    p.add_argument("--document-length", type=int, default=2048)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(MODEL_DIR, MODEL)
    docs = documents(args.num_documents, args.document_length,
                     len(AutoTokenizer.from_pretrained(model)))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(c, model, docs, args, Path(tmp)) for c in CONFIGS]
    text = (f"CPU: {cpu_model()}; load average (1 min) {load_before:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end\n\n" + table(rows, args))
    print(text)
    if args.no_write:
        return
    png = OUT.with_suffix(".png")
    OUT.write_text(f"{text}\n![plot]({png.name})\n")
    write_plot(rows, png)
    print(f"wrote {OUT} and {png}")


if __name__ == "__main__":
    main()
