"""Long-document QA behind a full batch, with a slow disk tier: prefetch off and on.

Engine harness (vLLM's real scheduler, both connector roles, a fake model that
checks every KV read; ``tests/support/engine_harness.py``) with the disk tier:

* every document is served once, then the device prefix cache and the CPU tier
  are emptied: the disk tier alone holds the documents (a restart, or a CPU tier
  too small for the working set);
* every disk block read then takes ``--read-ms`` more (a slow disk, a remote
  store; ``tests/support/prefetch_rig.py``), on the tier's two IO threads;
* one question per document, each generating ``GEN`` tokens: the first ``BATCH``
  fill the batch (``max_num_seqs``), then the others arrive together and queue
  behind it; every step that runs a forward pass takes at least ``STEP_MS`` (the
  fake model's own work included).

Reported per case (median of ``--repeats`` runs, the cases interleaved): time to
first token of the queued requests, from their arrival, in steps and
milliseconds, mean and p90, the total time from their arrival, the lookups that
answered "ask again later", the ``blocks_prefetched`` counter, the blocks read
from disk and the CPU hit tokens. The tokens of every question are checked equal
across the cases.

    python benchmarks/prefetch.py [--out-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package
sys.path.insert(0, str(ROOT / "tests"))  # the engine harness and its helpers
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefetch_report import write_report  # noqa: E402

BS = 16
PAGE = BS * 128  # one harness block: 16 tokens x 128 bytes of K and V
DOCS, DOC_BLOCKS, BATCH, GEN = 32, 32, 4, 16
CPU_BLOCKS = 512
STEP_MS = 4.0
# name -> extra config: the connector without lookahead, its defaults, a wider one.
MODES = {
    "off": {"prefetch_requests": 0},
    "on, defaults (4 requests, 25 %)": {},
    "on, 8 requests, 50 %": {"prefetch_requests": 8, "prefetch_cpu_share": 0.5},
}


def _docs(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(DOC_BLOCKS * BS)] for _ in range(DOCS)]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def run_case(model_dir: str, mode: dict, read_ms: float, docs: list[list[int]]) -> dict:
    from support.engine_harness import Engine
    from support.prefetch_rig import count_waits, forget_caches, slow_reads

    os.environ["KVOFFLOAD_HAL_BACKEND"] = "cpu"
    with tempfile.TemporaryDirectory() as disk:
        engine = Engine(model_dir, block_size=BS, num_gpu_blocks=BATCH * (DOC_BLOCKS + 4) + 64,
                        cpu_blocks=CPU_BLOCKS, max_num_seqs=BATCH, max_num_batched_tokens=2048,
                        extra_config={"disk_path": disk,
                                      "disk_bytes_to_use": 2 * DOCS * DOC_BLOCKS * PAGE,
                                      **mode})
        try:
            for i, doc in enumerate(docs):  # every block reaches the disk tier
                engine.add(f"warm-{i}", doc + [1], max_tokens=1)
                if i % BATCH == BATCH - 1:
                    engine.run_until_done()
                    engine.drain()
            forget_caches(engine)
            assert len(engine.offload.tiers.nearest.index) >= DOCS * DOC_BLOCKS
            slow_reads(engine.worker.worker.tiers.nearest, read_ms / 1e3)
            return _questions(engine, docs, count_waits(engine))
        finally:
            engine.close()


def _questions(engine, docs: list[list[int]], waits) -> dict:
    """The first ``BATCH`` questions fill the batch; the others then arrive together
    and queue behind it: their time to first token is measured from then."""
    before = dict(engine.offload.totals.data)
    ids = [f"q-{i}" for i in range(len(docs))]
    for i in range(BATCH):
        engine.add(ids[i], docs[i] + [2, 3 + i % 80], max_tokens=GEN)
    while len(engine.scheduler.running) < BATCH:
        _step(engine)
    queued = ids[BATCH:]
    first: dict[str, tuple[int, float]] = {}
    start, t0 = engine.steps, time.perf_counter()
    for i in range(BATCH, len(docs)):
        engine.add(ids[i], docs[i] + [2, 3 + i % 80], max_tokens=GEN)
    while engine.scheduler.has_requests():
        _step(engine)
        now = time.perf_counter()
        first.update((r, (engine.steps - start, now - t0)) for r in queued
                     if r not in first and engine.outputs[r])
    total = time.perf_counter() - t0
    engine.drain()
    steps = [first[r][0] for r in queued]
    ms = [first[r][1] * 1e3 for r in queued]
    totals = engine.offload.totals.data
    return {"ttft_steps_mean": statistics.mean(steps), "ttft_steps_p90": _p90(steps),
            "ttft_ms_mean": statistics.mean(ms), "ttft_ms_p90": _p90(ms),
            "total_s": total, "steps": engine.steps - start,
            "waits": sum(waits[r] for r in queued),
            "prefetched": totals.get("blocks_prefetched", 0),
            "from_disk": totals.get("blocks_from_disk", 0) - before.get("blocks_from_disk", 0),
            "hit_tokens": totals.get("cpu_hit_tokens", 0) - before.get("cpu_hit_tokens", 0),
            "outputs": {r: engine.outputs[r] for r in ids}}


def _step(engine) -> None:
    engine.step()
    if engine.scheduler.running:
        time.sleep(STEP_MS / 1e3)  # the rest of a forward pass


def measure(model_dir: str, read_ms_list: list[float], repeats: int) -> list[dict]:
    docs = _docs()
    rows = []
    for read_ms in read_ms_list:
        runs: dict[str, list[dict]] = {name: [] for name in MODES}
        for _ in range(repeats):  # interleaved: drift on the host hits every mode alike
            for name, mode in MODES.items():
                runs[name].append(run_case(model_dir, mode, read_ms, docs))
        reference = runs["off"][0]["outputs"]
        for name, results in runs.items():
            assert all(r["outputs"] == reference for r in results), f"tokens differ: {name}"
            row = {key: statistics.median(r[key] for r in results)
                   for key in results[0] if key != "outputs"}
            row.update(mode=name, read_ms=read_ms)
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--read-ms", type=float, nargs="+", default=[0.5, 2.0],
                        help="added time per disk block read, in ms (one case each)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from kvoffload_hal.demo.inprocess import set_inprocess_env
    from kvoffload_hal.demo.tiny_model import build_tiny_llama

    set_inprocess_env()
    model_dir = build_tiny_llama(str(Path(tempfile.gettempdir()) / "kvoffload-bench-llama"))
    rows = measure(model_dir, args.read_ms, args.repeats)
    write_report(rows, args.out_dir, dict(docs=DOCS, doc_blocks=DOC_BLOCKS, bs=BS,
                                          batch=BATCH, gen=GEN, cpu_blocks=CPU_BLOCKS,
                                          step_ms=STEP_MS, repeats=args.repeats))


if __name__ == "__main__":
    main()
