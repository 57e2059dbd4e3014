"""Worker side of a hand-over: a load whose CPU blocks take rescues as it runs.

The scheduler side (:mod:`kvoffload_hal.scheduler.hand_over`) orders a step's load so
that each rescue into the CPU blocks of the load sits between the part of the load that
read those blocks and the part that fills the device blocks it copies out. Here the load
runs part by part, waiting for every copy before and after each rescue (a copy backend
orders nothing between its jobs), and its result is told once, when its last part is
back: failed if any part failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvoffload_hal.hal import Direction, DmaCopyBackend, JobResult, TransferJob
from kvoffload_hal.logger import init_logger
from kvoffload_hal.metadata import LoadSpec, StoreSpec, TierJobs

logger = init_logger(__name__)


class LoadParts:
    """A load sent in parts (the tag of each): its result once every part is back."""

    def __init__(self, load: LoadSpec, parts: int) -> None:
        self.load = load
        self.left = parts
        self.ok = True

    def part_done(self, ok: bool) -> bool:
        """A part is back: True once it was the last."""
        self.ok = self.ok and ok
        self.left -= 1
        return self.left == 0


def launch_load(backend: DmaCopyBackend, load: LoadSpec,
                collect: Callable[[list[JobResult]], None]) -> None:
    """Submit ``load``, part by part with its rescues in between where it has some; the
    results of the copies waited for go to ``collect``. Its (last) part is left in flight."""
    if not load.hand_overs:
        backend.submit(TransferJob(load.job_id, Direction.LOAD, load.cpu_blocks,
                                   load.gpu_blocks, tag=load))
        return
    cuts = [h.upto for h in load.hand_overs] + [len(load.cpu_blocks)]
    starts = [0, *cuts[:-1]]
    job_ids = [load.job_id, *(h.next_job_id for h in load.hand_overs)]
    parts = LoadParts(load, sum(1 for start, end in zip(starts, cuts) if end > start))
    for i, (start, end, job_id) in enumerate(zip(starts, cuts, job_ids)):
        if end > start:
            backend.submit(TransferJob(job_id, Direction.LOAD, load.cpu_blocks[start:end],
                                       load.gpu_blocks[start:end], tag=parts))
        if i < len(load.hand_overs):
            collect(backend.flush())  # the part that read the rescue's CPU blocks
            rescue_now(backend, load.hand_overs[i].rescue, collect)  # before the next


def rescue_now(backend: DmaCopyBackend, rescue: StoreSpec,
               collect: Callable[[list[JobResult]], None]) -> None:
    """Copy ``rescue``'s device blocks out and wait for it (and every copy in flight)."""
    backend.submit(TransferJob(rescue.job_id, Direction.STORE, rescue.gpu_blocks,
                               rescue.cpu_blocks))
    collect(backend.flush())


def whole_load(result: JobResult, tag: LoadSpec | LoadParts,
               ) -> tuple[LoadSpec, JobResult] | None:
    """The load a copy's result is of, and the load's result: None for a part of a load
    in parts that is not its last one back."""
    if not isinstance(tag, LoadParts):
        return tag, result
    if not tag.part_done(result.ok):
        return None
    return tag.load, dataclasses.replace(result, job_id=tag.load.job_id, ok=tag.ok)


class Unfilled:
    """CPU blocks published at a lookup (scheduler/rescue_homes.py) whose rescue failed
    on this rank: a load that reads one fails here without copying, until a store, a
    rescue or a promotion fills the block again (the scheduler drops it once the
    failure is reported)."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def rescued(self, rescue: StoreSpec, ok: bool) -> None:
        if not ok:
            self._blocks.update(rescue.cpu_blocks)
        else:
            self.filled(rescue.cpu_blocks)

    def filled(self, cpu_blocks: list[int]) -> None:
        if self._blocks:
            self._blocks.difference_update(cpu_blocks)

    def promoted(self, jobs: Sequence[TierJobs]) -> None:
        """The step's promotions fill their CPU blocks anew."""
        for job in jobs:
            if job.promote is not None:
                self.filled([cpu_id for _, cpu_id in job.promote.items])

    def read_by(self, load: LoadSpec) -> bool:
        if not self._blocks or self._blocks.isdisjoint(load.cpu_blocks):
            return False
        logger.warning("load job %d reads CPU blocks whose rescue failed on this rank; "
                       "its %d blocks will be recomputed", load.job_id, len(load.gpu_blocks))
        return True
