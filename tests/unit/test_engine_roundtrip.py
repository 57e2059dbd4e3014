"""The connector on vLLM's real scheduler, with a model that verifies every KV read.

See ``engine_harness.py``: each test below fails if a wrong, stale or missing
block is ever attended to, on top of its own assertions.
"""

import random
import time

import pytest

from support import backend_doubles

BS = 16


def _docs(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)]


def _two_passes(engine, docs, suffix=(5, 6)):
    """Every document once, then again with a suffix after the device forgot it."""
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + list(suffix))
    engine.run_until_done()
    engine.drain()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_evicted_prefixes_come_back_from_cpu(make_engine, lazy):
    engine = make_engine(lazy=lazy)
    docs = _docs(6, 80)  # 5 blocks each; the device holds 19
    _two_passes(engine, docs)
    totals = engine.offload.totals.data
    if lazy:
        # Lazy stores only what reaches the head of the free queue before it is
        # reused; on a 20-block device some blocks are reused within one step.
        assert 6 * 80 // 2 <= totals["cpu_hit_tokens"] <= 6 * 80
    else:
        # Every second-pass request found its 5 full blocks on the CPU tier.
        assert totals["cpu_hit_tokens"] == 6 * 80
    assert totals["blocks_loaded"] == totals["cpu_hit_tokens"] // BS
    assert engine.model.checked_tokens > 6 * 80
    engine.assert_idle()


def test_without_offloading_the_same_workload_recomputes(make_engine):
    """The workload above really evicts: with a 1-block CPU tier nothing comes back."""
    engine = make_engine(cpu_blocks=1)
    _two_passes(engine, _docs(6, 80))
    assert engine.offload.totals.data.get("cpu_hit_tokens", 0) <= BS
    engine.assert_idle()


def test_last_block_of_a_request_finishing_in_that_step_is_stored(make_engine):
    engine = make_engine()
    prompt = _docs(1, 47)[0]
    req = engine.add("r", prompt, max_tokens=2)
    engine.run_until_done()
    engine.drain()
    # The step that computed token 47 (completing block 3) also finished the request.
    assert req.num_computed_tokens == 48
    _, hit_tokens = engine.offload.cpu.find_hit(req.block_hashes, 0, 10_000)
    assert hit_tokens == 48
    assert engine.offload.totals.data["blocks_stored"] == 3
    engine.assert_idle()


def test_blocks_a_finishing_request_had_no_room_for_are_stored_in_later_steps(make_engine):
    """Three 12-block prompts finish in the step that computes them; the CPU tier
    (24 blocks) has room for two of them then. The third one's blocks are stored
    once the first copies are done, while the device still holds them."""
    engine = make_engine(cpu_blocks=24, num_gpu_blocks=64, max_num_batched_tokens=1024)
    docs = _docs(3, 12 * BS)
    for i, d in enumerate(docs):
        engine.add(f"r{i}", d + [1], max_tokens=1)
    engine.run_until_done()
    engine.drain()
    assert engine.offload.totals.data["blocks_stored"] == 36
    engine.assert_idle()


def test_an_idle_engine_keeps_stepping_until_its_stores_are_confirmed(make_engine):
    """The connector reports pending work, so vLLM's busy loop does not go idle
    with device blocks pinned and CPU copies unpublished."""
    engine = make_engine(backend="slow-cpu")
    engine.add("r", _docs(1, 47)[0], max_tokens=2)
    while not engine.finished:
        engine.step()
    assert engine.offload.has_pending_transfers()
    steps_for_push_work = not engine.offload.caps.vllm.holds_last_request()
    if steps_for_push_work:
        assert engine.scheduler.has_requests()  # only because of the connector's push work
        engine.run_until_done()
    else:
        # This vLLM never asks: an engine that goes idle confirms its last stores
        # in the steps of its next request (what the connector documents).
        engine.run_until_done()
        engine.add("next", _docs(1, 47, seed=1)[0], max_tokens=2)
        engine.run_until_done()
        engine.drain()
    stored = 3 if steps_for_push_work else 6  # 47 + 1 computed tokens each
    assert engine.offload.totals.data["blocks_stored"] == stored
    engine.assert_idle()


@pytest.mark.parametrize("backend", ["cpu", "slow-cpu"])
def test_copies_complete_in_their_step_only_where_compute_is_synchronous(make_engine, backend):
    """On vLLM's CPU platform the worker waits for the step's copies: a request
    waiting for a load is scheduled in the next step. On a device it does not."""
    engine = make_engine(backend=backend, extra_config={"load_mode": "async"})
    docs = _docs(6, 80)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    steps_with_jobs_in_flight = 0
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + [5, 6])
    while engine.scheduler.has_requests():
        engine.step()
        steps_with_jobs_in_flight += bool(engine.offload.num_jobs_in_flight())
    assert engine.offload.totals.data["cpu_hit_tokens"] == 6 * 80
    if backend == "cpu":
        assert steps_with_jobs_in_flight == 0
    else:
        assert steps_with_jobs_in_flight > 0
    engine.assert_idle()


