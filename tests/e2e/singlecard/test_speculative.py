"""Speculative decoding with the connector: ``ngram``, a draft model, EAGLE.

Each method serves the same documents twice, the second time after the device
forgot them, with and without the connector (each engine in a process of its
own: see ``spec_engine.py``). With the connector:

* the tokens are the ones of the engine without it, in both passes;
* the second pass is served from the CPU tier (every full block; for EAGLE all
  but the last, as vLLM's own prefix cache does for drafters fed the target's
  hidden states);
* the drafts accepted in the second pass equal those of the cold pass. A draft
  model and an EAGLE head have KV cache layers of their own; had their KV not
  come back with the target's, they would propose other tokens. The draft
  model is the target itself, so every draft is accepted when its KV is right;
  a run that damages only the draft layers' loads keeps the target's tokens and
  loses accepted drafts (the canary). The EAGLE head has random weights: its
  drafts are rarely accepted, so its equality says little, and it shows that
  the EAGLE path runs with its layer offloaded;
* the scheduler and the worker count the same CPU blocks, the draft layers
  included (vLLM issue #52921: they disagree in vLLM's own CPU offloading).

Skipped, with vLLM's error, where vLLM cannot run speculative decoding on CPU
(0.23), found from the engine's start.
"""

import json
import os
import subprocess
import sys

import pytest

from support.openai_server import BLOCK_SIZE

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(os.path.dirname(__file__), "spec_engine.py")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HIT = 5 * BLOCK_SIZE  # each document is 181 tokens: 5 full blocks
# vLLM drops the last block of a prefix-cache hit for EAGLE-like drafters (their KV
# at a block's last position was computed with the next token); so does the CPU tier.
HITS = {"ngram": HIT, "draft_model": HIT, "eagle": HIT - BLOCK_SIZE}
CPU_BYTES = 64 << 20  # EngineSpec's cpu_bytes_to_use
LAYER_BLOCK_BYTES = 2 * 2 * 64 * BLOCK_SIZE * 4  # K,V x 2 heads x 64 x 32 tokens x fp32
# KV cache layers with the draft's: ngram has none, the draft model is the
# 2-layer target, the EAGLE head has one.
LAYERS = {"ngram": 2, "draft_model": 4, "eagle": 3}


def start(model: str, method: str, *options: str) -> subprocess.Popen:
    # This checkout's package, as the test process imports it.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, SCRIPT, model, method, *options],
                            stdout=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"engine exited with {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_eagle_dir):
    """``engines(method, *runs)``: each run's result (``plain``, ``offload`` or
    ``damaged``), the ones not run yet started side by side, each run once."""
    done: dict[tuple[str, str], dict] = {}
    cannot_run: list[str] = []  # found once, from the first engines' start
    options = {
        "plain": (), "offload": ("--offload",),
        "damaged": ("--offload", "--corrupt-from", str(LAYERS["ngram"])),  # the draft's layers
    }

    def get(method: str, *runs: str) -> list[dict]:
        if cannot_run:
            pytest.skip(cannot_run[0])
        draft = ("--draft", tiny_eagle_dir) if method == "eagle" else ()
        procs = {run: start(tiny_model_dir, method, *draft, *options[run])
                 for run in runs if (method, run) not in done}
        done.update({(method, run): result(proc) for run, proc in procs.items()})
        cannot_run.extend(done[method, run]["cannot_run"] for run in runs
                          if "cannot_run" in done[method, run])
        if cannot_run:
            pytest.skip(cannot_run[0])
        return [done[method, run] for run in runs]

    return get


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculative_decoding_is_token_identical_and_restores_the_drafts_kv(engines, method):
    extra = ("damaged",) if method == "draft_model" else ()  # the canary's, side by side
    plain, offload, *_ = engines(method, "plain", "offload", *extra)
    cold, reload = offload["passes"]
    assert [p["tokens"] for p in offload["passes"]] == [p["tokens"] for p in plain["passes"]]
    assert plain["passes"][1]["cached"] == [0] * len(cold["cached"])  # the device forgot
    assert reload["cached"] == [HITS[method]] * len(cold["cached"])
    assert offload["totals"]["cpu_hit_tokens"] == len(cold["cached"]) * HITS[method]
    assert cold["num_drafts"] > 0 and reload["num_drafts"] == cold["num_drafts"]
    assert reload["num_accepted_tokens"] == cold["num_accepted_tokens"]
    if method == "draft_model":  # the draft is the target: every draft is right
        assert cold["num_accepted_tokens"] == cold["num_draft_tokens"]
    blocks = CPU_BYTES // (LAYERS[method] * LAYER_BLOCK_BYTES)
    assert offload["scheduler_cpu_blocks"] == offload["worker_cpu_blocks"] == blocks


def test_canary_damaged_draft_layers_lose_accepted_drafts_not_tokens(engines):
    """The acceptance check above can fail: with the draft model's KV damaged as
    it is loaded (the target's exact), the target's tokens are unchanged and
    fewer drafts are accepted after the reload."""
    plain, damaged = engines("draft_model", "plain", "damaged")
    cold, reload = damaged["passes"]
    assert [p["tokens"] for p in damaged["passes"]] == [p["tokens"] for p in plain["passes"]]
    assert reload["cached"] == [HIT] * len(cold["cached"])
    assert reload["num_accepted_tokens"] < cold["num_accepted_tokens"]
