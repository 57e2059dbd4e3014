"""Warm restart, as a user restarts: a script generates and ends, a new one on the same
``disk_path`` generates, and its very first request is served from what the first kept,
token-identical to the cold run; never blocks of other weights or damaged files.

Each engine is a user's script in its own process (``restart_engine.py``), with vLLM's
``LLM`` and its engine core in a process of its own. Nothing waits for the connector:
no idle steps before stopping, no wait for the index after starting. A fresh engine's
device and CPU caches are empty, so the tokens it reports cached came from disk; the
control with every file damaged shows they did.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama
from support.disk_files import flip_a_byte_of_every_block

pytestmark = pytest.mark.e2e

SCRIPT = os.path.join(os.path.dirname(__file__), "restart_engine.py")
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(TESTS)  # this checkout's kvoffload_hal, whatever is installed
RESULT = "restart-engine: "
NUM_DOCS = 8
HIT_TOKENS = 5 * 32  # each document: 182 prompt tokens, 5 full blocks of 32 tokens


def _env():
    path = os.pathsep.join(p for p in (ROOT, TESTS, os.environ.get("PYTHONPATH")) if p)
    # vLLM's default: the engine core in its own process (this suite's conftest sets 0).
    return dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=path,
                VLLM_ENABLE_V1_MULTIPROCESSING="1")


def _engine(model, disk, end, *flush_s):
    return subprocess.Popen([sys.executable, SCRIPT, model, str(disk), end, *flush_s],
                            env=_env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _line(proc) -> dict:
    for line in proc.stdout:
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise AssertionError(f"the engine printed no result (exit code {proc.wait()})")


def _result(proc, timeout_s=420):
    result = _line(proc)
    proc.wait(timeout=timeout_s)
    assert proc.returncode == 0, f"engine exited with {proc.returncode}"
    return result


def _disk(tmp_path, name="kv"):
    disk = tmp_path / name
    disk.mkdir(mode=0o700)
    return disk


@pytest.mark.parametrize("end", ["exit", "delete"])
def test_the_first_request_after_a_restart_is_served_what_the_last_script_kept(
        tiny_model_dir, tmp_path, end):
    disk = _disk(tmp_path)
    cold = _result(_engine(tiny_model_dir, disk, end))
    assert not any(cold["cached"])
    warm = _result(_engine(tiny_model_dir, disk, "exit"))
    assert warm["tokens"] == cold["tokens"]  # token-identical to the cold run
    # Every full block of every document, the first request's and the last one's
    # (written in the first script's last steps, after its last generate) included.
    assert warm["cached"] == [HIT_TOKENS] * NUM_DOCS


def test_without_the_last_steps_the_last_request_is_lost_and_damaged_files_recomputed(
        tiny_model_dir, tmp_path):
    """The controls: ``shutdown_flush_timeout_s: 0`` leaves the last request's blocks
    unwritten (so the exit flush is what writes them), and the files damaged are never
    served (so the cached tokens came from them)."""
    disk = _disk(tmp_path)
    cold = _result(_engine(tiny_model_dir, disk, "exit", "0"))
    warm = _result(_engine(tiny_model_dir, disk, "exit"))
    assert warm["cached"] == [HIT_TOKENS] * (NUM_DOCS - 1) + [0]
    assert warm["tokens"] == cold["tokens"]
    flip_a_byte_of_every_block(str(disk))
    damaged = _result(_engine(tiny_model_dir, disk, "exit"))
    assert damaged["cached"] == [0] * NUM_DOCS
    assert damaged["tokens"] == cold["tokens"]


def test_a_server_killed_mid_run_leaves_blocks_the_next_one_serves(tiny_model_dir, tmp_path):
    disk = _disk(tmp_path)
    proc = _engine(tiny_model_dir, disk, "killed")
    try:
        cold = _line(proc)  # its requests are done, writes maybe not
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its engine core
        proc.wait(timeout=60)
    warm = _result(_engine(tiny_model_dir, disk, "exit"))
    assert warm["tokens"] == cold["tokens"]
    # Every document but the last, whose blocks the kill may have caught unwritten.
    assert all(c > 0 for c in warm["cached"][:-1]), warm["cached"]


def test_new_weights_under_the_same_path_are_never_served_old_kv(tmp_path):
    model = str(tmp_path / "llama")
    disk = _disk(tmp_path)
    build_tiny_llama(model, TinyModelSpec(seed=0))
    _result(_engine(model, disk, "exit"))
    build_tiny_llama(model, TinyModelSpec(seed=1))  # replaced in place, same path
    warm = _result(_engine(model, disk, "exit"))
    assert not any(warm["cached"])
    cold = _result(_engine(model, _disk(tmp_path, "kv-cold"), "exit"))
    assert warm["tokens"] == cold["tokens"]  # the new weights' own outputs
