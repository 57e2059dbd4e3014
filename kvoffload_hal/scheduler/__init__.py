"""Scheduler side: decides which blocks move; never touches a device.

:class:`~kvoffload_hal.scheduler.core.OffloadScheduler` wires the CPU tier
(:mod:`.cpu_tier`, vLLM's own ``BlockPool``), its eviction order
(:mod:`.eviction`), the choice of blocks to store (:mod:`.store_policy`) and
the jobs that move them (:mod:`.load_jobs`, :mod:`.store_jobs`, both counted
with :mod:`.jobs`).
"""


def __getattr__(name: str):
    # Lazy: the tiers' scheduler halves import .jobs without the whole scheduler.
    if name == "OffloadScheduler":
        from kvoffload_hal.scheduler.core import OffloadScheduler

        return OffloadScheduler
    raise AttributeError(name)
