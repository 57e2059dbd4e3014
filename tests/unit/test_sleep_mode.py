"""vLLM 0.33's sleep mode on the real scheduler and both connector roles.

A sleep (level 1) resets every cache, the connector's too, unregisters the KV
caches, then frees their memory; new weights may be loaded before the wake-up,
which restores the KV caches, possibly at other addresses. The engine harness
checks every KV read against the weights loaded at that moment.
"""

import random

import pytest

from kvoffload_hal.capabilities import sleeps_with_connectors

pytestmark = pytest.mark.skipif(not sleeps_with_connectors(),
                                reason="vLLM < 0.33 offers no sleep mode with KV connectors")


def _docs(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)]


def _serve(engine, docs, tag):
    """Each document, then each again with a suffix once the device forgot it."""
    for i, d in enumerate(docs):
        engine.add(f"{tag}-a{i}", d)
    engine.run_until_done()
    for i, d in enumerate(docs):
        engine.add(f"{tag}-b{i}", d + [5, 6])
    engine.run_until_done()
    engine.drain()


def _hits(engine):
    return engine.offload.totals.data.get("cpu_hit_tokens", 0)


def test_sleep_wake_serve_with_new_weights_and_moved_kv(make_engine):
    engine = make_engine()
    docs = _docs(6, 80)  # 5 blocks each; the device holds 19
    _serve(engine, docs, "before")
    assert _hits(engine) == 6 * 80
    engine.sleep()
    engine.wake(weights=b"after an update", move_kv=True)
    # The same prompts: a block kept from before the sleep would fail the KV check
    # (new weights), and so would a copy to or from the old KV addresses.
    for i, d in enumerate(docs):
        engine.add(f"after-a{i}", d)
    engine.run_until_done()
    assert _hits(engine) == 6 * 80  # nothing from before the sleep was served
    for i, d in enumerate(docs):
        engine.add(f"after-b{i}", d + [5, 6])
    engine.run_until_done()
    engine.drain()
    assert _hits(engine) == 2 * 6 * 80  # the CPU tier serves what was stored since
    engine.assert_idle()


def test_unregistering_waits_for_the_copies_in_flight(make_engine):
    """vLLM drains before it unregisters; the worker does not rely on it."""
    engine = make_engine(backend="slow-cpu")  # copies outlive the step that sent them
    backend = engine.worker.worker.backend
    for i, d in enumerate(_docs(4, 80)):
        engine.add(f"r{i}", d, max_tokens=16)
    for _ in range(100):
        engine.step()
        if backend.num_pending:
            break
    assert backend.num_pending, "no copy in flight to wait for"
    engine.worker.unregister_kv_caches()
    assert backend.num_pending == 0  # ended before the KV cache memory may go
    engine.worker.unregister_kv_caches()  # idempotent
    engine.wake()
    engine.run_until_done()  # the drained copies' reports reach the scheduler
    _serve(engine, _docs(6, 80, seed=1), "after")
    assert _hits(engine) > 0
    engine.assert_idle()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_copies_bound_while_the_kv_cache_is_unregistered_fail_and_are_recomputed(
        make_engine, load_mode):
    engine = make_engine(extra_config={"load_mode": load_mode})
    docs = _docs(6, 80)
    for i, d in enumerate(docs):
        engine.add(f"a{i}", d)
    engine.run_until_done()
    engine.drain()
    # No reset: the CPU tier still holds every document, and the KV cache moves
    # before the restore. A load launched now would land in the old memory.
    engine.worker.unregister_kv_caches()
    engine.move_kv()
    for i, d in enumerate(docs):
        engine.add(f"b{i}", d + [5, 6])
    engine.run_until_done()
    assert engine.worker.worker.totals.data["failed_jobs"] >= 1
    assert engine.offload.totals.data.get("blocks_loaded", 0) == 0
    engine.worker.restore_kv_caches()
    for i, d in enumerate(_docs(6, 80, seed=2)):
        engine.add(f"c{i}", d)
    engine.run_until_done()
    engine.drain()
    engine.assert_idle()


def test_the_connector_is_a_best_effort_cache(make_engine):
    engine = make_engine()
    assert engine.connector.requires_kv_delivery is False
    assert engine.scheduler.requires_kv_delivery is False  # preempted outputs are kept
