"""The soak driver's short run: the served connector, its whole chain of tiers (CPU ->
disk -> Mooncake; the disk tier alone where no Mooncake master can run), under concurrent
streaming clients and random faults for about a minute (``benchmarks/soak.py`` runs it for
as long as asked).

What a user sees is checked from outside: every greedy completion of a sampled share
equals the reference engine's (a server without the connector), token for token; no
HTTP error, every request ends within its deadline; the server's memory, open fds,
threads and the files under ``disk_path``, idle at the end, stay within the bounds of
``benchmarks/soak/checks.py`` from just after warm-up (their slopes per request are
shown; the long runs judge them); each tier's counters balance once idle and
no CPU-tier block stays pinned; each fault shows in a counter or a log line; SIGTERM
ends the server with nothing left under ``disk_path``. The connector is measured
through a subclass that only times its scheduler hooks and reads its tiers
(``benchmarks/soak/probe_connector.py``).

CI's time is short: the run is on the vLLM 0.32 lane only (the whole suite runs there
and on 0.23; the tiers and faults do not depend on the vLLM release).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

# make test runs it on the vLLM 0.32 lane only (CI time).
pytestmark = [pytest.mark.e2e, pytest.mark.two_cores, pytest.mark.main_lane]


def test_a_short_soak_under_faults_stays_correct_and_leaks_nothing(tiny_model_dir, tmp_path):
    from soak.config import SoakConfig
    from soak.driver import run

    from support.mooncake_master import skip_reason

    # A minute's slopes are the server's warm-up and the disk tier refilling what a fault
    # deleted, not leaks: the files a 'remove' deleted come back, and vLLM's CPU worker
    # grows for its first thousands of requests with or without a connector (the
    # reference engine under the same clients grew 460 MiB over 2700 requests). The short
    # run holds the idle-vs-warm-up bounds (fds, threads, files under disk_path) and
    # judges RSS growth against the reference engine's under the same load over the same
    # requests; the long runs (docs/benchmarks/soak/) judge the slopes.
    # The Mooncake master's faults (frozen, killed) run in the long soak only: a freeze
    # with two Mooncake jobs overdue at once can stop the engine (docs/benchmarks/soak/).
    faults = ("enospc", "damage", "remove", "burst")
    cfg = SoakConfig(minutes=1.25, clients=4, work_dir=tmp_path, warmup_s=10.0,
                     tiers="chain" if skip_reason() is None else "disk",
                     fault_every_s=(2.0, 3.0), fault_hold_s=4.0, request_deadline_s=90.0,
                     sample_every_s=1.0, reference_share=0.3, max_reference=40,
                     faults=faults, fault_rounds=1, min_leak_requests=sys.maxsize,
                     reference_load=True, rss_slack_bytes=128 << 20)
    result = run(cfg, tiny_model_dir)
    failed = [c for c in result.checks if not c.ok]
    assert not failed, result.table()
    assert {f.name for f in result.faults} == set(faults), result.table()
