"""A local secondary tier (the disk) counts its failed blocks in ``disk_failed_blocks``,
as its help text on ``/metrics`` says: a write that failed (ENOSPC) and a read that
failed (a damaged or removed file). Found by the soak (benchmarks/soak.py): a run with
a full tmpfs and damaged and removed block files logged the failures but the counter
stayed at zero; only the shared tier (scheduler/secondary/shared.py) counts."""

from kvoffload_hal.metadata import JobReport
from kvoffload_hal.metrics import StatsLedger
from kvoffload_hal.scheduler.secondary.index import TierIndex
from kvoffload_hal.scheduler.secondary.promotions import PromotingTier
from kvoffload_hal.scheduler.secondary.spill import TierNames

BS = 16
DISK = TierNames("disk", "disk tier")


def test_a_failed_write_counts_in_disk_failed_blocks(make_engine):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    engine = make_engine(cpu_blocks=8)
    cpu = engine.offload.cpu
    tiers = PromotingTier(TierIndex(16), cpu, world_size=1, stats=StatsLedger(), names=DISK)
    req = engine.add("r0", [1 + i % 50 for i in range(3 * BS + 1)])
    engine.scheduler.waiting.remove(req)
    blocks = cpu.allocate(3)
    hashes = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes[:3]]
    cpu.publish(blocks, hashes)
    tiers.on_published(blocks, hashes)
    cpu.unpin(blocks)
    spill = tiers.take_jobs().spill
    full_disk = hashes[2].hex()  # its write failed with ENOSPC
    tiers.on_reports({spill.job_id: JobReport(failed_keys=(full_disk,))})
    totals = tiers.stats.totals.data
    assert totals["blocks_to_disk"] == 2
    assert totals.get("disk_failed_blocks", 0) == 1, totals
