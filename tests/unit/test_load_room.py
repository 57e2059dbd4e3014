"""A CPU-tier load waits while the device has no room to keep it (``defer_loads_without_room``).

On vLLM's real scheduler with the model that checks every KV read
(``engine_harness.py``): three documents of four full blocks, all in the CPU tier
and none on the device, arrive together at a device of 12 usable blocks. vLLM
admits all three (12 blocks) and, in the next step, when each needs a fifth block,
preempts one. With the setting on, the third waits until the first two finish:
nothing is preempted, and every document still comes back from the CPU tier.
"""

import random

import pytest

from kvoffload_hal.config import OffloadConfig
from kvoffload_hal.scheduler import admission

BS = 16
DOC_BLOCKS = 4
# 12 usable blocks (vLLM keeps one as its null block); prefills of three documents in a step.
ENGINE = dict(num_gpu_blocks=13, cpu_blocks=64, max_num_batched_tokens=4 * DOC_BLOCKS * BS)


def _docs(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(DOC_BLOCKS * BS)] for _ in range(n)]


def _run(make_engine, defer, **engine_args):
    engine = make_engine(**{**ENGINE, **engine_args},
                         extra_config={"defer_loads_without_room": defer})
    docs, fillers = _docs(3, 1), _docs(3, 2)
    for i, d in enumerate(docs + fillers):  # one at a time: the fillers evict the docs
        engine.add(f"warm{i}", d, max_tokens=2)
        engine.run_until_done()
    engine.drain()
    preempted_before = engine.preemptions
    for i, d in enumerate(docs):
        engine.add(f"doc{i}", d, max_tokens=4)
    engine.run_until_done()
    engine.drain()
    hits = [engine.cached_tokens[f"doc{i}"] // BS for i in range(len(docs))]
    assert hits == [DOC_BLOCKS - 1] * len(docs)  # the last block is always computed
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
    return engine, engine.preemptions - preempted_before


def test_a_load_the_device_cannot_keep_waits_and_nothing_is_preempted(make_engine):
    engine, preempted = _run(make_engine, defer=True)
    assert preempted == 0
    assert engine.offload.room.num_deferred > 1  # asked again each step until room came


def test_without_the_setting_vllm_admits_the_load_and_preempts(make_engine):
    engine, preempted = _run(make_engine, defer=False)
    assert preempted > 0
    assert engine.offload.room.num_deferred == 0


def test_a_request_is_deferred_a_bounded_number_of_times(make_engine, monkeypatch):
    """Deferred once at most, the third document is left to vLLM from then on (which
    admits it once its prompt's blocks are free)."""
    monkeypatch.setattr(admission, "MAX_DEFERRED_STEPS", 1)
    engine, _ = _run(make_engine, defer=True)
    assert engine.offload.room.num_deferred == 1


def test_the_setting_is_off_by_default_and_checked():
    assert OffloadConfig.from_extra_config({}).defer_loads_without_room is False
    assert OffloadConfig.from_extra_config(
        {"defer_loads_without_room": True}).defer_loads_without_room is True
    with pytest.raises(ValueError, match="defer_loads_without_room"):
        OffloadConfig.from_extra_config({"defer_loads_without_room": "maybe"})


def test_a_load_whose_room_is_exactly_enough_is_admitted(make_engine):
    """15 usable blocks: when the third document is looked up, the first two hold 8 and
    the third's prompt takes 4, which leaves 3, the blocks the three start in the next
    step. It is admitted, and nothing is preempted."""
    engine, preempted = _run(make_engine, defer=True, num_gpu_blocks=16)
    assert engine.offload.room.num_deferred == 0
    assert preempted == 0


@pytest.fixture
def gate():
    from support import backend_doubles

    backend_doubles.GatedCpuBackend.gate.set()
    yield backend_doubles.GatedCpuBackend.gate
    backend_doubles.GatedCpuBackend.gate.set()


def test_a_lone_load_is_never_deferred(make_engine, gate):
    """No request runs, so none can take the room back: a CPU-tier hit is admitted
    even though the device's free blocks cover only its prompt (the rest is held by a
    finished request's store, which gives it back)."""
    engine = make_engine(backend="gated-cpu", num_gpu_blocks=9, cpu_blocks=64,
                         extra_config={"defer_loads_without_room": True})
    doc, filler, other = _docs(1, 1)[0], _docs(2, 2)[0] * 2, _docs(1, 3)[0]
    for i, prompt in enumerate((doc, filler)):  # the filler's 8 blocks evict the doc
        engine.add(f"warm{i}", prompt, max_tokens=1)
        engine.run_until_done()
        engine.drain()
    gate.clear()  # copies wait: "other"'s 4 blocks stay held by its store
    engine.add("other", other, max_tokens=1)
    engine.run_until_done()
    gpu_pool = engine.scheduler.kv_cache_manager.block_pool
    assert gpu_pool.get_num_free_blocks() == DOC_BLOCKS  # the doc's prompt, no more
    engine.add("doc", doc, max_tokens=4)
    engine.step()
    assert engine.offload.room.num_deferred == 0
    gate.set()
    engine.run_until_done()
    engine.drain()
    assert engine.cached_tokens["doc"] == (DOC_BLOCKS - 1) * BS  # came from the CPU tier
    assert engine.preemptions == 0
    engine.assert_idle()


def test_the_running_requests_next_blocks_are_summed_once_a_step_and_kept_right(make_engine):
    """The sum of the blocks the running requests start next step is kept between
    lookups of one step (requests allocated, preempted, finishing) and summed again
    after each step: at every lookup it equals the sum over the requests running."""
    engine = make_engine(**ENGINE, extra_config={"defer_loads_without_room": True})
    room = engine.offload.room
    defers, checked = room.defers, []

    def checking(request, num_computed_tokens):
        answer = defers(request, num_computed_tokens)
        fresh = sum(admission._next_block(r, room.block_size) for r in room._running.values())
        if room._needed is not None:
            checked.append(room._needed == fresh)
        return answer
    room.defers = checking
    for i, d in enumerate(_docs(6, 3)):
        engine.add(f"r{i}", d, max_tokens=2 + i % 3)
    engine.run_until_done()
    for i, d in enumerate(_docs(6, 3)):  # again, now from the CPU tier
        engine.add(f"s{i}", d, max_tokens=2 + i % 3)
    engine.run_until_done()
    assert checked and all(checked)
