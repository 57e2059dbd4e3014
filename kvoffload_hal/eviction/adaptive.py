"""The ``adaptive`` eviction policy (the default): a block's place by its class.

Runs in the scheduler process, inside the CPU tier (:mod:`kvoffload_hal.scheduler.cpu_tier`).

Each released block is put at the tail of vLLM's free queue (kept) or at the head
(the next to go unless it is hit first) according to its *class*: stored for the
first time, stored again (its hash was seen within the last :data:`HISTORY_FACTOR`
tier sizes of accesses, so it was evicted and wanted again), loaded once, loaded
more than once. Which class goes where is one of a few :data:`CANDIDATES`, each
right on some workload; the one in use is the one whose shadow (a key-level
simulation over a sample of the block hashes) has scored the most hits lately (set
dueling, with sampled keys standing for sets). Blocks of one release go deepest
first, so a partly evicted prefix keeps its head.

One more class is not the duel's: a block that ends a prompt exactly
(:meth:`~kvoffload_hal.eviction.base.Eviction.on_prompt_ends`) and was not loaded
since goes to the head, whatever the candidate. Its own prompt never reads it;
where prompts fill whole blocks (documents of a fixed length), such blocks took
one tier block in nine on the long-document benchmark and were never read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload_hal import vllm_compat
from kvoffload_hal.eviction.base import Eviction
from kvoffload_hal.eviction.duel import (
    BIMODAL_EVERY,
    CANDIDATES,
    DECAY_EVERY,
    FRESH,
    HEAD,
    HEAD_BIMODAL,
    LRU_ORDER,
    RETURNED,
    REUSED,
    SAMPLE_EVERY,
    TAIL,
    USED_UP,
    Duel,
    HeadPlacements,
    Insertion,
    Shadow,
    next_class,
)
from kvoffload_hal.eviction.sketch import RecentHashes, hash_number

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

__all__ = [  # the duel's vocabulary, with the policy it serves
    "BIMODAL_EVERY", "CANDIDATES", "DECAY_EVERY", "FRESH", "HEAD", "HEAD_BIMODAL",
    "HISTORY_FACTOR", "LRU_ORDER", "RETURNED", "REUSED", "SAMPLE_EVERY", "TAIL", "USED_UP",
    "AdaptiveEviction", "Duel", "HeadPlacements", "Insertion", "RecentHashes", "Shadow",
    "next_class",
]

# The sketch of stored hashes remembers at least this many tier sizes of them
# (a history of 1 scored 0.892 of the optimum on the trace replays, below the
# 0.9 target; 16 scored more but costs twice the memory).
HISTORY_FACTOR = 8
# The class of a block that ends a prompt exactly and was not loaded since.
PROMPT_END = 4
# Prompt ends kept ahead of every other block at the head of the free queue: each
# release that puts blocks at the head moves them there again, so few.
MAX_ENDS_AT_HEAD = 64


class AdaptiveEviction(Eviction):
    """Each released block to the tail or the head by its class, as the
    candidate insertion with the most shadow hits lately says.

    Per tier block: its class (one byte, by block id) and 27 bytes of
    :class:`RecentHashes`; the shadows hold at most 4 x 512 keys of 4 bytes.
    Nothing grows with the traffic.
    """

    name = "adaptive"

    def __init__(self, pool: BlockPool, num_blocks: int,
                 candidates: Sequence[Insertion] = CANDIDATES) -> None:
        super().__init__(pool, num_blocks)
        # Block id -> its class (FRESH: 0), for every block of the pool.
        self._classes = bytearray(len(pool.blocks))
        self.history = RecentHashes(HISTORY_FACTOR * num_blocks)
        self.duel = Duel(candidates, num_blocks)
        self._to_head = HeadPlacements()
        # Block id -> block: prompt ends released (kept at the head of the free
        # queue, or waiting for the tier to fill), oldest first.
        self._ends: dict[int, KVCacheBlock] = {}

    def on_loaded(self, blocks: Sequence[KVCacheBlock]) -> None:
        if self.trace is not None:
            super().on_loaded(blocks)
        classes, duel = self._classes, self.duel
        sampled = duel.sample_below_hash
        for b in blocks:
            i = b.block_id
            # next_class, inline: this runs for every block loaded.
            classes[i] = USED_UP if classes[i] in (REUSED, USED_UP) else REUSED
            # A hit: not the history's to say (the block may have outlived its entry).
            if b.block_hash < sampled:
                duel.access(hash_number(b.block_hash), True)

    def on_stored(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any]) -> None:
        if self.trace is not None:
            super().on_stored(blocks, hashes)
        classes, sampled = self._classes, self.duel.sample_below_hash
        seen = self.history.see_all(hashes)
        # Its class starts here (a block's class is read only once it has a hash):
        # RETURNED (1) if the history has seen the hash, FRESH (0) if not.
        for block, key, returned in zip(blocks, hashes, seen):
            classes[block.block_id] = returned
            if key < sampled:
                self.duel.access(hash_number(key), returned)

    def on_prompt_ends(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().on_prompt_ends(blocks)
        for b in blocks:
            self._classes[b.block_id] = PROMPT_END

    def on_dropped(self, block_ids: Iterable[int]) -> None:
        classes = self._classes
        for i in block_ids:
            classes[i] = FRESH

    def block_class(self, block: KVCacheBlock) -> int:
        return self._classes[block.block_id]

    def release(self, blocks: list[KVCacheBlock]) -> None:
        # Deepest first: of a request's blocks, the last is evicted first.
        blocks = blocks[::-1]
        self.pool.free_blocks(blocks)
        classes = self._classes
        new_ends = False
        for b in blocks:
            if classes[b.block_id] == PROMPT_END and not b.ref_cnt:
                self._ends[b.block_id] = b
                new_ends = True
        head = self.pool.free_block_queue.fake_free_list_head.next_free_block
        # Blocks without a hash at the head: the tier still has room, nothing is
        # evicted yet, and a block put before them would be the first to go.
        # Prompt ends wait for the tier to fill.
        if head is None or head.block_hash is None:
            return
        placements = self.duel.best()[1:]  # by class
        front = []
        if placements.count(TAIL) < len(placements):  # else vLLM's order: the tail
            to_head = self._to_head
            front = [b for b in blocks if not b.ref_cnt and b.block_hash is not None
                     and classes[b.block_id] != PROMPT_END
                     and (placement := placements[classes[b.block_id]]) is not TAIL
                     and to_head(placement)]
        if front or new_ends:
            # Prompt ends first, then the blocks the candidate sends to the head.
            self._put_first(self._free_ends() + front)

    def before_allocate(self, num_blocks: int) -> None:
        """The allocation that starts evicting takes prompt ends first too.

        ``release`` puts them at the head only once the tier is full; the allocation
        that fills it (fewer blocks without a hash at the head than it takes) would
        otherwise evict in vLLM's order, the oldest prompt's blocks, and a tier
        filled for the first time kept its prompt ends and lost whole prefixes. The
        ends go right behind the blocks that evict nothing."""
        if not self._ends:
            return
        empty = []
        for block in vllm_compat.iter_free_blocks(self.pool.free_block_queue):
            if block.block_hash is not None or len(empty) == num_blocks:
                break
            empty.append(block)
        if not empty or len(empty) == num_blocks:
            return  # full (``release`` placed the ends), or nothing evicted yet
        self._put_first(empty + self._free_ends())

    def _put_first(self, front: list[KVCacheBlock]) -> None:
        """``front`` at the head of the free queue, in order: ``front[0]`` goes next."""
        queue = self.pool.free_block_queue
        for b in front:
            queue.remove(b)
        queue.prepend_n(front)

    def _free_ends(self) -> list[KVCacheBlock]:
        """The prompt ends still in the free queue with their hash and class, the
        most recent :data:`MAX_ENDS_AT_HEAD` (older ones stay where they are)."""
        classes = self._classes
        ends = [b for b in self._ends.values()
                if not b.ref_cnt and b.block_hash is not None
                and classes[b.block_id] == PROMPT_END][-MAX_ENDS_AT_HEAD:]
        self._ends = {b.block_id: b for b in ends}
        return ends
