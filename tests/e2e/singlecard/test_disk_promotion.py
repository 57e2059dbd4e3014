"""A disk hit does not depend on whether the last disk writes were collected.

An offline engine stops stepping when its last request finishes, so the disk writes
(spills) of that request's last blocks are collected by the next request's first
step, after that request's lookup. While they are in flight they hold CPU blocks; a
CPU tier no larger than them then has no room to promote a disk hit into. Here the
disk writes are held back while the last document runs, so they are certainly in
flight when the repeated prompt arrives: it must wait for them and come back from
disk, not be recomputed whole (which the engine used to do at random, whenever a
write had not been collected yet). And the hit, about 14 blocks behind a CPU tier of
3 usable ones, comes back whole: staged through the CPU tier in rounds
(``kvoffload_hal/scheduler/secondary/staged.py``), where it used to bring back 3 blocks and
recompute the rest.
"""

import threading

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import drain_transfers

pytestmark = pytest.mark.e2e

BLOCK = 64  # tokens
BLOCK_BYTES = 2 * BLOCK * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
CPU_BLOCKS = 4  # 3 usable: vLLM's null block takes one
DOC_WORDS = 700  # ~11 blocks; the prompt served twice has ~14


def test_a_long_disk_hit_comes_back_whole_after_the_writes(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    from vllm import SamplingParams

    from kvoffload_hal.tiers.disk.worker import DiskTier

    writes_go = threading.Event()
    writes_go.set()
    write = DiskTier._store_batch

    def held_back_write(self, items):
        writes_go.wait(60)
        return write(self, items)

    monkeypatch.setattr(DiskTier, "_store_batch", held_back_write)
    llm = make_llm(EngineSpec(
        tiny_model_dir, num_gpu_blocks=40, block_size=BLOCK, max_model_len=2048, offload=True,
        cpu_bytes_to_use=CPU_BLOCKS * BLOCK_BYTES,
        extra_config={"disk_path": str(tmp_path / "kv"),
                      "disk_bytes_to_use": 400 * BLOCK_BYTES}))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = synthetic_text(900, seed=100)
    try:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        for seed in range(5):  # the prompt leaves the device and the CPU tier
            llm.generate([synthetic_text(DOC_WORDS, seed=seed)], params, use_tqdm=False)
        assert drain_transfers(llm)
        writes_go.clear()
        llm.generate([synthetic_text(DOC_WORDS, seed=5)], params, use_tqdm=False)
        offload = scheduler_connector(llm).scheduler
        assert offload.cpu.num_free_blocks() == 0  # every CPU block is being written
        threading.Timer(1.0, writes_go.set).start()
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert drain_transfers(llm)
        totals = offload.totals.data
    finally:
        writes_go.set()
        close_llm(llm)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Every full block came back from disk, through a CPU tier of 3 blocks.
    full_blocks = (len(again.prompt_token_ids) - 1) // BLOCK
    assert full_blocks > 3 * (CPU_BLOCKS - 1)
    assert again.num_cached_tokens == full_blocks * BLOCK
    assert totals["blocks_from_disk"] == full_blocks
    assert totals["staged_hits"] == 1
