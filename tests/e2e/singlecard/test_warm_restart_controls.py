"""Warm restart's controls: without the exit's last steps the last request is lost, and
damaged files or blocks of other weights are never served (so the cached tokens of
``test_warm_restart.py`` came from the files, written by the exit).

A separate file from the promises it controls, so that ``make test``'s processes share
the scripts (``support/restart_scripts.py``) between them.
"""

import pytest

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tiny_llama
from support.disk_files import flip_a_byte_of_every_block
from support.restart_scripts import HIT_TOKENS, NUM_DOCS, new_disk, result, start

pytestmark = pytest.mark.e2e


def test_without_the_last_steps_the_last_request_is_lost_and_damaged_files_recomputed(
        tiny_model_dir, tmp_path):
    """The controls: ``shutdown_flush_timeout_s: 0`` leaves the last request's blocks
    unwritten (so the exit flush is what writes them), and the files damaged are never
    served (so the cached tokens came from them)."""
    disk = new_disk(tmp_path)
    cold = result(start(tiny_model_dir, disk, "exit", "0"))
    warm = result(start(tiny_model_dir, disk, "exit"))
    assert warm["cached"] == [HIT_TOKENS] * (NUM_DOCS - 1) + [0]
    assert warm["tokens"] == cold["tokens"]
    flip_a_byte_of_every_block(str(disk))
    damaged = result(start(tiny_model_dir, disk, "exit"))
    assert damaged["cached"] == [0] * NUM_DOCS
    assert damaged["tokens"] == cold["tokens"]


def test_new_weights_under_the_same_path_are_never_served_old_kv(tmp_path):
    """Nothing is reused (no token cached, from any cache): the second script computes
    every token with the new weights, as a cold run of them does."""
    model = str(tmp_path / "llama")
    disk = new_disk(tmp_path)
    build_tiny_llama(model, TinyModelSpec(seed=0))
    old = result(start(model, disk, "exit"))
    build_tiny_llama(model, TinyModelSpec(seed=1))  # replaced in place, same path
    warm = result(start(model, disk, "exit"))
    assert not any(warm["cached"])
    assert warm["tokens"] != old["tokens"]  # the weights did change
