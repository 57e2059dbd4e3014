"""What ``scheduler_overhead.py`` measures and its report reads: the connectors'
names, the timed scheduler calls, one measured point and the timer.

Both modules import this one, and neither imports the other back.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["OURS", "TIMED", "UPSTREAM", "Point", "Timer"]

OURS, UPSTREAM = "HALOffloadConnector", "SimpleCPUOffloadConnector"
#: The connector's scheduler methods timed at each step.
TIMED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "request_finished_all_groups",
         "take_events", "get_kv_connector_stats")


@dataclass
class Point:
    """One connector at one (CPU blocks, live requests) size: its timed seconds and counts."""

    connector: str
    cpu_blocks: int
    live_requests: int
    steps: int
    connector_s: dict[str, float]
    calls: dict[str, int]
    loads: int = 0  # requests whose prefix came from the CPU tier
    stores: int = 0  # store jobs completed
    preemptions: int = 0
    finished: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def us_per_step(self) -> float:
        return sum(self.connector_s.values()) / self.steps * 1e6


class Timer:
    """Wraps an object's methods (a connector's scheduler calls, an eviction policy's
    hooks) in timers; nested calls count once (the outermost)."""

    def __init__(self, connector, names: tuple[str, ...] = TIMED) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self._depth = 0
        for name in names:  # every connector has them (KVConnectorBase_V1, SupportsHMA)
            setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.enabled or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self._depth -= 1
        return timed
