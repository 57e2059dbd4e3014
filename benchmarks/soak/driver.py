"""The soak run, start to end: load and faults, idle, the reference replay, shutdown,
then the checks. :func:`run` returns a :class:`Result`; ``benchmarks/soak.py`` prints
it, the e2e test asserts it."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from dataclasses import dataclass, field

from soak import checks, reference_load, report, sampler, workload
from soak.config import SoakConfig, tier_names, uses_disk
from soak.faults import Fault, enabled, fault_loop
from soak.stack import stack
from support.openai_server import Server, tracebacks

IDLE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# vLLM's logger prefix ("(EngineCore pid=12) ERROR 11-28 18:18:15 [core.py:1512] "): a
# traceback logged through it has it on every line.
LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                        r"\d\d-\d\d [\d:.]+ \[[^\]]+\] ?", re.MULTILINE)


def our_tracebacks(log: str) -> list[str]:
    """Tracebacks through kvoffload_hal, printed or logged by vLLM's logger."""
    return [tb for tb in tracebacks(LOG_PREFIX.sub("", log)) if "kvoffload_hal" in tb]


@dataclass
class Result:
    checks: list[checks.Check]
    figures: dict[str, str]
    rows: list[dict] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    outcomes: list[workload.Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def table(self) -> str:
        return report.table(self.checks, self.figures)


async def load(cfg: SoakConfig, served: Server, master, names: list[str]):
    """Clients, sampler and faults for ``cfg.minutes``: (outcomes, rows, faults)."""
    outcomes: list[workload.Outcome] = []
    rows: list[dict] = []
    faults: list[Fault] = []
    rng = random.Random(cfg.seed)
    stop_at = time.monotonic() + cfg.minutes * 60
    client = served.async_client()
    deadline = cfg.request_deadline_s

    ops = workload.FaultOps(client, served.model, rng, outcomes, deadline)
    ops.clients_go.set()

    async def observe() -> dict:
        return await sampler.observe(cfg, served)

    try:
        await asyncio.gather(
            *(workload.client_loop(client, served.model, random.Random(cfg.seed * 1000 + i),
                                   stop_at, outcomes, deadline, go=ops.clients_go)
              for i in range(cfg.clients)),
            sampler.sample_loop(cfg, served, outcomes, stop_at, rows, master),
            fault_loop(cfg, names, rng, stop_at, master, ops, observe, faults))
        await asyncio.sleep(5)  # the last fault's effects reach the counters
        if faults:
            faults[-1].after = await observe()
    finally:
        await client.close()
    return outcomes, rows, faults


def wait_idle(cfg: SoakConfig) -> dict:
    """The probe's snapshot once nothing is in flight and no CPU block is pinned."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        time.sleep(1.5)
        probe = sampler.read_probe(cfg)
        idle = probe.get("in_flight") == 0 and probe.get("cpu_pinned") == 0
        if idle or time.monotonic() > deadline:
            time.sleep(1.5)  # one more snapshot, the idle one
            return sampler.read_probe(cfg)


async def replay(reference: Server, chosen: list[workload.Outcome], clients: int):
    """Each chosen request again on the reference engine: (got, expected) token lists."""
    client = reference.async_client()
    gate = asyncio.Semaphore(clients)

    async def one(o: workload.Outcome) -> tuple[list[int], list[int]]:
        async with gate:
            again = workload.Outcome(o.kind, o.prompt, o.max_tokens, time.monotonic())
            await workload.stream(client, reference.model, again, None, 300)
            return o.tokens, again.tokens

    try:
        return await asyncio.gather(*(one(o) for o in chosen))
    finally:
        await client.close()


def sample_for_reference(cfg: SoakConfig, outcomes: list) -> list:
    done = [o for o in outcomes if o.status == "ok"]
    n = min(cfg.max_reference, max(1, int(len(done) * cfg.reference_share)))
    return random.Random(cfg.seed + 1).sample(done, min(n, len(done)))


def run(cfg: SoakConfig, model: str) -> Result:
    with stack(cfg, model) as (served, reference, master, mounted):
        names, left_out = enabled(cfg, mounted)
        started = time.monotonic()
        outcomes, rows, faults = asyncio.run(load(cfg, served, master, names))
        probe = wait_idle(cfg)
        rows.append(sampler.sample(cfg, served, len(outcomes), master))
        metrics = sampler.counters(served)
        compared = asyncio.run(replay(reference, sample_for_reference(cfg, outcomes),
                                      cfg.clients))
        reference_rows = (asyncio.run(reference_load.drive(cfg, reference, rows[-1]["requests"]))
                          if cfg.reference_load and rows else None)
        stop_s = served.stop(signal.SIGTERM, STOP_TIMEOUT_S)
        files_left = sampler.files_left(cfg.disk_path) if uses_disk(cfg) else None
        ours = our_tracebacks(served.log())
    found = [checks.token_checks(compared), *checks.outcome_checks(outcomes, cfg),
             *checks.leak_checks(rows, cfg, reference_rows),
             *checks.balance_checks(cfg, probe, metrics, files_left),
             *checks.fault_checks(faults),
             checks.Check("server stops on SIGTERM", f"{stop_s:.1f} s", f"< {STOP_TIMEOUT_S:g} s",
                          stop_s < STOP_TIMEOUT_S),
             checks.Check("tracebacks from kvoffload_hal in the log", str(len(ours)), "0",
                          not ours)]
    figures = figures_of(cfg, rows, outcomes, faults, metrics, time.monotonic() - started)
    figures["faults left out"] = "; ".join(left_out) or "none"
    return Result(found, figures, rows, faults, outcomes)


def figures_of(cfg: SoakConfig, rows, outcomes, faults, metrics, seconds: float) -> dict:
    p50, p99, steps = checks.hook_stats(checks.after_warmup(rows, cfg))
    first, last = (checks.after_warmup(rows, cfg) or rows or [{}])[0], rows[-1] if rows else {}
    kinds = {k: sum(1 for o in outcomes if o.kind == k) for k in ("system", "document",
                                                                  "oneoff", "burst",
                                                                  "fault-probe")}
    return {
        "run": f"{cfg.minutes:g} min of load, {seconds / 60:.1f} min in all, "
               f"{cfg.clients} streaming clients, tiers: "
               + " -> ".join(("CPU", *tier_names(cfg))),
        "requests by kind": ", ".join(f"{k} {v}" for k, v in kinds.items()),
        "faults injected": ", ".join(f"{f.name} ({f.detail})" for f in faults) or "none",
        "scheduler hooks per step, p50 / p99": f"{p50:.3f} / {p99:.3f} ms over {steps} "
                                               "sampled steps after warm-up",
        "RSS after warm-up / at the end (anonymous, file, shared)": " / ".join(
            f"{r.get('rss_bytes', 0) / 2**20:.0f} ({r.get('rss_anon_bytes', 0) / 2**20:.0f}, "
            f"{r.get('rss_file_bytes', 0) / 2**20:.0f}, {r.get('rss_shmem_bytes', 0) / 2**20:.0f})"
            for r in (first, last)) + " MiB",
        "RSS at the end by process": ", ".join(
            f"{name} {b / 2**20:.0f}" for name, b in last.get("rss_by_proc", {}).items()) + " MiB",
        "fds, threads after warm-up / at the end": f"{first.get('fds')}, {first.get('threads')}"
                                                   f" / {last.get('fds')}, {last.get('threads')}",
        "counters": ", ".join(f"{k} {v:g}" for k, v in sorted(metrics.items())
                              if v and not k.endswith("seconds")),
    }
