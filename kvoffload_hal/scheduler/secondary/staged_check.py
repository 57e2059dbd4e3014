"""Staged hits read once before they are offered, where vLLM cannot recompute a failed load.

vLLM < 0.32 is told of a failed load of a model with several KV cache groups neither per
block nor per request, so nothing a staged hit brings may fail once it is offered. There,
before a lookup offers one, a *check* reads the hit's tier blocks through the CPU tier
(the lookup asks again later meanwhile): a block that fails to read leaves the index, and
a check that cannot go on (no room, a read past its wait) ends the hit where it stopped.
The blocks read stay as ordinary CPU content. A failure after the offer (a file changed,
a copy failed) stops the engine before any block of the hit is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload_hal.capabilities import LoadFailedError
from kvoffload_hal.scheduler.room import RoomKind

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.scheduler.secondary.plan import Round, Staged
    from kvoffload_hal.scheduler.secondary.reads import Entry, TierRead, TierReads
    from kvoffload_hal.tiers.spec import BlockKey


@dataclass
class _Check:
    """One request's check: a read of the hit's tier blocks, position by position."""

    read: TierRead
    positions: list[int]  # of each entry in the request (its block index)
    done: set[BlockKey] = field(default_factory=set)  # keys read
    cut: int | None = None  # the first block index the hit may not reach

    def note_stop(self) -> None:
        at = self.read.stopped_at
        if at is not None:
            position = self.positions[at]
            self.cut = position if self.cut is None else min(self.cut, position)


class StagedChecks:
    """The checks of one scheduler's staged hits (see the module's docstring)."""

    def __init__(self, reads: TierReads, cpu: CpuTier, enabled: bool) -> None:
        self.reads = reads
        self.cpu = cpu
        self.enabled = enabled
        self._checks: dict[str, _Check] = {}

    def limit(self, req_id: str, num_computed_tokens: int, max_tokens: int,
              block_size: int) -> int:
        """The most tokens a hit may have: up to the first block its check could not
        read (the request's blocks from ``num_computed_tokens`` on)."""
        check = self._checks.get(req_id)
        if check is None or check.cut is None:
            return max_tokens
        return min(max_tokens, check.cut * block_size - num_computed_tokens)

    def refuse_failure(self, staged: Staged, final: Round) -> None:
        """A hit offered after its check must come back whole: raise if its last round
        leaves blocks unfilled (a block changed since, a copy failed). This vLLM cannot
        recompute it, and must never read them."""
        if self.enabled and final.failed and not staged.aborted:
            raise LoadFailedError(
                f"HALOffloadConnector: the staged KV hit of request {staged.req_id} failed "
                f"after its check ({len(final.failed)} device blocks unfilled), and this "
                "vLLM cannot recompute a failed load of this model (several KV cache "
                "groups, no KVConnectorOutput.failed_recving); stopping before its blocks "
                "are read. vLLM >= 0.32 recomputes instead")

    def still_reading(self, staged: Staged, first: int) -> bool:
        """True while a check reads the tier blocks of ``staged``, whose position 0 is
        the request's block ``first`` (the lookup asks again later); False once every
        one of them was read, and the check ends."""
        if not self.enabled:
            return False
        check = self._checks.get(staged.req_id)
        if check is not None and not check.read.over():
            return True
        unread = [(slot, key, h) for slot, key, h in staged.tier
                  if check is None or key not in check.done]
        if not unread:
            self.forget(staged.req_id)
            return False
        read = self.reads.start(staged.source, staged.req_id,
                                [(key, h) for _, key, h in unread],
                                self._read, RoomKind.STAGED, "checking a staged hit")
        new = _Check(read, [first + slot[0] for slot, _, _ in unread])
        if check is not None:  # what the last check read and where it stopped stay
            new.done, new.cut = check.done, check.cut
            self.forget(staged.req_id)
        self._checks[staged.req_id] = new
        return True

    def advance(self) -> int:
        """Read the next part of every check; the blocks they wanted and were not
        granted."""
        need = 0
        for check in self._checks.values():
            read = check.read
            if not read.over() and not self.reads.advance(read):
                need += read.left()
            check.note_stop()
        return need

    def _read(self, read: TierRead, part: list[Entry], blocks: list[KVCacheBlock],
              n_ok: int) -> None:
        """Every rank read a part: the blocks that read stay as ordinary CPU content."""
        self.cpu.unpin(blocks)
        check = self._checks.get(read.reader)
        if check is None or check.read is not read:
            return
        check.done.update(key for key, _ in part[:n_ok])
        check.note_stop()

    def forget(self, req_id: str) -> None:
        """The request's check is over: the hit was offered, or is not staged."""
        check = self._checks.pop(req_id, None)
        if check is not None:
            self.reads.end(check.read)

    def reset(self) -> None:
        for req_id in list(self._checks):
            self.forget(req_id)

    def has_pending(self) -> bool:
        return any(not check.read.over() for check in self._checks.values())
