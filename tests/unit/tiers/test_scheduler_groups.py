"""Which (group, block) entries a promotion brings back for a model with several groups."""

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.scheduler.secondary.groups import GroupKeys

POSITIONS = [bytes([i]) * 32 for i in range(6)]  # block hashes of one request


def _key(pos, group):
    return make_block_hash_with_group_id(POSITIONS[pos], group).hex()


def _plan(groups, readable, in_cpu=(), budget=100):
    return [k for k, _ in groups.to_read(POSITIONS, readable.__contains__,
                                      lambda h: h.hex() in in_cpu, budget)]


def test_dense_blocks_make_the_run_and_sparse_ones_come_where_held():
    # Group 0 attends to everything; group 1 keeps a state at some positions only.
    groups = GroupKeys(groups=[0, 1], dense=[0])
    readable = {_key(p, 0) for p in range(4)} | {_key(1, 1), _key(3, 1), _key(5, 1)}
    # The run ends where the dense group's block is missing (position 4): the state
    # at position 5 is not promoted, since no hit can reach it.
    assert _plan(groups, readable) == [_key(0, 0), _key(1, 0), _key(1, 1), _key(2, 0),
                                       _key(3, 0), _key(3, 1)]


def test_blocks_already_in_the_cpu_tier_count_for_the_run_and_are_not_read_again():
    groups = GroupKeys(groups=[0, 1], dense=[0])
    readable = {_key(p, 0) for p in (0, 2)} | {_key(2, 1)}
    assert _plan(groups, readable, in_cpu={_key(1, 0)}) == [_key(0, 0), _key(2, 0), _key(2, 1)]


def test_what_does_not_fit_is_left_whole_positions_at_a_time():
    groups = GroupKeys(groups=[0, 1], dense=[0])
    readable = {_key(p, g) for p in range(6) for g in (0, 1)}
    assert _plan(groups, readable, budget=5) == [_key(0, 0), _key(0, 1), _key(1, 0), _key(1, 1)]


def test_one_group_is_the_leading_run_of_its_keys():
    groups = GroupKeys(groups=[0], dense=[0])
    readable = {_key(p, 0) for p in (0, 1, 2, 4)}
    assert _plan(groups, readable) == [_key(0, 0), _key(1, 0), _key(2, 0)]
    assert groups.keys(POSITIONS[:2]) == [_key(0, 0), _key(1, 0)]


def test_without_a_dense_group_every_kept_group_makes_the_run():
    groups = GroupKeys(groups=[0, 1], dense=[])
    readable = {_key(0, 0), _key(0, 1), _key(1, 0)}
    assert _plan(groups, readable) == [_key(0, 0), _key(0, 1)]
