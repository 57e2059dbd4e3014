"""A real ``mooncake_master`` on a free loopback port, for the Mooncake tier's tests.

:func:`skip_reason` says why the tests cannot run here (no binary, or the
client library cannot load: the Debian packages ``libibverbs1 librdmacm1
libnuma1`` are missing); ``make test`` installs both where it can.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MASTER_START_TIMEOUT_S = 20.0


def master_binary() -> str | None:
    """``mooncake_master`` of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    return shutil.which("mooncake_master")


def skip_reason() -> str | None:
    if master_binary() is None:
        return ("mooncake_master not found: pip install 'kvoffload-hal[mooncake]' "
                "(make venv does)")
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return (f"mooncake.store does not load ({e}): apt-get install -y libibverbs1 "
                "librdmacm1 libnuma1 (make venv does, as root)")
    return None


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now: each is held until all are chosen, so the
    system never hands out one of them twice (ports asked for one after the other can
    repeat, and a master whose metrics port was its RPC port exited at start-up)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class MooncakeMaster:
    """``with MooncakeMaster() as m:`` runs a master at ``m.address`` until the block ends.

    ``flags``: more command-line flags (``-client_ttl=2``). :meth:`start` after
    :meth:`kill` runs a new master on the same port, with nothing of the old one's
    state (its log appended to the same file).
    """

    def __init__(self, log_path: str | None = None, flags: tuple[str, ...] = ()) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.flags = tuple(flags)
        self.proc: subprocess.Popen | None = None

    def start(self) -> MooncakeMaster:
        binary = master_binary()
        assert binary is not None, skip_reason()
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [binary, f"-rpc_port={self.port}", "-rpc_address=127.0.0.1",
             f"-metrics_port={self.metrics_port}", "-enable_metric_reporting=false",
             "-default_kv_lease_ttl=500", *self.flags],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.address}")

    def kill(self) -> None:
        """SIGKILL: the master is gone at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()  # a stopped master would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
