"""The device cache and the CPU tier as one cache (``device_copies``).

On vLLM's real scheduler with the model that checks every KV read
(``engine_harness.py``): with ``drop`` the CPU tier evicts its copies of blocks
the device holds before blocks only it holds, a block whose copy was dropped is
stored again before the device evicts it, and where the device evicts faster
than that, the block is recomputed, never read wrong. ``keep`` (inclusive tiers,
as before) is the control.
"""

import random

import pytest

from support import backend_doubles  # noqa: F401 (registers the doubles)

BS = 16
DOC_BLOCKS = 4
# Prefill chunks of 2 blocks: the device's evictions per step stay within its
# eviction window (2 steps of allocations, 4 blocks), as the design assumes.
CHUNK = dict(max_num_batched_tokens=2 * BS)
# 7 documents (28 blocks) on a device of 19 usable blocks and a CPU tier of 20.
TIGHT = dict(num_gpu_blocks=20, cpu_blocks=21, **CHUNK)
# 8 documents (32 blocks) on a device of 29 usable blocks and a CPU tier of 24:
# neither holds them, both together do (while a load of 5 blocks is allocated and
# 4 more are the device's eviction window).
ROOMY = dict(num_gpu_blocks=30, cpu_blocks=25, **CHUNK)
# 14 documents (56 blocks) on a device of 39 usable blocks and a CPU tier of 24, the
# whole burst admitted in one step.
BURST = dict(num_gpu_blocks=40, cpu_blocks=25, max_num_batched_tokens=2048)


def _docs(n, seed=0):
    rng = random.Random(seed)
    # One token past the last full block: every block of a document can be hit.
    return [[rng.randrange(1, 90) for _ in range(DOC_BLOCKS * BS + 1)] for _ in range(n)]


def _hashes(pool):
    return {b.block_hash for b in pool.blocks if b.block_hash is not None}


