"""Scheduler side: a secondary tier's keys for models with several KV cache groups.

A tier keeps one entry per (group, block): the key is vLLM's block hash with the
group id, as the CPU tier publishes it, so a hybrid model's attention blocks,
sliding-window blocks and Mamba states are separate entries, each written and
read like any other. What a prefix hit needs differs by group:

* a **dense** group (full attention, MLA) needs every block before the hit's end;
* a **sparse** group (sliding window, chunked local attention, Mamba state)
  needs only some of them: the last window, or the state at the hit's end.

Which entries a hit takes is vLLM's decision, made once for promotions and staged
hits alike (:mod:`.plan`): the CPU tier's coordinator looks the request up with each
group's own rules as if the tier's entries were cached there, so a Mamba state is
read only at the exact position its hash names, and a missing sparse block only
shortens the hit. Every group's blocks have the scheduler's block size (the registry
keeps the tier off otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload_hal.tiers.spec import BlockKey

if TYPE_CHECKING:
    from kvoffload_hal.scheduler.cpu_tier import CpuTier

Entry = tuple[BlockKey, Any]  # (tier key, block hash with group id)


class GroupKeys:
    """The groups a tier keeps for one model, and the keys of a request's blocks."""

    def __init__(self, groups: Sequence[int], dense: Sequence[int]) -> None:
        self.groups = list(groups)
        # Every group kept needs every block before a hit's end: a prefix of a hit is a hit.
        self.all_dense = all(g in dense for g in self.groups)
        self.dense = [g for g in dense if g in self.groups] or list(self.groups)

    @classmethod
    def of(cls, cpu: CpuTier) -> GroupKeys:
        return cls(cpu.prefix_groups, cpu.dense_groups)

    def at(self, block_hash: Any, groups: Sequence[int] | None = None) -> list[Entry]:
        """The entries of one block position, for ``groups`` (default: every group kept)."""
        out = []
        for g in self.groups if groups is None else groups:
            h = make_block_hash_with_group_id(block_hash, g)
            out.append((h.hex(), h))
        return out

    def keys(self, block_hashes: Sequence[Any]) -> list[BlockKey]:
        """Every group's key at each of these positions, position by position."""
        return [key for bh in block_hashes for key, _ in self.at(bh)]
