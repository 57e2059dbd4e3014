"""Device->CPU store jobs, from the blocks a policy picked to their publication.

A store goes through three states:

1. **queued**: CPU blocks are allocated (LRU eviction happens here) and the
   device blocks pinned, so neither can be reused while the copy runs;
2. **sent**: the step's queued stores become one job in the metadata;
3. **reported**: once every rank reported the job, its blocks are published in
   the CPU tier (and handed to a secondary tier), or, if a rank failed or
   ``reset_cache`` ran meanwhile, dropped unpublished. Both pins go; device blocks
   taken from the device's free queue (lazy stores) go back where they were in it.

A device block, or a hash, with a store queued or sent is not picked again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload_hal import vllm_compat
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import HandOver, JobReport, LoadSpec, StoreSpec
from kvoffload_hal.scheduler.cpu_tier import pin_ids, unpin_ids
from kvoffload_hal.scheduler.hand_over import Rescue, plan_hand_over
from kvoffload_hal.scheduler.jobs import JobBook
from kvoffload_hal.scheduler.rescue_homes import RescueHomes
from kvoffload_hal.scheduler.room import CpuRoom, RoomKind
from kvoffload_hal.scheduler.store_policy import BlockPicker

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.secondary.chain import TierChain

logger = init_logger(__name__)

# A cached device block in the free queue and the hash it had (None: the queue's end).
Anchor = tuple["KVCacheBlock", Any] | None


class HandOvers(Protocol):
    """The book of loads, as rescues into their CPU blocks see it (LoadJobs)."""

    def hand_over(self, job_id: int, cpu_ids: list[int]) -> None:
        """Load job ``job_id``'s CPU blocks ``cpu_ids`` are a rescue's now."""

    def new_job_id(self) -> int:
        """An id for the rest of a load, after a rescue into its blocks."""


@dataclass
class _Store:
    """Copies of ``gpu_ids[k]`` into ``cpu_ids[k]``; ``hashes`` as the device blocks had them."""

    gpu_ids: list[int]
    cpu_ids: list[int]
    hashes: list[Any]
    prompt_ends: set[Any] = field(default_factory=set)  # see BlockPicker.prompt_ends
    abandoned: bool = False  # reset_cache() ran while in flight: do not publish
    pins_device: bool = True  # a rescue's device blocks belong to their new requests
    handed_over: bool = False  # a rescue into CPU blocks of its step's loads
    published: int = 0  # the first blocks, homed by a lookup, are published already
    # Device blocks taken from the head of the free queue (a lazy store), the cached
    # block that followed them there and the window: they go back (see put_back).
    from_free: list[tuple[list[KVCacheBlock], Anchor, int]] = field(default_factory=list)
    # The device blocks pinned, in the order vLLM frees them (BlockPicker.free_order):
    # those whose request finished meanwhile enter the free queue in that order.
    free_order: list[int] = field(default_factory=list)


class StoreJobs:
    def __init__(self, cpu: CpuTier, tiers: TierChain, stats: StatsLedger,
                 world_size: int, room: CpuRoom, homes: bool = False) -> None:
        """``room``: the scheduler's room broker. ``homes``: lookups may home the step's
        rescues (scheduler/rescue_homes.py)."""
        self.cpu = cpu
        self.tiers = tiers
        self.room = room
        self.stats = stats
        self.gpu_pool: BlockPool | None = None
        self._queued: list[_Store] = []
        self._sent: JobBook[_Store] = JobBook(world_size)
        self._in_flight_gpu: set[int] = set()
        self._in_flight_hashes: set[Any] = set()
        self.homes = RescueHomes(cpu, room) if homes and cpu.device_copies.rescues else None

    def bind(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool

    @property
    def num_jobs_in_flight(self) -> int:
        """Jobs sent to the workers and not yet reported by every rank."""
        return len(self._sent)

    def has_pending(self) -> bool:
        return bool(self._queued or self._sent)

    def holds_last_references(self) -> bool:
        """Whether some device block is kept from the free pool by a store alone
        (its request finished): it goes back when the store ends."""
        blocks = self._gpu_pool().blocks
        return any(blocks[i].ref_cnt == 1 for i in self._in_flight_gpu)

    # ------------------------------------------------------------ picking
    def picker(self) -> BlockPicker:
        """A picker for one batch, bounded by the CPU room stores are granted."""
        held = self._held_here if self.cpu.device_copies.drops else None
        return BlockPicker(self.room.grant(RoomKind.STORES), self._storable, held)

    def _storable(self, block: KVCacheBlock) -> bool:
        h = block.block_hash
        return (block.block_id not in self._in_flight_gpu
                and h not in self._in_flight_hashes and not self.cpu.holds(h))

    def _held_here(self, block: KVCacheBlock) -> bool:
        """The CPU tier holds ``block``'s hash in a block it could evict."""
        copy = self.cpu.cached_block(block.block_hash)
        return copy is not None and not copy.ref_cnt

    def queue(self, picker: BlockPicker) -> None:
        if not picker.blocks:
            return
        # Eviction happens here; blocks the policy found stored stay (see BlockPicker).
        # With spare_stores, only room that evicts no block the CPU tier alone holds.
        cpu_blocks = self.cpu.allocate(len(picker.blocks), keep=picker.passed,
                                       for_device_blocks=self.cpu.device_copies.spare_stores)
        if not cpu_blocks:
            return
        chosen = picker.blocks[:len(cpu_blocks)]
        gpu_ids = [b.block_id for b in chosen]
        hashes = [b.block_hash for b in chosen]
        from_free = []
        if picker.head_window:  # taken from the head of the device's free queue
            anchor = next_cached(chosen[-1], set(gpu_ids))
            from_free.append((chosen, anchor, picker.head_window))
        pin_ids(self._gpu_pool(), gpu_ids)
        self._in_flight_gpu.update(gpu_ids)
        self._in_flight_hashes.update(hashes)
        self._queued.append(_Store(gpu_ids, [b.block_id for b in cpu_blocks], hashes,
                                   picker.prompt_ends.intersection(hashes),
                                   from_free=from_free, free_order=[
                                       b.block_id for b in picker.free_order(len(chosen))]))

    def rescue(self, rescued: list[tuple[int, Any]], load: LoadSpec | None = None,
               hands: HandOvers | None = None) -> tuple[StoreSpec | None, LoadSpec | None]:
        """The copies of device blocks vLLM reuses in this step, (device block id, hash)
        each, before anything writes them (``device_copies`` ``drop``): one job sent
        ahead of the step's other copies, as far as the CPU tier has room, and, given
        ``hands`` (the loads' book), rescues into the CPU blocks of the step's ``load``
        once each has run (:mod:`~kvoffload_hal.scheduler.hand_over`): the load comes
        back in the order its blocks run. The device blocks are not pinned: their new
        requests hold them, and the workers copy them before writing them. Rescues
        homed by the step's lookups go first, into the blocks they took."""
        homed, homed_blocks = self.homes.take() if self.homes is not None else ([], [])
        wanted: dict[Any, int] = {}
        for gpu_id, h in rescued:
            if h not in self._in_flight_hashes and not self.cpu.holds(h):
                wanted.setdefault(h, gpu_id)
        if not wanted:
            return self._send_rescue(homed, homed_blocks, published=len(homed)), load
        room = self.room.grant(RoomKind.RESCUES, len(wanted))
        rescues = [Rescue(g, h) for h, g in wanted.items()]
        if load is None or hands is None:
            return self._send_rescue(homed + rescues[:room],
                                     homed_blocks + self.cpu.allocate(room),
                                     published=len(homed)), load
        fresh = self.cpu.allocate(room, for_device_blocks=True)  # evicting nothing
        plan = plan_hand_over(rescues, list(zip(load.cpu_blocks, load.gpu_blocks)),
                              len(fresh), before_forward=load.sync)
        fresh += self.cpu.allocate(min(room, len(plan.first)) - len(fresh))
        first = self._send_rescue(homed + plan.first[:len(fresh)], homed_blocks + fresh,
                                  published=len(homed))
        hand_overs = []
        for upto, pairs in plan.rounds:
            homes = [cpu_id for _, cpu_id in pairs]
            hands.hand_over(load.job_id, homes)
            self.cpu.drop(homes)  # their bytes go to the device; the load keeps its pin
            spec = self._send_rescue([r for r, _ in pairs], self.cpu.blocks(homes),
                                     handed_over=True)
            hand_overs.append(HandOver(upto, spec, hands.new_job_id()))
        return first, load._replace(cpu_blocks=[load.cpu_blocks[i] for i in plan.order],
                                    gpu_blocks=[load.gpu_blocks[i] for i in plan.order],
                                    hand_overs=tuple(hand_overs))

    def _send_rescue(self, rescues: list[Rescue], cpu_blocks: list[KVCacheBlock],
                     handed_over: bool = False, published: int = 0) -> StoreSpec | None:
        """A job copying ``rescues`` into ``cpu_blocks`` (pinned: the job unpins them);
        the first ``published`` of them are published already."""
        if not rescues:
            return None
        gpu_ids, hashes = [r.gpu_id for r in rescues], [r.block_hash for r in rescues]
        cpu_ids = [b.block_id for b in cpu_blocks]
        self._in_flight_gpu.update(gpu_ids)
        self._in_flight_hashes.update(hashes)
        store = _Store(gpu_ids, cpu_ids, hashes, pins_device=False, handed_over=handed_over,
                       published=published)
        return StoreSpec(self._sent.send(store), gpu_ids, cpu_ids)

    # ------------------------------------------------------- send, report
    def take_job(self) -> StoreSpec | None:
        """This step's queued stores as one job, or None."""
        if not self._queued:
            return None
        store = _Store([], [], [])
        for queued in self._queued:
            store.gpu_ids += queued.gpu_ids
            store.cpu_ids += queued.cpu_ids
            store.hashes += queued.hashes
            store.prompt_ends |= queued.prompt_ends
            store.from_free += queued.from_free
            store.free_order += queued.free_order
        self._queued.clear()
        return StoreSpec(self._sent.send(store), store.gpu_ids, store.cpu_ids)

    def on_report(self, job: int, report: JobReport) -> None:
        done = self._sent.report(job, report)
        if done is None:
            return  # every TP/PP rank must have copied its shard
        store = done.payload
        cpu_blocks = self.cpu.blocks(store.cpu_ids)
        early = store.published
        if done.tally.failed:
            logger.warning("store job %d failed on a rank; %d blocks not offloaded",
                           job, len(cpu_blocks))
            # Homed blocks were published at their lookup: no longer (a load of one
            # failed on the rank whose copy failed).
            self.cpu.drop([b.block_id for b, h in zip(cpu_blocks[:early], store.hashes)
                           if self.cpu.cached_block(h) is b])
        elif not store.abandoned:
            self.cpu.publish(cpu_blocks[early:], store.hashes[early:], store.prompt_ends)
            self.stats.record_store(len(cpu_blocks), rescued=not store.pins_device,
                                    handed_over=store.handed_over, for_lookups=early)
            self.tiers.on_published(cpu_blocks, store.hashes)  # written through
        self._release(store)

    # --------------------------------------------------------------- misc
    def reset(self) -> None:
        """Stores in flight finish but are not published; queued ones are dropped."""
        for store in self._sent.payloads():
            store.abandoned = True
        for store in self._queued:
            self._release(store)
        self._queued.clear()

    def _release(self, store: _Store) -> None:
        self.cpu.unpin_ids(store.cpu_ids)
        if store.pins_device:
            unpin_ids(self._gpu_pool(), store.free_order)
            for blocks, anchor, window in store.from_free:
                put_back(self._gpu_pool(), blocks, anchor, window)
        self._in_flight_gpu.difference_update(store.gpu_ids)
        self._in_flight_hashes.difference_update(store.hashes)

    def _gpu_pool(self) -> BlockPool:
        assert self.gpu_pool is not None, "bind() was not called"
        return self.gpu_pool


