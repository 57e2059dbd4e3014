"""Warm restart, as a user restarts: a script generates and ends, a new one on the same
``disk_path`` generates, and its very first request is served from what the first kept,
token-identical to the cold run.

Each engine is a user's script in its own process (``restart_engine.py``, run by
``support/restart_scripts.py``), with vLLM's ``LLM`` and its engine core in a process
of its own. Nothing waits for the connector: no idle steps before stopping, no wait for
the index after starting. A fresh engine's device and CPU caches are empty, so the
tokens it reports cached came from disk; the controls (``test_warm_restart_controls.py``)
show they did.
"""

import os
import signal

import pytest

from support.restart_scripts import HIT_TOKENS, NUM_DOCS, new_disk, result, result_line, start

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("end", ["exit", "delete"])
def test_the_first_request_after_a_restart_is_served_what_the_last_script_kept(
        tiny_model_dir, tmp_path, end):
    disk = new_disk(tmp_path)
    cold = result(start(tiny_model_dir, disk, end))
    assert not any(cold["cached"])
    warm = result(start(tiny_model_dir, disk, "exit"))
    assert warm["tokens"] == cold["tokens"]  # token-identical to the cold run
    # Every full block of every document, the first request's and the last one's
    # (written in the first script's last steps, after its last generate) included.
    assert warm["cached"] == [HIT_TOKENS] * NUM_DOCS


def test_a_server_killed_mid_run_leaves_blocks_the_next_one_serves(tiny_model_dir, tmp_path):
    disk = new_disk(tmp_path)
    proc = start(tiny_model_dir, disk, "killed")
    try:
        cold = result_line(proc)  # its requests are done, writes maybe not
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its engine core
        proc.wait(timeout=60)
    warm = result(start(tiny_model_dir, disk, "exit"))
    assert warm["tokens"] == cold["tokens"]
    # Every document but the last, whose blocks the kill may have caught unwritten.
    assert all(c > 0 for c in warm["cached"][:-1]), warm["cached"]
