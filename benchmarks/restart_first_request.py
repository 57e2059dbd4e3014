"""The first request after a restart, restarted the way a user restarts.

A tiny Llama with 64-token blocks, a device cache of 40 blocks, a CPU tier of 4
blocks and a disk tier (``disk_path``, everything else default):

* engine 1 generates a prompt ``A`` of about 900 tokens and six other documents
  of 700 words, waits ``--pause`` seconds and exits;
* engine 2 starts on the same ``disk_path`` and generates ``A``, then ``A`` again.

Each engine is its own process and does only what a user does: ``offline``, a
script with vLLM's ``LLM`` (the engine core in its own process, vLLM's default)
that ends when its last ``generate`` returns; ``served``, vLLM's OpenAI-compatible
server, stopped with SIGTERM once its completions are answered, and a new server
asked once ``/health`` answers. Reported per run: prompt tokens of ``A``, cached
tokens of engine 2's first and second ``A``, and whether its completion equals
engine 1's. ``--runs`` repetitions, one after another; the vLLM lane is the one
of the interpreter running this script.

    PYTHONHASHSEED=0 python benchmarks/restart_first_request.py [--runs 10]
        [--mode offline served] [--pause 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = os.path.join(tempfile.gettempdir(), "kvoffload-restart-first-request", "llama")
BLOCK_SIZE = 64
NUM_GPU_BLOCKS = 40
MAX_MODEL_LEN = 2048
MAX_TOKENS = 8
# One 64-token block of the tiny Llama: 2 layers x (K, V) x 2 heads x 64 x 64 tokens.
CPU_BLOCKS = 4
RESULT = "restart-result: "  # marks the engine's one line of results on its stdout


def block_bytes(dtype_bytes: int) -> int:
    return 2 * 2 * 2 * 64 * BLOCK_SIZE * dtype_bytes


def prompts() -> tuple[str, list[str]]:
    from kvoffload_hal.demo.tiny_model import synthetic_text

    return synthetic_text(900, seed=1000), [synthetic_text(700, seed=1001 + i)
                                            for i in range(6)]


def extra_config(disk: str, dtype_bytes: int) -> dict:
    return {"cpu_bytes_to_use": CPU_BLOCKS * block_bytes(dtype_bytes), "disk_path": disk,
            "disk_bytes_to_use": 1 << 30}


# ------------------------------------------------------------------ offline
def offline_engine(model: str, disk: str, stage: str, pause_s: float) -> None:
    """One user script: ``write`` serves A and the documents, pauses and ends;
    ``read`` serves A twice. Prints one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_GPU_BLOCKS,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, enforce_eager=True,
              seed=0, kv_transfer_config=KVTransferConfig(
                  kv_connector="HALOffloadConnector", kv_role="kv_both",
                  kv_load_failure_policy="recompute",
                  kv_connector_extra_config=extra_config(disk, 2)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, docs = prompts()
    outs = [llm.generate([p], params, use_tqdm=False)[0]
            for p in ([a, *docs] if stage == "write" else [a, a])]
    print(RESULT + json.dumps({"prompt_tokens": len(outs[0].prompt_token_ids),
                      "cached": [o.num_cached_tokens or 0 for o in outs],
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    time.sleep(pause_s)


def offline_run(model: str, disk: str, pause_s: float, timeout_s: float = 600) -> dict:
    def engine(stage: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "engine", model, disk, stage,
                              str(pause_s)], env=_env(), capture_output=True, text=True,
                             timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"{stage} engine exited with {out.returncode}:\n"
                               f"{out.stderr[-4000:]}")
        line = [x for x in out.stdout.splitlines() if x.startswith(RESULT)][-1]
        return json.loads(line[len(RESULT):])

    cold, warm = engine("write"), engine("read")
    return {"prompt_tokens": warm["prompt_tokens"], "first": warm["cached"][0],
            "second": warm["cached"][1], "same": warm["tokens"][0] == cold["tokens"][0]}


# ------------------------------------------------------------------- served
def served_run(model: str, disk: str, pause_s: float, logs: Path, run: int) -> dict:
    from support.openai_server import Server

    config = {"kv_connector": "HALOffloadConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra_config(disk, 4)}
    args = ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-transfer-config", json.dumps(config)]
    a, docs = prompts()
    first = Server(model, logs / f"run{run}-first.log", num_gpu_blocks=NUM_GPU_BLOCKS,
                   offload=False, extra_args=args)
    try:
        first.wait_ready()
        cold = [_complete(first, p) for p in (a, *docs)][0]
        time.sleep(pause_s)
        first.stop(signal.SIGTERM, 60)
    finally:
        first.kill()
    second = Server(model, logs / f"run{run}-second.log", num_gpu_blocks=NUM_GPU_BLOCKS,
                    offload=False, extra_args=args)
    try:
        second.wait_ready()
        warm = [_complete(second, a) for _ in range(2)]
    finally:
        second.kill()
    cached = [_cached(r) for r in warm]
    return {"prompt_tokens": warm[0].usage.prompt_tokens, "first": cached[0],
            "second": cached[1], "same": warm[0].choices[0].text == cold.choices[0].text}


def _complete(server, prompt: str):
    return server.client().completions.create(model=server.model, prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0.0,
                                              extra_body={"ignore_eos": True})


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


# ------------------------------------------------------------------- driver
def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"),
                                       os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"),
                PYTHONPATH=path, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--mode", nargs="+", default=["offline", "served"],
                        choices=["offline", "served"])
    parser.add_argument("--pause", type=float, default=2.0)
    args = parser.parse_args()
    os.environ.update(_env())
    sys.path.insert(0, str(ROOT / "tests"))
    import vllm

    from kvoffload_hal.demo.tiny_model import build_tiny_llama
    from kvoffload_hal.selfcheck.environment import cpu_model

    model = build_tiny_llama(MODEL_DIR)
    print(f"CPU: {cpu_model()}; vLLM {vllm.__version__}; {args.runs} runs per mode, "
          f"pause {args.pause} s before exiting\n")
    print("| mode | run | prompt tokens | cached, first A | cached, second A | "
          "same completion | s |")
    print("|:---|---:|---:|---:|---:|:---|---:|")
    hits = {}
    for mode in args.mode:
        hits[mode] = 0
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="restart_first_") as tmp:
                disk = os.path.join(tmp, "kv")
                os.mkdir(disk, 0o700)
                start = time.monotonic()
                r = (offline_run(model, disk, args.pause) if mode == "offline"
                     else served_run(model, disk, args.pause, Path(tmp), run))
                seconds = time.monotonic() - start
            hits[mode] += r["first"] > 0 and r["same"]
            print(f"| {mode} | {run + 1} | {r['prompt_tokens']} | {r['first']} | "
                  f"{r['second']} | {r['same']} | {seconds:.0f} |", flush=True)
    print()
    for mode, n in hits.items():
        print(f"{mode}: the first A after the restart hit, with the cold run's completion, "
              f"in {n} of {args.runs} runs")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        offline_engine(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    else:
        main()
