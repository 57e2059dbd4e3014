"""What ``long_doc_qa.py`` observes inside an engine: its steps (:func:`count_steps`),
and where an offloading engine's pass goes, the wall time of our connector's own calls
(:class:`ConnectorTime`).

The engine runs in-process (``kvoffload_hal.demo.inprocess``), so the scheduler side
and the worker side of ``HALOffloadConnector`` run on the benchmark's thread, between
vLLM's own work. :class:`ConnectorTime` wraps the connector's methods (on the class:
both roles) in timers while :meth:`ConnectorTime.measuring` is open, and sums them by
what they do:

* ``scheduler``: the scheduler calls (lookups, allocation, the step's metadata,
  reports, finishing requests, events and stats);
* ``rescues``: ``bind_connector_metadata``, where the step's rescues (``device_copies:
  drop``) are copied out and waited for, before the forward pass;
* ``loads``: ``start_load_kv``, where synchronous loads are copied and waited for,
  before the forward pass;
* ``after forward``: ``get_finished`` (``get_transfer_results`` on newer vLLM), where
  the step's stores and asynchronous loads are launched and collected; and the rest
  of the worker's calls (``handle_preemptions``, the worker's metadata).

A call made inside another timed call counts once, in the outer one. On vLLM's CPU
platform every copy is a ``memmove`` on a core the model also computes on, so this is
time the pass spends in the connector; on a GPU the copies would overlap compute.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from scheduler_overhead_points import Timer

GROUPS = {
    "scheduler": ("get_num_new_matched_tokens", "update_state_after_alloc",
                  "build_connector_meta", "update_connector_output", "request_finished",
                  "request_finished_all_groups", "take_events", "get_kv_connector_stats"),
    "rescues": ("bind_connector_metadata",),
    "loads": ("start_load_kv",),
    "after forward": ("get_finished", "get_transfer_results", "handle_preemptions",
                      "build_connector_worker_meta", "clear_connector_metadata"),
}


class ConnectorTime:
    """Seconds spent in ``cls``'s methods, by :data:`GROUPS`, while measuring."""

    def __init__(self, cls: type | None = None) -> None:
        if cls is None:
            from kvoffload_hal.connector import HALOffloadConnector as cls
        self.cls = cls
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def measuring(self) -> Iterator[ConnectorTime]:
        """Time the class's calls until the block ends; the class is as before after."""
        originals = {name: self.cls.__dict__[name] for names in GROUPS.values()
                     for name in names if name in self.cls.__dict__}
        timer = Timer(self.cls, tuple(originals))  # a nested call counts once, outermost
        timer.enabled = True
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(self.cls, name, fn)
            for group, names in GROUPS.items():
                for name in names:
                    if name in timer.seconds:
                        self.seconds[group] += timer.seconds[name]


def count_steps(llm) -> list[int]:
    """Count engine steps and scheduled tokens from now on: [steps, tokens]."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counter = [0, 0]
    schedule = scheduler.schedule
    trace = os.environ.get("LONG_DOC_QA_STEP_TRACE")

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            counter[0] += 1
            counter[1] += out.total_num_scheduled_tokens
        if trace:  # one line per step: time, scheduled tokens, running requests
            with open(trace, "a") as f:
                f.write(f"{time.perf_counter():.4f} {out.total_num_scheduled_tokens} "
                        f"{len(out.num_scheduled_tokens)} {len(scheduler.running)} "
                        f"{len(scheduler.waiting)}\n")
        return out

    scheduler.schedule = counting_schedule
    return counter