class Tiers:
    """Steps the engine and watches both tiers after every step: a block the CPU
    tier let go of while the device held it is *pending* until the CPU tier holds
    it again (restored) or the device evicts it too (lost)."""

    def __init__(self, engine):
        self.engine = engine
        self.cpu = engine.offload.cpu.pool
        self.device = engine.scheduler.kv_cache_manager.block_pool
        self.pending: set = set()
        self.restored: set = set()
        self.lost: set = set()
        self._before = (_hashes(self.cpu), _hashes(self.device))

    def step(self):
        self.engine.step()
        cpu, device = _hashes(self.cpu), _hashes(self.device)
        cpu_before, device_before = self._before
        for h in (cpu_before & device_before) - cpu:
            (self.pending if h in device else self.lost).add(h)
        for h in list(self.pending):
            if h in cpu:
                self.pending.discard(h)
                self.restored.add(h)
            elif h not in device:
                self.pending.discard(h)
                self.lost.add(h)
        self._before = (cpu, device)

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not (self.engine.scheduler.has_requests()
                    or self.engine.offload.has_pending_transfers()):
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def held(self, request):
        """Full blocks of ``request``'s prompt in (CPU tier, device)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        keys = [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]
        cpu, device = _hashes(self.cpu), _hashes(self.device)
        return sum(k in cpu for k in keys), sum(k in device for k in keys)


def _one_at_a_time(engine, tiers, docs, tag):
    requests = []
    for i, d in enumerate(docs):
        requests.append(engine.add(f"{tag}{i}", d, max_tokens=2))
        tiers.run()
    return requests


def _hit_blocks(engine, requests):
    return [engine.cached_tokens[r.request_id] // BS for r in requests]


@pytest.mark.parametrize("mode, eviction", [
    ("drop", "lru"), ("drop", "adaptive"), ("keep", "lru")])
def test_copies_of_device_blocks_are_dropped_from_the_cpu_tier_first(make_engine, mode,
                                                                       eviction):
    """7 documents, one at a time: the device keeps the last ones, the CPU tier
    cannot keep them all. ``drop``: what it lets go of are copies of blocks the
    device holds, whatever the eviction policy, so every document is in one tier
    or the other. ``keep``: LRU drops the first documents, which only the CPU tier
    held."""
    engine = make_engine(**TIGHT, extra_config={"device_copies": mode, "eviction": eviction})
    tiers = Tiers(engine)
    requests = _one_at_a_time(engine, tiers, _docs(7), "a")
    held = [tiers.held(r) for r in requests]
    assert held[0][1] == held[1][1] == 0  # the device let go of the first two long ago
    dropped = engine.offload.cpu.device_copies.num_dropped
    if mode == "keep":
        assert dropped == 0
        assert held[0][0] < DOC_BLOCKS  # in neither tier now
    else:
        assert dropped > 0
        assert all(max(cpu, device) == DOC_BLOCKS for cpu, device in held), held
        assert not tiers.lost
    engine.assert_idle()


@pytest.mark.parametrize("mode", ["drop", "keep"])
def test_a_dropped_copy_is_stored_again_before_the_device_evicts_it(make_engine, mode):
    """8 documents read twice, one at a time. ``drop``: every block the CPU tier
    let go of while the device held it is in the CPU tier again before the device
    evicts it, and the second pass finds every document; ``keep`` loses some."""
    engine = make_engine(**ROOMY, extra_config={"device_copies": mode})
    tiers = Tiers(engine)
    docs = _docs(8)
    _one_at_a_time(engine, tiers, docs, "a")
    hits = _hit_blocks(engine, _one_at_a_time(engine, tiers, docs, "b"))
    if mode == "keep":
        assert tiers.lost
        assert min(hits) < DOC_BLOCKS
    else:
        assert tiers.restored and not tiers.lost
        assert hits == [DOC_BLOCKS] * len(docs)
        stored = engine.offload.totals.data["blocks_stored"]
        assert stored >= len(docs) * DOC_BLOCKS + len(tiers.restored)
    engine.assert_idle()


@pytest.mark.parametrize("backend", ["cpu", "slow-cpu"])
def test_blocks_the_device_evicts_before_they_are_stored_again_are_recomputed(
        make_engine, backend):
    """The second pass arrives at once: the device allocates for several loads in
    one step and evicts blocks whose CPU copies were dropped before any store can
    take them (with ``slow-cpu`` the stores also stay in flight for several steps).
    Those blocks are recomputed; every read is checked; nothing stays pinned."""
    engine = make_engine(backend, **ROOMY, extra_config={"device_copies": "drop"})
    # As where a failed load is sent again: no rescue goes into the CPU blocks of loads.
    engine.offload.hand_overs = None
    tiers = Tiers(engine)
    docs = _docs(8)
    _one_at_a_time(engine, tiers, docs, "a")
    burst = [engine.add(f"b{i}", d, max_tokens=2) for i, d in enumerate(docs)]
    tiers.run()
    assert tiers.lost  # the device was faster
    hits = _hit_blocks(engine, burst)
    assert min(hits) < DOC_BLOCKS  # so those documents were computed again
    assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
    assert engine.model.checked_tokens > 0
    engine.assert_idle()


def _rescues_before_the_loads(monkeypatch):
    """A worker that runs a load's rescues before any part of it: they overwrite CPU
    blocks the load has not read yet (the control below)."""
    from kvoffload_hal.hal.backend import Direction, TransferJob
    from kvoffload_hal.worker import core

    def out_of_order(backend, load, collect):
        for h in load.hand_overs:
            backend.submit(TransferJob(h.rescue.job_id, Direction.STORE, h.rescue.gpu_blocks,
                                       h.rescue.cpu_blocks))
            collect(backend.flush())
        backend.submit(TransferJob(load.job_id, Direction.LOAD, load.cpu_blocks,
                                   load.gpu_blocks, tag=load))
    monkeypatch.setattr(core, "launch_load", out_of_order)


@pytest.mark.parametrize("backend, control", [
    ("cpu", False), ("slow-cpu", False), ("cpu", True)], ids=["cpu", "slow-cpu", "control"])
def test_a_burst_rescues_into_the_cpu_blocks_of_its_own_loads(make_engine, monkeypatch,
                                                              backend, control):
    """The second pass arrives at once, and its loads pin the CPU blocks the device's
    evictions would need: each such block is rescued into a CPU block a load of the
    same step has read, between that load and the one that fills the device block it
    copies (scheduler/hand_over.py). Nothing is lost from both tiers, every read is
    checked, nothing stays pinned. The control runs the rescues before the loads: a
    load then copies a rescued block's bytes, and the read of them is caught."""
    engine = make_engine(backend, **ROOMY, extra_config={"device_copies": "drop"})
    # The hand-over alone: a rescue homed at a lookup takes fresh room, and may evict a
    # block only the CPU tier holds for the block asked for (test_rescue_homes.py).
    engine.offload.stores.homes = None
    if control:
        _rescues_before_the_loads(monkeypatch)
    tiers = Tiers(engine)
    docs = _docs(8)
    _one_at_a_time(engine, tiers, docs, "a")
    sent = len(engine.sent)
    burst = [engine.add(f"b{i}", d, max_tokens=2) for i, d in enumerate(docs)]
    if control:
        with pytest.raises(AssertionError, match="wrong KV read"):
            tiers.run()
        return
    tiers.run()
    hand_overs = [h for meta in engine.sent[sent:] if meta is not None and meta.load
                  for h in meta.load.hand_overs]
    assert hand_overs
    assert not tiers.lost
    handed = sum(len(h.rescue.cpu_blocks) for h in hand_overs)
    assert engine.offload.totals.data["blocks_handed_over"] == handed
    assert engine.offload.totals.data["blocks_rescued"] > handed
    assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
    assert engine.model.checked_tokens > 0
    engine.assert_idle()


