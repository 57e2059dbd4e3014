"""An eviction policy outside the package, as a third party would write one.

``mru``: once the CPU tier is full, the blocks it lets go of go to the head of
the free queue, so the most recently released block is the next one evicted
(what LRU keeps, it drops). A loop over more documents than the tier holds then
keeps the first ones instead of losing each just before its next use. It has
what every policy has (an :class:`~kvoffload_hal.eviction.base.Eviction`
subclass overriding a hook, found by name) and nothing else, so the tests can
show that a policy plugs in without the connector naming it.
"""

from __future__ import annotations

from kvoffload_hal.eviction.base import Eviction

ENTRY_POINT = "support.mru_eviction:MruEviction"


class MruEviction(Eviction):
    name = "mru"

    def __init__(self, pool, num_blocks: int) -> None:
        super().__init__(pool, num_blocks)
        self.to_head = 0  # blocks placed at the head, for the tests to see it ran

    def release(self, blocks) -> None:
        self.pool.free_blocks(blocks)
        queue = self.pool.free_block_queue
        head = queue.fake_free_list_head.next_free_block
        if head is None or head.block_hash is None:
            return  # free blocks without a hash first: the tier still has room
        front = [b for b in blocks if not b.ref_cnt and b.block_hash is not None]
        for b in front:
            queue.remove(b)
        queue.prepend_n(front[::-1])
        self.to_head += len(front)
