"""CPU->device load jobs, from a CPU hit to its release: the one book of every load.

Runs in the scheduler process. Plain loads are planned here; a staged hit's rounds
(:mod:`~kvoffload_hal.scheduler.secondary.staged`) are load jobs of the same book: one id
sequence (the workers' copy queues go by job id), one count of rank reports, one set of
*busy* CPU blocks, one set of requests whose load failed, one device pool.

A load goes through four states:

1. **held**: ``get_num_new_matched_tokens`` found a CPU hit and pinned it, so
   eviction cannot take it before vLLM allocates the request's device blocks;
2. **planned**: ``update_state_after_alloc`` took the prefix vLLM accepted, and
   pinned those CPU blocks and the device blocks they are copied into;
3. **sent**: the step's planned loads become one job in the metadata;
4. **over**: an asynchronous load is over when the workers report its requests
   in ``finished_recving``; a synchronous one when every rank reported its job.
   A successful load counts as a CPU-tier use; a failed one drops the CPU
   copies (a retry would fail the same way). Both pins go.

**One copy per block.** vLLM caches an asynchronously loaded request's device
blocks only once its load is over, so a second request on the same prefix
would see no device hit and copy the same CPU blocks again, into blocks of its
own. A CPU block being loaded is therefore *busy* (:meth:`LoadJobs.busy`): a
request whose hit needs one waits (the scheduler answers ``None``), and takes
the device prefix-cache hit once the first load has landed. A landed load's
blocks stay busy until the scheduler's next step has cached them on the
device; a load whose request was aborted or whose copy failed leaves them to
the next request's own hit or recompute.

A failed load is recomputed by vLLM. Where vLLM cannot be told per request
(vLLM < 0.32, a model with several KV cache groups; see
:meth:`~kvoffload_hal.capabilities.VllmStrategy.on_failed_loads`), the load is sent again
(the workers withhold a failed request from ``finished_recving``), and after
:data:`MAX_LOAD_ATTEMPTS` the engine stops with an error, before any of its
blocks is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from vllm.utils.math_utils import cdiv

from kvoffload_hal.capabilities import LoadFailedError
from kvoffload_hal.metadata import JobReport, LoadSpec
from kvoffload_hal.scheduler.cpu_tier import Hit, pin_ids, unpin_ids
from kvoffload_hal.scheduler.jobs import JobBook
from kvoffload_hal.scheduler.parts import RequestPart

MAX_LOAD_ATTEMPTS = 3


if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput

    from kvoffload_hal.capabilities import VllmStrategy
    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier


@dataclass
class _Load:
    """A CPU->device copy for one request; both block lists stay pinned until it ends."""

    gpu_ids: list[int]
    cpu_ids: list[int]
    num_tokens: int
    job_id: int | None = None  # None until sent to the workers
    attempts: int = 0


@dataclass(frozen=True)
class RoundJob:
    """A staged hit's round: the CPU blocks it reads, and who is told when every rank
    reported it (``on_done(job, ok)``)."""

    req_id: str
    cpu_blocks: list[KVCacheBlock]
    on_done: Callable[[RoundJob, bool], None]


class _PendingHit(NamedTuple):
    """A CPU hit found by a lookup, pinned until the request's allocation."""

    blocks: Hit
    num_computed_tokens: int