def _burst_with_homes(engine):
    """Each of 14 documents alone, then all at once; (the burst's lookups that asked
    again for a hand-over, the blocks lost from both tiers)."""
    tiers = Tiers(engine)
    _one_at_a_time(engine, tiers, _docs(14), "a")
    waits = []
    homes = engine.offload.stores.homes
    extend_hit = homes.extend_hit

    def watched(*args, **kwargs):
        out = extend_hit(*args, **kwargs)
        waits.append(out[2])
        return out
    homes.extend_hit = watched
    burst = [engine.add(f"b{i}", d, max_tokens=2) for i, d in enumerate(_docs(14))]
    tiers.run()
    assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
    return sum(waits), tiers.lost


def _home_into_any_room(monkeypatch):
    """The control: a lookup homes into any room and waits for nothing (as it did)."""
    from kvoffload_hal.scheduler.rescue_homes import RescueHomes

    extend_hit = RescueHomes.extend_hit
    monkeypatch.setattr(RescueHomes, "extend_hit",
                        lambda self, *args, lossless=None: extend_hit(self, *args))


@pytest.mark.parametrize("backend", ["cpu", "lagging-cpu"])
def test_a_lookup_leaves_to_the_hand_over_what_it_would_evict_for(make_engine, monkeypatch,
                                                                  backend):
    """A burst with homes at lookups (scheduler/rescue_homes.py): a later request of the
    step asking for a block the device just handed out homes it only into room that
    evicts no block only the CPU tier holds, and otherwise asks again later, once the
    hand-over has put the block in a load's CPU block. Fewer blocks leave both tiers
    than where the lookups home into any room (the control), with synchronous copies and
    with asynchronous ones (``lagging-cpu``: in flight for one step on any host); every
    read is checked."""
    engine = make_engine(backend, **BURST, extra_config={"device_copies": "drop"})
    waits, lost = _burst_with_homes(engine)
    assert waits and engine.offload.totals.data["blocks_handed_over"] > 0
    _home_into_any_room(monkeypatch)
    control = make_engine(backend, **BURST, extra_config={"device_copies": "drop"})
    control_waits, control_lost = _burst_with_homes(control)
    assert control_waits == 0
    assert len(lost) < len(control_lost)


