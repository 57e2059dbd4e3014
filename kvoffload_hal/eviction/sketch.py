"""A fixed-size memory of recently stored block hashes, for ``eviction: adaptive``.

The adaptive policy asks one question of every block stored: was its hash stored
not long ago (so it was evicted and is wanted again)? Keeping the hashes
themselves costs about 170 bytes per key (a Python ``bytes`` object and an
``OrderedDict`` entry), for several tier sizes of keys: 1.7 GB for a tier of a
million blocks. :class:`RecentHashes` keeps 3 bytes per key instead, in one
``bytearray`` allocated once (27 bytes per tier block for a window of 8 tier
sizes), whatever the traffic.

A key is a 20-bit fingerprint and a 4-bit *stamp*: the generation it was
recorded in, a generation being ``window / GENERATIONS`` new keys. A key is
recent while its stamp is at most ``GENERATIONS`` generations old: a key among
the last ``window`` new ones is recent (unless its bucket overflowed, below),
none older than ``window * (1 + 1 / GENERATIONS)`` is, and the blocks of one
request, stored together, are forgotten together. That matters more than the
exact length of the window: a request whose first blocks are taken for
returning ones and whose later blocks are not keeps only its head in the tier,
and every block after the first one lost misses. Forgetting each key at its own
time (an LRU list per bucket of 32 keys, without stamps: the window of each key
then varies by about 18 %) took the hot+scan replay of
``benchmarks/eviction_traces.py`` from 0.49 to 0.39 of the optimum at half its
working set; varying the window of every key alike by 20 % changed it by 0.01.

The array is cut into buckets of :data:`WAYS` slots, each a ring written in turn
(the oldest slot of the bucket is overwritten); a key goes to one bucket by its
number (:func:`hash_number`). The buckets have :data:`HEADROOM` times the slots
the window needs, so a bucket seldom overwrites a key before its stamp expires.
A key stored again while recent stays where it is (a history that moved it to
the front scored the same on the trace replays). What it costs against exact
keys: a key never recorded, or no longer recent, is taken for a recent one when
a recent key of its bucket has the same fingerprint, for about ``WAYS / 2**20``
(0.01 %) of the lookups; tests/unit/test_eviction_sketch.py bounds that and the
window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Slots per bucket (at most 255: a bucket's next slot is one byte). A lookup is
# a memchr over WAYS bytes; a larger bucket spreads the time a key lasts in it
# less (by 1/sqrt(WAYS)) but matches more fingerprints by chance (WAYS / 2**20).
WAYS = 128
# Slots per key of the window: a key is overwritten once WAYS more keys went to
# its bucket, after about HEADROOM windows (within 1/sqrt(WAYS), 9 %), so few
# keys of the window are lost that way before their stamp says so.
HEADROOM = 9 / 8
# Generations per window: a key is forgotten within 1/GENERATIONS of a window
# after it left it. Stamps count 1 to 15 (0: empty), so a key must leave its
# bucket within 15 generations (2.5 windows) or look recent again; a bucket
# takes WAYS new keys per window on average, so its keys last about one.
GENERATIONS = 6


def hash_number(block_hash: Any) -> int:
    """The number a block hash stands for in the sketch and the shadows.

    vLLM's block hashes (with group id) are ``bytes``: a digest of 16 or 32
    bytes, then the group id. All of its bytes count, so the same block of two
    KV cache groups are two numbers.
    """
    return int.from_bytes(block_hash, "little")


class RecentHashes:
    """Whether a hash was among about the last ``window`` new hashes recorded.

    Hashes are vLLM block hashes (``bytes`` of a digest). The fingerprint is
    their second and third bytes and the high half of the fourth (the first
    picks the shadows' sample); each bucket keeps the second bytes of its keys
    in one run, then the third bytes, then the stamps with the last four bits.
    """

    def __init__(self, window: int, ways: int = WAYS, generations: int = GENERATIONS) -> None:
        self.window = max(1, window)
        self.ways = ways
        # An odd number of buckets, so the bucket of a hash depends on every
        # byte of it (the group id is in its last bytes).
        self.num_buckets = max(1, -(-int(self.window * HEADROOM) // ways)) | 1
        #: New keys per generation.
        self.generation_keys = max(1, -(-self.window // generations))
        self._live_stamps = generations + 1  # the current one and GENERATIONS before it
        self._slots = bytearray(3 * ways * self.num_buckets)
        self._next = bytearray(self.num_buckets)  # per bucket: the slot written next
        self._stamp = 1
        self._left_in_generation = self.generation_keys  # new keys before the next stamp

    @property
    def nbytes(self) -> int:
        """Bytes of slots: fixed at construction."""
        return len(self._slots) + len(self._next)

    def see(self, block_hash: Any) -> bool:
        """Record ``block_hash``; whether it was recent already."""
        return self.see_all((block_hash,))[0]

    def see_all(self, block_hashes: Iterable[Any]) -> list[bool]:
        """Record each hash in turn; for each, whether it was recent already."""
        slots, ways, next_slot = self._slots, self.ways, self._next
        find, num_buckets, live = slots.find, self.num_buckets, self._live_stamps
        stamp, left = self._stamp, self._left_in_generation
        third, stamps, bucket_bytes = ways, 2 * ways, 3 * ways
        recent = []
        seen = recent.append
        for block_hash in block_hashes:
            first, second, tag = block_hash[1], block_hash[2], block_hash[3] & 0xF0
            bucket = int.from_bytes(block_hash, "little") % num_buckets
            start = bucket * bucket_bytes
            end = start + ways
            at = find(first, start, end)
            while at >= 0 and (slots[at + third] != second or slots[at + stamps] & 0xF0 != tag):
                at = find(first, at + 1, end)
            if at >= 0:
                old = slots[at + stamps] & 15
                if old and (stamp - old) % 15 < live:
                    seen(True)
                    continue
                slots[at + stamps] = 0  # no longer recent: recorded anew below
            slot = next_slot[bucket]
            at = start + slot
            slots[at] = first
            slots[at + third] = second
            slots[at + stamps] = tag | stamp
            next_slot[bucket] = (slot + 1) % ways
            left -= 1
            if not left:
                left = self.generation_keys
                stamp = stamp % 15 + 1
            seen(False)
        self._stamp, self._left_in_generation = stamp, left
        return recent
