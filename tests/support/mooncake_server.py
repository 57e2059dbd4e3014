"""vLLM's OpenAI server with a Mooncake tier, for the tests of a master that fails.

:func:`start_server` runs one server (engine core in a process of its own) on
the tiny model with a small CPU tier (LRU), so that a prompt leaves the CPU
tier after a few others and its next read must come from the store.
:class:`Probe` sends greedy completions and reads the connector's counters
from ``/metrics``; :func:`cpu_seconds` sums the CPU time of every process of
the server's session (the API server, the engine core, anything they spawned).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kvoffload_hal.demo.inprocess import CONNECTOR
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.openai_server import BLOCK_SIZE, Server, session_members

BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_SIZE * 4  # K,V x 2 layers x 2 heads x 64 x 32 x fp32
PROMPT_BLOCKS = 5  # synthetic_text(180) is 181 tokens: 5 full blocks
CPU_BLOCKS = 12  # three other prompts push a prompt out of the CPU tier
TIMEOUT_S = 2.0  # mooncake_timeout_s
TICKS = os.sysconf("SC_CLK_TCK")
# vLLM's log line when it cannot reset its prefix cache (a block still in use).
RESET_REFUSED = "Failed to reset prefix cache"
RESET_WAIT_S = 30.0


def start_server(model: str, master: str, log_path: Path, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> Server:
    """``timeout_s``: ``mooncake_timeout_s``; short, for the tests of a master that
    fails; a test of what the store serves gives a loaded host more."""
    config = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {
                  # lru: the oldest prompt leaves the CPU tier first (the adaptive
                  # order may keep it, by what happened to earlier prompts)
                  "cpu_bytes_to_use": CPU_BLOCKS * BLOCK_BYTES, "eviction": "lru",
                  "mooncake_master": master,
                  "mooncake_segment_bytes": 16 << 20, "mooncake_buffer_bytes": 16 << 20,
                  "mooncake_timeout_s": timeout_s, "mooncake_connect_timeout_s": 1.0,
                  "mooncake_required": True}}
    server = Server(model, log_path, num_gpu_blocks=40, offload=False,
                    extra_args=["--kv-transfer-config", json.dumps(config), *extra_args],
                    env=env)
    try:
        server.wait_ready()
    except BaseException:
        server.kill()
        raise
    return server


def prompt(seed: int) -> str:
    return synthetic_text(180, seed=seed)


class Probe:
    """Completions and counters of one server."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.client = server.client()

    def complete(self, seed: int, rank: int | None = None) -> tuple[str, int]:
        """The greedy completion of ``prompt(seed)`` and its cached prompt tokens;
        ``rank``: the data-parallel rank that serves it (vLLM's routing header)."""
        headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
        response = self.client.completions.create(
            model=self.server.model, prompt=prompt(seed), max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True}, extra_headers=headers)
        details = response.usage.prompt_tokens_details  # vLLM 0.23 leaves it out at 0
        return response.choices[0].text, details.cached_tokens if details is not None else 0

    def counters(self, engine: int | None = None) -> dict[str, float]:
        """The connector's counters, of every engine or of data-parallel rank ``engine``."""
        families = self.server.metrics(by_engine=engine is not None)
        prefix = "vllm:kvoffload_hal_"
        wanted = None if engine is None else ("engine", str(engine))
        return {name[len(prefix):]: sum(v for labels, v in samples.items()
                                        if wanted is None or wanted in labels)
                for name, samples in families.items()
                if name.startswith(prefix) and not name.endswith("_created")}

    def settled(self, ready, timeout_s: float = 20.0,
                engine: int | None = None) -> dict[str, float]:
        """Counters once ``ready(counters)`` holds (stats reach /metrics a step late);
        the last ones read when it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = self.counters(engine)
            if ready(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.25)

    def reset_device_cache(self, timeout_s: float = RESET_WAIT_S) -> None:
        """Empty vLLM's device prefix cache. vLLM refuses while a block is in use (a
        store's copy holds its device blocks until it lands) and says so only in its
        log, the endpoint answering 200 all the same: ask again until it takes."""
        deadline = time.monotonic() + timeout_s
        while True:
            refused = self.server.log().count(RESET_REFUSED)
            assert self.server.post("/reset_prefix_cache") == 200
            time.sleep(0.2)  # for the engine's log line, where it refused
            if self.server.log().count(RESET_REFUSED) == refused:
                return
            assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
            time.sleep(0.5)


def cpu_seconds(sid: int) -> float:
    """User + system CPU time of the live processes of session ``sid``."""
    total = 0
    for pid in session_members(sid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def idle_cores(sid: int, seconds: float) -> float:
    """Cores the session used on average over ``seconds`` of doing nothing."""
    before, started = cpu_seconds(sid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(sid) - before) / (time.monotonic() - started)
