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

* :class:`LruEviction` (``eviction: lru``): vLLM's order, unchanged.
* :class:`AdaptiveEviction` (``eviction: adaptive``, the default): each released block is put
  at the tail (kept) or at the head (the next to go unless it is hit first)
  according to its *class*: stored for the first time, stored again (its hash
  was seen within the last :data:`HISTORY_FACTOR` tier sizes of accesses, so it
  was evicted and wanted again), loaded once, loaded more than once. Which
  class goes where is one of a few :data:`CANDIDATES`, each right on some
  workload; the one in use is the one whose shadow (a key-level simulation
  over a sample of the block hashes) has scored the most hits lately (set
  dueling, with sampled keys standing for sets). Blocks of one release go
  deepest first, so a partly evicted prefix keeps its head.

The policy sees accesses through ``on_loaded`` (a hit) and ``on_stored`` (a
store or promotion, i.e. a miss).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

EVICTION_POLICIES = ("lru", "adaptive")
# On the long-document benchmark at 32 documents (tier of 30) "adaptive" computed
# 5664 prompt tokens where LRU computed 10560 (minimum 2624), and it is within
# 0.001 of LRU or above it on the trace replays (docs/design.md#eviction).
DEFAULT_EVICTION = "adaptive"
# One block hash in SAMPLE_EVERY feeds the shadows (their first byte is
# uniform: vLLM's block hashes are digests). Each shadow simulates a tier of
# 1/SAMPLE_EVERY the size on those keys. 1 in 4 scored 0.912 of the optimum on
# the trace replays, 1 in 8 0.901, at half the cost per block.
SAMPLE_EVERY = 8
# One head placement in BIMODAL_EVERY goes to the tail instead, where a
# candidate says so: a tier full of a dead working set still takes a new one
# (the bimodal insertion of Qureshi et al., ISCA 2007).
BIMODAL_EVERY = 32
# The history of accessed hashes holds this many tier sizes of keys (hashes
# only: a few hundred bytes per block against the block's kilobytes).
HISTORY_FACTOR = 8
# The shadows' hit counts are halved every DECAY_EVERY shadow sizes of sampled
# accesses, so the choice follows the workload as it changes.
DECAY_EVERY = 4

# Block classes, by what happened to the block since it was stored.
FRESH, RETURNED, REUSED, USED_UP = range(4)
# Placements: evicted last, evicted next, evicted next but one in BIMODAL_EVERY last.
TAIL, HEAD, HEAD_BIMODAL = "tail", "head", "head-bimodal"


class Insertion(NamedTuple):
    """Where a released block goes, by its class."""

    name: str
    fresh: str
    returned: str
    reused: str
    used_up: str


