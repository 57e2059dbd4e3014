"""Long-document QA across a restart, restarted the way a user restarts.

64 documents of 256 tokens (``long_doc_qa.py``'s model and documents), a device
cache of 8 documents, a CPU tier of 8 documents and a disk tier that holds them
all. A warm-up pass reads every document once; the measured pass, the first batch
after the restart, reads each document again with a question, in a seeded order,
in one ``generate`` call. Each engine is a user's script in its own process, with
vLLM's ``LLM`` (its engine core in a process of its own, vLLM's default), and
nothing waits for the connector: no idle steps before a script ends, no wait for
the index after one starts.

* ``never restarted``: one script runs both passes;
* ``restarted``: a script runs the warm-up pass and ends at once; a new one on the
  same ``disk_path`` (``disk_retention: keep``) runs the measured pass as soon as
  its ``LLM`` is built;
* ``restarted, empty tier``: the same with ``disk_retention: remove``, a restart
  that keeps nothing.

Reported for the measured pass: prompt tokens computed, TTFT (mean, p50, p99, from
``RequestOutput.metrics``), its wall time, and how long the engine took to build
(the listing of the kept blocks included). ``--scan-files N`` also lists a synthetic
directory of N block files to measure the listing rate at scale.

    python benchmarks/disk_restart.py [--num-documents 64] [--scan-files 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "disk-restart: "  # marks an engine script's line of results on its stdout

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
VARIANTS = ("never restarted", "restarted", "restarted, empty tier")


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


def measured_prompts(docs: list[list[int]], seed: int) -> list[list[int]]:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    return [docs[i] + [3, 4, 5] for i in order]


def engine(model: str, disk_dir: str, retention: str, passes: str, num_docs: int,
           length: int, seed: int) -> None:
    """One user script: ``warm-up``, ``measured`` or ``both`` passes, then it ends."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    docs = documents(num_docs, length, len(AutoTokenizer.from_pretrained(model)))
    start = time.perf_counter()
    llm = LLM(**_spec(model, num_docs, length, disk_dir, retention).llm_kwargs(),
              disable_log_stats=False)
    build_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    def generate(prompts):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)

    if passes in ("warm-up", "both"):
        generate(docs)
    result = {"build_s": build_s}
    if passes in ("measured", "both"):
        start = time.perf_counter()
        outputs = generate(measured_prompts(docs, seed))
        result.update(
            wall_s=time.perf_counter() - start,
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            cached=sum(o.num_cached_tokens or 0 for o in outputs),
            ttft=[o.metrics.first_token_latency for o in outputs if o.metrics is not None],
            tokens=[list(o.outputs[0].token_ids) for o in outputs])
    print(RESULT + json.dumps(result), flush=True)


def _script(model: str, disk_dir: str, retention: str, passes: str, args) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"),
               PYTHONPATH=path, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    out = subprocess.run([sys.executable, __file__, "engine", model, disk_dir, retention,
                          passes, str(args.num_documents), str(args.document_length), "0"],
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{passes} script exited with {out.returncode}:\n"
                           f"{out.stderr[-4000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith(RESULT)][-1]
    return json.loads(line[len(RESULT):])


def run(variant: str, model: str, args) -> dict:
    disk_dir = tempfile.mkdtemp(prefix="disk_restart_")
    retention = "remove" if variant == "restarted, empty tier" else "keep"
    try:
        if variant == "never restarted":
            r = _script(model, disk_dir, retention, "both", args)
        else:
            _script(model, disk_dir, retention, "warm-up", args)
            r = _script(model, disk_dir, retention, "measured", args)
        return {"variant": variant, **r}
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


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-documents", type=int, default=64)
    parser.add_argument("--document-length", type=int, default=256)
    parser.add_argument("--scan-files", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")  # block hashes match across engines
    from kvoffload_hal.demo.tiny_model import build_tiny_llama
    from kvoffload_hal.selfcheck.environment import cpu_model

    model = build_tiny_llama(MODEL_DIR, MODEL)
    rows = [run(v, model, args) for v in VARIANTS]
    for r in rows:  # batches differ between engines: bf16 sums may differ in the last bit
        r["differ"] = sum(a != b for a, b in zip(r["tokens"], rows[-1]["tokens"]))
    print(f"CPU: {cpu_model()}; {args.num_documents} documents of {args.document_length} "
          f"tokens, device cache {DEVICE_DOCS} documents, CPU tier {CPU_DOCS}, disk tier all; "
          "each engine a script of its own, nothing waited for\n")
    print("| engine | prompt tokens computed | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | "
          "measured pass s | engine built in s | outputs unlike the empty tier's |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ttft = [t * 1000 for t in r["ttft"]]
        print(f"| {r['variant']} | {r['prompt_tokens'] - r['cached']} of {r['prompt_tokens']} "
              f"| {statistics.fmean(ttft):.0f} | {_quantile(ttft, 0.5):.0f} | "
              f"{_quantile(ttft, 0.99):.0f} | {r['wall_s']:.1f} | {r['build_s']:.1f} | "
              f"{r['differ']} of {len(r['tokens'])} |")
    if args.scan_files:
        seconds, rate = scan_rate(args.scan_files)
        print(f"\nlisting {args.scan_files} block files: {seconds:.2f} s ({rate:.0f} files/s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]),
               int(sys.argv[7]), int(sys.argv[8]))
    else:
        main()
