"""Rescues into the CPU blocks of the step's own loads: the order of a step's copies.

Runs in the scheduler process, with ``device_copies: drop`` and no tier behind the CPU
tier (docs/design.md, "One cache"). A step whose requests reuse device blocks the CPU
tier holds no copy of *rescues* them (copies them out first). Fresh CPU blocks for
that evict blocks only the CPU tier holds, and those are lost to both tiers. Where
the device reuses a block because a request of this step loads its CPU hit into it,
the hit's CPU block is a better home: once its load has run, its bytes are on the
device too. So a step's copies run in an order:

1. the rescues of device blocks the forward pass writes (no load fills them), and
   of as many others as there are CPU blocks that evict nothing, before anything;
2. the loads whose device blocks need no rescue (now or any more);
3. a *hand-over*: the next rescues, each into the CPU block of a load that has run,
   then the loads into the device blocks just rescued; their CPU blocks are handed
   over next, and so on, one batch per round, until every rescue has a home.

Where the loads run before the forward pass (synchronous loads), the rescues of
blocks the forward pass writes need only run before it too: they wait for homes as
well, after the others (their blocks free no home), and only those left without one
go first into blocks that evict.

A block handed over leaves the CPU prefix cache when the step is planned (its bytes
go to the device and stay there, cached once its request runs) and holds the rescued
block's hash once the rescue is reported. A load that then fails loses its block from
both tiers (recomputed, never read wrong); where a failed load is tried again from its
CPU blocks (vLLM < 0.32 with several KV cache groups), nothing is handed over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Rescue(NamedTuple):
    """A device block to copy out: its id and the hash it held."""

    gpu_id: int
    block_hash: Any


@dataclass
class HandOverPlan:
    """A step's rescues and loads, in the order they run (see the module docstring).

    ``first``: rescued before anything, into fresh CPU blocks: the first ``lossless``
    of them evict nothing. ``order``: the load's (CPU, device) block pairs, by index, in
    the order they run. ``rounds``: (how many of ``order`` run before it, the rescues
    with the CPU block each goes into)."""

    first: list[Rescue]
    lossless: int
    order: list[int]
    rounds: list[tuple[int, list[tuple[Rescue, int]]]] = field(default_factory=list)


def plan_hand_over(rescues: list[Rescue], loads: list[tuple[int, int]], lossless: int,
                   before_forward: bool = False) -> HandOverPlan:
    """Order ``rescues`` (in the device's eviction order) and the step's ``loads``
    ((CPU block, device block) pairs) given ``lossless`` CPU blocks that evict nothing;
    ``before_forward``: the loads, and so every round, run before the forward pass.

    A rescue of a device block a load fills can wait for a round, and with
    ``before_forward`` one the forward pass writes too; one rescue goes first anyway
    where no load could run before every round (the chain needs a start)."""
    filled_by = {gpu: i for i, (_, gpu) in enumerate(loads)}
    written = [r for r in rescues if r.gpu_id not in filled_by]  # by the forward pass
    waiting = [r for r in rescues if r.gpu_id in filled_by]
    first = (written + waiting)[:lossless]
    waiting = waiting[max(0, lossless - len(written)):]
    written = written[lossless:]
    if not before_forward:
        first += written  # no round can take them: they evict
        written = []
    pending = {r.gpu_id for r in waiting}
    order = [i for i, (_, gpu) in enumerate(loads) if gpu not in pending]
    if not order and waiting:
        start = waiting.pop(0)
        first.append(start)
        order.append(filled_by[start.gpu_id])
    plan = HandOverPlan(first, min(lossless, len(rescues)), order)
    homes = [loads[i][0] for i in order]
    while waiting:
        batch, waiting = waiting[:len(homes)], waiting[len(homes):]
        plan.rounds.append((len(plan.order), list(zip(batch, homes))))
        ran = [filled_by[r.gpu_id] for r in batch]
        plan.order += ran
        homes = homes[len(batch):] + [loads[i][0] for i in ran]
    if written and homes:  # after every load: their blocks free no home
        plan.rounds.append((len(plan.order), list(zip(written, homes))))
    plan.first += written[len(homes):]  # no home left: they evict
    return plan
