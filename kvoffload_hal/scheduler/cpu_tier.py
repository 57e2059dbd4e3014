"""The CPU tier: a second vLLM ``BlockPool``, driven by a ``KVCacheCoordinator``.

The coordinator is built from a CPU ``KVCacheConfig`` (the device one with
fewer blocks), so prefix matching, LRU eviction, reference counts, the
hash->block map, HMA group semantics and KV events all come from vLLM.
:class:`CpuTier` adds only what offloading needs on top:

* a lookup that answers the common miss with one dict probe;
* pins (references) on blocks a hit or a copy uses, so LRU eviction cannot
  take them while in use;
* publishing a block under its hash once its bytes are in place, with a
  ``BlockStored`` event of medium CPU; evictions are labelled CPU too;
* an :class:`~kvoffload_hal.eviction.base.Eviction` that decides where a block the
  tier lets go of goes in the free queue (vLLM's eviction order), told of
  every load and store;
* :class:`~kvoffload_hal.scheduler.device_copies.DeviceCopies`: copies of blocks
  the device also holds are evicted first (``device_copies``), so that the
  device and the tier hold different blocks.

No device is touched here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from kvoffload_hal import vllm_compat
from kvoffload_hal.eviction.registry import DEFAULT_DEVICE_COPIES, DEFAULT_EVICTION, make_eviction
from kvoffload_hal.scheduler.device_copies import DeviceCopies
from kvoffload_hal.vllm_compat import MEDIUM_CPU

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

Hit = tuple[Sequence["KVCacheBlock"], ...]  # per KV cache group, as the coordinator gives it
_NO_HIT: tuple[Hit, int] = ((), 0)


def pin_ids(pool: BlockPool, block_ids: Iterable[int]) -> None:
    """Reference blocks of ``pool`` by id, so it neither reuses nor evicts them."""
    pool.touch([pool.blocks[b] for b in block_ids])


def unpin_ids(pool: BlockPool, block_ids: Iterable[int]) -> None:
    pool.free_blocks([pool.blocks[b] for b in block_ids])


def derive_cpu_kv_cache_config(gpu_config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """The device config with ``num_blocks`` blocks (same groups, so same HMA semantics).

    Only the groups and the block count drive the CPU coordinator; tensor sizes
    are scaled for consistency but nothing is allocated from them.
    """
    tensors = [replace(t, size=t.size // gpu_config.num_blocks * num_blocks)
               for t in gpu_config.kv_cache_tensors]
    return replace(gpu_config, num_blocks=num_blocks, kv_cache_tensors=tensors)


class CpuTier:
    """Which KV blocks the CPU tier holds, and under which hashes."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 num_blocks: int, block_size: int, hash_block_size: int,
                 eviction: str = DEFAULT_EVICTION,
                 device_copies: str = DEFAULT_DEVICE_COPIES, tier_behind: bool = False,
                 ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        config = derive_cpu_kv_cache_config(kv_cache_config, num_blocks)
        events = vllm_config.kv_events_config
        self.emit_kv_events = bool(events and events.enable_kv_cache_events)
        self.coordinator = vllm_compat.make_coordinator(
            vllm_config, config, block_size=block_size, hash_block_size=hash_block_size,
            enable_kv_cache_events=self.emit_kv_events)
        self.pool = self.coordinator.block_pool
        self.eviction = make_eviction(eviction, self.pool, num_blocks)
        self.device_copies = DeviceCopies(self.pool, device_copies, tier_behind)
        # Evictions from this pool are evictions from CPU memory: label its KV
        # events so a KV-aware router does not take them for device ones.
        self._take_pool_events = vllm_compat.label_pool(self.pool, MEDIUM_CPU)
        self.group_block_sizes: list[int] = list(vllm_compat.group_block_sizes(self.coordinator))
        cacheable = vllm_compat.prefix_cacheable_group_ids(config)
        # A group whose block at a position is replaced as the request runs
        # (Mamba state in 'align' mode) holds a block's bytes only until the
        # next step: eager stores cannot take it, lazy ones can (see scheduler).
        self.unstable_groups = [
            g for g in cacheable
            if not vllm_compat.positionally_stable(self.coordinator.single_type_managers[g])]
        self.cacheable_groups = [g for g in cacheable if g not in self.unstable_groups]
        self.prefix_groups = list(cacheable)
        # Groups whose hit needs every block before its end (full attention,
        # MLA); the others need some (a window, the state at the end).
        self.dense_groups = [g for g in cacheable if isinstance(
            config.kv_cache_groups[g].kv_cache_spec, FullAttentionSpec)]
        # One full-attention group hashed at its own block size: a miss on the
        # first block asked for is a miss, and the lookup can stop at one dict
        # probe (most waiting requests, most steps).
        groups = config.kv_cache_groups
        self._probe_first_block = (
            len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
            and block_size == hash_block_size)
        self._hash_map = self.pool.cached_block_hash_to_block

    # ------------------------------------------------------------- lookup
    def find_hit(self, block_hashes: Sequence[Any], first: int,
                 max_tokens: int) -> tuple[Hit, int]:
        """The longest run of cached blocks from hash ``first`` on: (blocks, tokens)."""
        if (self._probe_first_block and self._hash_map.get_one_block(
                make_block_hash_with_group_id(block_hashes[first], 0)) is None):
            return _NO_HIT
        return vllm_compat.find_longest_cache_hit(self.coordinator, block_hashes[first:],
                                                  max_tokens)

    def find_hit_with(self, block_hashes: Sequence[Any], first: int, max_tokens: int,
                      more: Callable[[Any], Any]) -> tuple[Hit, int]:
        """:meth:`find_hit` as if the blocks ``more(hash with group id)`` answers for
        (stand-ins, from a slower tier) were cached here too."""
        return vllm_compat.find_longest_cache_hit_with(self.coordinator, block_hashes[first:],
                                                       max_tokens, more)

    def holds(self, block_hash: Any) -> bool:
        """Whether a block is published under ``block_hash`` (hash with group id)."""
        return self._hash_map.get_one_block(block_hash) is not None

    def cached_block(self, block_hash: Any) -> KVCacheBlock | None:
        """The block published under ``block_hash`` (hash with group id), if any."""
        return self._hash_map.get_one_block(block_hash)

    def cached(self, block_hashes: Iterable[Any]) -> list[KVCacheBlock]:
        """The blocks published under these hashes (those that are)."""
        found = (self._hash_map.get_one_block(h) for h in block_hashes)
        return [b for b in found if b is not None]

    # --------------------------------------------------------------- pins
    def pin(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Reference blocks: eviction cannot take them until :meth:`unpin`."""
        self.pool.touch([b for b in blocks if not b.is_null])

    def unpin(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.eviction.release([b for b in blocks if not b.is_null])

    def pin_hit(self, hit: Hit) -> None:
        self.pool.touch([b for group in hit for b in group if not b.is_null])

    def unpin_hit(self, hit: Hit) -> None:
        self.eviction.release([b for group in hit for b in group if not b.is_null])

    def unpin_ids(self, block_ids: Iterable[int]) -> None:
        self.eviction.release([self.pool.blocks[b] for b in block_ids])

    def record_load(self, block_ids: Sequence[int]) -> None:
        """These blocks were copied to the device (a hit): the policy counts a reuse."""
        blocks = [self.pool.blocks[b] for b in block_ids]
        self.eviction.on_loaded(blocks)
        self.device_copies.note_loaded(blocks)

    def bind_device(self, device_pool: BlockPool) -> None:
        """The device's prefix cache: copies of what it holds are evicted first."""
        self.device_copies.bind(device_pool)

    def num_pinned_blocks(self) -> int:
        """Blocks referenced by a hit or a copy (0 when the tier is idle)."""
        return sum(1 for b in self.pool.blocks[:self.num_blocks]
                   if b.ref_cnt > 0 and not b.is_null)

    def keep_below(self, num_blocks: int) -> None:
        """Never hand out a block id ``>= num_blocks``: some rank holds only that many.

        Called at start-up, before any request: the blocks above are referenced
        for good, so they are never allocated (a copy to or from them would run
        past that rank's host memory).
        """
        if num_blocks >= self.num_blocks:
            return
        self.pool.touch(self.pool.blocks[num_blocks:self.num_blocks])
        self.num_blocks = num_blocks

    # ------------------------------------------------------- blocks, hashes
    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def allocate(self, num_blocks: int, keep: Collection[Any] = (),
                 for_device_blocks: bool = False) -> list[KVCacheBlock]:
        """Fresh pinned blocks; eviction of unpinned cached blocks happens here, in
        the order :meth:`DeviceCopies.make_room` arranges.

        ``keep``: hashes whose copies stay, though the device holds them (it may
        evict them before they could be stored again). ``for_device_blocks``: the
        blocks are for copies of device blocks (a store), and may be fewer than
        asked where the rest would evict such copies.
        """
        self.eviction.before_allocate(num_blocks)
        num_blocks = self.device_copies.make_room(num_blocks, keep, for_device_blocks)
        blocks = self.pool.get_new_blocks(num_blocks)
        self.eviction.on_allocated(blocks)
        self.device_copies.forget(b.block_id for b in blocks)
        return blocks

    def blocks(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        return [self.pool.blocks[b] for b in block_ids]

    def publish(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any],
                prompt_ends: Collection[Any] = ()) -> None:
        """Make each block findable under its hash; its bytes are already in place.
        ``prompt_ends``: those of ``hashes`` that end a prompt exactly
        (:meth:`Eviction.on_prompt_ends`)."""
        # vLLM has no public "insert this hash" call (see vllm_compat).
        vllm_compat.insert_block_hashes(self.pool, blocks, hashes)
        self.eviction.on_stored(blocks, hashes)
        if prompt_ends:
            self.eviction.on_prompt_ends(
                [b for b, h in zip(blocks, hashes) if h in prompt_ends])
        self.device_copies.note_stored(blocks)
        if self.emit_kv_events:
            self._queue_stored_events(hashes)

    def drop(self, block_ids: Iterable[int]) -> None:
        """Stop offering these blocks (their copy failed): they are evicted."""
        block_ids = set(block_ids)
        self.pool.evict_blocks(block_ids)
        self.eviction.on_dropped(block_ids)
        self.device_copies.forget(block_ids)

    def drop_all(self) -> None:
        self.drop(range(self.num_blocks))

    # ------------------------------------------------------------- events
    def _queue_stored_events(self, hashes: Sequence[Any]) -> None:
        """One ``BlockStored`` (medium CPU) per published block.

        Blocks are published one by one, not as a chain of one request's
        blocks, so parent hash and token ids are not known here; consumers key
        on the block hash, as for blocks offloaded by vLLM's own CPU offload.
        """
        queue = self.pool.kv_event_queue
        for key in hashes:
            group = get_group_id(key)
            queue.append(vllm_compat.block_stored(
                block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                parent_block_hash=None, token_ids=[],
                block_size=self.group_block_sizes[group], lora_id=None,
                medium=MEDIUM_CPU, lora_name=None, group_idx=group, locality="LOCAL"))

    def take_events(self) -> Iterable[Any]:
        return self._take_pool_events()