class LoadJobs(RequestPart):
    def __init__(self, cpu: CpuTier, stats: StatsLedger, world_size: int,
                 sync_loads: bool, vllm: VllmStrategy) -> None:
        """``vllm``: what this vLLM does with a failed load (see the module docstring)."""
        self.cpu = cpu
        self.stats = stats
        self.sync_loads = sync_loads
        self.vllm = vllm
        self._failed: set[str] = set()  # reported failed by some rank, not finished yet
        self.gpu_pool: BlockPool | None = None
        self._pending_hits: dict[str, _PendingHit] = {}
        self._loads: dict[str, _Load] = {}
        # Reported by every rank: synchronous jobs, staged rounds (asynchronous: per request).
        self._jobs: JobBook[list[str] | RoundJob] = JobBook(world_size)
        # CPU blocks a planned or unreported load reads, and those of loads that
        # ended since the last step (the device caches them in the next one).
        self._busy: Counter[int] = Counter()
        self._landed: list[list[int]] = []
        self._waiting: set[str] = set()  # requests that waited for another's load
        # Requests whose load failed: vLLM looks them up again, and a hit from a slower
        # tier would be copied, and fail, again (a device that fails every load).
        self.failed_requests: set[str] = set()

    def bind(self, gpu_pool: BlockPool) -> None:
        self.gpu_pool = gpu_pool

    # ------------------------------------------- the book other loads share
    def new_job_id(self) -> int:
        """An id for a load whose end comes as ``finished_recving``, not as reports."""
        return self._jobs.new_id()

    def send_round(self, round_job: RoundJob) -> int:
        """A staged round's id; ``round_job.on_done`` once every rank reported it."""
        return self._jobs.send(round_job)

    def hand_over(self, job_id: int, cpu_ids: list[int]) -> None:
        """Job ``job_id``'s CPU blocks ``cpu_ids`` go to a rescue once read (scheduler/
        hand_over.py), with their pins: not busy, nor counted as loaded, here."""
        for load in (ld for ld in self._loads.values() if ld.job_id == job_id):
            load.cpu_ids = [b for b in load.cpu_ids if b not in cpu_ids]
        self.release_busy(cpu_ids)

    def hold_busy(self, block_ids: Iterable[int]) -> None:
        """CPU blocks a copy to the device is about to read: other requests wait."""
        self._busy.update(block_ids)

    def release_busy(self, block_ids: Iterable[int]) -> None:
        self._busy.subtract(block_ids)
        self._busy = +self._busy

    def pin_device(self, gpu_ids: Iterable[int]) -> None:
        """Keep device blocks a copy writes ours, should the request be aborted mid-copy."""
        pin_ids(self._gpu_pool(), gpu_ids)

    def unpin_device(self, gpu_ids: Iterable[int]) -> None:
        unpin_ids(self._gpu_pool(), gpu_ids)

    def has_planned(self) -> bool:
        """A load is planned for this step's job (not sent yet)."""
        return any(load.job_id is None for load in self._loads.values())

    def in_flight(self, req_id: str) -> bool:
        """A load for the request is planned or sent and not over."""
        return req_id in self._loads

    def wait_for_shared_load(self, req_id: str, hit: Hit) -> bool:
        """True when a load in flight (or just landed) already copies a block of
        ``hit``: the request asks again once it is in the device prefix cache."""
        busy = self._busy
        if not busy or not any(b.block_id in busy for group in hit for b in group
                               if not b.is_null):
            return False
        self.note_wait(req_id)
        return True

    def note_wait(self, req_id: str) -> None:
        """The request waits for another request's copy of its blocks (counted once)."""
        if req_id not in self._waiting:
            self._waiting.add(req_id)
            self.stats.record_shared_load_wait()

    # --------------------------------------------------------------- hits
    def hold_hit(self, req_id: str, hit: Hit, num_computed_tokens: int) -> None:
        """Pin a hit until the allocation: eviction between the lookup and the
        allocation must not take it away (the lookup/allocation race)."""
        self.cpu.pin_hit(hit)
        self._pending_hits[req_id] = _PendingHit(hit, num_computed_tokens)

    def release_unallocated(self) -> None:
        """Hits held this step whose request vLLM could not allocate: vLLM looks it up
        again, so its hit need not stay pinned meanwhile (where the device is full, for
        as long as the requests holding it wait for CPU room; see scheduler/secondary/staged.py)."""
        for req_id in list(self._pending_hits):
            self.release_hit(req_id)

    def release_hit(self, req_id: str) -> None:
        pending = self._pending_hits.pop(req_id, None)
        if pending is not None:
            self.cpu.unpin_hit(pending.blocks)

    def on_allocated(self, req_id: str, blocks: KVCacheBlocks, num_external_tokens: int,
                     ) -> None:
        """vLLM allocated the request's device blocks: plan the load of what it accepted."""
        pending = self._pending_hits.pop(req_id, None)
        if pending is None:
            return
        if num_external_tokens == 0:
            self.cpu.unpin_hit(pending.blocks)
            return
        gpu_ids_by_group = blocks.get_block_ids()
        gpu_ids: list[int] = []
        taken: list[KVCacheBlock] = []
        for g, group_hit in enumerate(pending.blocks):
            bs = self.cpu.group_block_sizes[g]
            # The scheduler may accept fewer tokens than offered: take the prefix.
            first = pending.num_computed_tokens // bs
            for i, cpu_block in enumerate(group_hit[:cdiv(num_external_tokens, bs)]):
                if not cpu_block.is_null:
                    gpu_ids.append(gpu_ids_by_group[g][first + i])
                    taken.append(cpu_block)
        self.cpu.pin(taken)
        self.cpu.unpin_hit(pending.blocks)
        self.pin_device(gpu_ids)
        cpu_ids = [b.block_id for b in taken]
        self.hold_busy(cpu_ids)
        self._loads[req_id] = _Load(gpu_ids, cpu_ids, num_external_tokens)

    # --------------------------------------------------------- send, report
    def take_job(self) -> LoadSpec | None:
        """This step's planned loads as one job, or None. Loads that landed
        before this step was scheduled are in the device prefix cache now: their
        blocks are no longer busy."""
        if self._landed:
            self.release_busy(b for cpu_ids in self._landed for b in cpu_ids)
            self._landed.clear()
        new_loads = [(r, ld) for r, ld in self._loads.items() if ld.job_id is None]
        if not new_loads:
            return None
        req_ids = [r for r, _ in new_loads]
        job = self._jobs.send(req_ids) if self.sync_loads else self._jobs.new_id()
        cpu_blocks: list[int] = []
        gpu_blocks: list[int] = []
        for _, load in new_loads:
            load.job_id = job
            cpu_blocks += load.cpu_ids
            gpu_blocks += load.gpu_ids
        return LoadSpec(job, tuple(req_ids), cpu_blocks, gpu_blocks, self.sync_loads)

    def on_failed_loads(self, failed_loads: set[str]) -> None:
        """Requests a rank reported failed in its metadata (a rank may report before the
        others finish)."""
        self.vllm.on_failed_loads(failed_loads, self._send_again, self._note_failed)

    def _note_failed(self, req_ids: set[str]) -> None:
        """Failed on some rank: the load is over as failed once every rank reported it."""
        self._failed.update(r for r in req_ids if r in self._loads)

    def on_transfer_results(self, output: KVConnectorOutput) -> None:
        """Asynchronous loads that ended, as vLLM collected them from the workers."""
        invalid = output.invalid_block_ids or set()
        failed = self.vllm.failed_recving(output)
        for req_id in output.finished_recving or ():
            load = self._loads.pop(req_id, None)
            if load is None:
                continue
            ok = (req_id not in failed and req_id not in self._failed
                  and not invalid.intersection(load.gpu_ids))
            self._failed.discard(req_id)
            self._finish(req_id, load, ok)

    def _send_again(self, req_ids: set[str]) -> None:
        """Failed attempts the workers withheld: the same copies go in a new job."""
        for req_id in req_ids:
            load = self._loads.get(req_id)
            if load is None or load.job_id is None:
                continue  # finished meanwhile, or already queued again
            load.attempts += 1
            if load.attempts >= MAX_LOAD_ATTEMPTS:
                raise LoadFailedError(
                    f"HALOffloadConnector: the KV load of request {req_id} failed "
                    f"{load.attempts} times, and this vLLM cannot recompute a failed load of "
                    "this model (several KV cache groups, no KVConnectorOutput.failed_recving); "
                    "stopping before its blocks are read. vLLM >= 0.32 recomputes instead")
            load.job_id = None

    def on_report(self, job: int, report: JobReport) -> None:
        """A synchronous load job's or a staged round's report: the blocks stay pinned
        until every rank read them."""
        done = self._jobs.report(job, report)
        if done is None:
            return
        if isinstance(done.payload, RoundJob):
            done.payload.on_done(done.payload, not done.tally.failed)
            return
        for req_id in done.payload:
            # A failure was reported to vLLM as load errors by the workers.
            self._finish(req_id, self._loads.pop(req_id), not done.tally.failed)

    def _finish(self, req_id: str, load: _Load, ok: bool) -> None:
        if not ok:
            self.failed_requests.add(req_id)
        if ok:
            self.stats.record_load(len(load.gpu_ids), load.num_tokens)
            self.cpu.record_load(load.cpu_ids)
        else:
            # vLLM recomputes the request's KV. Stop offering this copy, or the
            # retry would hit it and fail the same way again.
            self.cpu.drop(load.cpu_ids)
        self._release(load)

    def _release(self, load: _Load) -> None:
        self._landed.append(load.cpu_ids)
        self.cpu.unpin_ids(load.cpu_ids)
        self.unpin_device(load.gpu_ids)

    # ------------------------------------------------------------ finishing
    def request_finished(self, req_id: str) -> bool:
        """True while vLLM must keep the request: an asynchronous load of it is in flight."""
        self.release_hit(req_id)
        self._failed.discard(req_id)
        self._waiting.discard(req_id)
        self.failed_requests.discard(req_id)
        load = self._loads.get(req_id)
        if load is None:
            return False
        if load.job_id is None:
            del self._loads[req_id]  # never sent to a worker: nothing in flight
            self._release(load)
            return False
        # A synchronous load was done before the forward pass that used it; its
        # pins go when the job's reports arrive. An asynchronous one in flight
        # will still be reported in finished_recving: vLLM must keep the request
        # (and free its blocks) until then.
        return not self.sync_loads

    on_lookup = release_hit  # vLLM looks the request up again: its last hit goes
    reset = release_unallocated  # every hit waiting for an allocation; loads run on

    def has_pending(self) -> bool:
        return bool(self._loads)

    @property
    def num_jobs_in_flight(self) -> int:
        """Jobs sent to the workers and not over."""
        return len({ld.job_id for ld in self._loads.values() if ld.job_id is not None})

    def _gpu_pool(self) -> BlockPool:
        assert self.gpu_pool is not None, "bind() was not called"
        return self.gpu_pool
