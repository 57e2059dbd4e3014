"""A SharedTier on a real CpuTier with a fake clock, and the requests its tests send.

The scheduler half of a tier shared across instances, named as the Mooncake tier
(its counters are ``mooncake_*``), without a store: the tests play the workers'
reports themselves.
"""

from __future__ import annotations

from typing import NamedTuple

from kvoffload_hal.metrics import StatsLedger
from kvoffload_hal.scheduler.secondary.shared import SharedTier, SharedTierIndex
from kvoffload_hal.scheduler.secondary.spill import TierNames
from support.clock import FakeClock

BS = 16
TIMEOUT_S = 5.0
MOONCAKE = TierNames("mooncake", "Mooncake tier")


class SharedRig(NamedTuple):
    engine: object
    cpu: object
    tiers: SharedTier
    clock: FakeClock


def shared_rig(make_engine, cpu_blocks: int, world_size: int = 2,
               known_keys: int = 64) -> SharedRig:
    engine = make_engine(cpu_blocks=cpu_blocks)
    clock = FakeClock()
    tiers = SharedTier(SharedTierIndex(known_keys), engine.offload.cpu,
                              world_size=world_size, stats=StatsLedger(), timeout_s=TIMEOUT_S,
                              clock=clock, names=MOONCAKE)
    return SharedRig(engine, engine.offload.cpu, tiers, clock)


def waiting_request(engine, n: int, seed: int = 0):
    """A request of ``n`` full blocks (and one token), out of vLLM's waiting queue."""
    req = engine.add(f"r{seed}", [seed + 1 + i % 50 for i in range(n * BS + 1)])
    engine.scheduler.waiting.remove(req)
    return req


def tier_keys(req, n: int) -> list[str]:
    """The tier keys of the request's first ``n`` blocks (group 0)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return [make_block_hash_with_group_id(h, 0).hex() for h in req.block_hashes[:n]]
