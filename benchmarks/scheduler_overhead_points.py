"""What ``scheduler_overhead.py`` measures and its report reads: the connectors'
names, the timed scheduler calls and one measured point.

Both modules import this one, and neither imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OURS", "TIMED", "UPSTREAM", "Point"]

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