@pytest.mark.parametrize("backend", ["cpu", "lagging-cpu"])
def test_a_lookup_homes_no_rescue_into_room_that_evicts_what_only_the_cpu_tier_holds(
        make_engine, monkeypatch, backend):
    """Device and CPU tier hold 14 documents between them, each in one. Two documents
    the CPU tier alone holds are loaded, and their device blocks are those of the two
    oldest documents the device holds, which two later requests of the same step ask
    for: the lookups home those rescues only into room that evicts nothing the CPU tier
    alone holds, and ask again later for the rest (the hand-over puts them in the loads'
    CPU blocks).
    Every block is still in one tier or the other, but at most the one that starts the
    hand-over's chain where every load needs a rescue (design.md). The control homes
    into any room: it evicts what the CPU tier alone held."""
    def held_blocks(control):
        if control:
            _home_into_any_room(monkeypatch)
        engine = make_engine(backend, **BURST, extra_config={"device_copies": "drop"})
        tiers = Tiers(engine)
        docs = _docs(14)
        first = _one_at_a_time(engine, tiers, docs, "a")
        assert len(_hashes(tiers.cpu) | _hashes(tiers.device)) == 14 * DOC_BLOCKS
        on_device = [i for i, r in enumerate(first) if tiers.held(r)[1] == DOC_BLOCKS]
        cpu_only = [i for i, r in enumerate(first) if tiers.held(r) == (DOC_BLOCKS, 0)]
        burst = [engine.add(f"b{i}", docs[i], max_tokens=2)
                 for i in (*cpu_only[:2], *on_device[:2])]
        tiers.run()
        assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
        assert engine.model.checked_tokens > 0
        engine.assert_idle()
        return len(_hashes(tiers.cpu) | _hashes(tiers.device))

    held = held_blocks(control=False)
    assert held >= 14 * DOC_BLOCKS - 1
    assert held_blocks(control=True) < held


def test_with_a_disk_tier_and_two_kv_cache_groups_every_block_is_written_and_comes_back(
        make_engine, tmp_path):
    """A sliding-window group next to full attention, a CPU tier smaller than the
    device and a disk tier behind: copies dropped from the CPU tier were written
    through first (each (group, block) once; the tier serves them, so they are not
    stored again), and the second pass finds every document."""
    page = BS * 128
    engine = make_engine(sliding_window=32, num_gpu_blocks=40, cpu_blocks=12, **CHUNK,
                         extra_config={
        "device_copies": "drop", "disk_path": str(tmp_path / "kv"),
        "disk_bytes_to_use": 400 * page})
    docs = _docs(6)
    for tag in "ab":
        for i, d in enumerate(docs):
            engine.add(f"{tag}{i}", d, max_tokens=2)
            engine.run_until_done()
            engine.drain()
    totals = engine.offload.totals.data
    assert engine.offload.cpu.device_copies.num_dropped > 0
    assert totals["blocks_to_disk"] == 2 * len(docs) * DOC_BLOCKS  # both groups, once each
    assert [engine.cached_tokens[f"b{i}"] for i in range(len(docs))] == [DOC_BLOCKS * BS] * 6
    engine.assert_idle()


def _rescue_after_the_forward(monkeypatch):
    """A worker that copies a rescue after the step's forward pass (in get_finished),
    when the device block already holds its new request's KV: the control below."""
    from kvoffload_hal.worker.core import OffloadWorker

    late = []
    monkeypatch.setattr(OffloadWorker, "_rescue", lambda self, spec: late.append(spec))
    get_finished = OffloadWorker.get_finished

    def deferred(self, finished_req_ids):
        while late:
            spec = late.pop(0)
            from kvoffload_hal.hal.backend import Direction, TransferJob

            self.backend.submit(TransferJob(spec.job_id, Direction.STORE, spec.gpu_blocks,
                                            spec.cpu_blocks))
            self._collect(self.backend.flush())
        return get_finished(self, finished_req_ids)
    monkeypatch.setattr(OffloadWorker, "get_finished", deferred)


