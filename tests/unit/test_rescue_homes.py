"""Rescues a lookup of the same step asks for (``device_copies: drop``).

On vLLM's real scheduler with the model that checks every KV read
(``engine_harness.py``): a burst whose early requests take the device blocks of
documents that later requests of the same step ask for. Those blocks are in neither
tier at the later lookups unless their rescues are homed and published there
(scheduler/rescue_homes.py). Where a homed rescue fails, the loads that read its blocks
fail on the worker and the requests are recomputed, never read wrong.
"""

import random

import pytest

from support import backend_doubles

BS = 16
DOC_BLOCKS = 4
# 8 documents (32 blocks) on a device of 29 usable blocks and a CPU tier of 24, the
# whole burst admitted in one step.
BURST = dict(num_gpu_blocks=30, cpu_blocks=25, max_num_batched_tokens=2048)


def _docs(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(DOC_BLOCKS * BS + 1)] for _ in range(n)]


def _burst(engine, homes=True, before_burst=lambda: None):
    """Each document alone, then all of them at once: the burst's hit blocks."""
    if not homes:
        engine.offload.stores.homes = None
    docs = _docs(8)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d, max_tokens=2)
        engine.run_until_done()
    before_burst()
    burst = [engine.add(f"b{i}", d, max_tokens=2) for i, d in enumerate(docs)]
    engine.run_until_done()
    engine.drain()
    assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
    return sum(engine.cached_tokens[r.request_id] // BS for r in burst)


@pytest.mark.parametrize("backend", ["cpu", "lagging-cpu"])
def test_a_block_the_device_hands_out_is_read_by_a_later_lookup_of_the_same_step(
        make_engine, backend):
    """With homes, the burst's later requests load blocks the device gave to its earlier
    ones in the same step (counted once their rescue is reported), every read checked;
    the same engine without homes recomputes them."""
    engine = make_engine(backend, **BURST, extra_config={"device_copies": "drop"})
    hits = _burst(engine)
    homed = engine.offload.totals.data["blocks_rescued_for_lookups"]
    assert homed > 0
    assert engine.offload.stores.homes.num_homed == homed
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
    without = make_engine(backend, **BURST, extra_config={"device_copies": "drop"})
    assert hits > _burst(without, homes=False)
    assert "blocks_rescued_for_lookups" not in without.offload.totals.data
    without.assert_idle()


@pytest.mark.parametrize("control", [False, True], ids=["checked", "control-unchecked"])
def test_a_load_of_a_block_whose_homed_rescue_failed_fails_and_is_recomputed(
        make_engine, monkeypatch, control):
    """Every store fails during the burst: the homed rescues' CPU blocks hold stale
    bytes. The loads that read them fail on the worker without copying, the requests
    are recomputed (the model checks every read), and the scheduler drops the homed
    hashes from the CPU tier. The control lets such a load run: its read is caught."""
    from kvoffload_hal.worker.hand_over import Unfilled

    refused = []
    read_by = Unfilled.read_by

    def checked(self, load):
        if control:
            return False  # the load runs
        refused.append(read_by(self, load))
        return refused[-1]
    monkeypatch.setattr(Unfilled, "read_by", checked)
    failing = backend_doubles.SwitchedStoresBackend.failing
    engine = make_engine("switched-stores", **BURST, extra_config={"device_copies": "drop"})
    homed = []
    take = engine.offload.stores.homes.take

    def watched():
        rescues, blocks = take()
        homed.extend(r.block_hash for r in rescues)
        return rescues, blocks
    monkeypatch.setattr(engine.offload.stores.homes, "take", watched)
    left = []  # homed hashes still published once their failed rescue was reported
    on_report = engine.offload.stores.on_report

    def reported(job, report):
        on_report(job, report)
        left.extend(h for h in homed if engine.offload.cpu.holds(h))
    monkeypatch.setattr(engine.offload.stores, "on_report", reported)
    try:
        if control:
            with pytest.raises(AssertionError, match="wrong KV read"):
                _burst(engine, before_burst=failing.set)
            return
        _burst(engine, before_burst=failing.set)
    finally:
        failing.clear()
    totals = engine.offload.totals.data
    assert homed
    assert "blocks_rescued_for_lookups" not in totals
    assert any(refused)  # loads of homed blocks failed unlaunched
    assert not left
    assert engine.model.checked_tokens > 0
    engine.assert_idle()


def test_two_kv_cache_groups_home_the_entries_the_hit_takes(make_engine):
    """A sliding-window group beside full attention: vLLM's own lookup, with the pending
    rescues as stand-ins, decides which (group, block) entries a later lookup takes; those
    are homed, every read checked, and the burst hits more than without homes. Where a
    failed load is read again from its CPU blocks (vLLM < 0.32 with several groups),
    nothing is homed."""
    config = dict(sliding_window=32, num_gpu_blocks=50, cpu_blocks=40,
                  max_num_batched_tokens=2048, extra_config={"device_copies": "drop"})
    engine = make_engine(**config)
    if engine.offload.caps.vllm.reads_failed_loads_again():
        assert engine.offload.stores.homes is None
        return
    hits = _burst(engine)
    assert engine.offload.totals.data["blocks_rescued_for_lookups"] > 0
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
    without = make_engine(**config)
    assert hits > _burst(without, homes=False)
    without.assert_idle()


def test_a_rescue_bound_while_the_kv_cache_is_unregistered_fails_the_loads_of_its_blocks(
        make_engine):
    """A rescue bound while the KV cache is unregistered fails unlaunched; a load of one
    of its CPU blocks (published at a lookup) after the wake-up fails too, unlaunched."""
    from kvoffload_hal.metadata import LoadSpec, OffloadMetadata, StoreSpec

    engine = make_engine(extra_config={"device_copies": "drop", "load_mode": "async"})
    worker = engine.worker.worker
    worker.unregister_kv_caches()
    worker.bind_connector_metadata(OffloadMetadata(rescue=StoreSpec(90, [1, 2], [3, 4])))
    assert worker.build_connector_worker_meta().stores[90].failed
    worker.restore_kv_caches()
    worker.bind_connector_metadata(OffloadMetadata(load=LoadSpec(91, ("r",), [4], [5])))
    _, finished, _ = worker.get_finished(set())
    worker.clear_connector_metadata()
    assert "r" in finished  # out of its wait, with its one device block to recompute
    assert worker.get_block_ids_with_load_errors() == {5}
    assert worker.totals.data["failed_jobs"] == 2


def test_a_homed_rescue_that_fails_on_one_rank_fails_the_loads_of_its_blocks_there(
        make_engine, monkeypatch):
    """Two ranks (pipeline stages); every store fails on the second during the burst.
    There the loads of homed blocks fail unlaunched, while the first rank copies them;
    the requests are recomputed (every read of the first rank checked), and the homed
    rescues, failed on a rank, are not counted."""
    import threading

    engine = make_engine("switched-stores", peer_layers=(1,), **BURST,
                         extra_config={"device_copies": "drop"})
    ranks = [engine.worker.worker, engine.peers[0].worker]
    failing = threading.Event()
    ranks[1].backend.failing = failing  # this rank's backend only
    refused = {0: 0, 1: 0}
    for rank, worker in enumerate(ranks):
        def checked(load, read_by=worker._unfilled.read_by, rank=rank):
            refuse = read_by(load)
            refused[rank] += refuse
            return refuse
        monkeypatch.setattr(worker._unfilled, "read_by", checked)
    _burst(engine, before_burst=failing.set)
    assert engine.offload.stores.homes.num_homed > 0
    assert refused[0] == 0 and refused[1] > 0
    assert ranks[0].totals.data.get("failed_jobs", 0) == 0
    assert "blocks_rescued_for_lookups" not in engine.offload.totals.data
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
