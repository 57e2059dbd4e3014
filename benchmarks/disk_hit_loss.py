"""A long disk hit after an idle period or a second engine: does it come back whole?

A tiny random-weight Llama (64-token blocks, a device cache of 40 blocks), the
connector with a CPU tier of 4 blocks (3 usable: vLLM's null block takes one)
and a disk tier, offline ``LLM`` API, one fresh engine process per run:

1. generate prompt A (~14 blocks, greedy, 8 tokens);
2. generate six other documents of 700 words each: A leaves the device and the
   CPU tier and stays on disk only;
3. wait, the engine not stepping:

   * ``--idle S``: sleep ``S`` seconds;
   * ``--second-engine``: a second engine process, with other random weights
     (another seed), on the same ``disk_path``, serves A's text, then exits; the
     first engine waits for it and at least 30 s in all;

4. generate A again.

Recorded per run: the second A's cached tokens against the full blocks it could
get back, ``blocks_from_disk`` and ``staged_hits`` (connector counters, before
and after it), whether its tokens equal the first A's, and its wall time. The
second engine must never read the first one's blocks (its fingerprint differs):
it gets 0 cached tokens and its own tokens (those of its model without the
connector).

    python benchmarks/disk_hit_loss.py --idle 2 [--runs 10]
    python benchmarks/disk_hit_loss.py --second-engine
    python benchmarks/disk_hit_loss.py --all [--out docs/benchmarks/disk_hit_loss.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.engines.drain_transfers

BLOCK = 64  # tokens
BLOCK_BYTES = 2 * BLOCK * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
CPU_BLOCKS = 4
DEVICE_BLOCKS = 40
PROMPT_WORDS, PROMPT_SEED = 900, 100  # ~14 blocks
DOC_WORDS, NUM_DOCS = 700, 6  # ~11 blocks each
SECOND_ENGINE_WAIT_S = 30.0
COUNTERS = ("blocks_from_disk", "staged_hits", "blocks_to_disk", "blocks_loaded",
            "cpu_hit_tokens", "failed_jobs", "shared_load_waits", "blocks_prefetched")


# --- engine processes -------------------------------------------------------------

def _engine(model: str, disk: str | None):
    from kvoffload_hal.demo.inprocess import EngineSpec, make_llm

    extra = {} if disk is None else {"disk_path": disk, "disk_bytes_to_use": 400 * BLOCK_BYTES}
    return make_llm(EngineSpec(model, num_gpu_blocks=DEVICE_BLOCKS, block_size=BLOCK,
                               max_model_len=2048, offload=disk is not None,
                               cpu_bytes_to_use=CPU_BLOCKS * BLOCK_BYTES,
                               extra_config=extra))


def _generate(llm, text: str):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.generate([text], params, use_tqdm=False)[0]


def _counters(llm) -> dict[str, int]:
    from kvoffload_hal.demo.inprocess import scheduler_connector

    conn = scheduler_connector(llm)
    data = conn.scheduler.totals.data if conn is not None else {}
    return {k: int(data.get(k, 0)) for k in COUNTERS}


def _prompt() -> str:
    from kvoffload_hal.demo.tiny_model import synthetic_text

    return synthetic_text(PROMPT_WORDS, seed=PROMPT_SEED)


def child_first(model: str, disk: str, sync: str, idle: float) -> dict:
    """Engine 1: A, six documents, the wait (``idle`` s, or until ``sync/go`` if
    ``idle`` < 0), A again."""
    from kvoffload_hal.demo.inprocess import close_llm
    from kvoffload_hal.demo.tiny_model import synthetic_text
    from support.engines import drain_transfers

    llm = _engine(model, disk)
    try:
        first = _generate(llm, _prompt())
        for seed in range(NUM_DOCS):
            _generate(llm, synthetic_text(DOC_WORDS, seed=seed))
        before = _counters(llm)
        Path(sync, "idle").touch()
        waited = time.monotonic()
        if idle >= 0:
            time.sleep(idle)
        else:
            deadline = time.monotonic() + 900
            while not Path(sync, "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        waited = time.monotonic() - waited
        start = time.perf_counter()
        again = _generate(llm, _prompt())
        wall = time.perf_counter() - start
        drained = drain_transfers(llm, timeout_s=120)
        after = _counters(llm)
    finally:
        close_llm(llm)
    return {"cached": again.num_cached_tokens or 0,
            "full_blocks": (len(again.prompt_token_ids) - 1) // BLOCK,
            "same_tokens": list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids),
            "wall_s": wall, "waited_s": waited, "drained": drained,
            "delta": {k: after[k] - before[k] for k in COUNTERS}, "before": before}


def child_second(model: str, disk: str | None) -> dict:
    """Engine 2 (or, without ``disk``, its model's own reference): A once."""
    from kvoffload_hal.demo.inprocess import close_llm
    from support.engines import drain_transfers

    llm = _engine(model, disk)
    try:
        out = _generate(llm, _prompt())
        drain_transfers(llm, timeout_s=120)
        counters = _counters(llm)
    finally:
        close_llm(llm)
    return {"cached": out.num_cached_tokens or 0, "tokens": list(out.outputs[0].token_ids),
            "blocks_from_disk": counters["blocks_from_disk"]}


def child_main(argv: list[str]) -> None:
    role = argv[0]
    if role == "first":
        result = child_first(argv[1], argv[2], argv[3], float(argv[4]))
    else:
        result = child_second(argv[1], argv[2] if len(argv) > 2 else None)
    print("RESULT " + json.dumps(result), flush=True)


# --- driver -----------------------------------------------------------------------

def _child(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0",  # block hashes match across engines
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, __file__, "--child", *args], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)


