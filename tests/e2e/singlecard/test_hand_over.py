"""Rescues into the CPU blocks of a step's own loads never change a token.

``device_copies: drop``: the CPU tier lets go of its copies of blocks the device holds,
and the device's reuse of a block it holds alone is rescued to the CPU tier first. A
burst of requests on documents the two tiers hold between them has its loads pin the
CPU blocks those rescues would need; the rescues then go into the CPU blocks of the
burst's own loads, each once its load has run (scheduler/hand_over.py); and a block the
device hands out to one request of the burst and a later request of the same step asks
for is published at that lookup and copied before the step's loads
(scheduler/rescue_homes.py). The burst's greedy outputs equal those of the engine
without the connector, and the counters show the hand-overs, those rescues and the
hits. Two controls change outputs: one runs the rescues before the loads (they overwrite
CPU blocks the loads have not read yet), the other publishes blocks at a lookup and
never copies them.
"""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import drain_transfers

pytestmark = pytest.mark.e2e

BLOCK_BYTES = 2 * 32 * 2 * 128 * 2  # layers x tokens x heads x (K+V)·head_dim x bf16
NUM_DOCS = 8  # ~190 tokens each: 5 full blocks of 32
DEVICE_BLOCKS = 24  # about 4 documents
CPU_BLOCKS = 24  # with the device, room for every document's 40 blocks; alone, not
ORDER = [3, 0, 6, 1, 7, 2, 5, 4]  # the burst


def _run(spec):
    """Each document once, one at a time; then all again at once: the burst's outputs
    and cached tokens, and the connector's counters."""
    from vllm import SamplingParams

    docs = [synthetic_text(180, seed=i) for i in range(NUM_DOCS)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(spec)
    try:
        for doc in docs:
            llm.generate([doc + " question 0"], params, use_tqdm=False)
        burst = llm.generate([docs[i] + " question 1" for i in ORDER], params,
                             use_tqdm=False)
        assert drain_transfers(llm)
        conn = scheduler_connector(llm)
        summary = None
        if conn is not None:
            summary = dict(totals=dict(conn.scheduler.totals.data),
                           pinned=conn.scheduler.num_pinned_cpu_blocks(),
                           pending=conn.scheduler.has_pending_transfers())
        return [list(o.outputs[0].token_ids) for o in burst], summary
    finally:
        close_llm(llm)


def _offload(model):
    return EngineSpec(model, num_gpu_blocks=DEVICE_BLOCKS, offload=True,
                      cpu_bytes_to_use=CPU_BLOCKS * BLOCK_BYTES,
                      extra_config={"device_copies": "drop"})


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    outputs, _ = _run(EngineSpec(tiny_model_dir, num_gpu_blocks=DEVICE_BLOCKS))
    return outputs


def test_a_burst_whose_rescues_go_into_its_loads_blocks_keeps_every_token(tiny_model_dir,
                                                                          baseline):
    outputs, summary = _run(_offload(tiny_model_dir))
    assert outputs == baseline
    totals = summary["totals"]
    assert totals["blocks_handed_over"] > 0
    assert totals["blocks_rescued_for_lookups"] > 0
    assert totals["cpu_hit_tokens"] > 0
    assert summary["pinned"] == 0 and not summary["pending"]


def test_canary_rescues_run_before_the_loads_change_outputs(tiny_model_dir, baseline,
                                                            monkeypatch):
    from kvoffload_hal.hal.backend import Direction, TransferJob
    from kvoffload_hal.worker import core

    def rescues_first(backend, load, collect):
        for hand_over in load.hand_overs:
            rescue = hand_over.rescue
            backend.submit(TransferJob(rescue.job_id, Direction.STORE, rescue.gpu_blocks,
                                       rescue.cpu_blocks))
            collect(backend.flush())
        backend.submit(TransferJob(load.job_id, Direction.LOAD, load.cpu_blocks,
                                   load.gpu_blocks, tag=load))

    monkeypatch.setattr(core, "launch_load", rescues_first)
    outputs, summary = _run(_offload(tiny_model_dir))
    assert summary["totals"]["blocks_handed_over"] > 0
    assert outputs != baseline


def test_canary_blocks_published_at_a_lookup_and_never_copied_change_outputs(
        tiny_model_dir, baseline, monkeypatch):
    from kvoffload_hal.scheduler.rescue_homes import RescueHomes

    homed = []
    take = RescueHomes.take

    def never_copied(self):
        rescues, blocks = take(self)
        homed.extend(rescues)
        self.cpu.unpin(blocks)  # published, and no rescue job writes them
        return [], []

    monkeypatch.setattr(RescueHomes, "take", never_copied)
    outputs, _ = _run(_offload(tiny_model_dir))
    assert homed
    assert outputs != baseline
