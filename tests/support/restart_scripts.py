"""Running the warm-restart tests' engines: each one a user's script in its own process.

The script is ``tests/e2e/singlecard/restart_engine.py`` (what it does, and how it ends,
is said there). Nothing here waits for the connector: a script generates, prints its
result line and ends as it was told.
"""

import collections
import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)  # this checkout's kvoffload_hal, whatever is installed
SCRIPT = os.path.join(TESTS, "e2e", "singlecard", "restart_engine.py")
RESULT = "restart-engine: "
NUM_DOCS = 8
HIT_TOKENS = 5 * 32  # each document: 182 prompt tokens, 5 full blocks of 32 tokens


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, TESTS, os.environ.get("PYTHONPATH")) if p)
    # vLLM's default: the engine core in its own process (this suite's conftest sets 0).
    return dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=path,
                VLLM_ENABLE_V1_MULTIPROCESSING="1")


def start(model: str, disk, end: str, *flush_s: str) -> subprocess.Popen:
    """One script on ``disk``, ending as ``end`` says (``FLUSH_S`` when given)."""
    return subprocess.Popen([sys.executable, SCRIPT, model, str(disk), end, *flush_s],
                            env=_env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def result_line(proc: subprocess.Popen) -> dict:
    """The script's result: each request's tokens and cached tokens."""
    tail: collections.deque[str] = collections.deque(maxlen=40)  # vLLM logs to stdout
    for line in proc.stdout:
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
        tail.append(line)
    raise AssertionError(f"the engine printed no result (exit code {proc.wait()}); "
                         f"its last lines:\n{''.join(tail)}")


def result(proc: subprocess.Popen, timeout_s: float = 420) -> dict:
    """The result of a script that ends by itself, once it ended well."""
    out = result_line(proc)
    proc.wait(timeout=timeout_s)
    assert proc.returncode == 0, f"engine exited with {proc.returncode}"
    return out


def new_disk(tmp_path, name: str = "kv"):
    disk = tmp_path / name
    disk.mkdir(mode=0o700)
    return disk
