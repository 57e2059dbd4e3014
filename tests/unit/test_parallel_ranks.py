"""Rank arithmetic of the parallel shapes, on vLLM's real scheduler and real workers.

* Pipeline parallel: each stage's worker holds its own layers, so the same share
  of ``cpu_bytes_to_use`` makes a different number of CPU blocks on each; the
  scheduler is given the first stage's KV cache config (as vLLM does) and must
  never plan a copy to a block id another stage lacks (vLLM issue #52921: its
  own CPU offloading copies out of bounds there).
* Data parallel: the CPU tiers of one server's data-parallel ranks on one host
  must fit together.
"""

import random

import pytest

from kvoffload_hal import host_memory

STAGE0_BLOCKS = 24  # the CPU blocks rank 0 (one layer) holds
STAGE1_LAYERS = 3  # rank 1 holds three layers: a third as many blocks in the same bytes
DEVICE_BLOCKS = 8  # the device forgets a document after two others


def _docs(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)]


def _serve_twice(engine, docs):
    """Every document, then again newest first (the tiers keep the newest)."""
    for rnd, order in enumerate((docs, docs[::-1])):
        for i, d in enumerate(order):
            engine.add(f"{rnd}-{i}", d + [5] * rnd)
            engine.run_until_done()
    engine.drain()


def _cpu_ids_sent(engine) -> set[int]:
    ids = set()
    for meta in engine.sent:
        for job in (meta.store, meta.load):
            if job is not None:
                ids.update(job.cpu_blocks)
    return ids


def test_pipeline_stages_get_no_cpu_block_the_heaviest_stage_lacks(make_engine):
    engine = make_engine(peer_layers=(STAGE1_LAYERS,), cpu_blocks=STAGE0_BLOCKS,
                         num_gpu_blocks=DEVICE_BLOCKS)
    stage1 = STAGE0_BLOCKS // STAGE1_LAYERS
    # cpu_bytes_to_use is split over TP x PP = 2 ranks; each holds what its layers fit.
    assert engine.worker.worker.num_cpu_blocks == STAGE0_BLOCKS
    assert engine.peers[0].worker.num_cpu_blocks == stage1
    assert engine.offload.cpu.num_blocks == stage1  # told by the workers at start-up
    _serve_twice(engine, _docs(6, 40))  # 12 blocks through a tier of 8
    assert max(_cpu_ids_sent(engine)) < stage1
    for worker in (engine.worker, engine.peers[0]):
        assert worker.worker.totals.data.get("failed_jobs", 0) == 0
    # Blocks came back: both stages copied them (a job is done once both reported).
    assert engine.offload.totals.data["cpu_hit_tokens"] > 0
    assert engine.offload.totals.data["blocks_loaded"] > 0
    engine.assert_idle()


def test_without_the_workers_counts_the_heaviest_stage_fails_its_copies(make_engine):
    """The control: sized from rank 0's layers alone, the scheduler plans copies to
    block ids rank 1 lacks; rank 1 refuses them (no copy runs out of its memory) and
    the blocks are recomputed, never served."""
    engine = make_engine(peer_layers=(STAGE1_LAYERS,), cpu_blocks=STAGE0_BLOCKS,
                         num_gpu_blocks=DEVICE_BLOCKS, handshake=False)
    assert engine.offload.cpu.num_blocks == STAGE0_BLOCKS
    _serve_twice(engine, _docs(6, 40))
    assert max(_cpu_ids_sent(engine)) >= STAGE0_BLOCKS // STAGE1_LAYERS
    assert engine.peers[0].worker.totals.data["failed_jobs"] > 0
    assert engine.worker.worker.totals.data.get("failed_jobs", 0) == 0


def test_data_parallel_ranks_that_overcommit_the_host_together_are_refused(
        make_engine, monkeypatch):
    page = 2 * 16 * 32 * 2  # the harness's block: K,V x 16 tokens x 32 x bf16
    tier = 64 * page  # make_engine's default cpu_blocks
    # The memory available as the ranks started: one tier fits, two do not.
    monkeypatch.setattr(host_memory, "_available_at_start", tier * 3 // 2)
    make_engine(parallel={"data_parallel_rank_local": 0})  # knows of itself only
    with pytest.raises(ValueError) as e:
        make_engine(parallel={"data_parallel_rank_local": 1})  # knows of ranks 0 and 1
    assert str(e.value) == (
        f"kv_connector_extra_config['cpu_bytes_to_use'] gives each of 2 data-parallel ranks "
        f"on this host {tier} bytes (0.0 GiB in all), more than the 0.0 GiB of memory "
        f"available as they started: expected at most {tier * 3 // 4} bytes per "
        "data-parallel rank (or set 'allow_overcommit': true)")
    make_engine(parallel={"data_parallel_rank_local": 1},
                extra_config={"allow_overcommit": True})  # a warning instead
