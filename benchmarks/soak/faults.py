"""Faults injected at random times while the clients run.

``enospc``: a filler file takes all that is left of the disk tier's tmpfs for a
while (writes fail with ENOSPC), then goes. ``damage``: bytes in the middle of a
share of the block files are overwritten. ``remove``: a share of the block files
is deleted under the server. A damaged or removed block shows only when it is
read, and most disk blocks are never read again, so these two first ask a new
long prompt, damage (remove) its block files too (those written since), and ask
it again once the device and the CPU tier forgot it: its tokens must not change.
``burst``: many long one-off requests at once, more blocks than the device and
the CPU tier hold. ``mooncake_freeze``: the master stopped (SIGSTOP), then
continued; ``mooncake_kill``: killed, then restarted (a restarted master has
none of the old objects). Slow disk reads are not injected: that needs a
throttled block device or a FUSE layer.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak.config import SoakConfig, uses_disk, uses_mooncake

FILLER = "filler.bin"
PROMPT_BLOCKS = 11  # blocks of a new long prompt (FaultOps.new_prompt)
DISK_FAULTS = ("enospc", "damage", "remove")
MOONCAKE_FAULTS = ("mooncake_freeze", "mooncake_kill")


@dataclass
class Fault:
    name: str
    started: float
    ended: float = 0.0
    detail: str = ""
    before: dict = field(default_factory=dict)  # counters and log-line counts at start
    after: dict = field(default_factory=dict)  # at the next fault's start, or the end


def enabled(cfg: SoakConfig, mounted: bool) -> tuple[list[str], list[str]]:
    """(faults to inject, 'fault: why not' for those left out)."""
    chosen, left = [], []
    for name in cfg.faults:
        if name in DISK_FAULTS and not uses_disk(cfg):
            left.append(f"{name}: no disk tier in this run's tier config")
        elif name == "enospc" and not mounted:
            left.append("enospc: the tmpfs could not be mounted (needs root)")
        elif name in MOONCAKE_FAULTS and not uses_mooncake(cfg):
            left.append(f"{name}: no Mooncake tier in this run's tier config")
        else:
            chosen.append(name)
    left.append("slow disk reads: not injected (needs a throttled device or FUSE)")
    return chosen, left


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kvb") if p.is_file()]


def fill(mount: Path) -> int:
    """Bytes written to the filler before ENOSPC."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(mount / FILLER, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
                written += len(chunk)
        except OSError:
            pass
    return written


def chosen(root: Path, rng: random.Random, share: float, since: float) -> list[Path]:
    """A share of the block files, and every one written since ``since`` (wall clock)."""
    files = block_files(root)
    fresh = [p for p in files if _mtime(p) >= since]
    return list({*fresh, *(rng.sample(files, int(len(files) * share)) if files else [])})


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def damage(hit: list[Path], rng: random.Random) -> int:
    for path in hit:
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(size // 2)
                f.write(bytes(rng.randrange(256) for _ in range(64)))
        except OSError:
            pass  # evicted meanwhile
    return len(hit)


def remove(hit: list[Path]) -> int:
    for path in hit:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return len(hit)


async def on_a_prompt_read_again(cfg: SoakConfig, rng: random.Random, ops, name: str) -> str:
    """``damage`` or ``remove``, with a prompt whose blocks are read from the disk after.
    The other clients wait meanwhile: on a fast host their new blocks pushed the prompt
    out of the disk tier too before it was asked again (its read then came from
    Mooncake, and showed nothing)."""
    ops.clients_go.clear()
    try:
        since = time.time() - 1
        prompt = ops.new_prompt()
        first = await ops.ask(prompt)
        await asyncio.sleep(2)  # its blocks reach the disk
        hit = chosen(cfg.disk_path, rng, 0.3, since)
        n = damage(hit, rng) if name == "damage" else remove(hit)
        # New long prompts, one at a time, until the device and the CPU tier forgot it
        # (the disk tier, larger, still holds it).
        flush = (cfg.device_blocks + cfg.cpu_blocks) // PROMPT_BLOCKS + 2
        for _ in range(flush):
            await ops.ask(ops.new_prompt(), max_tokens=1)
        again = await ops.ask(prompt)
    finally:
        ops.clients_go.set()
    same = "the same" if again.tokens == first.tokens else "OTHER"
    return (f"{n} block files {'overwritten' if name == 'damage' else 'deleted'}; a prompt "
            f"read again after {flush} others: {same} tokens")


async def inject(name: str, cfg: SoakConfig, rng: random.Random, master, ops) -> str:
    """Runs one fault to its end; what it did, in words."""
    hold = cfg.fault_hold_s
    if name == "enospc":
        n = fill(cfg.mount_point)
        await asyncio.sleep(hold)
        (cfg.mount_point / FILLER).unlink()
        return f"filler of {n >> 20} MiB, held {hold:g} s"
    if name in ("damage", "remove"):
        return await on_a_prompt_read_again(cfg, rng, ops, name)
    if name == "burst":
        n = cfg.clients * 4
        await ops.burst(n)
        return f"{n} requests of ~12 blocks at once"
    if name == "mooncake_freeze":
        master.freeze()
        await asyncio.sleep(hold)
        master.thaw()
        return f"master stopped {hold:g} s"
    if name == "mooncake_kill":
        master.kill()
        await asyncio.sleep(hold)
        master.start()
        return f"master killed, restarted after {hold:g} s"
    raise ValueError(f"fault {name!r}: unknown")


async def fault_loop(cfg: SoakConfig, names: list[str], rng: random.Random, stop_at: float,
                     master, ops, observe, faults: list[Fault]) -> None:
    """Faults at random times until ``stop_at``; ``observe()`` is the evidence snapshot."""
    await asyncio.sleep(cfg.warmup_s)
    order: list[str] = []
    rounds = 0
    while names:
        await asyncio.sleep(rng.uniform(*cfg.fault_every_s))
        if time.monotonic() > stop_at - cfg.fault_hold_s - 5:
            break
        if not order:
            if cfg.fault_rounds and rounds == cfg.fault_rounds:
                break
            order = rng.sample(names, len(names))  # each fault once per round
            rounds += 1
        fault = Fault(order.pop(), time.monotonic(), before=await observe())
        if faults:
            faults[-1].after = fault.before
        faults.append(fault)
        fault.detail = await inject(fault.name, cfg, rng, master, ops)
        fault.ended = time.monotonic()
