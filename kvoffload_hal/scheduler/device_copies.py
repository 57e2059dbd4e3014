"""The device cache and the CPU tier as one cache: CPU copies of blocks the device holds go first.

Runs in the scheduler process, inside the CPU tier (:mod:`kvoffload_hal.scheduler.cpu_tier`).

A store copies a block the device holds, and a load leaves the block it copied in
the device's prefix cache: without more care the CPU tier spends its room on what
the device already serves, and the two tiers together hold no more than the larger
of them. :class:`DeviceCopies` keeps the CPU blocks that are copies of device blocks
(by hash, with the device's own ``BlockPool`` as the judge) and, when the CPU tier
must evict, puts such a copy first in line in place of a block only the CPU tier
holds. The eviction policy (:mod:`kvoffload_hal.eviction.base`) orders everything
else.

With ``drop`` a copy may go at any time: the device's own evictions are watched
(:func:`~kvoffload_hal.vllm_compat.watch_allocations`), and a block the device hands
out for reuse while the CPU tier holds no copy of it is *rescued*: the step's
metadata carries a store of it (``OffloadMetadata.rescue``) that every worker copies
before the step's forward pass writes the block (``bind_connector_metadata``). The
CPU tier is then a victim cache of the device: the two hold their sum. A block is
recomputed only where no CPU block is free for its rescue (all pinned by copies),
or its rescue fails; a block not rescued is gone from both prefix caches, so
nothing stale is read. Without a tier behind, a store takes spare room only (free
blocks and copies of device blocks, ``spare_stores``): a block only the CPU tier
holds is evicted for a rescue, when a block leaves the device, never for a copy of
a block the device still holds.

Modes (``device_copies``): ``drop`` (copies made by stores and blocks just loaded
go first; rescues) and ``keep`` (the tiers are inclusive: no copy is preferred).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

from kvoffload_hal import vllm_compat
from kvoffload_hal.eviction.registry import DEVICE_COPY_MODES

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

# Blocks looked at per copy wanted, at most (and read at a time): copies that cannot
# go now (pinned for a copy in flight) and device blocks without a copy here are
# passed over. Candidates no longer copies are forgotten as they are met (each once).
_SCAN_PER_BLOCK, _SCAN_MIN = 4, 32


class DeviceCopies:
    """The CPU tier's copies of blocks the device holds: the first to drop."""

    def __init__(self, pool: BlockPool, mode: str, tier_behind: bool = False) -> None:
        if mode not in DEVICE_COPY_MODES:
            raise ValueError(f"device_copies={mode!r}: expected one of "
                             f"{', '.join(DEVICE_COPY_MODES)}")
        self.pool = pool
        self.mode = mode
        # Copies go first, and the device's evictions of blocks without one are rescued.
        self.drops = self.rescues = mode == "drop"
        # With rescues and no tier behind, a store takes spare room only: room that
        # evicts no block only this tier holds (the device holds what it stores, and
        # rescues it when it lets go of it). With a tier behind, such a block is there.
        self.spare_stores = self.rescues and not tier_behind
        # This step's rescues not taken yet, hash -> device block id, in eviction order
        # (a hash the device held twice: its first block). Lookups of the step may home
        # them (scheduler/rescue_homes.py); those homed leave for their own job.
        self.pending: dict[Any, int] = {}
        self.device: BlockPool | None = None
        self._max_candidates = 0
        # CPU blocks copied from or to a device block a request uses, in the order
        # noted: such a device block stays until its request ends (then goes to the
        # back of the device's eviction order), so its CPU copy is the first to drop.
        self._candidates: dict[int, None] = {}
        self.num_dropped = 0  # copies evicted in place of blocks only this tier held

    def bind(self, device: BlockPool) -> None:
        self.device = device
        # The device holds each hash once: more candidates than its blocks are stale.
        self._max_candidates = len(device.blocks)
        if self.rescues:
            vllm_compat.watch_allocations(device, self._on_device_evictions)
            vllm_compat.watch_caching(device, self._on_device_cached)

    # ------------------------------------------------------------ rescues
    def _on_device_evictions(self, blocks: list[KVCacheBlock]) -> None:
        """The device hands these cached blocks out for reuse: those the CPU tier
        holds no copy of are rescued in this step."""
        cpu_map = self.pool.cached_block_hash_to_block
        for b in blocks:
            copy = cpu_map.get_one_block(b.block_hash)
            if copy is None:
                self.pending.setdefault(b.block_hash, b.block_id)
            else:  # the CPU tier's block is no copy any more: it holds the only one
                self._candidates.pop(copy.block_id, None)

    def _on_device_cached(self, block_hash: Any) -> None:
        """The device computed or loaded a block: a CPU block of that hash is a copy."""
        copy = self.pool.cached_block_hash_to_block.get_one_block(block_hash)
        if copy is not None:
            self._note([copy])

    def take_rescues(self) -> list[tuple[int, Any]]:
        """The device blocks to copy out before this step's forward pass: (device
        block id, hash), in eviction order."""
        pending, self.pending = self.pending, {}
        return [(gpu_id, h) for h, gpu_id in pending.items()]

    def homed(self, block_hashes: Iterable[Any]) -> None:
        """A lookup took CPU blocks for these pending rescues: they go with it."""
        for h in block_hashes:
            del self.pending[h]

    # ------------------------------------------------------------ noting
    def note_stored(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``blocks`` were just published: copies of device blocks, or blocks the
        device no longer holds (rescued, promoted from a tier behind)."""
        if self.drops and self.device is not None:
            device_map = self.device.cached_block_hash_to_block
            self._note([b for b in blocks if device_map.get_one_block(b.block_hash) is not None])

    def note_loaded(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``blocks`` were just copied to the device, whose prefix cache keeps them."""
        if self.drops and self.device is not None:
            self._note(blocks)

    def _note(self, blocks: Sequence[KVCacheBlock]) -> None:
        candidates = self._candidates
        # A request's blocks come in prompt order; its first blocks are the ones the
        # device keeps longest (it frees a request's blocks deepest first): newest.
        for b in reversed(blocks):
            candidates.pop(b.block_id, None)
            candidates[b.block_id] = None
        while len(candidates) > self._max_candidates:
            del candidates[next(iter(candidates))]  # the oldest: the device let go of it

    def forget(self, block_ids: Iterable[int]) -> None:
        """These CPU blocks lost their hashes (reused or dropped)."""
        if self._candidates:
            for i in block_ids:
                self._candidates.pop(i, None)

    # ------------------------------------------------------------ room
    def make_room(self, num_blocks: int, keep: Collection[Any] = (),
                  spare_device_blocks: bool = False) -> int:
        """Arrange the head of the CPU free queue for the next ``get_new_blocks``:
        blocks that evict nothing, then copies of device blocks (:meth:`_droppable`),
        then blocks only this tier holds (in the eviction policy's order), then blocks
        of hashes the caller keeps. Returns how many blocks to take: ``num_blocks``,
        or, with ``spare_device_blocks`` (a store) and :attr:`spare_stores`, only as
        many as evict no block only this tier holds.
        """
        if not self.drops or num_blocks <= 0 or self.device is None:
            return num_blocks
        empty, others, kept = self._split_head(num_blocks, keep)
        wanted = max(0, num_blocks - len(empty))
        copies = self._droppable(wanted, keep) if wanted else []
        taken = {b.block_id for b in copies}
        head = empty[:num_blocks] + copies
        spare = spare_device_blocks and self.spare_stores
        if not spare:
            head += [b for b in others if b.block_id not in taken][:wanted - len(copies)]
            head += kept[:num_blocks - len(head)]
        # Once each (a hash the device holds twice may name one copy twice).
        head = list({b.block_id: b for b in head}.values())
        queue = self.pool.free_block_queue
        for b in head:
            queue.remove(b)
        queue.prepend_n(head)
        self.num_dropped += len(copies)
        return len(head) if spare else num_blocks

    def _split_head(self, num_blocks: int, keep: Collection[Any],
                    ) -> tuple[list[KVCacheBlock], list[KVCacheBlock], list[KVCacheBlock]]:
        """The head of the CPU free queue, read until ``num_blocks`` blocks may go:
        (blocks evicting nothing, blocks that may go, blocks of hashes kept)."""
        empty: list[KVCacheBlock] = []
        others: list[KVCacheBlock] = []
        kept: list[KVCacheBlock] = []
        budget = num_blocks + _SCAN_MIN + _SCAN_PER_BLOCK * num_blocks
        for block in islice(vllm_compat.iter_free_blocks(self.pool.free_block_queue), budget):
            if len(empty) + len(others) >= num_blocks:
                break
            if block.block_hash is None:
                empty.append(block)
            elif block.block_hash in keep:
                kept.append(block)
            else:
                others.append(block)
        return empty, others, kept

    def _droppable(self, wanted: int, keep: Collection[Any]) -> list[KVCacheBlock]:
        """Up to ``wanted`` free CPU blocks whose hash the device holds, copies of
        blocks a request uses first, then the latest noted (the device keeps what it
        cached last the longest). Any of them may go: the device's eviction rescues
        it."""
        assert self.device is not None
        device_map, blocks = self.device.cached_block_hash_to_block, self.pool.blocks
        in_use: list[KVCacheBlock] = []
        idle: list[KVCacheBlock] = []
        stale = []
        for block_id in reversed(self._candidates):
            block = blocks[block_id]
            h = block.block_hash
            held = device_map.get_one_block(h) if h is not None else None
            if held is None:
                stale.append(block_id)
            elif not (block.ref_cnt or h in keep):
                (in_use if held.ref_cnt else idle).append(block)
                if len(in_use) >= wanted:
                    break
        taken = (in_use + idle)[:wanted]
        for block_id in (*stale, *(b.block_id for b in taken)):
            del self._candidates[block_id]
        return taken
