"""The eager store policy looks, each step, only at the requests that got device blocks
or still have a block to offer (``EagerPolicy._still_due``). On vLLM's real scheduler,
a request it passes over never has a full block it could have offered."""

import random

import pytest


def _docs(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(length)] for _ in range(n)]


def _watch(engine):
    """Check every step's selection: (requests passed over with a full block not offered
    while the picker had room, how many scheduled requests were passed over)."""
    policy = engine.offload.policy
    select, look = policy.select, policy._look
    missed, looked, passed_over = [], set(), [0]

    def counted_look(req_id, picker):
        looked.add(req_id)
        look(req_id, picker)

    def checked(scheduler_output, picker):
        looked.clear()
        select(scheduler_output, picker)
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        scheduled += scheduler_output.scheduled_cached_reqs.req_ids
        for req_id in scheduled:
            cursor = policy._cursors.get(req_id)
            if cursor is None or req_id in looked:
                continue
            passed_over[0] += 1
            request = cursor.request
            confirmed = request.num_computed_tokens - request.num_output_placeholders
            if confirmed >= cursor.next_boundary and not picker.full:
                missed.append((engine.steps, req_id, confirmed, cursor.next_boundary))

    policy._look = counted_look
    policy.select = checked
    return missed, passed_over


SHAPES = {
    # Prompts in chunks of 48 tokens: a chunk fills blocks a later step confirms.
    "chunked-prefill": dict(max_num_batched_tokens=48),
    # A CPU tier of 6 blocks: a step's picker fills, and full blocks wait for later steps.
    "picker-full": dict(cpu_blocks=6),
    "sliding-window": dict(sliding_window=32, num_gpu_blocks=60, cpu_blocks=96),
    # Decodes outgrow the device cache: requests are preempted and resume.
    "preemption": dict(num_gpu_blocks=14, max_num_seqs=6),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_request_passed_over_has_no_block_to_offer(make_engine, shape):
    engine = make_engine(**SHAPES[shape])
    missed, passed_over = _watch(engine)
    for i, doc in enumerate(_docs(6, 70, seed=4)):
        engine.add(f"a{i}", doc, max_tokens=40)
        engine.step()
    engine.run_until_done()
    engine.drain()
    assert not missed
    assert passed_over[0] > 0  # the policy did pass requests over
    assert engine.offload.totals.data["blocks_stored"] > 0
    assert all(len(engine.outputs[f"a{i}"]) == 40 for i in range(6))
    engine.assert_idle()
