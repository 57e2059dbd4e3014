"""Warm restart: a new engine process on the same ``disk_path`` serves the blocks a
stopped one kept, token-identical to a cold run; never blocks of other weights.

Each engine is its own process (``restart_engine.py``), as a restarted server is.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(os.path.dirname(__file__), "restart_engine.py")
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=path)


def _engine(model, disk, stage):
    return subprocess.Popen([sys.executable, SCRIPT, model, str(disk), stage], env=_env(),
                            stdout=subprocess.PIPE, text=True)


def _result(proc, timeout_s=420):
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"engine exited with {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def _disk(tmp_path, name="kv"):
    disk = tmp_path / name
    disk.mkdir(mode=0o700)
    return disk


def _served_from_disk(cold, warm):
    assert warm["tokens"] == cold["tokens"]  # token-identical to the cold run
    assert warm["blocks_from_disk"] > 0
    assert all(c > 0 for c in warm["cached"]), warm["cached"]  # every document hit


def test_a_restarted_server_serves_what_it_kept_at_a_clean_stop(tiny_model_dir, tmp_path):
    disk = _disk(tmp_path)
    cold = _result(_engine(tiny_model_dir, disk, "write"))
    assert cold["blocks_to_disk"] > 0 and not any(cold["cached"])
    _served_from_disk(cold, _result(_engine(tiny_model_dir, disk, "read")))


def test_a_server_killed_mid_run_leaves_blocks_the_next_one_serves(tiny_model_dir, tmp_path):
    disk = _disk(tmp_path)
    proc = _engine(tiny_model_dir, disk, "write-then-wait")
    line = ""
    while not line.startswith("{"):  # its requests are done, spills maybe not
        line = proc.stdout.readline()
        assert line, "the engine exited before serving"
    cold = json.loads(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    _served_from_disk(cold, _result(_engine(tiny_model_dir, disk, "read")))


def test_new_weights_under_the_same_path_are_never_served_old_kv(tmp_path):
    model = str(tmp_path / "llama")
    disk = _disk(tmp_path)
    build_tiny_llama(model, TinyModelSpec(seed=0))
    _result(_engine(model, disk, "write"))
    build_tiny_llama(model, TinyModelSpec(seed=1))  # replaced in place, same path
    warm = _result(_engine(model, disk, "read"))
    assert warm["blocks_from_disk"] == 0 and not any(warm["cached"])
    cold = _result(_engine(model, _disk(tmp_path, "kv-cold"), "write"))
    assert warm["tokens"] == cold["tokens"]  # the new weights' own outputs
