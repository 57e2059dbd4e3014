"""One engine of the Mooncake tests, run as its own process.

``python mooncake_engine.py MODEL MASTER SYNC_DIR NAME ROLE [options]`` with ROLE

* ``writer``: serves the documents (cold), waits until its blocks are in the
  store, says ``NAME.stored``, then waits for the readers (its memory is part
  of the store's pool);
* ``reader``: waits for the writer, serves the documents (``warm``: whatever
  the store gives), then its own cold run (no prefix cache read at all);

then every engine waits for ``master.killed`` (the test kills the master),
forgets its prefix caches and serves the documents again (``after_kill``).
Prints one JSON line (also written to ``SYNC_DIR/NAME.json``): tokens of each
pass, cached tokens, the connector's counters after each stage, and the
after-kill pass's seconds, in all and per request.

Options, for engines on hosts of their own (``test_mooncake_netns.py``):
``--local-hostname`` (the address peers reach this engine at),
``--readers`` (whose ``.read`` the writer waits for), ``--start-after``
(a file to wait for before the engine starts, so that its segment joins the
pool after the writer's objects are placed), ``--after`` and ``--after-stage``
(the file the last pass waits for, and its name; an empty ``--after``: no
last pass, the engine stays up until it is killed), ``--no-drain-after``
(the last pass does not wait for its writes).
"""

import argparse
import json
import os
import sys
import time

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text

NUM_DOCS = 3
BLOCK_BYTES = 2 * 32 * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
WAIT_S = 400
TIMEOUT_S = 2.0  # mooncake_timeout_s


def wait_for(sync_dir: str, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(sync_dir, name)):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not appear")
        time.sleep(0.05)


def say(sync_dir: str, name: str) -> None:
    open(os.path.join(sync_dir, name), "w").close()


def drain(llm, params) -> None:
    """Step until the connector has nothing in flight (spills written to the store)."""
    connector = scheduler_connector(llm)
    for _ in range(200):
        if not connector.scheduler.has_pending_transfers():
            return
        llm.generate(["drain"], params, use_tqdm=False)
        time.sleep(0.02)
    raise SystemExit("spills still in flight")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("model", "master", "sync_dir", "name", "role"):
        parser.add_argument(name)
    parser.add_argument("--local-hostname", default=None)
    parser.add_argument("--readers", default="bc")
    parser.add_argument("--start-after", default=None)
    parser.add_argument("--after", default="master.killed")
    parser.add_argument("--after-stage", default="after_kill")
    parser.add_argument("--no-drain-after", action="store_true")
    return parser.parse_args(argv)


def make_engine(args: argparse.Namespace):
    extra = {"mooncake_master": args.master, "mooncake_segment_bytes": 32 << 20,
             "mooncake_buffer_bytes": 16 << 20, "mooncake_timeout_s": TIMEOUT_S}
    if args.local_hostname is not None:
        extra["mooncake_local_hostname"] = args.local_hostname
    if args.start_after is not None:
        wait_for(args.sync_dir, args.start_after)
    return make_llm(EngineSpec(args.model, num_gpu_blocks=24, offload=True,
                               cpu_bytes_to_use=24 * BLOCK_BYTES, extra_config=extra))


def main(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    sync_dir, name = args.sync_dir, args.name
    llm = make_engine(args)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                          skip_reading_prefix_cache=True)
    docs = [synthetic_text(180, seed=100 + i) for i in range(NUM_DOCS)]
    totals = scheduler_connector(llm).scheduler.totals.data
    out: dict = {"mooncake_timeout_s": TIMEOUT_S}

    def serve(stage: str, sampling, wait_for_writes: bool = True) -> None:
        outs, seconds = [], []
        for d in docs:
            started = time.monotonic()
            outs.append(llm.generate([d], sampling, use_tqdm=False)[0])
            seconds.append(time.monotonic() - started)
        out[stage] = [list(o.outputs[0].token_ids) for o in outs]
        out[f"{stage}_cached"] = [o.num_cached_tokens for o in outs]
        out[f"{stage}_request_s"] = seconds
        out["prompt_tokens"] = [len(o.prompt_token_ids) for o in outs]
        if wait_for_writes:
            drain(llm, params)
        out[f"{stage}_totals"] = dict(totals)

    try:
        if args.role == "writer":
            serve("cold", params)
            say(sync_dir, f"{name}.stored")
            for reader in args.readers:
                wait_for(sync_dir, f"{reader}.read")
        else:
            wait_for(sync_dir, "a.stored")
            serve("warm", params)
            llm.reset_prefix_cache(reset_connector=True)
            serve("cold", cold)
            say(sync_dir, f"{name}.read")
        if args.after:
            wait_for(sync_dir, args.after)
            llm.reset_prefix_cache(reset_connector=True)
            started = time.monotonic()
            serve(args.after_stage, params, wait_for_writes=not args.no_drain_after)
            out[f"{args.after_stage}_s"] = time.monotonic() - started
        report(sync_dir, name, out)
        while not args.after:  # stays up (its segment with it) until it is killed
            time.sleep(1)
    finally:
        close_llm(llm)


def report(sync_dir: str, name: str, out: dict) -> None:
    print(json.dumps(out), flush=True)
    with open(os.path.join(sync_dir, f"{name}.json.tmp"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(sync_dir, f"{name}.json.tmp"), os.path.join(sync_dir, f"{name}.json"))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
