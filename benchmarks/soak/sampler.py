"""What the soak watches: the server's processes, the disk tier's files, the probe's
snapshot and the counters on ``/metrics``, every ``sample_every_s``."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from soak.config import SoakConfig
from support.openai_server import Server, session_members

# Log lines that show a fault (counted in the served server's log).
LOG_MARKS = {"unusable": "is unusable", "write_failed": "disk tier: writing",
             "read_failed": "disk tier: reading", "breaker": "circuit breaker"}


def proc_stats(pids: list[int]) -> dict[str, float]:
    rss = fds = threads = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_bytes": rss, "fds": fds, "threads": threads, "procs": len(pids)}


def tree_stats(root: Path) -> dict[str, int]:
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return {"disk_files": files, "disk_bytes": size}


def files_left(root: Path) -> int:
    """Files under ``root`` but the setup lock servers on one ``disk_path`` share."""
    return sum(1 for p in root.rglob("*") if p.is_file()
               and p.name != ".kvoffload-hal-setup.lock")


def read_probe(cfg: SoakConfig) -> dict:
    try:
        return json.loads((cfg.work_dir / "probe.json").read_text())
    except (OSError, ValueError):
        return {}


def counters(server: Server) -> dict[str, float]:
    """The connector's counters and vLLM's preemptions, summed over labels."""
    try:
        families = server.metrics()
    except OSError:
        return {}
    out = {}
    for name, samples in families.items():
        if name.startswith("vllm:kvoffload_hal_") or name == "vllm:num_preemptions":
            out[name.removeprefix("vllm:kvoffload_hal_").removeprefix("vllm:")] = \
                sum(samples.values())
    return out


def log_marks(server: Server) -> dict[str, int]:
    log = server.log()
    return {f"log_{k}": log.count(v) for k, v in LOG_MARKS.items()}


def sample(cfg: SoakConfig, server: Server, done: int) -> dict:
    probe = read_probe(cfg)
    row = {"t": time.monotonic(), "requests": done,
           **proc_stats([server.proc.pid, *session_members(server.proc.pid)]),
           **tree_stats(cfg.disk_path)}
    row.update({k: probe.get(k) for k in ("cpu_resident", "cpu_pinned", "cpu_evicted",
                                           "tier_index", "tier_evicted", "in_flight", "steps")})
    row["step_hook_s"] = probe.get("step_hook_s", [])
    row["probe_t"] = probe.get("t")
    return row


async def sample_loop(cfg: SoakConfig, server: Server, outcomes: list, stop_at: float,
                      rows: list[dict]) -> None:
    while time.monotonic() < stop_at:
        done = sum(1 for o in outcomes if o.status != "running")
        rows.append(await asyncio.to_thread(sample, cfg, server, done))
        await asyncio.sleep(cfg.sample_every_s)


async def observe(cfg: SoakConfig, server: Server) -> dict:
    """Counters, log-line counts and the probe's counts: a fault's evidence."""
    def read() -> dict:
        probe = read_probe(cfg)
        return {**counters(server), **log_marks(server),
                **{f"probe_{k}": probe.get(k, 0) for k in ("cpu_evicted", "tier_evicted")}}
    return await asyncio.to_thread(read)
