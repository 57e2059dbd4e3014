"""The eviction policy contract, and ``lru`` (vLLM's own order).

Runs in the scheduler process, inside the CPU tier (:mod:`kvoffload_hal.scheduler.cpu_tier`).

The CPU tier is vLLM's ``BlockPool``: its free queue (a doubly linked
``FreeKVCacheBlockQueue``) *is* the eviction order. ``get_new_blocks`` pops the
head and evicts the hash the popped block had; ``free_blocks`` appends blocks
whose last reference went to the tail. That is LRU, and LRU thrashes when the
blocks being reused do not all fit: every miss stores a block at the tail and
evicts the block at the head, which in a random or cyclic order is the block
whose next use is nearest. A policy changes only *where* an unreferenced block
is put, with the queue's own O(1) ``remove``/``prepend_n``/``append_n`` (present
in every supported vLLM); prefix matching, reference counts, the hash->block map
and KV events stay vLLM's.

A policy subclasses :class:`Eviction` and overrides the hooks it needs: it sees
accesses through ``on_loaded`` (a hit) and ``on_stored`` (a store or promotion,
i.e. a miss), and places blocks in ``release``. It is built with the pool and
its number of blocks, and must keep its own state bounded (it lives as long as
the engine). Policies are found by name: :mod:`kvoffload_hal.eviction.registry`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


class Eviction:
    """The eviction order of one CPU-tier ``BlockPool`` (base: vLLM's LRU)."""

    name: ClassVar[str] = "lru"  # the registry's name for it

    def __init__(self, pool: BlockPool, num_blocks: int) -> None:
        self.pool = pool
        self.num_blocks = num_blocks
        # Every access, in order, as (block hash, was it a hit); None: not recorded.
        # The benchmarks set a list here to replay the exact trace offline.
        self.trace: list[tuple[Any, bool]] | None = None

    def on_loaded(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``blocks`` were just copied to the device: a hit on each."""
        if self.trace is not None:
            self.trace.extend((b.block_hash, True) for b in blocks)

    def on_stored(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any]) -> None:
        """``blocks`` were just published under ``hashes``: a miss on each."""
        if self.trace is not None:
            self.trace.extend((h, False) for h in hashes)

    def on_prompt_ends(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``blocks``, just stored, each end a prompt exactly (its last token is the
        prompt's last): a lookup of that prompt never reads it, since vLLM computes
        a prompt's last token whatever is cached; only a longer prompt can (the next
        turn of a chat, the request itself resumed after a preemption). Called
        after :meth:`on_stored`."""

    def before_allocate(self, num_blocks: int) -> None:
        """The tier is about to take ``num_blocks`` from the head of the free queue
        (evicting the hashes of those that have one): a last chance to order it."""

    def on_allocated(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``blocks`` were just taken from the free queue (their old hashes evicted)."""

    def on_dropped(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` lost their hashes outside an allocation."""

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference on each block; unreferenced ones become evictable."""
        self.pool.free_blocks(blocks)


class LruEviction(Eviction):
    """vLLM's ``BlockPool`` order, as is: freed blocks go to the tail."""
