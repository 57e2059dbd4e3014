"""Rescues a lookup of the same step asks for: homed and published at that lookup.

Runs in the scheduler process, with ``device_copies: drop`` (docs/design.md, "One
cache"). vLLM looks its waiting requests up one at a time and allocates each before the
next, so a block the device hands out in a step may be the prefix of a request looked
up later in that step. Its rescue is sent with the step's metadata, after every lookup:
without more, that request finds the block in neither tier and recomputes it.

:class:`RescueHomes` lets such a lookup take the block from the CPU tier. Where the CPU
hit stops short, vLLM's lookup is asked again with the step's pending rescues as
stand-ins; if that hit is longer, the rescues it takes get fresh CPU blocks now, are
published under their hashes at once (pinned by the rescue), and go first in the step's
rescue job. The worker copies them in ``bind_connector_metadata``, before any load, and
fails a load that reads a block whose rescue failed on that rank (``Unfilled``,
:mod:`kvoffload_hal.worker.hand_over`).

Fresh CPU blocks may evict blocks only the CPU tier holds. Where a load of the step is
planned already, the step's hand-over (:mod:`~kvoffload_hal.scheduler.hand_over`) can
home the rescues in the CPU blocks of its loads instead. There a lookup homes only into
blocks that evict no such block, and a request whose hit wants more asks again next
step (``waits``): by then its blocks are in the CPU tier, or (asynchronous loads) on
their way, and it computes what is not there yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload_hal.scheduler.hand_over import Rescue
from kvoffload_hal.scheduler.room import RoomKind

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.room import CpuRoom


class _Pending(NamedTuple):
    """A pending rescue as vLLM's lookup sees it: a stand-in for a cached block."""

    gpu_id: int
    block_hash: Any
    is_null: bool = False


class RescueHomes:
    """The step's rescues homed at lookups: their CPU blocks, already published."""

    def __init__(self, cpu: CpuTier, room: CpuRoom) -> None:
        self.cpu = cpu
        self.room = room
        self._rescues: list[Rescue] = []
        self._blocks: list[KVCacheBlock] = []
        self.num_homed = 0

    def extend_hit(self, block_hashes: Sequence[Any], first: int, max_tokens: int,
                   hit: Hit, hit_tokens: int, lossless: Callable[[], bool] = lambda: False,
                   ) -> tuple[Hit, int, bool]:
        """The CPU hit from hash ``first`` on, made longer by homing the pending rescues
        that continue it (as far as the CPU tier has room; where ``lossless()``, room that
        evicts no block only the CPU tier holds), and whether the request waits for the
        rest."""
        pending = self.cpu.device_copies.pending
        if not pending or hit_tokens >= max_tokens:
            return hit, hit_tokens, False

        def stand_in(key: Any) -> _Pending | None:
            gpu_id = pending.get(key)
            return None if gpu_id is None else _Pending(gpu_id, key)

        longer, tokens = self.cpu.find_hit_with(block_hashes, first, max_tokens, stand_in)
        if tokens <= hit_tokens:
            return hit, hit_tokens, False
        by_position = sorted(((pos, g), b) for g, group in enumerate(longer)
                             for pos, b in enumerate(group) if isinstance(b, _Pending))
        held = {b.block_hash for group in longer for b in group
                if not isinstance(b, _Pending) and not b.is_null}
        spare_only = lossless()
        homed = self._home([b for _, b in by_position], held, spare_only)
        return (*self.cpu.find_hit(block_hashes, first, max_tokens),
                spare_only and homed < len(by_position))

    def _home(self, wanted: list[_Pending], keep: set[Any], lossless: bool) -> int:
        """Fresh CPU blocks for ``wanted``, first to last as far as there is room,
        published now; how many. They evict what any rescue would (blocks that evict
        nothing first, then, unless ``lossless``, the eviction policy's pick; the hit's
        own blocks last): the block a lookup asks for now is worth more than one that
        may be asked for later."""
        room = self.room.grant(RoomKind.RESCUES, len(wanted))
        blocks = self.cpu.allocate(room, keep=keep, for_device_blocks=lossless)
        rescues = [Rescue(b.gpu_id, b.block_hash) for b in wanted[:len(blocks)]]
        hashes = [r.block_hash for r in rescues]
        self.cpu.publish(blocks, hashes)
        self.cpu.device_copies.homed(hashes)
        self._rescues += rescues
        self._blocks += blocks
        self.num_homed += len(blocks)
        return len(blocks)

    def take(self) -> tuple[list[Rescue], list[KVCacheBlock]]:
        """The step's homed rescues and their CPU blocks (pinned), for its rescue job."""
        taken = self._rescues, self._blocks
        self._rescues, self._blocks = [], []
        return taken
