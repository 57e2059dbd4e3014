"""Long-document QA across a server restart: what the disk tier's warm restart saves.

64 documents of 256 tokens (``long_doc_qa.py``'s model and documents), a device
cache of 8 documents, a CPU tier of 8 documents and a disk tier that holds them
all. A warm-up pass reads every document once; the measured pass reads each
document again with a question, in a seeded order, in one ``generate`` call.

* ``never restarted``: one engine runs both passes;
* ``restarted``: the engine stops cleanly after the warm-up, a new one starts on
  the same ``disk_path`` (``disk_retention: keep``), rebuilds its index from the
  files, and runs the measured pass;
* ``restarted, empty tier``: the same with ``disk_retention: remove``, what a
  restart cost before.

Reported: prompt tokens computed and wall time of the measured pass, blocks
promoted from disk, and the index rebuild (seconds until every rank reported,
blocks found per second). ``--scan-files N`` also lists a synthetic directory of
N block files to measure the scan rate at scale.

    python benchmarks/disk_restart.py [--num-documents 64] [--scan-files 100000]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.engines.drain_transfers

from long_doc_qa import (  # noqa: E402
    BLOCK_SIZE,
    DEVICE_DOCS,
    MODEL,
    MODEL_DIR,
    OUTPUT_TOKENS,
    block_bytes,
    documents,
)

CPU_DOCS = 8


def _spec(model: str, num_docs: int, length: int, disk_dir: str, retention: str):
    from kvoffload_hal.demo.inprocess import EngineSpec

    blocks_per_doc = -(-(length + OUTPUT_TOKENS) // BLOCK_SIZE)
    return EngineSpec(model=model, num_gpu_blocks=DEVICE_DOCS * blocks_per_doc,
                      block_size=BLOCK_SIZE, max_model_len=length + OUTPUT_TOKENS + BLOCK_SIZE,
                      offload=True,
                      cpu_bytes_to_use=CPU_DOCS * (length // BLOCK_SIZE) * block_bytes(MODEL),
                      extra_config={"disk_path": disk_dir, "disk_retention": retention,
                                    "disk_bytes_to_use": (num_docs + 1) * blocks_per_doc
                                    * block_bytes(MODEL)})


def _generate(llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)


def run(variant: str, model: str, docs: list[list[int]], seed: int) -> dict:
    from kvoffload_hal.demo.inprocess import close_llm, make_llm, scheduler_connector
    from support.engines import drain_transfers

    disk_dir = tempfile.mkdtemp(prefix="disk_restart_")
    retention = "remove" if variant == "restarted, empty tier" else "keep"
    spec = _spec(model, len(docs), len(docs[0]), disk_dir, retention)
    try:
        llm = make_llm(spec)
        _generate(llm, docs)
        assert drain_transfers(llm, timeout_s=300)
        rebuild_s, found = 0.0, 0
        if variant != "never restarted":
            close_llm(llm)
            llm = make_llm(spec)
            start = time.perf_counter()
            assert drain_transfers(llm, timeout_s=300)  # the index is rebuilt
            rebuild_s = time.perf_counter() - start
            rebuild = scheduler_connector(llm).scheduler.cascade.rebuild
            found = rebuild.adopted
        order = list(range(len(docs)))
        random.Random(seed).shuffle(order)
        prompts = [docs[i] + [3, 4, 5] for i in order]
        totals = scheduler_connector(llm).scheduler.totals.data
        from_disk = totals.get("blocks_from_disk", 0)
        start = time.perf_counter()
        outputs = _generate(llm, prompts)
        wall = time.perf_counter() - start
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        close_llm(llm)
        return {"variant": variant, "computed": prompt_tokens - cached,
                "prompt_tokens": prompt_tokens, "wall_s": wall, "rebuild_s": rebuild_s,
                "found": found, "from_disk": totals.get("blocks_from_disk", 0) - from_disk,
                "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def scan_rate(num_files: int) -> tuple[float, float]:
    """Seconds to list ``num_files`` block files laid out as the tier lays them out."""
    from kvoffload_hal.tiers.disk.rebuild import DirScan

    root = tempfile.mkdtemp(prefix="disk_scan_")
    try:
        rng = random.Random(0)
        for _ in range(num_files):
            key = f"{rng.getrandbits(256):064x}00000000"
            sub = os.path.join(root, key[:2])
            os.makedirs(sub, exist_ok=True)
            open(os.path.join(sub, f"{key}.kvb"), "wb").close()
        start = time.perf_counter()
        scan = DirScan(root)
        scan.join()
        seconds = time.perf_counter() - start
        found = 0
        while True:
            keys, done = scan.take()
            found += len(keys)
            if done:
                break
        assert found == num_files
        return seconds, num_files / seconds
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-documents", type=int, default=64)
    parser.add_argument("--document-length", type=int, default=256)
    parser.add_argument("--scan-files", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")  # block hashes match across engines
    from kvoffload_hal.demo.inprocess import set_inprocess_env
    from kvoffload_hal.demo.tiny_model import build_tiny_llama
    from kvoffload_hal.selfcheck.environment import cpu_model

    set_inprocess_env()
    model = build_tiny_llama(MODEL_DIR, MODEL)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    docs = documents(args.num_documents, args.document_length, vocab)
    rows = [run(v, model, docs, seed=0)
            for v in ("never restarted", "restarted", "restarted, empty tier")]
    for r in rows:  # batches differ between engines: bf16 sums may differ in the last bit
        r["differ"] = sum(a != b for a, b in zip(r["tokens"], rows[-1]["tokens"]))
    print(f"CPU: {cpu_model()}; {args.num_documents} documents of {args.document_length} "
          f"tokens, device cache {DEVICE_DOCS} documents, CPU tier {CPU_DOCS}, disk tier all\n")
    print("| engine | prompt tokens computed | measured pass s | blocks from disk | "
          "index rebuild s | blocks found | found/s | outputs unlike the empty tier's |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = r["found"] / r["rebuild_s"] if r["rebuild_s"] and r["found"] else 0.0
        print(f"| {r['variant']} | {r['computed']} of {r['prompt_tokens']} | "
              f"{r['wall_s']:.1f} | {r['from_disk']} | {r['rebuild_s']:.2f} | {r['found']} | "
              f"{rate:.0f} | {r['differ']} of {len(r['tokens'])} |")
    if args.scan_files:
        seconds, rate = scan_rate(args.scan_files)
        print(f"\nlisting {args.scan_files} block files: {seconds:.2f} s ({rate:.0f} files/s)")


if __name__ == "__main__":
    main()
