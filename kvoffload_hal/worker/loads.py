"""Worker side: what a finished load job tells vLLM and the scheduler side.

* A **synchronous** load feeds the forward pass of its step: its job is reported in
  the worker metadata, and on failure its device blocks, which vLLM recomputes.
* An **asynchronous** load is reported in ``finished_recving`` even when it failed,
  so its requests leave the waiting state; a failure names the device blocks
  (``get_block_ids_with_load_errors``) or, where this vLLM takes no blocks for the
  model, the requests (``failed_recving``, and the worker metadata).
* Where vLLM cannot recompute a failed asynchronous load at all (load recovery
  ``retry``), a failed attempt is withheld from vLLM and told to the scheduler side,
  which sends the load again.
* A **staged hit's round** (:mod:`kvoffload_hal.scheduler.secondary.staged`): an earlier round is
  reported in the worker metadata and a failure kept for the last round, which
  finishes the request, failed if any of its rounds failed or left blocks unfilled
  (with load recovery ``retry`` the engine stops instead: the hit was checked first).

How an asynchronous load's end is reported depends on the vLLM release and the
model: :meth:`~kvoffload_hal.capabilities.VllmStrategy.settle_load` and
:meth:`~kvoffload_hal.capabilities.VllmStrategy.settle_staged_hit` decide, and
report through this object's :class:`~kvoffload_hal.capabilities.LoadSink` methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvoffload_hal.metadata import JobReport, LoadSpec, OffloadWorkerMetadata

if TYPE_CHECKING:
    from kvoffload_hal.capabilities import Capabilities


class LoadOutcomes:
    """One worker's load results, until vLLM and the scheduler side collect them."""

    def __init__(self, caps: Capabilities) -> None:
        self.vllm = caps.vllm
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.error_blocks: set[int] = set()
        self._reported: set[str] = set()  # finish_once: until vLLM says they finished
        self._failed_rounds: dict[str, list[int]] = {}  # staged hits: until the last round

    def on_result(self, load: LoadSpec, job_id: int, ok: bool,
                  reports: OffloadWorkerMetadata) -> None:
        """``reports``: this step's worker metadata, to the scheduler side."""
        if load.staged:
            self._on_round(load, ok, reports)
        elif load.sync:
            # The requests are running: this step's output is dropped on failure.
            reports.loads[job_id] = JobReport(failed=not ok)
            if not ok:
                self.error_blocks.update(load.gpu_blocks)
        else:
            self.vllm.settle_load(self, load, ok, reports)

    def fail_unlaunched(self, load: LoadSpec, reports: OffloadWorkerMetadata) -> None:
        """``load`` fails without copying, and so do the rescues into its blocks."""
        for hand_over in load.hand_overs:
            reports.stores[hand_over.rescue.job_id] = JobReport(failed=True)
        self.on_result(load, load.job_id, False, reports)

    def take(self) -> tuple[set[str], set[str]]:
        """(finished, failed) requests since the last call."""
        finished, failed = self.finished, self.failed
        self.finished, self.failed = set(), set()
        return finished, failed

    def take_error_blocks(self) -> set[int]:
        errors, self.error_blocks = self.error_blocks, set()
        return errors

    def forget(self, finished_req_ids: set[str]) -> None:
        self._reported.difference_update(finished_req_ids)

    # ---------------------------------------------- LoadSink (capabilities.py)
    def finish(self, req_ids: Iterable[str]) -> None:
        self.finished.update(req_ids)

    def finish_once(self, req_ids: Iterable[str]) -> None:
        new = [q for q in req_ids if q not in self._reported]
        self.finished.update(new)
        self._reported.update(new)

    def fail_blocks(self, gpu_blocks: Iterable[int]) -> None:
        self.error_blocks.update(gpu_blocks)

    def fail_requests(self, req_ids: Iterable[str]) -> None:
        self.failed.update(req_ids)

    def _on_round(self, spec: LoadSpec, ok: bool, reports: OffloadWorkerMetadata) -> None:
        req_id = spec.req_ids[0]
        if not spec.final:
            reports.rounds[spec.job_id] = JobReport(failed=not ok)
            if not ok:
                self._failed_rounds.setdefault(req_id, []).extend(spec.gpu_blocks)
            return
        failed = [*spec.failed_gpu_blocks, *self._failed_rounds.pop(req_id, ())]
        if not ok:
            failed += spec.gpu_blocks
        self.vllm.settle_staged_hit(self, req_id, failed, reports)
