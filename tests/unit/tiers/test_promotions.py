"""PromotingTier on its public methods, against a real CpuTier: spills, promotions, reports."""

import pytest

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.metrics import StatsLedger
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.spill import TierNames

BS = 16
DISK = TierNames("disk", "disk tier")


@pytest.fixture
def rig(make_engine):
    engine = make_engine(cpu_blocks=8)
    cpu = engine.offload.cpu
    return engine, cpu, PromotingTier(TierIndex(16), cpu, world_size=2, stats=StatsLedger(),
                                     names=DISK)


def _published(engine, cpu, n, seed=0):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = engine.add(f"r{seed}", [seed + 1 + i % 50 for i in range(n * BS + 1)])
    engine.scheduler.waiting.remove(req)
    blocks = cpu.allocate(n)
    hashes = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:n]]
    cpu.publish(blocks, hashes)
    return req, blocks, hashes


def test_spill_is_committed_only_after_every_rank_reported(rig):
    engine, cpu, tiers = rig
    req, blocks, hashes = _published(engine, cpu, 3)
    tiers.on_published(blocks, hashes)
    cpu.unpin(blocks)
    jobs = tiers.take_jobs()
    assert jobs.promote is None and jobs.spill is not None
    assert jobs.spill.items == [(h.hex(), b.block_id) for h, b in zip(hashes, blocks)]
    assert cpu.num_pinned_blocks() == 3  # read by the tier: not reusable
    tiers.on_reports({jobs.spill.job_id: JobReport()})
    assert not tiers.index.is_ready(hashes[0].hex()) and tiers.has_pending()
    tiers.on_reports({jobs.spill.job_id: JobReport()})
    assert all(tiers.index.is_ready(h.hex()) for h in hashes)
    assert tiers.stats.totals.data["blocks_to_disk"] == 3
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def _spilled_then_dropped(engine, cpu, tiers, n):
    req, blocks, hashes = _published(engine, cpu, n)
    tiers.on_published(blocks, hashes)
    cpu.unpin(blocks)
    spill = tiers.take_jobs().spill
    tiers.on_reports({spill.job_id: JobReport(ranks=2)})
    cpu.drop_all()  # the CPU tier forgot them; the disk still has them
    return req, hashes


def test_promotion_publishes_up_to_the_first_failed_key(rig):
    engine, cpu, tiers = rig
    req, hashes = _spilled_then_dropped(engine, cpu, tiers, 4)
    assert tiers.lookup(req, (), 0, 4) is True  # promotion started: ask again later
    assert tiers.lookup(req, (), 0, 4) is True  # still in flight
    promote = tiers.take_jobs().promote
    assert [k for k, _ in promote.items] == [h.hex() for h in hashes]
    bad = hashes[2].hex()
    tiers.on_reports({promote.job_id: JobReport(ranks=1)})
    tiers.on_reports({promote.job_id: JobReport(ranks=1, failed_keys=(bad,))})
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 2 * BS
    assert bad not in tiers.index  # a failed read is forgotten
    assert tiers.lookup(req, (), 2, 4) is False  # this request recomputes the rest
    tiers.request_finished(req.request_id)
    assert cpu.num_pinned_blocks() == 0


