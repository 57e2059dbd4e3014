"""A tier's circuit breaker: a tier that stopped answering is skipped, then probed.

Every secondary tier has one (:class:`~.spill.SpillingTier`): a job or a read in flight
past the tier's wait, a request that waited its full wait, or, on a tier shared across
instances, :data:`MAX_ERRORS` jobs in a row that failed as a whole open it
(docs/design.md, "A chain of tiers").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvoffload_hal.logger import init_logger

logger = init_logger(__name__)

BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# Errors (a failed write or read reported by every key of a job) in a row that
# open the breaker: one failed job may be a single bad value, three are not.
MAX_ERRORS = 3


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(eq=False)
class CircuitBreaker:
    """Skips a tier that stopped answering, then probes it with one caller.

    **Closed**: the tier is used; a timeout opens the breaker at once, errors after
    ``max_errors`` in a row, and any success resets the count. **Open**: the tier is
    skipped (lookups miss at once, spills are not sent) for a backoff window, doubled at
    each reopening up to ``max_backoff_s``. **Half-open**: the window passed; one caller
    (the *probe*) goes through: its success closes the breaker, its failure or no answer
    within ``probe_timeout_s`` reopens it. Each transition is logged once and reported to
    ``on_transition(old, new)``.
    """

    label: str  # how log lines name the tier
    probe_timeout_s: float
    on_transition: Callable[[BreakerState, BreakerState], None] | None = None
    base_backoff_s: float = BASE_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    max_errors: int = MAX_ERRORS
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = field(default=BreakerState.CLOSED, init=False)
    backoff_s: float = field(default=0.0, init=False)  # the current (last) open window
    _since: float = field(default=0.0, init=False)  # when the current state began
    _errors: int = field(default=0, init=False)
    _probe: str | None = field(default=None, init=False)  # let through while half-open

    def __post_init__(self) -> None:
        self._since = self.clock()

    def allow(self, caller: str) -> bool:
        """Whether ``caller`` may use the tier now; an open breaker whose window
        passed lets this caller through as its probe (half-open)."""
        if self.state is BreakerState.CLOSED:
            return True
        if (self.state is BreakerState.HALF_OPEN
                and self.clock() - self._since > self.probe_timeout_s):
            self._open(f"the probe had no answer within {self.probe_timeout_s:g} s")
        if self.state is BreakerState.OPEN:
            if self.clock() - self._since < self.backoff_s:
                return False
            self._move(BreakerState.HALF_OPEN, "probing with one request")
        if self._probe is None:
            self._probe, self._since = caller, self.clock()
        return caller == self._probe

    def cancel(self, caller: str) -> None:
        """``caller`` was let through but sent nothing: the next caller probes instead."""
        if self.state is BreakerState.HALF_OPEN and self._probe == caller:
            self._probe = None

    def success(self) -> None:
        """The tier answered in time."""
        self._errors = 0
        if self.state is not BreakerState.CLOSED:
            self.backoff_s = 0.0
            self._probe = None
            self._move(BreakerState.CLOSED, "the tier answered")

    def timeout(self) -> None:
        """A request stopped waiting for the tier: opens the breaker now."""
        if self.state is not BreakerState.OPEN:
            self._open("a request waited its full timeout")

    def error(self) -> None:
        """A job failed as a whole (every key)."""
        if self.state is BreakerState.HALF_OPEN:
            self._open("the probe failed")
        elif self.state is BreakerState.CLOSED:
            self._errors += 1
            if self._errors >= self.max_errors:
                self._open(f"{self._errors} failed jobs in a row")

    def _open(self, why: str) -> None:
        self.backoff_s = (self.base_backoff_s if self.backoff_s == 0
                          else min(self.backoff_s * 2, self.max_backoff_s))
        self._errors = 0
        self._probe = None
        self._move(BreakerState.OPEN, f"{why}; skipped for {self.backoff_s:g} s")

    def _move(self, new: BreakerState, why: str) -> None:
        old, self.state, self._since = self.state, new, self.clock()
        log = logger.warning if new is BreakerState.OPEN else logger.info
        log("%s: circuit breaker %s -> %s (%s)", self.label, old.value, new.value, why)
        if self.on_transition is not None:
            self.on_transition(old, new)