def _result(proc: subprocess.Popen, log: Path, timeout: float = 900) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"engine exited with {proc.returncode}; log {log}:\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"engine 1 did not reach the wait (exit {proc.returncode})")
        time.sleep(0.05)


def run_once(scenario: str, models: dict[str, str], reference: list[int] | None,
             logs: Path, index: int) -> dict:
    """One run of ``scenario`` ("idle 2", "idle 30" or "second engine")."""
    work = Path(tempfile.mkdtemp(prefix="disk_hit_loss_"))
    disk, sync = work / "kv", work / "sync"
    disk.mkdir(mode=0o700)
    sync.mkdir()
    tag = scenario.replace(" ", "_")
    idle = -1.0 if scenario == "second engine" else float(scenario.split()[1])
    log1 = logs / f"{tag}_{index}_engine1.log"
    first = _child(["first", models["a"], str(disk), str(sync), str(idle)], log1)
    second = None
    try:
        if idle < 0:
            _wait_for(sync / "idle", first)
            start = time.monotonic()
            log2 = logs / f"{tag}_{index}_engine2.log"
            second = _result(_child(["second", models["b"], str(disk)], log2), log2)
            time.sleep(max(0.0, SECOND_ENGINE_WAIT_S - (time.monotonic() - start)))
            (sync / "go").touch()
        row = _result(first, log1)
    finally:
        if first.poll() is None:
            first.kill()
        shutil.rmtree(work, ignore_errors=True)
    row.update(scenario=scenario, run=index, log=str(log1))
    if second is not None:
        row["second"] = {"cached": second["cached"],
                         "blocks_from_disk": second["blocks_from_disk"],
                         "own_tokens": second["tokens"] == reference}
        assert second["cached"] == 0 and second["blocks_from_disk"] == 0, second
        assert second["tokens"] == reference, "engine 2 served tokens not its own"
    row["full_hit"] = row["cached"] == row["full_blocks"] * BLOCK
    return row


def build_models(root: str) -> dict[str, str]:
    from kvoffload_hal.demo.inprocess import set_inprocess_env
    from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama

    set_inprocess_env()
    return {"a": build_tiny_llama(os.path.join(root, "tiny-llama")),
            "b": build_tiny_llama(os.path.join(root, "other-llama"), TinyModelSpec(seed=1))}


def _describe(row: dict) -> str:
    d = row["delta"]
    text = (f"  {row['scenario']} #{row['run']}: cached {row['cached']} of "
            f"{row['full_blocks'] * BLOCK}, from disk {d['blocks_from_disk']}, staged "
            f"{d['staged_hits']}, same tokens {row['same_tokens']}, {row['wall_s']:.2f} s "
            f"(waited {row['waited_s']:.1f} s)")
    if not row["full_hit"]:
        text += f"\n    counters {d}; before {row['before']}; log {row['log']}"
    return text


# --- report -----------------------------------------------------------------------

