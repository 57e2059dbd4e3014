"""The soak driver's parts (``benchmarks/soak.py`` runs them).

``config``: the run's settings and the one place the tier chain is configured;
``stack``: the servers, the tmpfs under ``disk_path`` and a Mooncake master;
``probe_connector``: the connector with its scheduler hooks timed and its tiers
read, once a second, into a file; ``workload``: the streaming clients;
``faults``: what is injected; ``sampler``: what is watched; ``checks`` and
``report``: the verdicts, the table and the plot.
"""

import sys
from pathlib import Path

# tests/support: the server and Mooncake master wrappers the tests use too.
_TESTS = str(Path(__file__).resolve().parents[2] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