@pytest.mark.parametrize("late", [False, True], ids=["before-forward", "control-late"])
def test_a_block_the_device_reuses_without_a_cpu_copy_is_rescued_before_it_is_written(
        make_engine, monkeypatch, late):
    """``drop``: the CPU tier drops its copies of blocks the device holds; when the
    device hands such a block out, the step's rescue copies it to the CPU tier
    before the forward pass writes it, and the second pass reads every document back
    (the model checks every read). The control copies the rescue after the forward
    pass: its CPU blocks hold the new request's KV, and a read of them is caught."""
    if late:
        _rescue_after_the_forward(monkeypatch)
    engine = make_engine(**ROOMY, extra_config={"device_copies": "drop"})
    tiers = Tiers(engine)
    docs = _docs(8)
    _one_at_a_time(engine, tiers, docs, "a")
    if late:
        with pytest.raises(AssertionError, match="wrong KV read"):
            _one_at_a_time(engine, tiers, docs, "b")
        return
    hits = _hit_blocks(engine, _one_at_a_time(engine, tiers, docs, "b"))
    totals = engine.offload.totals.data
    assert totals["blocks_rescued"] > 0
    assert hits == [DOC_BLOCKS] * len(docs)
    assert not tiers.lost
    engine.assert_idle()


def test_rescues_take_the_room_first_and_the_rest_is_recomputed(make_engine):
    """A burst pins the CPU tier for its loads: the device reuses more blocks without a
    CPU copy than there are free CPU blocks. What fits is rescued first (before
    stores and promotions); the rest is gone from both tiers and recomputed, every
    read checked, nothing left pinned (where no rescue goes into the CPU blocks of the
    step's loads: a failed load is sent again from them)."""
    engine = make_engine(**ROOMY, extra_config={"device_copies": "drop"})
    engine.offload.hand_overs = None
    tiers = Tiers(engine)
    docs = _docs(8)
    _one_at_a_time(engine, tiers, docs, "a")
    burst = [engine.add(f"b{i}", d, max_tokens=2) for i, d in enumerate(docs)]
    tiers.run()
    assert engine.offload.totals.data["blocks_rescued"] > 0
    assert tiers.lost and min(_hit_blocks(engine, burst)) < DOC_BLOCKS
    assert all(len(engine.outputs[r.request_id]) == 2 for r in burst)
    engine.assert_idle()


def test_blocks_of_preempted_requests_are_rescued_when_the_device_reuses_them(make_engine):
    """Decodes outgrow the device cache: vLLM preempts requests and hands their freed
    blocks to others. Those the CPU tier dropped its copy of are rescued, the preempted
    requests resume from a cache, every read is checked, nothing stays pinned."""
    engine = make_engine(backend="slow-cpu", num_gpu_blocks=14, cpu_blocks=24, max_num_seqs=6,
                         extra_config={"device_copies": "drop"})
    rng = random.Random(5)
    for i in range(6):
        engine.add(str(i), [rng.randrange(1, 90) for _ in range(2 * BS + 1)], max_tokens=40)
    engine.run_until_done()
    engine.drain()
    assert engine.preemptions > 0
    assert engine.offload.totals.data["blocks_rescued"] > 0
    assert all(len(engine.outputs[str(i)]) == 40 for i in range(6))
    assert engine.model.checked_tokens > 0
    engine.assert_idle()


