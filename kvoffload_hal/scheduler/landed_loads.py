"""Requests whose asynchronous load landed, until vLLM picks them up (vLLM < 0.32).

Runs in the scheduler process, where the release's strategy says so
(``tracks_landed_loads``, :mod:`kvoffload_hal.capabilities`). vLLM 0.32 scans the
waiting requests that hold KV blocks first. Older releases stop their scan of the
waiting queue at the first request they cannot allocate: a request ahead of one whose
load landed, needing the device blocks that one holds, would stop the scan before it
every step. While such a request waits, every other lookup asks again later
(:meth:`LandedLoads.holds_up_lookups`), so the scan reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from kvoffload_hal.scheduler.parts import RequestPart

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class LandedLoads(RequestPart):
    """Requests answered with an asynchronous load, and those whose load landed."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._in_flight: dict[str, Request] = {}
        self._landed: dict[str, Request] = {}

    def note_async(self, request: Request) -> None:
        """The lookup answered ``request`` with an asynchronous load."""
        if self.active:
            self._in_flight[request.request_id] = request

    def holds_up_lookups(self) -> bool:
        """Whether a request whose load landed still waits for vLLM to pick it up."""
        if not self._landed:
            return False
        for req_id, request in list(self._landed.items()):
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self._landed[req_id]
        return bool(self._landed)

    def on_transfer_results(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            request = self._in_flight.pop(req_id, None)
            if request is not None:
                self._landed[req_id] = request

    def request_finished(self, req_id: str) -> bool:
        self._in_flight.pop(req_id, None)
        self._landed.pop(req_id, None)
        return False
