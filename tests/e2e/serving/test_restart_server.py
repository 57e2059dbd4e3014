"""A server stopped and started again on the same ``disk_path``: its first completion is
served from what the stopped one kept, with the cold run's completion.

As an operator restarts: two prompts, SIGTERM, a new server, the same prompts as soon
as ``/health`` answers. Nothing waits for the connector in between. The new server's
device and CPU caches are empty, so the tokens it reports cached came from disk.

The last prompt asks for one token, so its blocks are written only in the engine's
steps after it answered: the stopped server must finish them as it stops. vLLM kills
the engine core at once when the server is given no ``--shutdown-timeout`` (its
default, 0), so these servers get one, as the README advises for a disk tier.
"""

from __future__ import annotations

import json
import signal

import pytest

from kvoffload_hal.demo.inprocess import CONNECTOR
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.openai_server import BLOCK_SIZE, Server, tracebacks

pytestmark = pytest.mark.e2e

NUM_GPU_BLOCKS = 40
PROMPT_BLOCKS = 5  # synthetic_text(180) is 181 tokens: 5 full blocks
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_SIZE * 4  # K,V x 2 layers x 2 heads x 64 x 32 x fp32


def _server(model: str, log, disk) -> Server:
    config = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 4 * BLOCK_BYTES,
                                            "disk_path": str(disk),
                                            "disk_bytes_to_use": 200 * BLOCK_BYTES}}
    return Server(model, log, num_gpu_blocks=NUM_GPU_BLOCKS, offload=False,
                  extra_args=["--kv-transfer-config", json.dumps(config),
                              "--shutdown-timeout", "30"])


def _complete(server: Server, prompt: str, max_tokens: int):
    return server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        logprobs=1, extra_body={"ignore_eos": True})


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details  # vLLM 0.23 leaves it out at 0
    return details.cached_tokens if details is not None else 0


def test_the_first_completion_after_a_restart_comes_from_disk(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the same block hashes in both servers
    disk = tmp_path / "kv"
    disk.mkdir(mode=0o700)
    prompts = {synthetic_text(180, seed=801): 8, synthetic_text(180, seed=802): 1}
    first = _server(tiny_model_dir, tmp_path / "first.log", disk)
    try:
        first.wait_ready()
        cold = [_complete(first, p, n) for p, n in prompts.items()]
        assert first.stop(signal.SIGTERM, 60) < 60
    finally:
        first.kill()
    second = _server(tiny_model_dir, tmp_path / "second.log", disk)
    try:
        second.wait_ready()
        # The last prompt first: the first completion after /health.
        warm = [_complete(second, p, n) for p, n in reversed(prompts.items())][::-1]
    finally:
        second.kill()
    assert [_cached(r) for r in cold] == [0, 0]
    assert [_cached(r) for r in warm] == [PROMPT_BLOCKS * BLOCK_SIZE] * 2
    for w, c in zip(warm, cold):
        assert w.choices[0].text == c.choices[0].text
        assert w.choices[0].logprobs.tokens == c.choices[0].logprobs.tokens
        assert w.choices[0].logprobs.token_logprobs == pytest.approx(
            c.choices[0].logprobs.token_logprobs, abs=1e-4)
    for server in (first, second):
        ours = [tb for tb in tracebacks(server.log()) if "kvoffload_hal" in tb]
        assert not ours, "\n\n".join(ours)