def test_kv_events_of_the_cpu_tier_say_cpu(make_engine):
    """A KV-aware router must not take CPU-tier stores and evictions for device ones."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    engine = make_engine(cpu_blocks=12, kv_events=True)  # small: the tier evicts
    batches = []
    engine.scheduler.kv_event_publisher.publish = batches.append
    _two_passes(engine, _docs(6, 80))
    events = [e for batch in batches for e in batch.events]
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    cpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert len(cpu_stored) == engine.offload.totals.data["blocks_stored"]
    assert cpu_removed
    stored_hashes = {h for e in cpu_stored for h in e.block_hashes}
    assert {h for e in cpu_removed for h in e.block_hashes} <= stored_hashes
    # Device events keep their own medium.
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events)
    engine.assert_idle()


def test_cpu_hit_is_pinned_between_lookup_and_allocation(make_engine):
    engine = make_engine(cpu_blocks=8)
    doc = _docs(1, 64)[0]
    engine.add("a", doc)
    engine.run_until_done()
    engine.drain()
    b = engine.add("b", doc + [1])
    engine.scheduler.waiting.remove(b)  # drive the two phases by hand
    cpu = engine.offload.cpu
    before = [blk.block_id for blk in cpu.find_hit(b.block_hashes, 0, 64)[0][0]]
    hit, is_async = engine.offload.get_num_new_matched_tokens(b, 0)
    assert (hit, is_async) == (64, not engine.offload.caps.sync_loads)
    # Another request now takes every free CPU block: LRU eviction must spare the hit.
    taken = cpu.allocate(cpu.num_free_blocks())
    assert [blk.block_id for blk in cpu.find_hit(b.block_hashes, 0, 64)[0][0]] == before
    cpu.unpin(taken)
    engine.offload.request_finished(b, ([],))
    assert engine.offload.num_pinned_cpu_blocks() == 0


def _hit_then_allocate(engine, num_tokens):
    """Request "b" finds a 64-token CPU hit and is given ``num_tokens`` of it."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    doc = _docs(1, 64)[0]
    engine.add("a", doc)
    engine.run_until_done()
    engine.drain()
    b = engine.add("b", doc + [1])
    engine.scheduler.waiting.remove(b)  # drive the phases by hand
    hit = [blk.block_id for blk in engine.offload.cpu.find_hit(b.block_hashes, 0, 64)[0][0]]
    assert engine.offload.get_num_new_matched_tokens(b, 0)[0] == 64
    gpu_pool = engine.scheduler.kv_cache_manager.block_pool
    gpu_blocks = gpu_pool.get_new_blocks(5)
    engine.offload.update_state_after_alloc(b, KVCacheBlocks((gpu_blocks,)), num_tokens)
    return b, hit, gpu_blocks


def test_scheduler_accepting_fewer_tokens_takes_the_leading_blocks(make_engine):
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    engine = make_engine(extra_config={"load_mode": "async"})
    b, hit, gpu_blocks = _hit_then_allocate(engine, 2 * BS)
    # Only the two taken CPU blocks stay pinned; the rest of the hit was released.
    assert engine.offload.num_pinned_cpu_blocks() == 2
    load = engine.offload.build_connector_meta(SchedulerOutput.make_empty()).load
    assert load.req_ids == ("b",)
    assert load.cpu_blocks == hit[:2]
    assert load.gpu_blocks == [blk.block_id for blk in gpu_blocks[:2]]
    # Sent: vLLM must keep the request until the load is reported.
    assert engine.offload.request_finished(b, ([],)) == (True, None)
    engine.offload.update_connector_output(KVConnectorOutput(finished_recving={"b"}))
    engine.scheduler.kv_cache_manager.block_pool.free_blocks(gpu_blocks)
    assert engine.offload.num_pinned_cpu_blocks() == 0


def test_a_load_never_sent_is_released_when_its_request_finishes(make_engine):
    engine = make_engine()
    b, _, gpu_blocks = _hit_then_allocate(engine, 4 * BS)
    assert engine.offload.num_pinned_cpu_blocks() == 4
    assert engine.offload.request_finished(b, ([],)) == (False, None)
    engine.scheduler.kv_cache_manager.block_pool.free_blocks(gpu_blocks)
    assert engine.offload.num_pinned_cpu_blocks() == 0
    assert not engine.offload.has_pending_transfers()


