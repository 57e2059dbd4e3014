"""TierChain on two real PromotingTiers over one CpuTier: writes go through the chain, a
block is read from the nearest tier that holds it, and the CPU room goes by RoomKind."""

import pytest

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.metrics import StatsLedger
from kvoffload_hal.scheduler.room import CpuRoom, RoomKind
from kvoffload_hal.scheduler.secondary.chain import TierChain
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.reads import TierReads
from kvoffload_hal.scheduler.secondary.spill import TierNames

BS = 16


@pytest.fixture
def chain(make_engine):
    engine = make_engine(cpu_blocks=8)
    cpu, stats = engine.offload.cpu, StatsLedger()
    reads = TierReads(cpu, CpuRoom(cpu), stats)
    tiers = [PromotingTier(TierIndex(16), cpu, world_size=1, stats=stats,
                         names=TierNames(name, name), reads=reads) for name in ("near", "far")]
    return engine, cpu, TierChain(tiers, reads)


def _published(engine, cpu, chain, n):
    """A request whose first ``n`` blocks were stored, written through, and then left
    the CPU tier."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = engine.add("r", [1 + i % 50 for i in range(n * BS + 1)])
    engine.scheduler.waiting.remove(req)
    blocks = cpu.allocate(n)
    hashes = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:n]]
    cpu.publish(blocks, hashes)
    chain.on_published(blocks, hashes)
    cpu.unpin(blocks)
    _report(chain, chain.take_jobs())
    cpu.drop_all()
    return req, [h.hex() for h in hashes]


def _report(chain, jobs, failed=()):
    reports = {}
    for place, job in enumerate(jobs):
        for spec in (job.spill, job.promote):
            if spec is not None:
                keys = tuple(k for k, _ in spec.items if k in failed)
                reports[place, spec.job_id] = JobReport(failed_keys=keys)
    chain.on_reports(reports)


def test_a_block_is_written_to_every_tier_and_read_from_the_nearest(chain):
    engine, cpu, tiers = chain
    req, keys = _published(engine, cpu, tiers, 3)
    near, far = tiers.tiers
    assert all(near.index.is_ready(k) and far.index.is_ready(k) for k in keys)
    assert tiers.lookup(req, (), 0, 3) is True
    jobs = tiers.take_jobs()
    assert [k for k, _ in jobs[0].promote.items] == keys and jobs[1].promote is None
    _report(tiers, jobs)
    assert tiers.reads.stats.totals.data["blocks_from_near"] == 3
    assert "blocks_from_far" not in tiers.reads.stats.totals.data
    tiers.request_finished(req.request_id)
    assert cpu.num_pinned_blocks() == 0 and not tiers.has_pending()


def test_a_block_the_near_tier_fails_comes_back_from_the_far_one(chain):
    engine, cpu, tiers = chain
    req, keys = _published(engine, cpu, tiers, 3)
    assert tiers.lookup(req, (), 0, 3) is True
    _report(tiers, tiers.take_jobs(), failed={keys[1]})  # a corrupted file, say
    near, far = tiers.tiers
    assert keys[1] not in near.index  # forgotten where it failed, kept behind it
    assert far.index.is_ready(keys[1])
    hit, hit_tokens = cpu.find_hit(req.block_hashes, 0, 3 * BS)
    assert hit_tokens == BS  # what read before the failed key
    assert tiers.lookup(req, hit, 1, 3) is True  # the rest: from the far tier
    jobs = tiers.take_jobs()
    assert jobs[0].promote is None and [k for k, _ in jobs[1].promote.items] == keys[1:]
    _report(tiers, jobs)
    assert cpu.find_hit(req.block_hashes, 0, 3 * BS)[1] == 3 * BS
    tiers.request_finished(req.request_id)


def test_two_tiers_holding_a_block_read_it_once(chain):
    """One owner map across the chain: a second request waits for the first one's read
    instead of reading the same block from the other tier."""
    engine, cpu, tiers = chain
    req, keys = _published(engine, cpu, tiers, 2)
    other = engine.add("other", list(req.prompt_token_ids))
    engine.scheduler.waiting.remove(other)
    assert tiers.lookup(req, (), 0, 2) is True
    assert tiers.lookup(other, (), 0, 2) is True  # waits, reading nothing
    jobs = tiers.take_jobs()
    assert len(jobs[0].promote.items) == 2 and jobs[1].promote is None
    _report(tiers, jobs)
    for r in (req, other):
        tiers.request_finished(r.request_id)


def test_the_room_goes_by_kind_whoever_asks_first(chain):
    """A staged hit's claim holds back promotions and prefetch, and leaves stores what
    is free beyond it; without a claim every kind gets what is free."""
    engine, cpu, tiers = chain
    room = tiers.room
    free = cpu.num_free_blocks()
    assert [room.grant(k) for k in RoomKind] == [free] * len(RoomKind)
    room.claim(RoomKind.STAGED, 2)
    assert room.grant(RoomKind.STAGED) == free
    assert room.grant(RoomKind.STORES) == free - 2
    assert room.held_back(RoomKind.PROMOTIONS) and room.held_back(RoomKind.PREFETCH)
    assert not room.held_back(RoomKind.STAGED)
    req, _ = _published(engine, cpu, tiers, 2)
    assert tiers.lookup(req, (), 0, 2) is True  # waits for the staged hit's room...
    assert all(job.promote is None for job in tiers.take_jobs())  # ...holding nothing
    room.claim(RoomKind.STAGED, 0)  # met
    assert tiers.lookup(req, (), 0, 2) is True
    assert tiers.take_jobs()[0].promote is not None
    assert room.grant(RoomKind.PREFETCH, want=1) == 1
    tiers.request_finished(req.request_id)
