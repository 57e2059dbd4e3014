"""The worker's record of CPU blocks published at a lookup whose rescue failed on its
rank (worker/hand_over.py ``Unfilled``): a load that reads one fails unlaunched until
the block is filled again."""

from kvoffload_hal.metadata import LoadSpec, StoreSpec, TierJobs, TierJobSpec
from kvoffload_hal.worker.hand_over import Unfilled


def _load(cpu_blocks):
    return LoadSpec(7, ("r",), list(cpu_blocks), list(range(len(cpu_blocks))), False)


def test_a_load_reading_a_block_of_a_failed_rescue_is_refused_until_the_block_is_filled():
    unfilled = Unfilled()
    assert not unfilled.read_by(_load([1, 2, 3]))
    unfilled.rescued(StoreSpec(1, [10, 11], [2, 3]), ok=False)
    assert unfilled.read_by(_load([1, 2]))
    assert unfilled.read_by(_load([3]))
    assert not unfilled.read_by(_load([1, 4]))
    unfilled.filled([2])  # a store or a promotion wrote it again
    assert not unfilled.read_by(_load([2]))
    assert unfilled.read_by(_load([3]))
    unfilled.rescued(StoreSpec(2, [12], [3]), ok=True)  # a later rescue into it landed
    assert not unfilled.read_by(_load([1, 2, 3]))
    unfilled.rescued(StoreSpec(3, [13], [5]), ok=False)
    unfilled.promoted([TierJobs(spill=TierJobSpec(4, [("k", 5)]))])  # a spill reads it
    assert unfilled.read_by(_load([5]))
    unfilled.promoted([TierJobs(), TierJobs(promote=TierJobSpec(5, [("k", 5)]))])
    assert not unfilled.read_by(_load([5]))
