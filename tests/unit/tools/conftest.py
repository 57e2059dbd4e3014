"""The GPU bundle's tools (tools/gpu/) and the benchmarks are scripts, not packages:
put their folders on the path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
for folder in (ROOT / "tools" / "gpu", ROOT / "benchmarks"):
    sys.path.insert(0, str(folder))
