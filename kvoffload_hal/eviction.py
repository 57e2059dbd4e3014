"""Where a CPU-tier block goes in the eviction order when the tier lets go of it.

The CPU tier is vLLM's ``BlockPool``: its free queue (a doubly linked
``FreeKVCacheBlockQueue``) *is* the eviction order. ``get_new_blocks`` pops the
head and evicts the hash the popped block had; ``free_blocks`` appends blocks
whose last reference went to the tail. That is LRU, and LRU thrashes when the
blocks being reused do not all fit: every miss stores a block at the tail and
evicts the block at the head, which in a random or cyclic order is the block
whose next use is nearest. A policy here changes only *where* an unreferenced
block is put, with the queue's own O(1) ``remove``/``prepend_n``/``append_n``
(present in every supported vLLM); prefix matching, reference counts, the
hash->block map and KV events stay vLLM's.

* :class:`LruEviction` (``eviction: lru``, the default): vLLM's order, unchanged.
* :class:`AdaptiveEviction` (``eviction: adaptive``): adaptive insertion. A
  block that was loaded at least once since it was stored is *protected* and
  goes to the tail, as in LRU. A block never loaded goes either to the tail
  (LRU insertion) or to the head (LRU-position insertion: it is the next one
  evicted unless it is loaded first, so a stream of one-off blocks churns
  through one slot instead of flushing the blocks being reused; one in
  :data:`BIMODAL_EVERY` still goes to the tail, so a new working set can get
  in). Which of the two is used follows two shadow directories over a sample
  of block hashes, one simulating each insertion, that count hits on the same
  accesses (set dueling, with sampled keys standing for sets). Blocks of one
  release go deepest first, so a partly evicted prefix keeps its head.

The policy sees accesses through :meth:`Eviction.on_access`: every block the
tier loads (a hit) or publishes (a store or promotion, i.e. a miss).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

EVICTION_POLICIES = ("lru", "adaptive")
# LRU stays the default: on the long-document benchmark at 32 documents (tier of
# 30) "adaptive" served 1327 hit blocks where LRU served 1345 in the same session,
# though it wins the trace replays (docs/design.md#eviction).
DEFAULT_EVICTION = "lru"
# One block hash in SAMPLE_EVERY feeds the shadow directories (their first byte
# is uniform: vLLM's block hashes are digests). 1/8 keeps the shadows at an
# eighth of the tier's size and still gives a tier of ~100 blocks a sample.
SAMPLE_EVERY = 8
# One never-loaded block in BIMODAL_EVERY goes to the tail even when inserting
# at the head: without it a tier full of a dead working set never takes a new one
# (the bimodal insertion of Qureshi et al., ISCA 2007).
BIMODAL_EVERY = 32
# The duel's counter saturates here: a change of workload flips the choice after
# at most this many more hits of the other shadow.
DUEL_LIMIT = 64


class Eviction:
    """The eviction order of one CPU-tier ``BlockPool`` (base: vLLM's LRU)."""

    name = "lru"

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

    def on_allocated(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``blocks`` were just taken from the free queue (their old hashes evicted)."""

    def on_dropped(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` lost their hashes outside an allocation."""

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference on each block; unreferenced ones become evictable."""
        self.pool.free_blocks(blocks)


class LruEviction(Eviction):
    """vLLM's ``BlockPool`` order, as is: freed blocks go to the tail."""


class AdaptiveEviction(Eviction):
    """Protected blocks to the tail; never-loaded ones to the tail or the head,
    whichever of the two shadow directories has scored more hits lately."""

    name = "adaptive"

    def __init__(self, pool: BlockPool, num_blocks: int, *, mode: str = "duel",
                 ghosts: bool = True) -> None:
        super().__init__(pool, num_blocks)
        self.mode = mode  # "duel"; "head"/"tail" fix the insertion (measurements, tests)
        # Block ids protected since their allocation: loaded, or stored again.
        self._loaded: set[int] = set()
        # Hashes stored and never loaded, most recent last, as many as the tier
        # holds blocks: one stored again was evicted unused, yet wanted again.
        self._ghosts: OrderedDict[Any, None] | None = OrderedDict() if ghosts else None
        self._inserts = 0
        self.duel = ShadowDuel(max(1, num_blocks // SAMPLE_EVERY))

    def _sample(self, keys: Iterable[Any]) -> None:
        duel = self.duel
        for key in keys:
            if key[0] % SAMPLE_EVERY == 0:
                duel.access(key)

    def on_loaded(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().on_loaded(blocks)
        self._loaded.update(b.block_id for b in blocks)
        self._sample([b.block_hash for b in blocks])

    def on_stored(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any]) -> None:
        super().on_stored(blocks, hashes)
        self._sample(hashes)
        ghosts = self._ghosts
        if ghosts is None:
            return
        for block, key in zip(blocks, hashes):
            if key in ghosts:
                del ghosts[key]
                self._loaded.add(block.block_id)
            else:
                ghosts[key] = None
        while len(ghosts) > self.num_blocks:
            ghosts.popitem(last=False)

    def on_allocated(self, blocks: Iterable[KVCacheBlock]) -> None:
        if self._loaded:
            self._loaded.difference_update(b.block_id for b in blocks)

    def on_dropped(self, block_ids: Iterable[int]) -> None:
        self._loaded.difference_update(block_ids)

    def inserts_at_head(self) -> bool:
        if self.mode == "duel":
            return self.duel.head_wins()
        return self.mode == "head"

    def release(self, blocks: list[KVCacheBlock]) -> None:
        # Deepest first: of a request's blocks, the last is evicted first.
        blocks = blocks[::-1]
        self.pool.free_blocks(blocks)
        queue = self.pool.free_block_queue
        head = queue.fake_free_list_head.next_free_block
        # Blocks without a hash at the head: the tier still has room, nothing is
        # evicted yet, and a block put before them would be the first to go.
        if not self.inserts_at_head() or head is None or head.block_hash is None:
            return
        probation = []
        for b in blocks:
            if b.ref_cnt or b.block_id in self._loaded or b.block_hash is None:
                continue
            self._inserts += 1
            if self._inserts % BIMODAL_EVERY:
                probation.append(b)
        if probation:
            for b in probation:
                queue.remove(b)
            queue.prepend_n(probation)  # deepest first: it is the next one evicted


class ShadowDuel:
    """Two key-level caches of ``capacity`` keys on the same sampled accesses:
    one inserting misses at the tail (LRU), one at the head (bimodal). A
    saturating counter keeps the difference of their hits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tail: OrderedDict[Any, None] = OrderedDict()
        self.head: OrderedDict[Any, None] = OrderedDict()
        self.ghosts: OrderedDict[Any, None] = OrderedDict()  # as AdaptiveEviction's
        self.score = 0  # > 0: tail insertion scored more hits lately
        self._inserts = 0

    def head_wins(self) -> bool:
        return self.score < 0

    def access(self, key: Any) -> None:
        hit_tail = key in self.tail
        if hit_tail:
            self.tail.move_to_end(key)
        else:
            if len(self.tail) >= self.capacity:
                self.tail.popitem(last=False)
            self.tail[key] = None
        head = self.head
        hit_head = key in head
        if hit_head:
            head.move_to_end(key)
        else:
            if len(head) >= self.capacity:
                head.popitem(last=False)
            head[key] = None
            if key in self.ghosts:  # stored again: protected
                del self.ghosts[key]
            else:
                self.ghosts[key] = None
                if len(self.ghosts) > self.capacity:
                    self.ghosts.popitem(last=False)
                self._inserts += 1
                if self._inserts % BIMODAL_EVERY:
                    head.move_to_end(key, last=False)
        self.score = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.score + hit_tail - hit_head))


def make_eviction(name: str, pool: BlockPool, num_blocks: int) -> Eviction:
    if name == "lru":
        return LruEviction(pool, num_blocks)
    if name == "adaptive":
        return AdaptiveEviction(pool, num_blocks)
    raise ValueError(f"eviction={name!r}: expected one of {', '.join(EVICTION_POLICIES)}")
