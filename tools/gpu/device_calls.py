"""The device calls that send a built bundle and run it, one per part, in order.

    python tools/gpu/device_calls.py [build/gpu_bundle] [--qa "ARGS"]

Prints a JSON list: each call's ``command``, ``carry`` (paths relative to the
repository root: the manifest and one part) and ``timeout_s``. Every call but the
last keeps its part (``gpu_run.py receive``); the last keeps its own and runs
``run_on_gpu.sh``. They must follow each other closely: the machine keeps the parts
only while it stays held.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bundle_parts  # noqa: E402

ROOT = HERE.parent.parent
RECEIVE = "python3 tools/gpu/gpu_run.py receive build/gpu_bundle/parts"
RUN = "tools/gpu/run_on_gpu.sh $OUT"
RECEIVE_TIMEOUT_S, RUN_TIMEOUT_S = 60, 600


def device_calls(parts_dir: Path, qa_args: str = "") -> list[dict]:
    manifest = bundle_parts.load_manifest(parts_dir / bundle_parts.MANIFEST)
    rel = parts_dir.resolve().relative_to(ROOT)
    names = [p["name"] for p in manifest["parts"]]
    calls = [dict(command=RECEIVE, carry=[str(rel / bundle_parts.MANIFEST), str(rel / n)],
                  timeout_s=RECEIVE_TIMEOUT_S) for n in names]
    calls[-1].update(command=f"{RUN} {qa_args}".strip(), timeout_s=RUN_TIMEOUT_S)
    return calls


def main(argv: list[str]) -> int:
    qa = argv[argv.index("--qa") + 1] if "--qa" in argv else ""
    rest = [a for i, a in enumerate(argv) if a != "--qa" and (i == 0 or argv[i - 1] != "--qa")]
    out = Path(rest[0]) if rest else ROOT / "build" / "gpu_bundle"
    print(json.dumps(device_calls(out / "parts", qa), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
