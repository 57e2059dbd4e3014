"""Servers sharing one ``disk_path`` never read each other's KV."""

import json
import os
import subprocess
import sys

import pytest

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama

pytestmark = pytest.mark.e2e


def test_two_servers_with_different_weights_share_a_disk_path(tiny_model_dir, tmp_path):
    """Two engines at once on one ``disk_path``, same prompts, same block hashes
    (``PYTHONHASHSEED`` fixed), different weights: each serves its own KV."""
    other_model = build_tiny_llama(str(tmp_path / "other-llama"), TinyModelSpec(seed=1))
    disk, sync = tmp_path / "kv", tmp_path / "sync"
    disk.mkdir(mode=0o700)
    sync.mkdir()
    script = os.path.join(os.path.dirname(__file__), "shared_disk_engine.py")
    env = dict(os.environ, PYTHONHASHSEED="0")
    procs = [subprocess.Popen([sys.executable, script, model, str(disk), str(sync), me, peer],
                              env=env, stdout=subprocess.PIPE, text=True)
             for model, me, peer in ((tiny_model_dir, "a", "b"), (other_model, "b", "a"))]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=420)
        assert proc.returncode == 0, f"engine exited with {proc.returncode}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    a, b = results
    assert a["first"] != b["first"]  # the weights differ: mixing their KV would show
    for r in results:
        assert r["second"] == r["first"]  # each engine's own cold outputs
        assert r["blocks_from_disk"] > 0 and all(c > 0 for c in r["cached"])