def _environment() -> list[str]:
    import vllm

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(ln for ln in lscpu.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        cpu = "Model name: unknown"
    return [f"- `lscpu`: `{' '.join(cpu.split())}` ({os.cpu_count()} CPUs)",
            f"- vLLM {vllm.__version__} (CPU platform), Python {sys.version.split()[0]}"]


def _summary(rows: list[dict], scenarios: list[str]) -> list[str]:
    out = ["| scenario | runs | runs with the full hit | runs with 0 cached tokens | "
           "runs with A's tokens unchanged | median wall time of the second A (s) |",
           "|:---|---:|---:|---:|---:|---:|"]
    for name in scenarios:
        mine = [r for r in rows if r["scenario"] == name]
        if not mine:
            continue
        wall = statistics.median(r["wall_s"] for r in mine)
        out.append(f"| {name} | {len(mine)} | {sum(r['full_hit'] for r in mine)} | "
                   f"{sum(r['cached'] == 0 for r in mine)} | "
                   f"{sum(r['same_tokens'] for r in mine)} | {wall:.2f} |")
    return out


def _per_run(rows: list[dict]) -> list[str]:
    out = ["| scenario | run | cached tokens | full blocks | blocks from disk | staged hits | "
           "same tokens | wall s | waited s | engine 2: cached, from disk, own tokens |",
           "|:---|---:|---:|---:|---:|---:|:---|---:|---:|:---|"]
    for r in rows:
        d, s = r["delta"], r.get("second")
        other = "" if s is None else (f"{s['cached']}, {s['blocks_from_disk']}, "
                                      f"{'yes' if s['own_tokens'] else 'no'}")
        out.append(f"| {r['scenario']} | {r['run']} | {r['cached']} | {r['full_blocks']} | "
                   f"{d['blocks_from_disk']} | {d['staged_hits']} | "
                   f"{'yes' if r['same_tokens'] else 'no'} | {r['wall_s']:.2f} | "
                   f"{r['waited_s']:.1f} | {other} |")
    return out


def write_report(path: Path, rows: list[dict], scenarios: list[str], runs: int) -> None:
    lines = ["# Disk hits after idle periods and a second engine", "",
             "Generated by `benchmarks/disk_hit_loss.py` "
             f"({runs} runs per scenario, a fresh engine process per run).", "",
             *_environment(), "",
             f"Tiny random-weight Llama, {BLOCK}-token blocks, `num_gpu_blocks_override="
             f"{DEVICE_BLOCKS}`, CPU tier of {CPU_BLOCKS} blocks ({CPU_BLOCKS - 1} usable), "
             f"disk tier; prompt A ({PROMPT_WORDS} words), then {NUM_DOCS} documents of "
             f"{DOC_WORDS} words, the wait, then A again (greedy, 8 tokens). The full hit: "
             "`num_cached_tokens == (len(prompt_token_ids) - 1) // 64 * 64`. "
             "`second engine`: another engine process with other random weights "
             "(`TinyModelSpec(seed=1)`) on the same `disk_path` serves A's text while the "
             f"first waits (at least {SECOND_ENGINE_WAIT_S:.0f} s in all) and exits; it "
             "must get 0 cached tokens and its own model's tokens.", "",
             *_summary(rows, scenarios), "", "Every run:", "", *_per_run(rows), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, action="append", default=[],
                        help="seconds engine 1 sleeps before A again (repeatable)")
    parser.add_argument("--second-engine", action="store_true")
    parser.add_argument("--all", action="store_true", help="--idle 2 --idle 30 --second-engine")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks/disk_hit_loss.md"))
    args = parser.parse_args()
    idles = [2.0, 30.0] if args.all else args.idle
    scenarios = [f"idle {s:g}" for s in idles]
    if args.all or args.second_engine or not scenarios:
        scenarios.append("second engine")
    work = tempfile.mkdtemp(prefix="disk_hit_loss_models_")
    models = build_models(work)
    logs = Path(work, "logs")
    logs.mkdir()
    reference = None
    if "second engine" in scenarios:  # engine 2's model without the connector
        log = logs / "reference.log"
        reference = _result(_child(["second", models["b"]], log), log)["tokens"]
    rows: list[dict] = []
    for name in scenarios:
        for i in range(args.runs):
            rows.append(run_once(name, models, reference, logs, i + 1))
            print(_describe(rows[-1]), flush=True)
            write_report(Path(args.out), rows, scenarios, args.runs)
    print("\n".join(_summary(rows, scenarios)))
    print(f"report: {args.out}; engine logs: {logs}")


if __name__ == "__main__":
    main()
