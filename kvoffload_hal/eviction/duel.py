"""The candidate insertions of ``eviction: adaptive`` and the duel that picks one.

A candidate says where a released block goes (the tail of the free queue: kept;
the head: evicted next) by its class. The duel runs one *shadow* per candidate:
a key-level simulation of a tier a :data:`SAMPLE_EVERY`-th the size, fed the
sampled accesses (one block hash in :data:`SAMPLE_EVERY`), and the candidate whose
shadow scored the most hits lately is the one the tier uses (set dueling, with
sampled keys standing for sets).

A shadow holds 3-byte fingerprints in ``bytearray`` queues of at most
:data:`WAYS` keys each (a key goes to one queue by its number, as in a
set-associative cache), with each key's class in a parallel ``bytearray``:
4 bytes per key, so the four shadows cost about 2 bytes per tier block
where ``OrderedDict`` queues of the hashes cost over 50.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

# One block hash in SAMPLE_EVERY feeds the shadows (their first bytes are
# uniform: vLLM's block hashes are digests). Each shadow simulates a tier of
# 1/SAMPLE_EVERY the size on those keys. 1 in 4 scored 0.912 of the optimum on
# the trace replays, 1 in 8 0.901, at half the cost per block.
SAMPLE_EVERY = 8
# ... but no shadow holds more than SHADOW_MAX_KEYS keys: a larger tier samples
# fewer hashes (a tier of 100 000 blocks, 1 in 195), so the shadows cost less per
# block the larger the tier. The trace replays 8 and 32 times larger
# (`eviction_traces.py --scale`, tiers of 800 to 120 000 blocks) scored 0.911
# and 0.913 of the optimum with this cap, 0.912 and 0.916 with 4096 keys, 0.905
# and 0.909 with 128. A tier that starts full of unused blocks needs the
# evidence too: with 256 keys, one of 8192 blocks lost a quarter of its hits to
# LRU before the duel left the first candidate (tests/unit/test_eviction.py).
SHADOW_MAX_KEYS = 512
# One head placement in BIMODAL_EVERY goes to the tail instead, where a
# candidate says so: a tier full of a dead working set still takes a new one
# (the bimodal insertion of Qureshi et al., ISCA 2007).
BIMODAL_EVERY = 32
# The shadows' hit counts are halved every DECAY_EVERY shadow sizes of sampled
# accesses, so the choice follows the workload as it changes.
DECAY_EVERY = 4
# Shadow sizes of sampled accesses before the duel decides (vLLM's order until
# then).
WARM_UP = 1.125
# Keys per queue of a shadow. A queue is an exact LRU order over its keys and a
# lookup in it is one ``bytearray.find`` over 3 * WAYS bytes; a larger shadow is
# several queues, each an LRU of its own keys, as a set-associative cache of that
# many ways is (the trace replays score the same with queues of 128 and of 512).
WAYS = 128
# Fingerprints are a hash's number modulo this prime (the largest below 2**32):
# every byte of the hash counts, and two keys of one queue share a fingerprint
# with a probability of about WAYS / 2**24.
_FINGERPRINT_PRIME = 16777213
_PRINT = 3  # bytes per fingerprint

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
#: vLLM's own order: what the tier uses until the shadows have something to say.
LRU_ORDER = Insertion("lru", TAIL, TAIL, TAIL, TAIL)


def next_class(block_class: int) -> int:
    """The class of a block just loaded (hit) that had ``block_class``."""
    return USED_UP if block_class >= REUSED else REUSED


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


class Shadow:
    """A key-level tier of ``capacity`` keys placing blocks as ``insertion`` does.

    The keys are in ``num_sets`` queues (head first) of 3-byte fingerprints; the
    caller says which queue a key is in (see :meth:`Duel.access`).
    """

    def __init__(self, insertion: Insertion, capacity: int, num_sets: int = 1) -> None:
        self.insertion = insertion
        self.capacity = capacity
        self.ways = max(1, -(-capacity // num_sets))
        self.hits = 0.0
        self._placements = insertion[1:]  # by block class
        self._fingerprints = [bytearray() for _ in range(num_sets)]
        self._classes = [bytearray() for _ in range(num_sets)]
        # Per class: 0 tail, 1 head, 2 head-bimodal; and the head placements so far.
        self._codes = bytes((TAIL, HEAD, HEAD_BIMODAL).index(p) for p in self._placements)
        self._heads = 0

    @property
    def nbytes(self) -> int:
        """Bytes of fingerprints and classes held (without the queues' own headers)."""
        return sum(len(q) for q in self._fingerprints) + sum(len(q) for q in self._classes)

    def access(self, queue: int, fingerprint: bytes, seen: bool) -> None:
        """An access to the key ``fingerprint`` of queue ``queue``: a hit if it is
        held; ``seen``: a miss on a key the sketch remembers (class returned)."""
        prints, classes = self._fingerprints[queue], self._classes[queue]
        at = prints.find(fingerprint)
        while at > 0 and at % _PRINT:  # a match across two fingerprints: look further
            at = prints.find(fingerprint, at + 1)
        if at < 0:
            if len(classes) >= self.ways:
                del prints[:_PRINT]
                del classes[0]
            block_class = RETURNED if seen else FRESH
        else:
            self.hits += 1
            at //= _PRINT
            # next_class, inline
            block_class = USED_UP if classes[at] >= REUSED else REUSED
            del prints[_PRINT * at:_PRINT * at + _PRINT]
            del classes[at]
        # HeadPlacements, inline: 0 tail, 1 head, 2 head but one in BIMODAL_EVERY.
        code = self._codes[block_class]
        if code:
            self._heads += 1
            if code == 1 or self._heads % BIMODAL_EVERY:
                prints[0:0] = fingerprint
                classes.insert(0, block_class)
                return
        prints += fingerprint
        classes.append(block_class)


class Duel:
    """One shadow per candidate on the same sampled accesses; the best is the
    one with the most (decayed) hits, the earliest on a tie.

    Until the shadows have taken as many sampled accesses as they hold keys,
    none can have evicted anything and all score alike: the tier keeps vLLM's
    order (:data:`LRU_ORDER`) until then, so one that starts full of blocks no
    one uses does not put new blocks before them on no evidence. One candidate
    alone is used from the start.
    """

    def __init__(self, candidates: Sequence[Insertion], num_blocks: int) -> None:
        wanted = min(SHADOW_MAX_KEYS, num_blocks // SAMPLE_EVERY)
        #: A block hash whose first two bytes, big-endian, are below this is sampled.
        self.sample_below = max(1, min(1 << 16, round((1 << 16) * wanted / max(1, num_blocks))))
        #: The largest first byte of a sampled hash (most hashes are ruled out by it).
        self.sample_first_byte_max = (self.sample_below - 1) >> 8
        #: The same test as one comparison of bytes: a hash (2 bytes or more) is
        #: sampled if it sorts before this (sample_below is at most 2**16 / SAMPLE_EVERY).
        self.sample_below_hash = min(self.sample_below, 0xFFFF).to_bytes(2, "big")
        #: Keys per shadow: the tier's size times the fraction of hashes sampled.
        self.capacity = max(1, round(num_blocks * self.sample_below / (1 << 16)))
        self.num_sets = max(1, -(-self.capacity // WAYS))
        self.shadows = [Shadow(c, self.capacity, self.num_sets) for c in candidates]
        self._decay_every = DECAY_EVERY * self.capacity
        self._warm_after = int(WARM_UP * self.capacity) if len(candidates) > 1 else 0
        self._accesses = 0
        self._best: Shadow | None = None  # None: to be found again

    def best(self) -> Insertion:
        if self._accesses < self._warm_after:
            return LRU_ORDER
        if self._best is None:
            self._best = max(self.shadows, key=lambda s: s.hits)  # max keeps the earliest tie
        return self._best.insertion

    def access(self, number: int, seen: bool) -> None:
        """A sampled access to the hash of number ``number`` (a hit, or a miss
        ``seen`` by the sketch or not)."""
        queue = number % self.num_sets
        fingerprint = (number % _FINGERPRINT_PRIME).to_bytes(_PRINT, "little")
        for shadow in self.shadows:
            shadow.access(queue, fingerprint, seen)
        self._accesses += 1
        if self._accesses % self._decay_every == 0:
            for shadow in self.shadows:
                shadow.hits /= 2
        self._best = None
