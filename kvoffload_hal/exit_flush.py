"""Connector, scheduler role: an engine that goes idle finishes its last writes, within a bound.

The last stores of a finished request, and their spills to a secondary tier, are
planned when it finishes and done over the engine's next steps. An engine with no
request left steps only while something asks it to, and a process that stops
(a script whose last ``generate`` returned, a server given SIGTERM or SIGINT)
drains only while the engine core has work. So the connector keeps an idle engine
stepping while writes are pending, for at most ``shutdown_flush_timeout_s``
after its last request finished:

* vLLM >= 0.32 asks :meth:`ExitFlush.steps_for_writes` through
  ``has_pending_push_work``: the engine core steps while it is true, also in its
  shutdown, before it stops the workers;
* older vLLM (:meth:`~kvoffload_hal.capabilities.VllmStrategy.holds_last_request`)
  steps an idle engine only for a finished request whose blocks a
  connector still holds, so the request that finished last is held
  (``request_finished`` answers that its blocks are freed later) while writes
  are pending, and released to the workers, who report it in
  ``finished_sending``, once none is or the bound has passed. Only one request is
  held at a time, only with a tier that outlives the server (what the CPU tier
  holds dies with it anyway), and only where the engine core runs its own loop
  (its own process: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` no step runs
  between two ``generate`` calls, and a held request would only keep its device
  blocks until the next one).

What is still being written when the workers stop gets the same bound there
(:meth:`~kvoffload_hal.tiers.spec.SecondaryTier.shutdown`); a write
unfinished then is dropped whole, never left half-written.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload_hal.capabilities import VllmStrategy

# The engine core's process as vLLM names it ("EngineCore", "EngineCore_DP<n>").
ENGINE_CORE_PROCESS = "EngineCore"


def engine_core_steps_by_itself() -> bool:
    """Whether this scheduler runs in an engine core process with its own busy loop."""
    return multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS)


class ExitFlush:
    """Keeps an idle engine stepping for its last writes; see the module docstring."""

    def __init__(self, bound_s: float, holds_requests: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``holds_requests``: hold the last finished request (see the module docstring)."""
        self.bound_s = bound_s
        self.holds_requests = holds_requests
        self._clock = clock
        self._idle_since = clock()  # start-up counts as the end of a request
        self._held: str | None = None
        self._release: list[str] = []

    @classmethod
    def for_engine(cls, bound_s: float, secondary_tier: bool, vllm: VllmStrategy) -> ExitFlush:
        """``secondary_tier``: a tier that can outlive the server runs behind the CPU tier."""
        holds = secondary_tier and vllm.holds_last_request() and engine_core_steps_by_itself()
        return cls(bound_s, holds)

    def within_bound(self) -> bool:
        return self._clock() - self._idle_since <= self.bound_s

    def steps_for_writes(self, pending: bool) -> bool:
        """Whether pending writes keep the engine stepping (``has_pending_push_work``)."""
        return pending and self.within_bound()

    def on_finished(self, req_id: str, delayed: bool, pending: bool) -> bool:
        """A request finished; ``delayed``: its blocks are already freed later (a load
        in flight). Returns whether vLLM frees its blocks later."""
        self._idle_since = self._clock()
        if delayed or not (self.holds_requests and pending and self.bound_s > 0):
            return delayed
        if self._held is not None:
            self._release.append(self._held)  # the newer one keeps the engine stepping
        self._held = req_id
        return True

    def take_released(self, pending: bool) -> tuple[str, ...]:
        """Held requests vLLM may free now: the writes are done, or the bound passed."""
        if self._held is not None and not (pending and self.within_bound()):
            self._release.append(self._held)
            self._held = None
        released, self._release = tuple(self._release), []
        return released

    @property
    def held(self) -> str | None:
        return self._held