CANDIDATES = (
    # Exclusive: a block loaded once is in the device cache now, so its copy here
    # matters only after the device evicts it; first-time blocks go next too.
    Insertion("exclusive", HEAD, TAIL, HEAD, TAIL),
    # Scan-resistant: a block seen once goes next, one seen twice is kept by recency.
    Insertion("scan-resistant", HEAD, TAIL, TAIL, TAIL),
    # vLLM's LRU: recency is right (chat turns, a working set that fits).
    Insertion("lru", TAIL, TAIL, TAIL, TAIL),
    # Keep residents: a loop larger than the tier keeps what it holds; a block
    # loaded twice is done.
    Insertion("keep-residents", HEAD_BIMODAL, HEAD_BIMODAL, TAIL, HEAD),
)


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
    """Each released block to the tail or the head by its class, as the
    candidate insertion with the most shadow hits lately says."""

    name = "adaptive"

    def __init__(self, pool: BlockPool, num_blocks: int,
                 candidates: Sequence[Insertion] = CANDIDATES) -> None:
        super().__init__(pool, num_blocks)
        # Block id -> its class, for blocks not FRESH (stored again, or loaded).
        self._classes: dict[int, int] = {}
        self.history = History(HISTORY_FACTOR * num_blocks)
        self.duel = Duel(candidates, max(1, num_blocks // SAMPLE_EVERY))
        self._to_head = HeadPlacements()

    def on_loaded(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().on_loaded(blocks)
        classes, duel = self._classes, self.duel
        for b in blocks:
            classes[b.block_id] = USED_UP if classes.get(b.block_id, FRESH) >= REUSED else REUSED
            # A hit: not the history's to say (the block may have outlived its entry).
            key = b.block_hash
            if key[0] % SAMPLE_EVERY == 0:
                duel.access(key, True)

    def on_stored(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any]) -> None:
        super().on_stored(blocks, hashes)
        classes, duel, see = self._classes, self.duel, self.history.see
        for block, key in zip(blocks, hashes):
            seen = see(key)
            if seen:
                classes[block.block_id] = RETURNED
            if key[0] % SAMPLE_EVERY == 0:
                duel.access(key, seen)

    def on_allocated(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.on_dropped(b.block_id for b in blocks)

    def on_dropped(self, block_ids: Iterable[int]) -> None:
        classes = self._classes
        for i in block_ids:
            classes.pop(i, None)

    def block_class(self, block: KVCacheBlock) -> int:
        return self._classes.get(block.block_id, FRESH)

    def release(self, blocks: list[KVCacheBlock]) -> None:
        # Deepest first: of a request's blocks, the last is evicted first.
        blocks = blocks[::-1]
        self.pool.free_blocks(blocks)
        queue = self.pool.free_block_queue
        head = queue.fake_free_list_head.next_free_block
        # Blocks without a hash at the head: the tier still has room, nothing is
        # evicted yet, and a block put before them would be the first to go.
        if head is None or head.block_hash is None:
            return
        insertion = self.duel.best()
        classes = self._classes
        front = []
        for b in blocks:
            if b.ref_cnt or b.block_hash is None:
                continue
            if self._to_head(insertion[1 + classes.get(b.block_id, FRESH)]):
                front.append(b)
        if front:
            for b in front:
                queue.remove(b)
            queue.prepend_n(front)  # deepest first: it is the next one evicted


class HeadPlacements:
    """Whether a block placed as ``placement`` goes to the head: every ``HEAD``,
    and every ``HEAD_BIMODAL`` but one in :data:`BIMODAL_EVERY`."""

    def __init__(self) -> None:
        self._count = 0

    def __call__(self, placement: str) -> bool:
        if placement == TAIL:
            return False
        self._count += 1
        return placement == HEAD or self._count % BIMODAL_EVERY != 0


class History:
    """The last ``capacity`` distinct hashes stored."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Any, None] = OrderedDict()

    def see(self, key: Any) -> bool:
        """Record an access to ``key``; whether it was in the history already."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return True
        keys[key] = None
        if len(keys) > self.capacity:
            keys.popitem(last=False)
        return False


class Shadow:
    """A key-level tier of ``capacity`` keys placing blocks as ``insertion`` does."""

    def __init__(self, insertion: Insertion, capacity: int) -> None:
        self.insertion = insertion
        self.capacity = capacity
        self.hits = 0.0
        self._placements = insertion[1:]  # by block class
        self._queue: OrderedDict[Any, int] = OrderedDict()  # key -> class; first: head
        self._to_head = HeadPlacements()

    def access(self, key: Any, seen: bool) -> None:
        queue = self._queue
        block_class = queue.get(key)
        if block_class is None:
            if len(queue) >= self.capacity:
                queue.popitem(last=False)
            block_class = RETURNED if seen else FRESH
            queue[key] = block_class  # at the tail
        else:
            self.hits += 1
            block_class = USED_UP if block_class >= REUSED else REUSED
            queue[key] = block_class  # where it was
            if self._placements[block_class] == TAIL:
                queue.move_to_end(key)
                return
        placement = self._placements[block_class]
        if placement != TAIL:
            queue.move_to_end(key, last=not self._to_head(placement))


class Duel:
    """One shadow per candidate on the same sampled accesses; the best is the
    one with the most (decayed) hits, the earliest on a tie."""

    def __init__(self, candidates: Sequence[Insertion], capacity: int) -> None:
        self.shadows = [Shadow(c, capacity) for c in candidates]
        self._decay_every = DECAY_EVERY * capacity
        self._accesses = 0
        self._best: Shadow | None = self.shadows[0]  # None: to be found again

    def best(self) -> Insertion:
        if self._best is None:
            self._best = max(self.shadows, key=lambda s: s.hits)  # max keeps the earliest tie
        return self._best.insertion

    def access(self, key: Any, seen: bool) -> None:
        for shadow in self.shadows:
            shadow.access(key, seen)
        self._accesses += 1
        if self._accesses % self._decay_every == 0:
            for shadow in self.shadows:
                shadow.hits /= 2
        self._best = None


def make_eviction(name: str, pool: BlockPool, num_blocks: int) -> Eviction:
    if name == "lru":
        return LruEviction(pool, num_blocks)
    if name == "adaptive":
        return AdaptiveEviction(pool, num_blocks)
    raise ValueError(f"eviction={name!r}: expected one of {', '.join(EVICTION_POLICIES)}")