def test_preemptions_and_aborts_with_transfers_in_flight(make_engine):
    engine = make_engine(backend="slow-cpu", num_gpu_blocks=24, cpu_blocks=48, max_num_seqs=8)
    docs = _docs(12, 40, seed=3)
    shared = _docs(1, 32, seed=9)[0]
    aborted = []
    for i in range(60):
        engine.add(str(i), shared + docs[i % 12] + [i % 7], max_tokens=12)
        if i % 5 == 4:
            engine.step()
        if i % 9 == 8:
            victim = str(i - 3)
            engine.abort([victim])
            aborted.append(victim)
    engine.run_until_done()
    engine.drain()
    preempted = engine.scheduler.kv_cache_manager  # noqa: F841 (for debugging)
    assert engine.offload.totals.data["cpu_hit_tokens"] > 0
    done = [r for r in engine.outputs if r not in aborted]
    assert all(len(engine.outputs[r]) == 12 for r in done)
    engine.assert_idle()


def test_preemption_flushes_the_copy_queue(make_engine):
    engine = make_engine(backend="slow-cpu", num_gpu_blocks=12, cpu_blocks=64, max_num_seqs=6)
    for i, d in enumerate(_docs(6, 40, seed=5)):
        engine.add(str(i), d, max_tokens=40)  # decodes outgrow the device cache
    flushes = []
    original = engine.worker.worker.backend.flush

    def counting_flush():
        flushes.append(engine.worker.worker.backend.num_pending)
        return original()

    engine.worker.worker.backend.flush = counting_flush
    engine.run_until_done()
    engine.drain()
    assert flushes, "the workload must preempt"
    assert engine.worker.worker.backend.num_pending == 0
    engine.assert_idle()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_failed_load_is_recomputed_not_used(make_engine, load_mode):
    engine = make_engine(backend="failing-loads", extra_config={"load_mode": load_mode})
    _two_passes(engine, _docs(6, 80))
    # The model check passed: a torn device block was attended to only in the
    # step whose synchronous load reported it (vLLM drops that step's output),
    # and never after.
    assert engine.worker.worker.totals.data["failed_jobs"] > 0
    assert engine.offload.totals.data.get("cpu_hit_tokens", 0) == 0
    assert all(len(engine.outputs[f"b{i}"]) == 4 for i in range(6))
    engine.assert_idle()


HYBRID = dict(sliding_window=32, num_gpu_blocks=40, cpu_blocks=128)


def _hybrid_run(engine, docs, device_prefix=False):
    """Every document once, then again one at a time (optionally after a short
    request left the first document's first two blocks in the device cache)."""
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    if device_prefix:
        engine.add("p", docs[0][:33])
        engine.run_until_done()
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + [5, 6])
        engine.run_until_done()
    engine.drain()


@pytest.mark.parametrize("device_prefix", [False, True], ids=["all-loaded", "device-prefix"])
def test_a_failed_load_of_a_hybrid_model_is_never_read(make_engine, device_prefix):
    """Two KV cache groups, every load fails (torn): the fake model checks each read.
    vLLM >= 0.32 recomputes the requests; older releases cannot recompute a failed
    load of such a model safely, so the engine stops after the retries, before
    any torn block is read."""
    from kvoffload_hal.scheduler.load_jobs import MAX_LOAD_ATTEMPTS, LoadFailedError

    docs = _docs(6, 80)
    reference = make_engine(**HYBRID)
    _hybrid_run(reference, docs, device_prefix)
    assert reference.offload.totals.data["cpu_hit_tokens"] > 0
    failing = make_engine(backend="failing-loads", extra_config={"load_mode": "async"}, **HYBRID)
    if failing.offload.caps.vllm.reads_failed_loads_again():
        with pytest.raises(LoadFailedError, match=f"failed {MAX_LOAD_ATTEMPTS} times"):
            _hybrid_run(failing, docs, device_prefix)
        assert failing.worker.worker.totals.data["failed_jobs"] == MAX_LOAD_ATTEMPTS
        return
    _hybrid_run(failing, docs, device_prefix)
    assert failing.worker.worker.totals.data["failed_jobs"] > 0
    assert failing.offload.totals.data.get("cpu_hit_tokens", 0) == 0
    assert failing.outputs == reference.outputs
    failing.assert_idle()


def test_a_hybrid_load_that_fails_once_is_recovered_on_every_vllm(make_engine):
    """A load fails once: recomputed (vLLM >= 0.32), or sent again and served
    (older releases); the same tokens as without the failure either way."""
    from support import flaky_backend  # noqa: F401 (registers flaky-loads)

    docs = _docs(6, 80)
    reference = make_engine(**HYBRID)
    _hybrid_run(reference, docs)
    flaky = make_engine(backend="flaky-loads", extra_config={"load_mode": "async"}, **HYBRID)
    _hybrid_run(flaky, docs)
    assert flaky.worker.worker.backend.failed_loads == 1
    assert flaky.outputs == reference.outputs
    hits, reference_hits = (e.offload.totals.data["cpu_hit_tokens"] for e in (flaky, reference))
    if flaky.offload.caps.vllm.reads_failed_loads_again():
        assert hits == reference_hits  # the retry served it
    else:
        assert hits < reference_hits  # the failed request recomputed its prefix
    flaky.assert_idle()