def test_reset_abandons_promotions_in_flight(rig):
    engine, cpu, tiers = rig
    req, _ = _spilled_then_dropped(engine, cpu, tiers, 3)
    assert tiers.lookup(req, (), 0, 3)
    promote = tiers.take_jobs().promote
    tiers.reset()
    tiers.on_reports({promote.job_id: JobReport(ranks=2)})
    assert cpu.find_hit(req.block_hashes, 0, 10_000)[1] == 0  # nothing from before the reset
    tiers.request_finished(req.request_id)
    # The entries that promotion read are gone with it: a later request recomputes.
    again = engine.add("again", list(req.prompt_token_ids))
    engine.scheduler.waiting.remove(again)
    assert tiers.lookup(again, (), 0, 3) is False
    assert sorted(tiers.take_jobs().evictions) == sorted(k for k, _ in promote.items)
    tiers.request_finished(again.request_id)
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def test_a_promotion_waits_for_room_that_copies_in_flight_hold(rig):
    """No free CPU block: the request waits while copies in flight hold blocks they
    release when they end, and recomputes when nothing would ever free one."""
    engine, cpu, tiers = rig
    req, hashes = _spilled_then_dropped(engine, cpu, tiers, 3)
    copying = [False]
    tiers.bind_copies(lambda: copying[0])
    taken = cpu.allocate(cpu.num_free_blocks())  # held by something that is no copy
    assert tiers.lookup(req, (), 0, 3) is False  # no room will come: recompute
    copying[0] = True  # a load or a store holds them now
    assert tiers.lookup(req, (), 0, 3) is True and tiers.take_jobs().promote is None
    copying[0] = False
    cpu.unpin(taken)  # it ended
    assert tiers.lookup(req, (), 0, 3) is True
    assert [k for k, _ in tiers.take_jobs().promote.items] == [h.hex() for h in hashes]
    tiers.request_finished(req.request_id)


def test_a_spill_of_the_requests_own_hit_frees_no_room_for_it(rig):
    """Its own blocks stay taken when their spill ends; another block's spill frees one,
    and the request keeps its hit while it waits for it."""
    engine, cpu, tiers = rig
    req, hashes = _spilled_then_dropped(engine, cpu, tiers, 4)
    # Its first 3 blocks are back in the CPU tier, being written to disk again.
    hit = cpu.allocate(3)
    cpu.publish(hit, hashes[:3])
    tiers.index.drop(h.hex() for h in hashes[:3])
    tiers.on_published(hit, hashes[:3])
    cpu.unpin(hit)
    taken = cpu.allocate(cpu.num_free_blocks())
    assert tiers.lookup(req, (hit,), 3, 4) is False  # its hit stays taken: recompute
    cpu.unpin(taken[:1])
    _, other, other_hashes = _published(engine, cpu, 1, seed=60)
    tiers.on_published(other, other_hashes)  # another block's spill: that one frees
    cpu.unpin(other)
    assert tiers.lookup(req, (hit,), 3, 4) is True  # waits for that spill
    jobs = tiers.take_jobs()
    assert jobs.promote is None
    tiers.on_reports({jobs.spill.job_id: JobReport(ranks=2)})
    assert all(b.ref_cnt == 1 for b in hit)  # kept while it waits: nothing evicts them
    assert tiers.lookup(req, (hit,), 3, 4) is True
    assert [k for k, _ in tiers.take_jobs().promote.items] == [hashes[3].hex()]
    tiers.request_finished(req.request_id)


def test_a_request_waits_for_room_at_most_a_bounded_time(make_engine):
    """Copies that never end (a stuck disk) cannot keep a request waiting forever."""
    from kvoffload_hal.scheduler.secondary.reads import MAX_ROOM_WAIT_S

    engine = make_engine(cpu_blocks=8)
    cpu, now = engine.offload.cpu, [0.0]
    tiers = PromotingTier(TierIndex(16), cpu, world_size=2, stats=StatsLedger(),
                        clock=lambda: now[0], names=DISK)
    req, _ = _spilled_then_dropped(engine, cpu, tiers, 3)
    tiers.bind_copies(lambda: True)  # a copy that never ends
    taken = cpu.allocate(cpu.num_free_blocks())
    assert tiers.lookup(req, (), 0, 3) is True  # waits
    now[0] += MAX_ROOM_WAIT_S / 2
    assert tiers.lookup(req, (), 0, 3) is True  # still
    now[0] += MAX_ROOM_WAIT_S
    assert tiers.lookup(req, (), 0, 3) is False  # recomputes
    cpu.unpin(taken)
    tiers.request_finished(req.request_id)
