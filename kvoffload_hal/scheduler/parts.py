"""The lifecycle every part of the scheduler side follows, called in one loop.

Runs in the scheduler process. :class:`~kvoffload_hal.scheduler.core.OffloadScheduler`
holds its parts (loads, staged hits, prefetch, the secondary tier's cascade) as a
tuple of :class:`RequestPart` and tells each of them every event; a part overrides
the hooks it needs. The order of the tuple is the order of the calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import KVConnectorOutput


class RequestPart:
    """No-op defaults for each event of a request's and a step's life."""

    def bind(self, gpu_pool: BlockPool) -> None:
        """The device's block pool, once, before the first step."""

    def on_lookup(self, req_id: str) -> None:
        """vLLM looks the request up (again): drop what was held for its last lookup."""

    def release_unallocated(self) -> None:
        """The step is scheduled: what was held for requests vLLM did not allocate goes."""

    def on_transfer_results(self, output: KVConnectorOutput) -> None:
        """What the workers reported this step, as vLLM collected it."""

    def request_finished(self, req_id: str) -> bool:
        """The request finished or was aborted: True while a copy still writes its
        device blocks (vLLM frees them later)."""
        return False

    def reset(self) -> None:
        """vLLM's prefix cache was reset (see docs/design.md, "Resetting the cache")."""

    def has_pending(self) -> bool:
        """Work in flight or queued that needs the engine to keep stepping."""
        return False
