"""Scheduler side: a CPU-tier load is not started into device room vLLM takes back next step.

Runs in the scheduler process, as one of the scheduler's parts
(:mod:`kvoffload_hal.scheduler.parts`).

vLLM admits a waiting request whenever the blocks of its prompt are free now; it
reserves nothing for the running requests' next blocks. On a nearly full device
the request admitted last is then the one vLLM preempts in the next step, when the
running requests cross into new blocks. For a CPU-tier hit that means a load whose
blocks are taken back one step later, a prefill step spent on a request that goes
back to the queue, and a batch whose requests no longer start and end together.

:class:`LoadRoom` answers a CPU-tier hit's lookup with "ask again later" (vLLM
keeps the request at the front of its queue) while the device's free blocks, less
the ones the request's prompt takes, would not cover the blocks that the running
requests and the request itself start in the next step. A request needs a block
in a step where it computes the first token of one: in the step after its
prefill, and every ``block_size`` decode steps after that. Requests that finish
this step are not counted; a chunked prefill counts as if it ended this step (the
size of its next chunk is the scheduler's to choose).

What bounds it: it never defers while no request runs (the running ones finish
and give their blocks back), nor one request for more than
:data:`MAX_DEFERRED_STEPS` lookups; it defers only CPU-tier hits (what vLLM
admits without a load stays vLLM's); and it applies to models with one KV cache
group (``defer_loads_without_room``, off by default: it changes the order in
which requests start; see README).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_hal.scheduler.parts import RequestPart

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

# A request is deferred for at most this many lookups (about as many steps), then
# admitted as vLLM would: requests admitted without a load could otherwise take
# the room it waits for, step after step.
MAX_DEFERRED_STEPS = 32


class LoadRoom(RequestPart):
    """Defers a CPU-tier hit's admission while the device has no room to keep it."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        self.block_size = block_size
        self.enabled = self.active = enabled
        self.gpu_pool: BlockPool | None = None
        self._running: dict[str, Request] = {}  # allocated on the device, not finished
        # The blocks the running requests start next step, summed once per step (their
        # tokens move on only between steps) and kept as requests come and go; None:
        # to be summed at the next lookup.
        self._needed: int | None = None
        self._deferred: dict[str, int] = {}  # request -> lookups deferred so far
        self.num_deferred = 0  # lookups deferred since start-up

    def bind(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool

    def release_unallocated(self) -> None:
        self._needed = None  # the step is scheduled: tokens move on before the next lookup

    def on_allocated(self, request: Request) -> None:
        if not self.enabled:
            return  # nothing to count for
        if self._needed is not None and request.request_id not in self._running:
            self._needed += _next_block(request, self.block_size)
        else:
            self._needed = None
        self._running[request.request_id] = request
        self._deferred.pop(request.request_id, None)

    def on_preempted(self, req_id: str) -> None:
        self._leaves(req_id)

    def request_finished(self, req_id: str) -> bool:
        self._leaves(req_id)
        self._deferred.pop(req_id, None)
        return False

    def _leaves(self, req_id: str) -> None:
        request = self._running.pop(req_id, None)
        if request is not None and self._needed is not None:
            self._needed -= _next_block(request, self.block_size)

    def defers(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether a CPU-tier hit of ``request`` (device prefix ``num_computed_tokens``)
        waits: admitted now, vLLM would preempt a request in the next step."""
        if not self.enabled or self.gpu_pool is None or not self._running:
            return False
        times = self._deferred.get(request.request_id, 0)
        if times >= MAX_DEFERRED_STEPS:
            return False
        size = self.block_size
        own = -(-request.num_tokens // size) - num_computed_tokens // size
        if self._needed is None:
            self._needed = sum(_next_block(r, size) for r in self._running.values())
        needed = _next_block(request, size) + self._needed
        if self.gpu_pool.get_num_free_blocks() - own >= needed:
            return False
        self._deferred[request.request_id] = times + 1
        self.num_deferred += 1
        return True


def _next_block(request: Request, block_size: int) -> int:
    """1 if the request starts a block in the step after this one: its tokens so far
    (prompt and output) fill whole blocks, so the token that step computes is the
    first of a new one; 0 if it finishes in this step."""
    if request.num_output_tokens + 1 >= request.max_tokens:
        return 0
    return int(request.num_tokens % block_size == 0)