# ----------------------------------------------------------- the device's order
def next_cached(block: KVCacheBlock, skip: set[int]) -> Anchor:
    """The first block after ``block`` in the device's free queue that has a hash and is
    not in ``skip`` (ids), with that hash; None at the queue's end."""
    after = block.next_free_block
    while after is not None and after.block_id >= 0:
        if after.block_hash is not None and after.block_id not in skip:
            return after, after.block_hash
        after = after.next_free_block
    return None


def put_back(pool: BlockPool, blocks: list[KVCacheBlock], anchor: Anchor,
             window: int) -> None:
    """Device blocks a store took from the first ``window`` of the free queue
    (``free_blocks`` just appended them to its tail) go back where they were: right
    before ``anchor``, the cached block that followed them, or at the head where it left
    the queue (vLLM evicted it and would have evicted them first; or it is in use). So
    storing a block never changes when the device evicts it. The walk to ``anchor``
    stops after ``window`` blocks: they are put back there."""
    back = [b for b in blocks if not b.ref_cnt]  # a request took the others meanwhile
    if not back or anchor is None:  # no cached block followed them: the tail is theirs
        return
    block, block_hash = anchor
    ahead: list[KVCacheBlock] = []
    if block.ref_cnt == 0 and block.block_hash == block_hash:  # still cached, free
        returning = {b.block_id for b in back}
        for queued in vllm_compat.iter_free_blocks(pool.free_block_queue):
            if queued is block or len(ahead) >= window:
                break
            if queued.block_id not in returning:
                ahead.append(queued)
    queue = pool.free_block_queue
    for b in [*ahead, *back]:
        queue.remove(b)
    queue.prepend_n([*ahead, *back])