def test_failed_store_is_never_published(make_engine):
    engine = make_engine(backend="failing-stores")
    _two_passes(engine, _docs(6, 80))
    assert len(engine.offload.cpu.pool.cached_block_hash_to_block) == 0
    assert engine.offload.totals.data.get("cpu_hit_tokens", 0) == 0
    engine.assert_idle()


def test_store_is_published_only_after_every_rank_reported(make_engine):
    from vllm.v1.outputs import KVConnectorOutput

    from kvoffload_hal.metadata import JobReport, OffloadWorkerMetadata

    engine = make_engine(ranks=2)  # this worker plays one rank of two
    req = engine.add("r", _docs(1, 48)[0], max_tokens=2)
    while "r" not in engine.finished:
        engine.step()
    def sent():
        return {m.store.job_id for m in engine.sent if m.store is not None}

    for _ in range(200):  # let the copies finish and be reported by this rank
        if sent() and sent() <= {j for r in engine.reported for j in r.stores}:
            break
        time.sleep(0.005)
        engine.step()
    jobs = sorted(sent())
    assert jobs and engine.offload.num_jobs_in_flight() == len(jobs)
    cpu = engine.offload.cpu
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 0  # nothing published yet
    # The other rank reports: now the blocks are published and the pins dropped.
    engine.offload.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=OffloadWorkerMetadata(stores={j: JobReport() for j in jobs})))
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 48
    engine.assert_idle()


def test_get_finished_twice_on_the_same_metadata_launches_once(make_engine):
    engine = make_engine(backend="counting-cpu")
    backend_doubles.launches.clear()
    engine.add("r", _docs(1, 64)[0], max_tokens=3)
    engine.step()  # prefill
    meta = engine.scheduler.schedule().kv_connector_metadata  # stores the 4 blocks
    assert meta.store is not None
    engine.worker.bind_connector_metadata(meta)
    for _ in range(3):
        engine.worker.get_finished(set())
    engine.worker.worker.backend.flush()
    assert backend_doubles.launches.count(("store", 1)) == 1


@pytest.mark.parametrize("device_copies", ["keep", "drop"])
def test_reset_cache_forgets_prefixes_and_drops_stores_in_flight(make_engine, device_copies):
    engine = make_engine(backend="slow-cpu", extra_config={"device_copies": device_copies})
    docs = _docs(3, 64)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    engine.drain()
    assert len(engine.offload.cpu.pool.cached_block_hash_to_block) > 0
    engine.add("c", _docs(1, 64, seed=7)[0], max_tokens=2)
    for _ in range(3):
        engine.step()  # its stores are now in flight
    assert engine.connector.reset_cache() is True
    engine.run_until_done()
    engine.drain()
    cpu = {b.block_hash for b in engine.offload.cpu.pool.blocks if b.block_hash is not None}
    if device_copies == "keep":
        assert not cpu
    else:
        # Only copies of what the device still holds, stored since (a block the
        # device would evict and the CPU tier lacks is stored again).
        device = engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        assert all(device.get_one_block(h) is not None for h in cpu)
    engine.assert_idle()


def test_sliding_window_group_next_to_full_attention(make_engine):
    engine = make_engine(sliding_window=32, num_gpu_blocks=40, cpu_blocks=128)
    assert len(engine.offload.cpu.group_block_sizes) == 2
    _two_passes(engine, _docs(6, 80))
    totals = engine.offload.totals.data
    assert totals["cpu_hit_tokens"] > 0
    engine.assert_idle()


def test_abort_while_load_in_flight_defers_the_free_until_reported(make_engine):
    # Only an asynchronous load can be in flight when its request is aborted.
    engine = make_engine(backend="slow-cpu", extra_config={"load_mode": "async"})
    engine.worker.worker.backend.delay_s = 0.05
    docs = _docs(6, 80)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    engine.drain()
    engine.add("b", docs[0] + [1])
    while not any(m.load is not None and "b" in m.load.req_ids for m in engine.sent):
        engine.step()
    engine.step()  # the load job is launched and sleeping in the copy thread
    assert engine.offload.num_jobs_in_flight() > 0
    engine.abort(["b"])
    assert "b" in engine.scheduler.requests  # kept until the load is reported
    engine.drain()
    assert "b" not in engine.scheduler.requests
    engine.assert_idle()

