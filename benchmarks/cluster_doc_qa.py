"""Two instances splitting a long-document QA workload, with and without the Mooncake tier.

``N`` documents of ``L`` random tokens (long_doc_qa's model and documents). Phase 1:
instance X is asked the even documents, instance Y the odd ones, at the same time.
Phase 2, measured: every document is asked again at the *other* instance (X, then Y,
one after the other so that the two never share the CPU). Each request asks for 10
greedy tokens; each instance's requests of a phase go in one ``llm.generate`` call.

* ``cpu-tier``: each instance has its own CPU tier only: phase 2 recomputes;
* ``mooncake``: plus the Mooncake tier on one ``mooncake_master`` (TCP, loopback):
  phase 2 reads what the other instance stored;
* ``single-instance limit``: one instance is asked every document twice; phase 2 is
  served from its own caches.

Reported: phase 2 wall time (X + Y), the fraction of phase 2's prompt tokens served
from a cache and from the store, and the bytes written to and read from the store.
Prints a table and writes ``docs/benchmarks/cluster_doc_qa.{md,png}``.

    python benchmarks/cluster_doc_qa.py [--num-documents 16] [--document-length 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from long_doc_qa import MODEL, MODEL_DIR, block_bytes, documents  # noqa: E402

from kvoffload_hal.selfcheck.environment import cpu_model  # noqa: E402

OUT = HERE.parent / "docs" / "benchmarks" / "cluster_doc_qa.md"
OUTPUT_TOKENS = 10
WAIT_S = 900


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path.name} did not appear")
        time.sleep(0.05)


def engine(args: argparse.Namespace) -> None:
    """One instance (its own process): phase 1, then the measured phase 2."""
    from vllm import SamplingParams

    from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector

    docs = documents(args.num_documents, args.document_length, args.vocab)
    first, second = (json.loads(x) for x in (args.first, args.second))
    extra = {} if args.master is None else {
        "mooncake_master": args.master, "mooncake_segment_bytes": 512 << 20}
    per_doc = block_bytes(MODEL) * (args.document_length // 32 + 1)
    spec = EngineSpec(args.model, num_gpu_blocks=8 * per_doc // block_bytes(MODEL) + 8,
                      offload=True, cpu_bytes_to_use=30 * per_doc,
                      max_model_len=args.document_length + 64, extra_config=extra)
    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    scheduler = scheduler_connector(llm).scheduler
    sync = Path(args.sync)

    def ask(ids):
        return llm.generate([{"prompt_token_ids": docs[i]} for i in ids], params,
                            use_tqdm=False)

    def drain():
        while scheduler.has_pending_transfers():
            llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)

    try:
        ask(first)
        drain()
        (sync / f"{args.name}.phase1").touch()
        for peer in args.wait_for.split(","):
            if peer:
                wait_for(sync / peer)
        before = dict(scheduler.totals.data)
        started = time.perf_counter()
        outs = ask(second)
        wall = time.perf_counter() - started
        drain()
        (sync / f"{args.name}.phase2").touch()
        after = scheduler.totals.data
        print(json.dumps({
            "wall_s": wall,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "from_store_blocks": after.get("blocks_from_mooncake", 0)
            - before.get("blocks_from_mooncake", 0),
            "to_store_blocks": after.get("blocks_to_mooncake", 0),
        }))
        if args.hold:
            wait_for(sync / "done")  # its segment is part of the pool until the end
    finally:
        close_llm(llm)


def launch(name, first, second, wait, master, sync, args, hold):
    cmd = [sys.executable, __file__, "--engine", name, "--first", json.dumps(first),
           "--second", json.dumps(second), "--wait-for", wait, "--sync", sync,
           "--model", args.model, "--vocab", str(args.vocab),
           "--num-documents", str(args.num_documents),
           "--document-length", str(args.document_length)]
    if master:
        cmd += ["--master", master]
    if hold:
        cmd.append("--hold")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONHASHSEED="0"))


def run(config: str, args) -> dict:
    from support.mooncake_master import MooncakeMaster

    n = args.num_documents
    even, odd, every = list(range(0, n, 2)), list(range(1, n, 2)), list(range(n))
    with tempfile.TemporaryDirectory() as sync, MooncakeMaster() as master:
        address = master.address if config == "mooncake" else None
        if config == "single-instance limit":
            plan = [("x", every, every, "")]
        else:  # X measures first, then Y: never both at once
            plan = [("x", even, odd, "x.phase1,y.phase1"), ("y", odd, even, "x.phase2")]
        procs = [launch(name, f, s, w, address, sync, args, hold=len(plan) > 1)
                 for name, f, s, w in plan]
        for name, *_ in plan:
            wait_for(Path(sync) / f"{name}.phase2")
        Path(sync, "done").touch()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, f"{config}: an instance exited with {proc.returncode}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    total = {k: sum(r[k] for r in results) for k in results[0]}
    total["config"] = config
    return total


def table(rows: list[dict], args) -> str:
    bb = block_bytes(MODEL)
    lines = [f"{args.num_documents} documents of {args.document_length} tokens; phase 2 "
             "(each document asked again at the other instance) measured", "",
             "| configuration | phase 2 s | cached tokens | from the store | "
             "MiB to the store | MiB from the store |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['wall_s']:.2f} | "
            f"{r['cached_tokens'] / r['prompt_tokens']:.0%} | "
            f"{r['from_store_blocks'] * 32 / r['prompt_tokens']:.0%} | "
            f"{r['to_store_blocks'] * bb / 2**20:.1f} | "
            f"{r['from_store_blocks'] * bb / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-documents", type=int, default=16)
    p.add_argument("--document-length", type=int, default=512)
    for flag in ("--engine", "--first", "--second", "--wait-for", "--sync", "--master",
                 "--model"):
        p.add_argument(flag)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--hold", action="store_true")
    args = p.parse_args()
    if args.engine:
        args.name = args.engine
        return engine(args)
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    args.model = build_tiny_llama(MODEL_DIR, MODEL)
    from transformers import AutoTokenizer

    args.vocab = len(AutoTokenizer.from_pretrained(args.model))
    rows = [run(c, args) for c in ("cpu-tier", "mooncake", "single-instance limit")]
    text = f"CPU: {cpu_model()}\n\n" + table(rows, args)
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    png = OUT.with_suffix(".png")
    OUT.write_text(f"{text}\n![plot]({png.name})\n")
    write_plot(rows, png)
    print(f"wrote {OUT} and {png}")


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    names = [r["config"] for r in rows]
    left.bar(names, [r["wall_s"] for r in rows], color="tab:blue")
    left.set_ylabel("phase 2 wall s")
    right.bar(names, [r["from_store_blocks"] * 32 / r["prompt_tokens"] for r in rows],
              color="tab:green", label="from the store")
    right.plot(names, [r["cached_tokens"] / r["prompt_tokens"] for r in rows], "ko",
               label="from any cache")
    right.set_ylabel("fraction of phase 2 prompt tokens")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("two instances splitting long-document QA", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
