"""Hosts of their own for one test: network namespaces joined by a private bridge.

``with Bridge(["master", "a", "b"]) as net:`` gives each node a network namespace
with loopback up and one interface, ``eth0``, at ``net.address[node]`` on a /24.
The other end of each ``eth0`` (a veth pair) is a port of a bridge that lives in a
namespace of its own, so nothing is added to the host's namespace, and no node has
a route beyond the bridge's subnet: the nodes reach each other and nothing else.

:meth:`Bridge.spawn` runs a command inside a node's namespace; leaving the block
kills every process spawned so, then deletes every namespace, on failure too.
:func:`skip_reason` says why namespaces cannot be made here (no ``ip`` command:
Debian's ``iproute2``; not root; ``ip netns add`` refused).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

# A private (RFC 1918) subnet that exists only inside the test's namespaces: the
# host's own routes never see it, so it cannot clash with the host's networks.
SUBNET = "10.231.7"
IFACE = "eth0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def skip_reason() -> str | None:
    """Why network namespaces cannot be created here, or None (creates and deletes one)."""
    if shutil.which("ip") is None:
        return "no `ip` command to create network namespaces (Debian package iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvt{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    ip("netns", "del", probe, check=False)
    return None


class Bridge:
    """Namespaces for ``nodes`` on one bridge; see the module docstring."""

    def __init__(self, nodes: Sequence[str], tag: str | None = None) -> None:
        tag = tag or f"kvt{os.getpid()}"
        self.bridge_ns = f"{tag}-br"
        self.netns = {node: f"{tag}-{node}" for node in nodes}
        self.address = {node: f"{SUBNET}.{i}" for i, node in enumerate(nodes, start=1)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def up(self) -> Bridge:
        self._add_netns(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for node, ns in self.netns.items():
            self._add_netns(ns)
            port = f"v-{node}"
            ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
               "peer", "name", IFACE, "netns", ns)
            ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address[node]}/24", "dev", IFACE)
            ip("-n", ns, "link", "set", IFACE, "up")
        return self

    def _add_netns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns[node], *argv]

    def spawn(self, node: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """``argv`` inside ``node``'s namespace, in a session of its own (killed at exit)."""
        proc = subprocess.Popen(self.command(node, argv), start_new_session=True,
                                **popen_kwargs)
        self.procs.append(proc)
        return proc

    def wait_listening(self, node: str, address: str, port: int,
                       timeout_s: float = 20.0) -> None:
        """Until a TCP connection from ``node``'s namespace to ``address:port`` opens."""
        probe = ("import socket, sys, time\n"
                 f"end = time.monotonic() + {timeout_s}\n"
                 "while True:\n"
                 "    try:\n"
                 f"        socket.create_connection(({address!r}, {port}), 0.5).close()\n"
                 "        break\n"
                 "    except OSError:\n"
                 f"        if time.monotonic() > end: sys.exit('{address}:{port} not reached')\n"
                 "        time.sleep(0.05)\n")
        subprocess.run(self.command(node, [sys.executable, "-c", probe]), check=True,
                       timeout=timeout_s + 10)

    def cut(self, node: str) -> None:
        """Take ``node`` off the network: its interface goes down, its processes stay.
        Packets to it are dropped without an answer, as when a host's link fails."""
        ip("-n", self.netns[node], "link", "set", IFACE, "down")

    def tx_bytes(self, node: str) -> int:
        """Bytes ``node`` has sent on its interface (to the other nodes)."""
        shown = json.loads(ip("-j", "-s", "-n", self.netns[node], "link", "show", IFACE).stdout)
        return int(shown[0]["stats64"]["tx"]["bytes"])

    def down(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Bridge:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
