"""Worker side: one per TP/PP rank, owns the host buffer and every copy.

:class:`~kvoffload_hal.worker.core.OffloadWorker` turns the scheduler's jobs
into copies through the HAL (:mod:`kvoffload_hal.hal`) and runs the worker half
of the secondary tier, if any (:mod:`kvoffload_hal.tiers`).
"""


def __getattr__(name: str):
    if name == "OffloadWorker":
        from kvoffload_hal.worker.core import OffloadWorker

        return OffloadWorker
    raise AttributeError(name)
