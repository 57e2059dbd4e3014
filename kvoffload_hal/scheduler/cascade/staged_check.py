"""Staged hits read once before they are offered, where vLLM cannot recompute a failed load.

vLLM < 0.32 is told of a failed load of a model with several KV cache groups neither
per block nor per request (``LoadRecovery.RETRY``): once a staged hit is offered and its
device blocks are allocated, nothing it brings may fail. There, before a lookup offers
a staged hit, a *check* reads the hit's tier blocks once through the CPU tier, part by
part (as many as the CPU tier has free blocks for at each step), every read checked as
a promotion's is; the lookup asks again later meanwhile.

* A block that fails to read is dropped from the tier's index (as any failed
  promotion's), so the hit the next lookup plans ends before it: the same "a failed or
  corrupted block ends the hit there" as on later vLLM, decided before vLLM allocates.
* A check that cannot go on (no free CPU block for ``MAX_STAGE_WAIT_S``, or a read past
  the tier's wait) ends the hit where it stopped: the lookup offers what was read.
* The blocks read stay in the CPU tier as ordinary content: the last parts are often
  still there when the hit is served, and are not read again.

What is left is a failure after the offer: a block changed on disk between the check
and the serving read, or a copy failed. That vLLM cannot recompute it, so the engine
stops with an error before any block of the hit is read (``StagedHits``, the worker's
``LoadOutcomes``), as it does after a failed load of such a model is tried again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload_hal.capabilities import LoadFailedError
from kvoffload_hal.hal.plumbing import log_once
from kvoffload_hal.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvoffload_hal.scheduler.cascade.staged_plan import Round, Staged
    from kvoffload_hal.scheduler.cascade.tier_cascade import TierCascade
    from kvoffload_hal.scheduler.cpu_tier import CpuTier
    from kvoffload_hal.tiers.spec import BlockKey

# The longest a staged hit, or its check, waits for a free CPU block before the rest of
# the hit is recomputed.
MAX_STAGE_WAIT_S = 10.0

logger = init_logger(__name__)


def starved_for_long(since: float, now: float, label: str, what: str) -> bool:
    """Whether ``what`` found no free CPU block for ``MAX_STAGE_WAIT_S`` (said once)."""
    if now - since <= MAX_STAGE_WAIT_S:
        return False
    log_once(logger, logging.WARNING, "%s: %s found no free CPU block for %.0f s; the "
             "rest of its prompt is recomputed", label, what, MAX_STAGE_WAIT_S)
    return True


@dataclass
class _Check:
    """One request's check: the tier blocks it reads, position by position."""

    keys: list[BlockKey]
    hashes: list[Any]
    positions: list[int]  # of each key in the request (its block index)
    since: float  # the last progress
    next: int = 0
    reading: list[BlockKey] | None = None  # the part being read
    read: set[BlockKey] = field(default_factory=set)
    cut: int | None = None  # the first block index the hit may not reach
    stopped: bool = False  # before its end

    def over(self) -> bool:
        return self.reading is None and (self.stopped or self.next >= len(self.keys))


class StagedChecks:
    """The checks of one scheduler's staged hits (see the module's docstring)."""

    def __init__(self, cascade: TierCascade, cpu: CpuTier, enabled: bool,
                 clock: Callable[[], float]) -> None:
        self.cascade = cascade
        self.cpu = cpu
        self.enabled = enabled
        self._clock = clock
        self._checks: dict[str, _Check] = {}
        self._owners: dict[BlockKey, str] = {}  # a key being checked -> its request

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

    @property
    def owns_keys(self) -> bool:
        """Whether any check reads tier keys now."""
        return bool(self._owners)

    def owned_by_another(self, key: BlockKey, req_id: str) -> bool:
        """Whether another request's check reads ``key`` (this one waits for it, then
        takes what that one's hit left on the device)."""
        return self._owners.get(key, req_id) != req_id

    def still_reading(self, staged: Staged, first: int) -> bool:
        """True while a check reads the tier blocks of ``staged``, whose position 0 is
        the request's block ``first`` (the lookup asks again later); False once every
        one of them was read, and the check ends."""
        if not self.enabled:
            return False
        check = self._checks.get(staged.req_id)
        if check is not None and not check.over():
            return True
        unread = [(slot, key, h) for slot, key, h in staged.tier
                  if check is None or key not in check.read]
        if not unread:
            self.forget(staged.req_id)
            return False
        new = _Check([k for _, k, _ in unread], [h for _, _, h in unread],
                     [first + slot[0] for slot, _, _ in unread], self._clock())
        if check is not None:  # what the last check read and where it stopped stay
            new.read, new.cut = check.read, check.cut
            self.forget(staged.req_id)
        self.cascade.index.pin(new.keys)
        self._owners.update((key, staged.req_id) for key in new.keys)
        self._checks[staged.req_id] = new
        return True

    def advance(self) -> bool:
        """Read the next part of every check; True when one found no free CPU block."""
        starving = False
        now = self._clock()
        for check in self._checks.values():
            if check.reading is not None:
                wait_s = self.cascade.read_wait_s
                if wait_s is not None and now - check.since > wait_s:
                    self._stop(check, check.next - len(check.reading))  # read late
                continue
            if check.over():
                continue
            n = min(self.cascade.room(), len(check.keys) - check.next)
            if n <= 0:
                starving = True
                if starved_for_long(check.since, now, self.cascade.names.label,
                                    "checking a staged hit"):
                    self._stop(check, check.next)
                continue
            part = check.keys[check.next:check.next + n]
            hashes = check.hashes[check.next:check.next + n]
            check.next += n
            check.reading = part
            check.since = now
            self.cascade.queue_promotion(
                part, hashes, None, lambda blocks, n_ok, c=check, p=part: self._read(
                    c, p, blocks, n_ok))
        return starving

    def _read(self, check: _Check, part: list[BlockKey], blocks: list[KVCacheBlock],
              n_ok: int) -> None:
        """Every rank read a part: the blocks that read stay as ordinary CPU content."""
        self.cpu.unpin(blocks)
        if check.reading is not part:  # given up (late), or the request is gone
            return
        check.reading = None
        check.since = self._clock()
        check.read.update(part[:n_ok])
        if n_ok < len(part):
            self._stop(check, check.next - len(part) + n_ok)

    def _stop(self, check: _Check, index: int) -> None:
        """The check goes no further than its key ``index``: the hit ends before it."""
        position = check.positions[index]
        check.cut = position if check.cut is None else min(check.cut, position)
        check.reading = None
        check.stopped = True

    def forget(self, req_id: str) -> None:
        """The request's check is over: the hit was offered, or is not staged."""
        check = self._checks.pop(req_id, None)
        if check is not None:
            self.cascade.index.unpin(check.keys)
            for key in check.keys:
                if self._owners.get(key) == req_id:
                    del self._owners[key]

    def reset(self) -> None:
        for req_id in list(self._checks):
            self.forget(req_id)

    def has_pending(self) -> bool:
        return any(not check.over() for check in self._checks.values())
