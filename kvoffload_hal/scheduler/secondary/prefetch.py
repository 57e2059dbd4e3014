"""Lookahead for waiting requests: secondary-tier blocks promoted before admission.

vLLM stops looking at its waiting queue while every running slot is taken, so a tier
hit would be promoted only at the request's lookup, and the request wait again. Each
step, :class:`Prefetcher` looks at the oldest waiting requests not yet looked up (up to
``prefetch_requests``) and starts, for the first one not seen before, the promotion its
own lookup would: the blocks stay pinned for it until vLLM looks it up, and so does
the CPU hit they extend. One request a step, the oldest first: the promotions of one
step are one job, published when its last block is read, so the next request's blocks
arrive first instead of all of them together.

Budget: what prefetched requests hold (blocks promoting, promoted, and the hits they
extend) stays within ``min(prefetch_blocks, prefetch_cpu_share x CPU blocks)``; all of
it is released at the request's lookup or when it finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from kvoffload_hal.scheduler.parts import RequestPart
from kvoffload_hal.scheduler.room import RoomKind

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from kvoffload_hal.config import OffloadConfig
    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.secondary.chain import TierChain


class NullPrefetcher(RequestPart):
    """No lookahead: the scheduler's calls, each doing nothing."""

    active = False

    def add(self, request: Request) -> None:
        """vLLM added ``request`` to its waiting queue."""

    def forget(self, req_id: str) -> None:
        """vLLM looked the request up, or it finished: release what it holds."""

    def on_lookup(self, req_id: str) -> None:
        self.forget(req_id)

    def request_finished(self, req_id: str) -> bool:
        self.forget(req_id)
        return False

    def step(self) -> None:
        """Queue promotions for the requests next in line (once per engine step)."""

    def num_held_blocks(self) -> int:
        """CPU blocks held for prefetched requests not yet looked up."""
        return 0


class Prefetcher(NullPrefetcher):
    active = True

    def __init__(self, cpu: CpuTier, tiers: TierChain, block_size: int,
                 stats: StatsLedger, max_requests: int, max_blocks: int) -> None:
        self.cpu = cpu
        self.tiers = tiers
        self.block_size = block_size
        self.stats = stats
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        # Added and neither looked up nor finished, in arrival order.
        self._waiting: dict[str, Request] = {}
        # Requests looked at: the CPU hit pinned for each (empty if nothing was queued).
        self._seen: dict[str, list[KVCacheBlock]] = {}
        # Blocks one promotion needs at least: one per KV cache group of a position.
        self._min_blocks = max(1, len(cpu.group_block_sizes))

    def add(self, request: Request) -> None:
        self._waiting[request.request_id] = request

    def forget(self, req_id: str) -> None:
        if self._waiting.pop(req_id, None) is not None and (hit := self._seen.pop(req_id, None)):
            self.cpu.unpin(hit)

    def reset(self) -> None:
        """vLLM's prefix cache was reset: the CPU hits held for waiting requests are let
        go (their hashes are dropped); a request still waiting is looked at again."""
        for hit in self._seen.values():
            if hit:
                self.cpu.unpin(hit)
        self._seen.clear()

    def num_held_blocks(self) -> int:
        return sum(self.tiers.held_for(req_id) + len(hit)
                   for req_id, hit in self._seen.items())

    def step(self) -> None:
        """Prefetch the first request of the window not looked at yet, within the budget."""
        if not self._waiting:
            return
        left = self.max_blocks - self.num_held_blocks()
        ahead = 0
        for req_id, request in self._waiting.items():
            if ahead >= self.max_requests or left < self._min_blocks:
                return
            if request.status != RequestStatus.WAITING or request.num_computed_tokens:
                continue  # not admissible yet (remote KV, grammar), or already scheduled
            ahead += 1
            if req_id not in self._seen and self._prefetch(request, left):
                return  # one request a step (see the module docstring)

    def _prefetch(self, request: Request, budget: int) -> int:
        """Queue the promotion of the request's tier blocks after its CPU hit, within
        ``budget`` blocks held; the blocks now held for it."""
        req_id = request.request_id
        # As the request's own lookup: the last prompt token is always computed.
        max_hit_tokens = request.num_tokens - 1
        if (request.skip_reading_prefix_cache or max_hit_tokens < self.block_size
                or not request.block_hashes):
            self._seen[req_id] = []
            return 0
        hit, hit_tokens = self.cpu.find_hit(request.block_hashes, 0, max_hit_tokens)
        hit_blocks = [b for group in hit for b in group if not b.is_null]
        room = budget - len(hit_blocks)
        if room < self._min_blocks:
            return 0  # looked at again once prefetched requests release blocks
        free_before = self.cpu.num_free_blocks()
        queued = self.tiers.lookup(request, hit, hit_tokens // self.block_size,
                                     max_hit_tokens // self.block_size, RoomKind.PREFETCH,
                                     max_blocks=room)
        # A promotion takes fresh CPU blocks; a lookup changes the free count otherwise
        # only when none were free (it then waits for room, holding nothing new).
        promoted = free_before - self.cpu.num_free_blocks()
        held = self.tiers.held_for(req_id)
        if queued and not held:
            # A shared tier's existence query, or another request's promotion of these
            # blocks, is in flight: looked at again next step, when it has answered.
            return 0
        if not queued:
            self._seen[req_id] = []
            return held
        self.cpu.pin(hit_blocks)
        self._seen[req_id] = hit_blocks
        if promoted > 0:
            self.stats.record_prefetch(promoted)
        return held + len(hit_blocks)


def build_prefetcher(config: OffloadConfig, cpu: CpuTier, tiers: TierChain, block_size: int,
                     stats: StatsLedger) -> NullPrefetcher:
    """The lookahead configured, or :class:`NullPrefetcher` where it has nothing to do."""
    cap = int(config.prefetch_cpu_share * cpu.num_blocks)
    if config.prefetch_blocks:
        cap = min(cap, config.prefetch_blocks)
    if not tiers or config.prefetch_requests <= 0 or cap <= 0:
        return NullPrefetcher()
    return Prefetcher(cpu, tiers, block_size, stats, config.prefetch_requests, cap)
