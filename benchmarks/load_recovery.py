"""What a failed load costs a model with several KV cache groups, on the running vLLM.

vLLM's real scheduler and both connector roles on the engine harness (a fake
model that checks every KV read), a model with a full-attention and a
sliding-window group. Documents are read, evicted from the device, read again;
the second pass runs with a backend whose loads all work, and with one whose
first load fails. On vLLM >= 0.32 the failed request is recomputed; on 0.23 the
load is sent again from the CPU blocks it holds. Reported: steps and wall time
of the second pass, tokens served from the CPU tier, failed copy jobs.

    python benchmarks/load_recovery.py [--out-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the engine harness and the backend doubles

NUM_DOCS, DOC_TOKENS = 6, 80


def _docs() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 90) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)]


def measure(model_dir: str, backend: str) -> dict:
    import os

    from support import backend_doubles, flaky_backend  # noqa: F401 (register the doubles)
    from support.engine_harness import Engine

    os.environ["KVOFFLOAD_HAL_BACKEND"] = backend
    engine = Engine(model_dir, block_size=16, num_gpu_blocks=40, cpu_blocks=128,
                    sliding_window=32, extra_config={"load_mode": "async"})
    try:
        docs = _docs()
        for i, d in enumerate(docs):
            engine.add(f"a{i}", d)
        engine.run_until_done()
        steps, start = engine.steps, time.perf_counter()
        for i, d in enumerate(docs):
            engine.add(f"b{i}", d + [5, 6])
            engine.run_until_done()
        engine.drain()
        return {"backend": backend, "steps": engine.steps - steps,
                "seconds": time.perf_counter() - start,
                "hit_tokens": engine.offload.totals.data.get("cpu_hit_tokens", 0),
                "failed_jobs": engine.worker.worker.totals.data.get("failed_jobs", 0),
                "outputs": {k: v for k, v in engine.outputs.items() if k.startswith("b")}}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    from kvoffload_hal.capabilities import select_strategy
    from kvoffload_hal.demo.inprocess import set_inprocess_env
    from kvoffload_hal.demo.tiny_model import build_tiny_llama
    from kvoffload_hal.selfcheck.environment import cpu_model

    set_inprocess_env()
    import vllm

    model_dir = build_tiny_llama(str(Path(tempfile.gettempdir()) / "kvoffload-bench-llama"))
    rows = [measure(model_dir, b) for b in ("cpu", "flaky-loads")]
    assert rows[0]["outputs"] == rows[1]["outputs"], "a failed load changed a token"
    retries = select_strategy(num_groups=2).reads_failed_loads_again()  # the model's two groups
    how = "sent again from the CPU blocks" if retries else "recomputed (failed_recving)"
    lines = [f"## vLLM {vllm.__version__}: a failed load is {how}", "",
             f"CPU: {cpu_model()}; {NUM_DOCS} documents of {DOC_TOKENS} tokens read again "
             "after eviction, one at a time; two KV cache groups (full + sliding window).", "",
             "| loads | second pass steps | wall s | CPU-tier hit tokens | failed jobs |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        name = "all work" if r["backend"] == "cpu" else "the first fails"
        lines.append(f"| {name} | {r['steps']} | {r['seconds']:.2f} | {r['hit_tokens']} | "
                     f"{r['failed_jobs']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        name = "load_recovery_vllm" + vllm.__version__.split("+")[0].replace(".", "") + ".md"
        (args.out_dir / name).write_text(text)


if __name__ == "__main__":
    main()
