"""Faults injected at random times while the clients run.

``enospc``: a filler file takes all that is left of the disk tier's tmpfs for a
while (writes fail with ENOSPC), then goes. ``damage``: bytes in the middle of a
share of the block files are overwritten. ``remove``: a share of the block files
is deleted under the server. ``burst``: many long one-off requests at once, more
blocks than the device and the CPU tier hold. ``mooncake_freeze``: the master
stopped (SIGSTOP), then continued; ``mooncake_kill``: killed, then restarted
(a restarted master has none of the old objects). Slow disk reads are not
injected: that needs a throttled block device or a FUSE layer.
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


def damage(root: Path, rng: random.Random, share: float) -> int:
    files = block_files(root)
    hit = rng.sample(files, int(len(files) * share)) if files else []
    for path in hit:
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(size // 2)
                f.write(bytes(rng.randrange(256) for _ in range(64)))
        except OSError:
            pass  # evicted meanwhile
    return len(hit)


def remove(root: Path, rng: random.Random, share: float) -> int:
    files = block_files(root)
    hit = rng.sample(files, int(len(files) * share)) if files else []
    for path in hit:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return len(hit)


async def inject(name: str, cfg: SoakConfig, rng: random.Random, master, run_burst) -> str:
    """Runs one fault to its end; what it did, in words."""
    hold = cfg.fault_hold_s
    if name == "enospc":
        n = fill(cfg.mount_point)
        await asyncio.sleep(hold)
        (cfg.mount_point / FILLER).unlink()
        return f"filler of {n >> 20} MiB, held {hold:g} s"
    if name == "damage":
        return f"{damage(cfg.disk_path, rng, 0.4)} block files overwritten in the middle"
    if name == "remove":
        return f"{remove(cfg.disk_path, rng, 0.3)} block files deleted"
    if name == "burst":
        n = cfg.clients * 4
        await run_burst(n)
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
                     master, run_burst, observe, faults: list[Fault]) -> None:
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
        fault.detail = await inject(fault.name, cfg, rng, master, run_burst)
        fault.ended = time.monotonic()
