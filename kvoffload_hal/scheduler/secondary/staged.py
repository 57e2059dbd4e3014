"""Tier hits longer than the CPU tier has room for, served whole by staging them through it.

A promotion would lose such a run's tail, so the lookup answers the whole hit as an
asynchronous load instead (its slots are the one planner's, :mod:`.plan`), and round by
round the next slots the tier holds are read into the CPU blocks free at that step,
loaded into their device blocks and released; slots the CPU tier holds go in the first
round. The last round is the request's load: the workers report the request in
``finished_recving`` once every round of it landed.

Nothing of the hit is evicted while it is served: its tier keys are pinned from the
lookup on, its CPU blocks until their round landed, its device blocks until the last
round did. Slots go position by position, so a block that fails to read or copy, or
a read past its deadline, ends the hit there: the rest is reported failed (per block
with one group, per request with several) and the request is offered no hit again.
Where vLLM cannot be told that a load of several groups failed, a check reads the hit
once before it is offered (:mod:`.staged_check`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv

from kvoffload_hal.metadata import LoadSpec
from kvoffload_hal.scheduler.load_jobs import RoundJob
from kvoffload_hal.scheduler.parts import RequestPart
from kvoffload_hal.scheduler.room import RoomKind
from kvoffload_hal.scheduler.secondary.plan import (
    GroupKeys,
    Round,
    Slot,
    Staged,
    plan_chain_hit,
)
from kvoffload_hal.scheduler.secondary.staged_check import StagedChecks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload_hal.capabilities import VllmStrategy
    from kvoffload_hal.metrics import StatsLedger
    from kvoffload_hal.scheduler.cpu_tier import CpuTier, Hit
    from kvoffload_hal.scheduler.load_jobs import LoadJobs
    from kvoffload_hal.scheduler.secondary.chain import TierChain
    from kvoffload_hal.scheduler.secondary.reads import Entry, TierRead


class StagedHits(RequestPart):
    """The staged hits of one scheduler: offered at lookup, advanced every step. Rounds
    are load jobs of ``loads``, which keeps their ids, reports, busy blocks and pins."""

    def __init__(self, tiers: TierChain, loads: LoadJobs, cpu: CpuTier,
                 stats: StatsLedger, block_size: int, vllm: VllmStrategy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = tiers
        self.loads = loads
        self.cpu = cpu
        self.stats = stats
        self.block_size = block_size
        self.enabled = self.active = bool(tiers)
        self.reads = tiers.reads
        self.groups = GroupKeys.of(cpu)
        self.vllm = vllm
        self.checks = StagedChecks(tiers.reads, cpu, vllm.checks_staged_hits_first())
        self._clock = clock
        self._pending: dict[str, Staged] = {}  # offered, not allocated yet
        self._active: dict[str, Staged] = {}
        self._queued: list[Round] = []
        self._landed: list[Staged] = []  # over: its keys stay owned until the next step

    # ------------------------------------------------------------- lookup
    def offer(self, request: Request, hit: Hit, hit_tokens: int, num_computed_tokens: int,
              max_hit_tokens: int) -> int | None:
        """Tokens of a staged hit for the request (CPU hit included), 0 when it is not
        staged, None when a staged hit brings its blocks (it asks again later)."""
        if not self.enabled:
            return 0
        bs, req_id = self.block_size, request.request_id
        max_hit_tokens = self.checks.limit(req_id, num_computed_tokens, max_hit_tokens, bs)
        if max_hit_tokens <= hit_tokens:  # a check stopped within the CPU hit
            self.checks.forget(req_id)
            return 0
        first = (num_computed_tokens + hit_tokens) // bs
        end = (num_computed_tokens + max_hit_tokens) // bs
        if not self.tiers.may_extend(request.block_hashes, first, end):
            self.checks.forget(req_id)
            return 0  # no tier holds the block after the CPU hit
        run = request.block_hashes[first:end]
        # (A hit on busy CPU blocks waited already: LoadJobs.wait_for_shared_load.)
        if self.reads.brings_for_another(self.groups.keys(run), req_id):
            self.loads.note_wait(req_id)
            return None
        staged = plan_chain_hit(self.tiers, self.cpu, req_id, hit, request.block_hashes,
                                num_computed_tokens // bs, max_hit_tokens)
        if not isinstance(staged, Staged):
            self.checks.forget(req_id)
            return 0
        if self.checks.still_reading(staged, num_computed_tokens // bs):
            return None
        staged.num_computed_tokens = num_computed_tokens
        self.cpu.pin([b for _, b in staged.cpu])
        self.loads.hold_busy(b.block_id for _, b in staged.cpu)
        staged.read = self.reads.start(staged.source, req_id,
                                       [(key, h) for _, key, h in staged.tier],
                                       self._promoted, RoomKind.STAGED, "a staged hit")
        self._pending[req_id] = staged
        self.tiers.release_promoted(req_id)  # a prefetch's blocks: pinned above
        return staged.num_tokens

    def on_lookup(self, req_id: str) -> None:
        self.release_pending(req_id)

    def release_pending(self, req_id: str) -> None:
        """A hit offered and never allocated (vLLM looks the request up again)."""
        staged = self._pending.pop(req_id, None)
        if staged is not None:
            self._drop(staged, lambda slot: False)
            self.reads.end(staged.read)

    def _drop(self, staged: Staged, keep: Callable[[Slot], bool]) -> None:
        """Stop holding the slots not kept (before any round was sent)."""
        cpu_blocks = [b for slot, b in staged.cpu if not keep(slot)]
        self.cpu.unpin(cpu_blocks)
        self.loads.release_busy(b.block_id for b in cpu_blocks)
        self.reads.keep_only(staged.read, lambda i: keep(staged.tier[i][0]))
        staged.cpu = [x for x in staged.cpu if keep(x[0])]
        staged.tier = [x for x in staged.tier if keep(x[0])]

    # --------------------------------------------------------- allocation
    def on_allocated(self, req_id: str, blocks: KVCacheBlocks, num_external_tokens: int,
                     ) -> bool:
        """vLLM allocated the request's device blocks: False when it has no staged hit."""
        staged = self._pending.pop(req_id, None)
        if staged is None:
            return False
        # The scheduler may accept fewer tokens than offered: the rest is not staged.
        # A prefix of the hit is a hit only where every group needs every block before
        # its end; otherwise the blocks a window or a state needs differ, and none is.
        n = cdiv(num_external_tokens, self.block_size)
        if n * self.block_size < staged.num_tokens and not self.groups.all_dense:
            staged.fail_from(0)
        first = staged.num_computed_tokens // self.block_size
        device = blocks.blocks
        # A null device block is one vLLM never reads (outside a window): not filled.
        self._drop(staged, lambda s: s[0] < n and not device[s[1]][first + s[0]].is_null)
        if n == 0:
            self.reads.end(staged.read)
            return True
        ids = blocks.get_block_ids()
        staged.gpu_ids = {(pos, g): ids[g][first + pos] for pos, g in staged.slots()}
        self.loads.pin_device(staged.gpu_ids.values())  # ours until the last round landed
        staged.ready = [(b, staged.gpu_ids[slot]) for slot, b in staged.cpu]
        staged.num_tokens = min(staged.num_tokens, num_external_tokens)
        staged.read.since = self._clock()
        self._active[req_id] = staged
        return True

    # ------------------------------------------------------------ per step
    def advance(self) -> None:
        """Send what each staged hit can do this step: a round of its blocks in the
        CPU tier, the next part of its read, or the last round. Hits and checks that
        found no room claim it (``RoomKind.STAGED``): later kinds wait for them."""
        for staged in self._landed:
            self.reads.end(staged.read)
        self._landed.clear()
        need = 0
        for staged in list(self._active.values()):
            if not staged.final_sent:
                need += self._advance(staged)
        need += self.checks.advance()
        if self.enabled:
            if need and not self.tiers.room.claimed(RoomKind.STAGED):
                self.tiers.release_all_kept()
            self.tiers.room.claim(RoomKind.STAGED, need)

    def _advance(self, staged: Staged) -> int:
        """One hit's step; the blocks it wanted and was not granted."""
        read, need = staged.read, 0
        if staged.reading():
            self.reads.advance(read)  # its deadline
            staged.note_stop()
        if staged.ready and not (staged.stops() and not staged.reading()):
            self._queued.append(staged.take_round())
        if not staged.stops() and not staged.reading():
            if not self.reads.advance(read):
                need = read.left()
            staged.note_stop()
        if staged.stops() and not staged.reading() and not staged.rounds:
            final = staged.take_final()
            self.checks.refuse_failure(staged, final)
            self._queued.append(final)
        return need

    def release_unallocated(self) -> None:
        """Hits offered this step whose request vLLM could not allocate (it looks the
        request up again): as LoadJobs.release_unallocated."""
        for req_id in list(self._pending):
            self.release_pending(req_id)

    def _promoted(self, read: TierRead, part: list[Entry], blocks: list[KVCacheBlock],
                  n_ok: int) -> None:
        """Every rank read a part: the blocks that read join the next round."""
        staged = self._active.get(read.reader)
        if staged is None or staged.read is not read:
            self.cpu.unpin(blocks)
            return
        self.cpu.unpin(blocks[n_ok:])
        staged.note_stop()
        start = read.next - len(part)
        ok = list(zip(blocks[:n_ok], (staged.gpu_ids[slot]
                                      for slot, _, _ in staged.tier[start:start + n_ok])))
        self.loads.hold_busy(b.block_id for b, _ in ok)
        staged.ready += ok

    def take_rounds(self) -> tuple[LoadSpec, ...]:
        """This step's rounds, numbered after the step's other load job (the workers
        launch them after it, and their copy queues go by job id)."""
        specs = tuple(r.spec(self.loads.new_job_id() if r.failed is not None else
                             self.loads.send_round(RoundJob(r.req_id, r.cpu_blocks,
                                                            self._on_round_done)))
                      for r in self._queued)
        self._queued.clear()
        return specs

    # ------------------------------------------------------------ reports
    def _on_round_done(self, job: RoundJob, ok: bool) -> None:
        """Every rank reported a round (LoadJobs.on_report)."""
        staged = self._active[job.req_id]
        staged.rounds -= 1
        self._release(job.cpu_blocks, ok)
        if not ok:
            staged.fail_from(0)  # the workers report its blocks with the last round

    def _release(self, cpu_blocks: list[KVCacheBlock], ok: bool) -> None:
        ids = [b.block_id for b in cpu_blocks]
        (self.cpu.record_load if ok else self.cpu.drop)(ids)  # a failed copy: not offered
        self.cpu.unpin(cpu_blocks)
        self.loads.release_busy(ids)

    def on_transfer_results(self, output: KVConnectorOutput) -> None:
        """Last rounds that landed on every rank: the hit is over."""
        failed = self.vllm.failed_recving(output)
        invalid = output.invalid_block_ids or set()
        for req_id in output.finished_recving or ():
            staged = self._active.get(req_id)
            if staged is None or not staged.final_sent:
                continue
            del self._active[req_id]
            ok = req_id not in failed and not invalid.intersection(staged.gpu_ids.values())
            if ok and staged.failed_at is None and not staged.aborted:
                self.stats.record_load(len(staged.gpu_ids), staged.num_tokens)
                self.stats.record_staged_hit()
            elif not ok:
                self.loads.failed_requests.add(req_id)
            # A failure names blocks (then only those of this round were not copied) or
            # the request: then this round's blocks may be torn, and are dropped.
            torn = not ok and (req_id in failed
                               or bool(invalid.intersection(staged.final_gpu_ids)))
            self._release(staged.final_blocks, not torn)
            self.loads.unpin_device(staged.gpu_ids.values())
            self._landed.append(staged)  # its keys stay owned until the next step

    # ----------------------------------------------------------- finishing
    def request_finished(self, req_id: str) -> bool:
        """True while vLLM must keep the request's blocks (its last round is to come)."""
        self.release_pending(req_id)
        self.checks.forget(req_id)
        staged = self._active.get(req_id)
        if staged is not None:
            staged.aborted = True
        return staged is not None

    def reset(self) -> None:
        """vLLM's prefix cache was reset: hits offered and not allocated are let go;
        a hit being served stops after the blocks already promoted or being promoted
        (the rest is recomputed). Rounds and promotions in flight run to their end."""
        self.release_unallocated()
        self.checks.reset()
        if self.checks.enabled:
            return  # this vLLM cannot recompute the rest: served whole (its keys pinned)
        for staged in self._active.values():
            if not staged.stops():  # read nothing more: the hit ends before the next slot
                staged.read.stop(staged.read.next)
                staged.note_stop()

    def has_pending(self) -> bool:
        return bool(self._pending or self._active or self._landed or self._queued
                    or self.checks.has_pending())
