"""What the soak watches: the server's processes, the disk tier's files, the probe's
snapshot, the counters on ``/metrics`` and, with a Mooncake tier, the master's keys
and mounted segments (its own ``/metrics``), every ``sample_every_s``."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

from soak.config import SoakConfig
from support.openai_server import Server, session_members

# Log lines that show a fault (counted in the served server's log).
LOG_MARKS = {"unusable": "is unusable", "write_failed": "disk tier: writing",
             "read_failed": "disk tier: reading", "breaker": "circuit breaker"}
# The Mooncake master's /metrics: name there -> name in a sample.
MASTER_METRICS = {"master_key_count": "mooncake_keys",
                  "master_total_capacity_bytes": "mooncake_segment_bytes",
                  "master_active_clients": "mooncake_clients"}


# /proc/<pid>/status lines summed over the server's processes -> name in a sample. RSS is
# split into anonymous, file-backed and shared memory, so a rise can be told apart (a
# heap that grows, a mapped file read, a shared segment touched for the first time).
STATUS_FIELDS = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes",
                 "RssFile:": "rss_file_bytes", "RssShmem:": "rss_shmem_bytes"}


def proc_stats(pids: list[int]) -> dict[str, float]:
    out = dict.fromkeys(STATUS_FIELDS.values(), 0)
    out.update(fds=0, threads=0, procs=len(pids))
    by_proc: dict[str, int] = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            out["fds"] += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for line in status.splitlines():
            head, _, rest = line.partition("\t")
            if head in STATUS_FIELDS:
                out[STATUS_FIELDS[head]] += int(rest.split()[0]) * 1024
            elif head == "Threads:":
                out["threads"] += int(rest.split()[0])
            elif head == "Name:":
                name = rest.strip()
        by_proc[f"{name}[{pid}]"] = out["rss_bytes"] - sum(by_proc.values())
    out["rss_by_proc"] = by_proc
    return out


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


def master_stats(master) -> dict[str, float | None]:
    """The Mooncake master's keys, mounted segment bytes and clients (None while it does
    not answer: frozen or killed); {} without a master."""
    if master is None:
        return {}
    out: dict[str, float | None] = dict.fromkeys(MASTER_METRICS.values())
    port = next((a.split("=", 1)[1] for a in (master.proc.args if master.proc else ())
                 if a.startswith("-metrics_port=")), None)
    if port is None:
        return out
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in MASTER_METRICS:
            out[MASTER_METRICS[name]] = float(value)
    return out


def sample(cfg: SoakConfig, server: Server, done: int, master=None) -> dict:
    probe = read_probe(cfg)
    row = {"t": time.monotonic(), "requests": done,
           **proc_stats([server.proc.pid, *session_members(server.proc.pid)]),
           **tree_stats(cfg.disk_path), **master_stats(master)}
    row.update({k: probe.get(k) for k in ("cpu_resident", "cpu_pinned", "cpu_evicted",
                                           "in_flight", "steps")})
    row.update({k: v for k, v in probe.items() if k.startswith("tier_")})
    row["step_hook_s"] = probe.get("step_hook_s", [])
    row["probe_t"] = probe.get("t")
    return row


async def sample_loop(cfg: SoakConfig, server: Server, outcomes: list, stop_at: float,
                      rows: list[dict], master=None) -> None:
    while time.monotonic() < stop_at:
        done = sum(1 for o in outcomes if o.status != "running")
        rows.append(await asyncio.to_thread(sample, cfg, server, done, master))
        await asyncio.sleep(cfg.sample_every_s)


async def observe(cfg: SoakConfig, server: Server) -> dict:
    """Counters, log-line counts and the probe's counts: a fault's evidence."""
    def read() -> dict:
        probe = read_probe(cfg)
        return {**counters(server), **log_marks(server),
                **{f"probe_{k}": v for k, v in probe.items()
                   if k == "cpu_evicted" or k.startswith("tier_evicted_")}}
    return await asyncio.to_thread(read)
