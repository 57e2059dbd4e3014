"""The order of a step's rescues and loads (scheduler/hand_over.py), on random steps.

Replays each plan as the workers run it, on a model of the blocks' contents: every
rescue must copy a device block before a load fills it, into a CPU block no load still
has to read, and every load must read its CPU block before a rescue overwrites it.
"""

import random

import pytest

from kvoffload_hal.scheduler.hand_over import Rescue, plan_hand_over


def _step(rng):
    """Loads (CPU block, device block) and rescues of device blocks, some filled by
    the loads, some written by the forward pass."""
    num_loads = rng.randrange(0, 12)
    gpu = rng.sample(range(100), num_loads + rng.randrange(0, 6))
    loads = [(1000 + i, g) for i, g in enumerate(gpu[:num_loads])]
    rescued = [g for g in gpu if rng.random() < 0.7]
    rng.shuffle(rescued)
    return loads, [Rescue(g, f"h{g}") for g in rescued], rng.randrange(0, 4)


def _replay(loads, rescues, plan):
    """Run the plan on block contents; the rescues that saved their block."""
    device = {g: f"h{g}" for _, g in loads} | {r.gpu_id: r.block_hash for r in rescues}
    cpu = {c: f"x{c}" for c, _ in loads}
    saved = [r.block_hash for r in plan.first]  # into fresh blocks, before anything
    done = 0
    rounds = [*plan.rounds, (len(plan.order), [])]
    for upto, pairs in rounds:
        for i in plan.order[done:upto]:
            c, g = loads[i]
            assert cpu[c] == f"x{c}", "a load read a CPU block a rescue overwrote"
            device[g] = cpu[c]
        done = upto
        for rescue, home in pairs:
            assert home in {loads[i][0] for i in plan.order[:upto]}, "home not read yet"
            assert device[rescue.gpu_id] == rescue.block_hash, "rescued after a load"
            cpu[home] = rescue.block_hash
            saved.append(rescue.block_hash)
    return saved


@pytest.mark.parametrize("before_forward", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("seed", range(200))
def test_every_rescue_runs_before_the_load_that_fills_its_block_and_into_a_block_read(
        seed, before_forward):
    loads, rescues, lossless = _step(random.Random(seed))
    plan = plan_hand_over(rescues, loads, lossless, before_forward)
    assert sorted(plan.order) == list(range(len(loads)))  # every load once
    saved = _replay(loads, rescues, plan)
    assert sorted(saved) == sorted(r.block_hash for r in rescues)  # every rescue once
    # Only the forward pass's blocks and a chain's start evict to make room; before
    # the forward pass, only those of its blocks no load's CPU block could take.
    filled = {g for _, g in loads}
    evicting = plan.first[plan.lossless:]
    written = [r for r in rescues if r.gpu_id not in filled]
    # Every load's CPU block is a home once it ran, less those the loads' own rescues take.
    homes = max(0, len(loads) - (len(rescues) - len(written))) if before_forward else 0
    homeless = max(0, len(written) - lossless - homes)
    assert len(evicting) <= homeless + 1


def test_before_the_forward_pass_its_blocks_wait_for_the_loads_cpu_blocks():
    """Two loads needing no rescue, one load whose device block needs one and two
    blocks the forward pass writes, no CPU block that evicts nothing: with the loads
    before the forward pass nothing evicts but the chain's start; after it, the
    forward pass's blocks must go first."""
    loads = [(10, 0), (11, 1), (12, 2)]
    filled, written = Rescue(2, "h2"), [Rescue(5, "h5"), Rescue(6, "h6")]
    after = plan_hand_over([filled, *written], loads, 0)
    assert after.first == written and after.rounds == [(2, [(filled, 10)])]
    before = plan_hand_over([filled, *written], loads, 0, before_forward=True)
    assert before.first == [] and before.order == [0, 1, 2]
    # The load's own rescue first (its block frees a home), then the forward's blocks.
    assert before.rounds == [(2, [(filled, 10)]), (3, [(written[0], 11), (written[1], 12)])]
    # One load, whose own rescue starts the chain: one home, and the rest evicts.
    short = plan_hand_over([filled, *written], loads[2:], 0, before_forward=True)
    assert short.first == [filled, written[1]]
    assert short.rounds == [(1, [(written[0], 12)])]


def test_without_loads_every_rescue_goes_first():
    rescues = [Rescue(g, g) for g in range(5)]
    plan = plan_hand_over(rescues, [], 2)
    assert plan.first == rescues and plan.lossless == 2 and not plan.rounds


def test_one_free_block_starts_a_chain_through_every_load():
    """Four loads whose device blocks all need a rescue and one CPU block that evicts
    nothing: one rescue a round, each into the block the last load read."""
    loads = [(10 + i, i) for i in range(4)]
    rescues = [Rescue(i, f"h{i}") for i in range(4)]
    plan = plan_hand_over(rescues, loads, 1)
    assert plan.first == rescues[:1] and plan.lossless == 1
    assert plan.order == [0, 1, 2, 3]
    assert plan.rounds == [(1, [(rescues[1], 10)]), (2, [(rescues[2], 11)]),
                           (3, [(rescues[3], 12)])]
