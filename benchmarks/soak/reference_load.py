"""The reference engine (a server without the connector) under the served run's client
load, for as many requests as the served run ended: how much vLLM's own processes grow
over the same requests.

vLLM's CPU worker grows for its first few thousand requests whether a connector runs or
not (about 460 MiB over the short run's 2500 requests on a 2-core host, then flat in the
long runs): a one-minute run cannot tell that from a leak by its own RSS alone. With
``SoakConfig.reference_load`` the served server's RSS growth after warm-up is judged
against the reference's growth over the same span of requests (:mod:`.checks`).
"""

from __future__ import annotations

import asyncio
import random
import time

from soak import sampler, workload
from soak.config import SoakConfig
from support.openai_server import Server, session_members


def rss_row(server: Server, done: int) -> dict:
    return {"t": time.monotonic(), "requests": done,
            **sampler.proc_stats([server.proc.pid, *session_members(server.proc.pid)])}


async def drive(cfg: SoakConfig, reference: Server, upto: int) -> list[dict]:
    """The clients of the served run against ``reference`` until ``upto`` requests ended
    (at most twice the served run's time); RSS samples by requests ended, the last
    taken once idle."""
    outcomes: list[workload.Outcome] = []
    rows: list[dict] = []
    stop_at = time.monotonic() + 2 * cfg.minutes * 60

    def ended() -> int:
        return sum(1 for o in outcomes if o.status != "running")

    async def sample_loop() -> None:
        while time.monotonic() < stop_at and ended() < upto:
            rows.append(await asyncio.to_thread(rss_row, reference, ended()))
            await asyncio.sleep(cfg.sample_every_s)

    client = reference.async_client()
    try:
        await asyncio.gather(
            *(workload.client_loop(client, reference.model, random.Random(cfg.seed * 1000 + i),
                                   stop_at, outcomes, cfg.request_deadline_s,
                                   until=lambda: ended() >= upto)
              for i in range(cfg.clients)),
            sample_loop())
    finally:
        await client.close()
    await asyncio.sleep(2)  # idle, as the served run's last sample
    rows.append(await asyncio.to_thread(rss_row, reference, ended()))
    return rows


def rss_at(rows: list[dict], requests: int) -> int:
    """RSS at the first sample with ``requests`` ended (the last sample if none)."""
    return next((r["rss_bytes"] for r in rows if r["requests"] >= requests),
                rows[-1]["rss_bytes"])
