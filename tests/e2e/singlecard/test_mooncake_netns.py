"""Two engines on two "hosts" sharing KV through a ``mooncake_master`` on a third.

The other Mooncake tests run on loopback, where every component has the same
address: a wrong advertised hostname or segment address cannot fail there. Here
the master and each engine run in a network namespace of their own
(:mod:`support.netns`), joined by a bridge that exists only inside the test, and
each engine advertises its own address (``mooncake_local_hostname``). One
scenario, run once for the module:

1. engine A computes the documents; its writes land in the only segment of the
   pool, its own;
2. engine B starts only then (so the objects stay in A's segment), serves the
   documents from the store, reading them from A over TCP between namespaces,
   then runs its own cold pass;
3. A's link goes down (A keeps running and the master still lists its segment:
   packets to A are dropped without an answer, as when a host's link fails); B
   forgets what it knows of the store and serves the documents again.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from support import netns
from support.mooncake_master import master_binary, skip_reason

pytestmark = [pytest.mark.e2e, pytest.mark.two_cores,
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

BLOCK = 32  # EngineSpec's block size
BLOCK_BYTES = 2 * 32 * 2 * 128 * 2  # mooncake_engine.py's: the bytes of one block
MASTER_PORT = 50051  # any: nothing else listens in the master's namespace
# The master keeps a client's segment listed this long after its last heartbeat
# (Mooncake's default is 10 s): long enough that B's reads after the cut really
# go to A's address, instead of finding the objects gone.
CLIENT_TTL_S = 120
# A request may wait for an existence query and then a read, each at most
# mooncake_timeout_s; the margin is for computing it on a shared 2-core host.
MARGIN_S = 4.0
WAIT_S = 300
SCRIPT = os.path.join(os.path.dirname(__file__), "mooncake_engine.py")


def start_master(net: netns.Bridge, log) -> str:
    host = net.address["master"]
    net.spawn("master", [master_binary(), f"-rpc_port={MASTER_PORT}", f"-rpc_address={host}",
                         "-metrics_port=9003", "-enable_metric_reporting=false",
                         "-default_kv_lease_ttl=500", f"-client_ttl={CLIENT_TTL_S}"],
              stdout=log, stderr=subprocess.STDOUT)
    net.wait_listening("a", host, MASTER_PORT)  # across the bridge, as the engines reach it
    return f"{host}:{MASTER_PORT}"


def start_engine(net, name, model, master, sync, log, *options) -> subprocess.Popen:
    role = "writer" if name == "a" else "reader"
    return net.spawn(name, [sys.executable, SCRIPT, model, master, str(sync), name, role,
                            "--local-hostname", net.address[name], *options],
                     env=dict(os.environ, PYTHONHASHSEED="0"), stdout=log,
                     stderr=subprocess.STDOUT)


def wait_file(path, procs: dict, logs) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        for name, proc in procs.items():
            assert proc.poll() is None, (f"engine {name} exited ({proc.returncode}):\n"
                                         + logs[name].read_text()[-3000:])
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def hosts(tiny_model_dir, tmp_path_factory):
    reason = netns.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("mooncake-netns")
    sync = tmp / "sync"
    sync.mkdir()
    logs = {name: tmp / f"{name}.log" for name in ("master", "a", "b")}
    with netns.Bridge(["master", "a", "b"]) as net, \
            open(logs["master"], "w") as master_log, open(logs["a"], "w") as a_log, \
            open(logs["b"], "w") as b_log:
        master = start_master(net, master_log)
        procs = {"a": start_engine(net, "a", tiny_model_dir, master, sync, a_log,
                                   "--readers", "b", "--after", ""),
                 "b": start_engine(net, "b", tiny_model_dir, master, sync, b_log,
                                   "--start-after", "a.stored", "--after", "a.down",
                                   "--after-stage", "after_down", "--no-drain-after")}
        wait_file(sync / "b.read", procs, logs)
        wait_file(sync / "a.json", procs, logs)
        a_sent = net.tx_bytes("a")
        net.cut("a")
        (sync / "a.down").touch()
        wait_file(sync / "b.json", {"b": procs["b"]}, logs)
        results = {name: json.loads((sync / f"{name}.json").read_text()) for name in "ab"}
        results["a_sent_bytes"] = a_sent
        results["addresses"] = dict(net.address)
    return results


def test_the_second_host_reads_the_first_hosts_blocks_over_tcp(hosts):
    a, b = hosts["a"], hosts["b"]
    assert b["warm"] == b["cold"] == a["cold"]
    full = [(n - 1) // BLOCK * BLOCK for n in b["prompt_tokens"]]
    assert b["warm_cached"] == full and all(f >= 4 * BLOCK for f in full)
    read_blocks = sum(full) // BLOCK
    assert b["warm_totals"]["blocks_from_mooncake"] == read_blocks
    assert a["cold_totals"]["blocks_to_mooncake"] >= read_blocks
    assert b["cold_cached"] == [0] * len(full)
    # The blocks crossed the bridge: A's interface sent at least their bytes (A's
    # writes to its own segment never leave its namespace).
    assert hosts["a_sent_bytes"] >= read_blocks * BLOCK_BYTES


def test_cutting_the_first_host_off_mid_run_degrades_the_second_to_recompute(hosts):
    b = hosts["b"]
    assert b["after_down"] == b["cold"]  # no wrong token
    before = b["warm_totals"].get("blocks_from_mooncake", 0)
    assert b["after_down_totals"].get("blocks_from_mooncake", 0) == before
    # B did go to the store for them, and gave up on A instead of waiting for it.
    totals = b["after_down_totals"]
    assert totals.get("mooncake_timeouts", 0) + totals.get("mooncake_failed_blocks", 0) > 0
    bound_s = 2 * b["mooncake_timeout_s"] + MARGIN_S
    assert max(b["after_down_request_s"]) < bound_s, b["after_down_request_s"]
