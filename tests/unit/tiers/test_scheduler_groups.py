"""Which (group, block) entries a promotion reads (scheduler/secondary/plan.py): vLLM's
own lookup over the CPU tier and the tier decides, for a model with a full-attention
group and a sliding-window group (a 32-token window: the last two blocks before a
hit's end), on the CPU tier's real coordinator."""

import pytest
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.scheduler.secondary.plan import GroupKeys, SlotPlanner

BS = 16
FULL, SLIDING = 0, 1
POSITIONS = 6


@pytest.fixture
def rig(make_engine):
    engine = make_engine(cpu_blocks=32, num_gpu_blocks=72, sliding_window=2 * BS)
    req = engine.add("r", [(7 + i) % 89 + 1 for i in range(POSITIONS * BS + 1)])
    engine.scheduler.waiting.remove(req)
    return engine.offload.cpu, req.block_hashes


def _hash(hashes, pos, group):
    return make_block_hash_with_group_id(hashes[pos], group)


def _keys(hashes, *slots):
    return [_hash(hashes, pos, group).hex() for pos, group in slots]


def _planner(cpu, readable, coming=()):
    return SlotPlanner(cpu, GroupKeys.of(cpu), readable.__contains__, coming.__contains__)


def _promotion(cpu, hashes, readable, coming=(), budget=100, start=0, end=POSITIONS):
    planner = _planner(cpu, readable, coming)
    plan = planner.plan(hashes, start, (end - start) * BS)
    return [k for k, _ in planner.promotion(plan, hashes, end, budget)]


def test_the_full_group_reads_the_run_and_the_window_only_its_last_blocks(rig):
    cpu, hashes = rig
    readable = set(_keys(hashes, *((p, g) for p in range(POSITIONS) for g in (FULL, SLIDING))))
    assert _promotion(cpu, hashes, readable) == _keys(
        hashes, (0, FULL), (1, FULL), (2, FULL), (3, FULL), (4, FULL), (4, SLIDING),
        (5, FULL), (5, SLIDING))


def test_a_missing_full_block_ends_the_run_and_the_window_moves_before_it(rig):
    cpu, hashes = rig
    readable = set(_keys(hashes, *((p, FULL) for p in (0, 1, 2, 4)),
                         *((p, SLIDING) for p in range(POSITIONS))))
    assert _promotion(cpu, hashes, readable) == _keys(
        hashes, (0, FULL), (1, FULL), (1, SLIDING), (2, FULL), (2, SLIDING))


def test_blocks_the_cpu_tier_holds_or_another_read_brings_are_not_read(rig):
    cpu, hashes = rig
    held = [_hash(hashes, 1, FULL), _hash(hashes, 5, SLIDING)]
    blocks = cpu.allocate(len(held))
    cpu.publish(blocks, held)
    cpu.unpin(blocks)
    readable = set(_keys(hashes, *((p, g) for p in range(POSITIONS) for g in (FULL, SLIDING))))
    coming = set(_keys(hashes, (3, FULL)))
    assert _promotion(cpu, hashes, readable - coming, coming) == _keys(
        hashes, (0, FULL), (2, FULL), (4, FULL), (4, SLIDING), (5, FULL))


def test_what_does_not_fit_is_planned_again_for_fewer_positions(rig):
    cpu, hashes = rig
    readable = set(_keys(hashes, *((p, g) for p in range(POSITIONS) for g in (FULL, SLIDING))))
    # 3 positions need 3 full blocks and the window at positions 1 and 2: 5; 4 need 6.
    assert _promotion(cpu, hashes, readable, budget=5) == _keys(
        hashes, (0, FULL), (1, FULL), (1, SLIDING), (2, FULL), (2, SLIDING))
    # One position needs both groups' blocks there.
    assert _promotion(cpu, hashes, readable, budget=2) == _keys(hashes, (0, FULL), (0, SLIDING))
    assert _promotion(cpu, hashes, readable, budget=1) == []


def test_a_run_starts_after_the_blocks_the_device_computed(rig):
    cpu, hashes = rig
    readable = set(_keys(hashes, *((p, g) for p in range(POSITIONS) for g in (FULL, SLIDING))))
    # The device holds the first 4 blocks: the lookup, and the window, start there.
    assert _promotion(cpu, hashes, readable, start=4) == _keys(
        hashes, (4, FULL), (4, SLIDING), (5, FULL), (5, SLIDING))


def test_with_an_eagle_drafter_the_block_after_the_hit_is_read_too(
        make_engine, tiny_model_dir, tiny_eagle_dir):
    """vLLM's lookup drops an EAGLE hit's last block: the promotion reads it anyway,
    or the lookup over the CPU tier alone would find one block less again."""
    from support.eagle_tier import eagle_cpu_tier

    engine = make_engine(cpu_blocks=8)
    cpu = eagle_cpu_tier(engine, tiny_model_dir, tiny_eagle_dir)
    req = engine.add("req", [1 + i % 50 for i in range(3 * BS + 1)])
    hashes = req.block_hashes
    readable = set(_keys(hashes, (0, FULL), (1, FULL), (2, FULL)))
    planner = _planner(cpu, readable)
    plan = planner.plan(hashes, 0, 3 * BS)
    assert plan.num_tokens == 2 * BS  # the union's hit, less EAGLE's block
    read = planner.promotion(plan, hashes, 3, 100)
    assert [k for k, _ in read] == _keys(hashes, (0, FULL), (1, FULL), (2, FULL))
    blocks = cpu.allocate(3)  # once read, the CPU tier's own lookup finds the plan's hit
    cpu.publish(blocks, [h for _, h in read])
    cpu.unpin(blocks)
    assert cpu.find_hit(hashes, 0, 3 * BS)[1] == plan.num_tokens
