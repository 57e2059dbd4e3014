"""The lifecycle every part of the scheduler side follows, called in one loop.

Runs in the scheduler process. :class:`~kvoffload_hal.scheduler.core.OffloadScheduler`
holds its parts (loads, staged hits, prefetch, the chain of secondary tiers, the load
room) as :class:`Parts` and tells each of them every event; a part overrides the hooks it
needs. The order of the parts is the order of the calls. A part whose feature is off
(``active`` false) and a hook a part does not override cost nothing per call: they are
left out when the parts are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import KVConnectorOutput


class RequestPart:
    """No-op defaults for each event of a request's and a step's life."""

    active = True  # False: the part's feature is off, and none of its hooks is called

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


_HOOKS = ("bind", "on_lookup", "release_unallocated", "on_transfer_results",
          "request_finished", "reset", "has_pending")


class Parts:
    """For each hook, the active parts' own implementations of it, in the parts' order."""

    def __init__(self, parts: tuple[RequestPart, ...]) -> None:
        active = [part for part in parts if part.active]
        for hook in _HOOKS:
            default = getattr(RequestPart, hook)
            setattr(self, hook, tuple(getattr(part, hook) for part in active
                                      if getattr(type(part), hook) is not default))
