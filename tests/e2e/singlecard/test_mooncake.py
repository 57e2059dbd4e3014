"""Engines in separate processes sharing KV through a real ``mooncake_master``.

One scenario, run once for the module: engine A computes the documents and
stores them; engine B (same model) and engine C (other weights) then serve
the same documents; the master is killed and all three serve them again.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama
from support.mooncake_master import MooncakeMaster, skip_reason

pytestmark = [pytest.mark.e2e, pytest.mark.two_cores,
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

BLOCK = 32  # EngineSpec's block size


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mooncake")
    other_model = build_tiny_llama(str(tmp / "other-llama"), TinyModelSpec(seed=1))
    sync = tmp / "sync"
    sync.mkdir()
    script = os.path.join(os.path.dirname(__file__), "mooncake_engine.py")
    env = dict(os.environ, PYTHONHASHSEED="0")
    with MooncakeMaster(str(tmp / "master.log")) as master:
        procs = {name: subprocess.Popen(
            [sys.executable, script, model, master.address, str(sync), name, role],
            env=env, stdout=subprocess.PIPE, text=True)
            for name, model, role in (("a", tiny_model_dir, "writer"),
                                      ("b", tiny_model_dir, "reader"),
                                      ("c", other_model, "reader"))}
        deadline = time.monotonic() + 600
        while not all((sync / f"{r}.read").exists() for r in "bc"):
            assert all(p.poll() is None for p in procs.values()), "an engine exited early"
            assert time.monotonic() < deadline, "the readers did not finish"
            time.sleep(0.1)
        master.kill()  # mid-run: every engine is still up and serves again
        (sync / "master.killed").touch()
        results = {}
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"engine {name} exited with {proc.returncode}"
            results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def test_same_model_serves_the_prefix_from_another_engines_store_writes(cluster):
    a, b = cluster["a"], cluster["b"]
    assert b["warm"] == b["cold"] == a["cold"]  # B's own cold run, and A's
    # B never computed these documents before: its cached tokens came from the
    # store, every full block of each prompt (the last token is computed).
    full = [(n - 1) // BLOCK * BLOCK for n in b["prompt_tokens"]]
    assert b["warm_cached"] == full and all(f >= 4 * BLOCK for f in full)
    assert b["warm_totals"]["blocks_from_mooncake"] == sum(full) // BLOCK
    assert a["cold_totals"]["blocks_to_mooncake"] >= sum(full) // BLOCK
    assert b["cold_cached"] == [0] * len(full)  # the cold run read no cache


def test_other_weights_on_the_same_master_never_share(cluster):
    a, c = cluster["a"], cluster["c"]
    assert c["warm"] != a["cold"]  # the weights differ: mixing their KV would show
    assert c["warm"] == c["cold"]
    assert c["warm_cached"] == [0] * len(c["warm"])
    assert c["warm_totals"].get("blocks_from_mooncake", 0) == 0


def test_killing_the_master_mid_run_leaves_every_engine_serving_correct_tokens(cluster):
    for name, r in cluster.items():
        assert r["after_kill"] == r["cold"], name
        before = r.get("warm_totals", r["cold_totals"]).get("blocks_from_mooncake", 0)
        assert r["after_kill_totals"].get("blocks_from_mooncake", 0) == before, name
        # The store was really unreachable: its writes failed, or the circuit breaker,
        # opened by an earlier timeout, kept them from being sent; none was waited on.
        totals = r["after_kill_totals"]
        refused = totals.get("mooncake_failed_blocks", 0) + totals.get("mooncake_breaker_skips", 0)
        assert refused > 0, (name, totals)
        assert r["after_kill_s"] < 60, name
