"""The one place that divides the CPU tier's free blocks in a step: the room broker.

Runs in the scheduler process. Every part that takes fresh CPU blocks asks
:class:`CpuRoom` how many it may take, naming its :class:`RoomKind`; the order of the
kinds is the rule (docs/design.md, "One read, one room"). A kind that finds no room
*claims* what it needs: a standing claim is taken off what every later kind is granted,
and a later kind is *held back* (it waits holding nothing) until the claim is met or
dropped. Lookups come before the step's metadata is built, so a claim made while a step
is built holds back the lookups of the next one.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload_hal.scheduler.cpu_tier import CpuTier


class RoomKind(IntEnum):
    """Who takes the CPU tier's free blocks, first to last."""

    RESCUES = 0  # blocks the device is reusing this step: not copied now, they are gone
    STAGED = 1  # staged hits' reads and checks: a request waits, device blocks allocated
    STORES = 2  # the step's store job: a store not sent now is offered again
    PROMOTIONS = 3  # reads started at a lookup: the request asks again later
    PREFETCH = 4  # reads for requests vLLM has not looked up yet


class CpuRoom:
    """Grants free CPU blocks by :class:`RoomKind`; see the module docstring."""

    def __init__(self, cpu: CpuTier) -> None:
        self.cpu = cpu
        self._claims: dict[RoomKind, int] = {}

    def grant(self, kind: RoomKind, want: int | None = None) -> int:
        """Free blocks ``kind`` may take now (at most ``want``): what is free, less what
        the kinds before it claim."""
        room = self.cpu.num_free_blocks()
        if self._claims:
            room -= sum(n for k, n in self._claims.items() if k < kind)
        room = max(0, room)
        return room if want is None else min(room, want)

    def claim(self, kind: RoomKind, blocks: int) -> None:
        """``kind`` needs ``blocks`` it was not granted (0: its claim is met or dropped)."""
        if blocks > 0:
            self._claims[kind] = blocks
        else:
            self._claims.pop(kind, None)

    def held_back(self, kind: RoomKind) -> bool:
        """Whether a kind before ``kind`` has a standing claim: ``kind`` waits for it,
        holding nothing."""
        return bool(self._claims) and any(k < kind for k in self._claims)

    def claimed(self, kind: RoomKind) -> int:
        return self._claims.get(kind, 0)
