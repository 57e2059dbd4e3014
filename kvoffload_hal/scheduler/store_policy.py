"""Which device blocks to copy to the CPU tier, and when.

Two policies behind one interface (:class:`StorePolicy`):

* **eager** (default): every full block of a running request is stored once
  the step that computed it has finished, including the last full block of a
  request that finishes in that same step. A step stores at most as many
  blocks as the CPU tier has free; blocks of a finished request left over are
  stored in the next steps, while the device still holds them (same hash);
* **lazy**: only the device blocks next in line for eviction (the head of the
  device pool's free queue) are stored, a window of about two steps' worth of
  allocations.

A policy only *chooses*: it offers device blocks to a :class:`BlockPicker`,
which keeps those worth storing (hashed, not stored already, not in flight)
up to the number of free CPU blocks. Allocation, pinning and job tracking are
the scheduler's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec

from kvoffload_hal import vllm_compat

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class BlockPicker:
    """Device blocks chosen for one store job, at most ``budget`` of them.

    ``held``: whether the CPU tier holds a block's hash in a block it could evict.
    Such a block offered is one the job must not evict to make room (the device
    may let go of it before the policy looks again): it is kept in ``passed`` and
    takes one block off the budget, so a job never evicts what it just found
    stored (a window of device blocks larger than the CPU tier would otherwise
    store and evict its own blocks in turn, step after step).
    """

    def __init__(self, budget: int, wanted: Callable[[KVCacheBlock], bool],
                 held: Callable[[KVCacheBlock], bool] | None = None) -> None:
        self.budget = budget
        self._wanted = wanted
        self._held = held
        self.blocks: list[KVCacheBlock] = []
        self._hashes: set[Any] = set()
        self.passed: set[Any] = set()
        # Hashes of kept blocks that end their request's prompt exactly (see
        # Eviction.on_prompt_ends): only a longer prompt can read them.
        self.prompt_ends: set[Any] = set()
        # > 0: the blocks offered are the first ``head_window`` of the device's free queue
        # (lazy); they go back there once stored (store_jobs.put_back).
        self.head_window = 0
        # Where each run of :attr:`blocks` offered together (one request's blocks of one
        # KV cache group, in block order) starts: see :meth:`free_order`.
        self._run_starts: list[int] = []

    @property
    def full(self) -> bool:
        return len(self.blocks) >= self.budget

    def offer(self, block: KVCacheBlock, prompt_end: bool = False) -> None:
        """Keep ``block`` if it is hashed, new to this job and ``wanted``; ``prompt_end``:
        its last token is its request's last prompt token (see :attr:`prompt_ends`)."""
        self.offer_ids((block,), (0,), 0, 1, 0 if prompt_end else -1)

    def offer_ids(self, blocks: Sequence[KVCacheBlock], ids: Sequence[int], start: int,
                  stop: int, prompt_end: int = -1) -> int:
        """:meth:`offer` ``blocks[ids[i]]`` for ``i`` from ``start`` until ``stop`` or
        :attr:`full`, ``i == prompt_end`` ending the prompt; returns the ``i`` reached.
        (One loop, for every block a step offers.)"""
        kept, kept_hashes, passed = self.blocks, self._hashes, self.passed
        wanted, held = self._wanted, self._held
        first_kept = len(kept)
        i = start
        while i < stop and len(kept) < self.budget:
            block = blocks[ids[i]]
            h = block.block_hash
            if block.is_null or h is None or h in kept_hashes or h in passed:
                pass
            elif wanted(block):
                kept.append(block)
                kept_hashes.add(h)
                if i == prompt_end:
                    self.prompt_ends.add(h)
            elif held is not None and held(block):
                passed.add(h)
                self.budget -= 1
            i += 1
        if len(kept) > first_kept:
            self._run_starts.append(first_kept)
        return i

    def free_order(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks kept, in the order vLLM frees a finished request's
        blocks: each run offered together deepest first (the device evicts a prefix
        from its end). Blocks offered one by one (lazy) keep their order."""
        bounds = [*(start for start in self._run_starts if start < n), n]
        return [b for lo, hi in zip(bounds, bounds[1:]) for b in reversed(self.blocks[lo:hi])]


class StorePolicy(ABC):
    """Chooses device blocks to store; see the module docstring."""

    gpu_pool: BlockPool | None = None

    def bind(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool

    @abstractmethod
    def select(self, scheduler_output: SchedulerOutput, picker: BlockPicker) -> None:
        """Offer this step's candidates, before the step runs."""

    def on_allocated(self, request: Request, num_groups: int) -> None:
        """``request`` got device blocks (every scheduling of it, new or resumed)."""

    def on_preempted(self, req_id: str) -> None:
        """``req_id`` lost its device blocks; it restarts with a fresh block table."""

    def on_finished(self, request: Request, block_ids: Sequence[list[int]],
                    picker: BlockPicker) -> None:
        """``request`` finished with these device blocks (per group); last chance to offer."""

    def reset(self) -> None:
        """The CPU tier was emptied: blocks offered before may be offered again."""

    def has_pending(self) -> bool:
        """Blocks still to offer in later steps, with no request left to step for."""
        return False


@dataclass
class _Cursor:
    """A running request's device blocks and how many of each group were offered.

    ``next_boundary`` is the confirmed-token count at which some group gets a
    full block not yet offered; below it a step has nothing to look at.
    """

    request: Request
    block_ids: list[list[int]]
    num_scanned: list[int] = field(default_factory=list)
    next_boundary: int = 0

    def rewind(self, forget_blocks: bool) -> None:
        if forget_blocks:
            self.block_ids = [[] for _ in self.block_ids]
        self.num_scanned = [0] * len(self.block_ids)
        self.next_boundary = 0


class EagerPolicy(StorePolicy):
    """Store every full block once computed."""

    def __init__(self, group_block_sizes: Sequence[int], cacheable_groups: Sequence[int],
                 ) -> None:
        self.group_block_sizes = list(group_block_sizes)
        self.cacheable_groups = list(cacheable_groups)
        self._cursors: dict[str, _Cursor] = {}
        # Requests with a block to offer at a step that gives them no device block.
        self._due: set[str] = set()
        # (device block id, its hash) of finished requests, not stored for want of room.
        self._leftovers: deque[tuple[int, Any]] = deque()

    def bind(self, gpu_pool: BlockPool) -> None:
        super().bind(gpu_pool)
        # Leftovers older than one device pool's worth are evicted by now.
        self._leftovers = deque(maxlen=len(gpu_pool.blocks))

    def on_allocated(self, request: Request, num_groups: int) -> None:
        if request.request_id not in self._cursors:
            self._cursors[request.request_id] = _Cursor(
                request, [[] for _ in range(num_groups)], [0] * num_groups)

    def on_preempted(self, req_id: str) -> None:
        cursor = self._cursors.get(req_id)
        if cursor is not None:
            cursor.rewind(forget_blocks=True)
            self._due.discard(req_id)  # due again with the blocks it resumes with

    def select(self, scheduler_output: SchedulerOutput, picker: BlockPicker) -> None:
        # Runs every step: only requests that got device blocks, or still have one
        # to offer (see _still_due), are looked at.
        if self._leftovers:
            self._offer_leftovers(picker)  # first: the device may evict them any time
        due = self._due
        for new_req in scheduler_output.scheduled_new_reqs:
            if self._grow(new_req.req_id, new_req.block_ids):
                self._look(new_req.req_id, picker)
        cached = scheduler_output.scheduled_cached_reqs
        grown = cached.new_block_ids
        if any(grown):
            for req_id, new_block_ids in zip(compress(cached.req_ids, grown),
                                             filter(None, grown)):
                self._grow(req_id, new_block_ids)
        if due:
            for req_id in [r for r in cached.req_ids if r in due]:
                self._look(req_id, picker)

    def _grow(self, req_id: str, new_block_ids: Sequence[list[int]] | None) -> bool:
        """Add the device blocks the request got this step; whether it has a cursor."""
        cursor = self._cursors.get(req_id)
        if cursor is None:
            return False
        if new_block_ids:
            for ids, new_ids in zip(cursor.block_ids, new_block_ids):
                if new_ids:
                    ids.extend(new_ids)
            self._due.add(req_id)
        return True

    def _look(self, req_id: str, picker: BlockPicker) -> None:
        """Offer the request's blocks confirmed full since it was last looked at."""
        cursor = self._cursors[req_id]
        request = cursor.request
        # Built before the step runs: num_computed_tokens counts only KV
        # written by earlier steps, which have finished.
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        if confirmed >= cursor.next_boundary:
            self._offer(cursor, cursor.block_ids, confirmed, picker)
        if not self._still_due(cursor):
            self._due.discard(req_id)

    def on_finished(self, request: Request, block_ids: Sequence[list[int]],
                    picker: BlockPicker) -> None:
        cursor = self._cursors.pop(request.request_id, None)
        self._due.discard(request.request_id)
        if cursor is not None:
            # The request's last full block may have been computed in this very
            # step: offer it now, from the final block table, or it is lost.
            self._offer(cursor, block_ids, request.num_computed_tokens, picker)
            self._keep_leftovers(cursor, block_ids, request.num_computed_tokens)

    def reset(self) -> None:
        for cursor in self._cursors.values():
            cursor.rewind(forget_blocks=False)
        self._due.update(self._cursors)
        self._leftovers.clear()

    def has_pending(self) -> bool:
        return bool(self._leftovers)

    def _keep_leftovers(self, cursor: _Cursor, block_ids: Sequence[list[int]],
                        confirmed_tokens: int) -> None:
        """Remember the full blocks a finished request could not offer (the picker was full)."""
        assert self.gpu_pool is not None, "bind() was not called"
        blocks = self.gpu_pool.blocks
        for g in self.cacheable_groups:
            ready = self._num_ready(block_ids[g], g, confirmed_tokens)
            for block_id in block_ids[g][cursor.num_scanned[g]:ready]:
                block_hash = blocks[block_id].block_hash
                if block_hash is not None:
                    self._leftovers.append((block_id, block_hash))

    def _offer_leftovers(self, picker: BlockPicker) -> None:
        assert self.gpu_pool is not None, "bind() was not called"
        blocks = self.gpu_pool.blocks
        while self._leftovers and not picker.full:
            block_id, block_hash = self._leftovers.popleft()
            block = blocks[block_id]
            if block.block_hash == block_hash:  # not evicted since its request finished
                picker.offer(block)

    def _still_due(self, cursor: _Cursor) -> bool:
        """Whether a block the request was not offered is before its group's last: a
        token past it was scheduled, so it fills with no new device block. A block
        found full is never its group's last (the step that finds it full schedules a
        token past it, which allocates the group's next block), so a request not due
        is looked at again when it gets a device block."""
        return any(cursor.num_scanned[g] + 1 < len(cursor.block_ids[g])
                   for g in self.cacheable_groups)

    def _num_ready(self, ids: Sequence[int], group: int, confirmed_tokens: int) -> int:
        """Device blocks of ``ids`` full of confirmed tokens."""
        return min(len(ids), confirmed_tokens // self.group_block_sizes[group])

    def _offer(self, cursor: _Cursor, block_ids: Sequence[list[int]], confirmed_tokens: int,
               picker: BlockPicker) -> None:
        assert self.gpu_pool is not None, "bind() was not called"
        blocks = self.gpu_pool.blocks
        prompt_len = cursor.request.num_prompt_tokens
        for g in self.cacheable_groups:
            ids = block_ids[g]
            ready = self._num_ready(ids, g, confirmed_tokens)
            # The block whose last token is the prompt's last one, if any.
            prompt_end, rest = divmod(prompt_len, self.group_block_sizes[g])
            prompt_end = prompt_end - 1 if rest == 0 else -1
            cursor.num_scanned[g] = picker.offer_ids(
                blocks, ids, cursor.num_scanned[g], ready, prompt_end)
        cursor.next_boundary = min(
            ((cursor.num_scanned[g] + 1) * self.group_block_sizes[g]
             for g in self.cacheable_groups), default=1 << 62)


class LazyPolicy(StorePolicy):
    """Store the device blocks next in line for eviction (the free queue's head)."""

    def __init__(self, window_blocks: int) -> None:
        self.window_blocks = window_blocks

    def select(self, scheduler_output: SchedulerOutput, picker: BlockPicker) -> None:
        if self.gpu_pool is None:
            return
        picker.head_window = self.window_blocks
        free_queue = vllm_compat.iter_free_blocks(self.gpu_pool.free_block_queue)
        for n, block in enumerate(free_queue):
            if n >= self.window_blocks or picker.full:
                break
            picker.offer(block)


def lazy_window_blocks(kv_cache_config: KVCacheConfig, max_num_batched_tokens: int) -> int:
    """Device blocks to keep offloaded ahead of eviction: two steps' worth of allocations.

    Per group, one step allocates at most: two blocks for Mamba state, the
    window plus one for sliding-window attention, and a batch's tokens for
    full attention.
    """
    target = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            target += 2
        elif isinstance(spec, SlidingWindowSpec):
            target += cdiv(spec.sliding_window, spec.block_size) + 1
        else:
            target += cdiv(max_num_batched_tokens, spec.block_size)
    return 2 * target