def test_two_kv_cache_groups_with_rescues(make_engine):
    """A sliding-window group beside full attention, each (group, block) its own entry:
    the device's evictions are rescued in both groups, and the second pass reads
    documents back from the CPU tier, every read checked. (How many come back whole
    depends on which group of a position each tier ends up holding: vLLM takes a hit
    from one tier, and block hashes, so eviction orders, differ from run to run.)"""
    from vllm.v1.core.kv_cache_utils import get_group_id

    engine = make_engine(sliding_window=32, num_gpu_blocks=30, cpu_blocks=30, **CHUNK,
                         extra_config={"device_copies": "drop"})
    stores, groups = engine.offload.stores, set()
    rescue = stores.rescue

    def watched(rescued, *args):
        groups.update(get_group_id(h) for _, h in rescued)
        return rescue(rescued, *args)
    stores.rescue = watched
    docs = _docs(6)
    for tag in "ab":
        for i, d in enumerate(docs):
            engine.add(f"{tag}{i}", d, max_tokens=2)
            engine.run_until_done()
    assert groups == {0, 1}
    assert engine.offload.totals.data["blocks_rescued"] > 0
    assert engine.offload.totals.data["cpu_hit_tokens"] > 0
    assert all(len(engine.outputs[f"{t}{i}"]) == 2 for t in "ab" for i in range(6))
    engine.assert_idle()


def test_without_a_tier_behind_a_store_evicts_no_block_only_the_cpu_tier_holds(make_engine):
    """10 documents at once: more than either tier holds, not more than both. With
    rescues and no tier behind, a store takes only room that evicts no block only the
    CPU tier holds (the device holds what it stores, and rescues it when it reuses the
    block), so after the first pass every block is in one tier or the other; the
    second pass, one document at a time, reads them back, every read checked. The
    control, the same engine whose stores evict such blocks as ``keep``'s do, loses
    blocks of the first documents in the first pass. (How much the second pass serves
    also depends on the rescues' room as each load pins its CPU blocks, which varies
    with the block hashes, so it is not compared.)"""
    held = {}
    for spare in (True, False):
        engine = make_engine(num_gpu_blocks=24, cpu_blocks=25, max_num_batched_tokens=512,
                             extra_config={"device_copies": "drop"})
        copies = engine.offload.cpu.device_copies
        assert copies.spare_stores
        copies.spare_stores = spare
        tiers = Tiers(engine)
        docs = _docs(10)
        for i, d in enumerate(docs):
            engine.add(f"a{i}", d, max_tokens=2)
        tiers.run()
        held[spare] = len(_hashes(tiers.cpu) | _hashes(tiers.device))
        assert max(_hit_blocks(engine, _one_at_a_time(engine, tiers, docs, "b"))) == DOC_BLOCKS
        assert engine.offload.totals.data["blocks_rescued"] > 0
        assert engine.model.checked_tokens > 0
        engine.assert_idle()
    assert held[True] == 10 * DOC_BLOCKS > held[False]


def test_a_block_the_forward_pass_writes_waits_for_a_home_among_the_loads(make_engine):
    """Synchronous loads run before the forward pass: a device block that a request
    computing a new document reuses (no load fills it) is rescued into the CPU block
    of a load of the same step once that load has run, as the loads' own blocks are,
    not into fresh room that evicts a block only the CPU tier holds. The documents
    fit in the two tiers together: no block leaves both while the burst runs. (Where
    the device's allocations this burst makes evict a block without a CPU copy for a
    new document, as on vLLM 0.32, planning that rescue before the loads loses one.)"""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    engine = make_engine(**ROOMY, extra_config={"device_copies": "drop"})
    engine.offload.stores.homes = None  # the hand-over alone (see the burst above)
    assert engine.offload.loads.sync_loads
    tiers = Tiers(engine)
    old, new = _docs(8), _docs(2, seed=1)
    first = _one_at_a_time(engine, tiers, old, "a")
    keys = {make_block_hash_with_group_id(h, 0) for r in first for h in r.block_hashes}
    # New documents are computed while the old ones load their CPU hits, in one burst.
    for i, d in enumerate(new + old):
        engine.add(f"b{i}", d, max_tokens=2)
    lost = set()
    while engine.scheduler.has_requests() or engine.offload.has_pending_transfers():
        tiers.step()
        lost |= keys - _hashes(tiers.cpu) - _hashes(tiers.device)
    assert not lost
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
