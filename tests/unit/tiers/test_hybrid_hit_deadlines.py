"""A hybrid model's tier hit that cannot be read gives up within its deadline.

The multi-group versions of the one-group tests in test_staged_hits.py and
test_object_store_tier.py (a staged hit without CPU room, a staged read that does not
land in time). Two full-attention and two sliding-window KV cache groups. On vLLM < 0.32
the hit's tier blocks are read by a check before it is offered
(scheduler/secondary/staged_check.py); on later vLLM the staged hit reads them. Either way
the request is recomputed once the CPU tier stayed full for the reads' limit, or once a
read stayed in flight past the tier's wait, and finishes token-identical.

The scheduler runs on a clock the test moves (support.clock.install_clock): each engine
step is half a second of it, and a request must finish within a bounded number of steps.
"""

import threading

import pytest

from kvoffload_hal.tiers import registry
from support.clock import FakeClock, install_clock
from support.object_store_tier import ENTRY_POINT, STORES, ObjectStoreSpec
from support.polling import wait_for_tier_io
from support.serving_rig import serve

BS = 16
PAGE = BS * 128
STEP_S = 0.5  # of the fake clock, per engine step
# Two limits of 10 s (no CPU room for the read, then for a plain promotion) and change.
DEADLINE_STEPS = int(30 / STEP_S)
GROUPS = dict(sliding_window=32, full_groups=2, sliding_groups=2)


def _serve(engine, *requests):
    return serve(engine, *requests, max_steps=3000)


def _doc(seed, blocks):
    return [(seed * 7 + i) % 89 + 1 for i in range(blocks * BS + 1)]


def _finishes_within_the_deadline(engine, clock, req_id):
    for _ in range(DEADLINE_STEPS):
        if req_id in engine.finished:
            return True
        engine.step()
        clock.now += STEP_S
    return req_id in engine.finished


def test_a_hybrid_hit_on_a_full_cpu_tier_is_recomputed_within_a_deadline(make_engine,
                                                                         tmp_path):
    """Disk writes that never end hold every CPU block (as in the one-group test)."""
    engine = make_engine(cpu_blocks=12, num_gpu_blocks=40, max_num_batched_tokens=2 * BS,
                         extra_config={"disk_path": str(tmp_path / "kv"),
                                       "disk_bytes_to_use": 1024 * PAGE}, **GROUPS)
    clock = FakeClock()
    assert install_clock(engine.offload, clock) > 0
    doc = _doc(1, 6)
    _serve(engine, ("first", doc))
    for seed in range(2, 5):  # the document leaves the device and the CPU tier
        _serve(engine, (f"other-{seed}", _doc(seed, 6)))
    tier = engine.worker.worker.tiers.nearest
    gate = threading.Event()  # disk writes wait here: the spills hold the CPU tier
    write = tier._store_batch
    tier._store_batch = lambda items: (gate.wait(60), write(items))[1]
    try:
        engine.add("last", _doc(5, 6))
        while "last" not in engine.finished:
            engine.step()
        assert engine.offload.cpu.num_free_blocks() == 0
        engine.add("again", doc)
        assert _finishes_within_the_deadline(engine, clock, "again"), \
            "the hit waited for CPU room past its limit"
    finally:
        gate.set()
    # Writes stuck past the disk tier's wait opened its breaker: while it is open they
    # are no pending work (an idle engine does not step for them). Once the disk has
    # answered, the next request, after the breaker's window, collects the late writes'
    # reports (or probes the disk), and the breaker closes.
    assert engine.offload.totals.data["disk_breaker_opens"] == 1
    wait_for_tier_io(tier)
    clock.now += 60.0
    _serve(engine, ("after", _doc(9, 2)))
    engine.drain()
    assert engine.offload.totals.data["disk_breaker_closes"] == 1
    assert engine.outputs["again"] == engine.outputs["first"]
    assert engine.cached_tokens["again"] == 0  # recomputed, not served
    assert engine.offload.totals.data.get("staged_hits", 0) == 0
    engine.assert_idle()


@pytest.fixture
def object_store(monkeypatch):
    # Instances that share a store must name blocks alike (vLLM 0.23 draws a random
    # block-hash seed per engine otherwise).
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    # Its worker half keeps one object per key whatever the key's group: a model with
    # several groups is one more thing its spec may say it serves.
    monkeypatch.setattr(ObjectStoreSpec, "one_group_only", False)
    registry.register_tier("objstore", ENTRY_POINT)
    yield
    registry.unregister_tier("objstore")
    for store in STORES.values():
        store.thaw()
    STORES.clear()


def _shared_engine(make_engine, cpu_blocks, **extra):
    return make_engine(cpu_blocks=cpu_blocks, num_gpu_blocks=120,
                       max_num_batched_tokens=2 * BS,
                       extra_config={"object_store": "shared", **extra}, **GROUPS)


def test_a_hybrid_hit_whose_read_hangs_is_recomputed_within_a_deadline(make_engine,
                                                                       object_store):
    """The store hangs after its first batch of reads, and stays frozen until the request
    finished: nothing waits for it past the tier's wait."""
    writer = _shared_engine(make_engine, cpu_blocks=256)
    doc = _doc(6, 20)
    _serve(writer, ("first", doc))
    STORES["shared"].freeze_after_reads = 8
    reader = _shared_engine(make_engine, cpu_blocks=12, object_store_timeout_s=2.0)
    clock = FakeClock()
    assert install_clock(reader.offload, clock) > 0
    reader.add("again", doc)
    assert _finishes_within_the_deadline(reader, clock, "again"), \
        "the hit waited for a hung read past the tier's wait"
    assert not STORES["shared"].thawed.is_set()  # it never answered
    assert reader.outputs["again"] == writer.outputs["first"]
    assert reader.offload.totals.data["objstore_breaker_opens"] == 1
    assert not reader.offload.has_pending_transfers()  # nothing to step for
    STORES["shared"].thaw()
    _serve(reader, ("later", _doc(7, 20)))  # steps that collect the late reads
    reader.assert_idle()
