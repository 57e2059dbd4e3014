"""Scheduler side: decides which blocks move; never touches a device.

Runs in the scheduler process. :class:`~kvoffload_hal.scheduler.core.OffloadScheduler`
wires the CPU tier (:mod:`.cpu_tier`, vLLM's own ``BlockPool``, with its eviction
policy from :mod:`kvoffload_hal.eviction`), the choice of blocks to store
(:mod:`.store_policy`), the jobs that move them (:mod:`.load_jobs`,
:mod:`.store_jobs`, both counted with :mod:`.jobs`) and the scheduler half of the
secondary tier (:mod:`.secondary`).
"""


def __getattr__(name: str):
    # Lazy: importing .secondary or .jobs does not import the whole scheduler.
    if name == "OffloadScheduler":
        from kvoffload_hal.scheduler.core import OffloadScheduler

        return OffloadScheduler
    raise AttributeError(name)
