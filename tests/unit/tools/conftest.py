"""The GPU bundle's tools (tools/gpu/) and the benchmarks are scripts, not packages:
put their folders on the path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
for folder in (ROOT / "tools" / "gpu", ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # after everything else: shadows nothing
