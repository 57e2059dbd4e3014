"""One CPU->device copy per block, however many requests share the prefix.

On vLLM's real scheduler with asynchronous loads (the path of every device
backend): requests that arrive together, or one per step while the first load
is in flight, on one prefix that left the device but not the CPU tier. The
harness checks every KV read of every request (see ``engine_harness.py``).
"""

import random

import pytest

from support import backend_doubles

BS = 16
PREFIX_BLOCKS = 8


def _prefix(seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1, 90) for _ in range(PREFIX_BLOCKS * BS)]


def _offloaded_prefix(engine, prefix):
    """Serve ``prefix`` once, let its blocks reach the CPU tier, forget it on the device."""
    engine.add("seed", prefix + [1])
    engine.run_until_done()
    engine.drain()
    assert engine.scheduler.kv_cache_manager.reset_prefix_cache()


def _first_token_steps(engine, req_ids, max_steps=400):
    """Run until every request is done; the step of each one's first token."""
    first: dict[str, int] = {}
    for _ in range(max_steps):
        if not engine.scheduler.has_requests():
            break
        engine.step()
        first.update((r, engine.steps) for r in req_ids
                     if r not in first and engine.outputs[r])
    else:
        raise AssertionError("requests not done")
    return first


def _together(engine, prefix, n):
    """``n`` requests on ``prefix`` added at once, run and drained: their ids and the
    step of each one's first token."""
    req_ids = [f"r{i}" for i in range(n)]
    for i, r in enumerate(req_ids):
        engine.add(r, prefix + [2 + i, 3])
    first = _first_token_steps(engine, req_ids)
    engine.drain()
    return req_ids, first


def _engine(make_engine, backend="slow-cpu", **kwargs):
    return make_engine(backend=backend, num_gpu_blocks=96, cpu_blocks=64, **kwargs)


@pytest.mark.parametrize("n, window", [(1, None), (4, None), (16, None), (4, 32)],
                         ids=["1", "4", "16", "4-with-sliding-window"])
def test_concurrent_requests_copy_a_shared_prefix_once(make_engine, n, window):
    engine = _engine(make_engine, sliding_window=window)
    prefix = _prefix()
    _offloaded_prefix(engine, prefix)
    start = engine.steps
    req_ids, first = _together(engine, prefix, n)
    totals = engine.offload.totals.data
    # A sliding window of 32 tokens needs the last 2 blocks of its group too.
    assert totals["blocks_loaded"] == PREFIX_BLOCKS + (2 if window else 0)
    assert totals.get("shared_load_waits", 0) == n - 1
    # Every waiter was scheduled in the step the first load was cached in.
    owner = min(first.values())
    assert max(first.values()) <= owner + 1, (first, start)
    assert all(len(engine.outputs[r]) == 4 for r in req_ids)
    engine.assert_idle()


@pytest.fixture
def gate():
    """Holds every copy of the gated backend until opened."""
    backend_doubles.GatedCpuBackend.gate.set()
    yield backend_doubles.GatedCpuBackend.gate
    backend_doubles.GatedCpuBackend.gate.set()


def _staggered(engine, gate, prefix, n):
    """The first request's load held in flight while one more arrives per step."""
    gate.clear()
    engine.add("r0", prefix + [2, 3])
    engine.step()
    for i in range(1, n):
        engine.add(f"r{i}", prefix + [2 + i, 3])
        engine.step()
    return [f"r{i}" for i in range(n)]


def test_requests_arriving_while_a_load_is_in_flight_wait_for_it(make_engine, gate):
    engine = _engine(make_engine, backend="gated-cpu")
    prefix = _prefix(1)
    _offloaded_prefix(engine, prefix)
    req_ids = _staggered(engine, gate, prefix, 5)
    # Nothing was loaded twice while the first load was in flight.
    sent = [m.load for m in engine.sent if m is not None and m.load is not None]
    assert [len(job.cpu_blocks) for job in sent] == [PREFIX_BLOCKS]
    gate.set()
    first = _first_token_steps(engine, req_ids)
    engine.drain()
    assert engine.offload.totals.data["blocks_loaded"] == PREFIX_BLOCKS
    assert max(first.values()) <= min(first.values()) + 1, first
    engine.assert_idle()


def test_a_waiter_ahead_of_the_owner_in_the_queue_still_waits_for_the_device_hit(
        make_engine, gate):
    """The landed blocks stay busy until the step that caches them on the device, even
    for a waiter vLLM looks at before the owner (here by priority). vLLM >= 0.32
    looks at requests holding device blocks first; 0.23 keeps one queue."""
    engine = make_engine(backend="gated-cpu", num_gpu_blocks=96, cpu_blocks=64,
                         scheduling_policy="priority")
    prefix = _prefix(5)
    _offloaded_prefix(engine, prefix)
    gate.clear()
    engine.add("owner", prefix + [2, 3], priority=1)
    engine.step()
    engine.add("first", prefix + [4, 3], priority=0)  # ahead of the owner in the queue
    engine.step()
    gate.set()
    _first_token_steps(engine, ["owner", "first"])
    engine.drain()
    assert engine.offload.totals.data["blocks_loaded"] == PREFIX_BLOCKS
    engine.assert_idle()


def test_an_aborted_owner_leaves_the_prefix_to_a_waiter(make_engine, gate):
    engine = _engine(make_engine, backend="gated-cpu")
    prefix = _prefix(2)
    _offloaded_prefix(engine, prefix)
    req_ids = _staggered(engine, gate, prefix, 4)
    engine.abort(["r0"])
    engine.step()
    gate.set()
    _first_token_steps(engine, req_ids[1:])
    engine.drain()
    # The aborted request's copy landed in blocks nobody caches: one waiter
    # loads the prefix again, the others wait for that load.
    assert engine.offload.totals.data["blocks_loaded"] == 2 * PREFIX_BLOCKS
    assert all(len(engine.outputs[r]) == 4 for r in req_ids[1:])
    engine.assert_idle()


def test_a_failed_shared_load_makes_every_waiter_recompute(make_engine):
    engine = make_engine(backend="failing-loads-async", num_gpu_blocks=96, cpu_blocks=64)
    prefix = _prefix(3)
    _offloaded_prefix(engine, prefix)
    req_ids, _ = _together(engine, prefix, 4)
    totals = engine.offload.totals.data
    assert totals.get("blocks_loaded", 0) == 0
    assert totals.get("shared_load_waits", 0) == 3
    assert all(len(engine.outputs[r]) == 4 for r in req_ids)
    engine.assert_idle()


@pytest.mark.parametrize("n", [1, 4])
def test_concurrent_requests_promote_a_disk_prefix_once(make_engine, tmp_path, n):
    page = BS * 128  # one harness block
    engine = _engine(make_engine, extra_config={
        "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 64 * page})
    prefix = _prefix(4)
    _offloaded_prefix(engine, prefix)
    assert engine.offload.totals.data["blocks_to_disk"] == PREFIX_BLOCKS
    engine.offload.cpu.drop_all()  # the CPU tier let the prefix go; the disk holds it
    req_ids, first = _together(engine, prefix, n)
    totals = engine.offload.totals.data
    assert totals["blocks_from_disk"] == PREFIX_BLOCKS
    assert totals["blocks_loaded"] == PREFIX_BLOCKS
    assert max(first.values()) <= min(first.values()) + 1, first
    engine.assert_idle()
