"""Check a bundle's wheels offline, for CPython 3.12 on manylinux x86_64.

    python tools/gpu/check_bundle.py build/gpu_bundle/payload

1. the set (``bundle_deps.check_set``): every needed distribution is in the
   bundle or on the machine, once, and every requirement among them holds;
2. pip itself, with no index: ``pip install --dry-run --no-index --no-deps`` of
   every wheel for the target's tags (a wheel built for another Python or
   platform, or two versions of one distribution, fail here).

Exit status 0 when both pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bundle_deps  # noqa: E402

TARGET_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
               "--abi", "abi3", "--abi", "none"]
TARGET_PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
                    + ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"])


def pip_dry_run(wheels: list[Path]) -> tuple[bool, str]:
    """pip's own verdict on installing ``wheels`` for the target, offline."""
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
               "--no-deps", "--ignore-installed", "--only-binary=:all:", "--target", target,
               *TARGET_TAGS]
        for platform in TARGET_PLATFORMS:
            cmd += ["--platform", platform]
        proc = subprocess.run(cmd + [str(w) for w in wheels], capture_output=True, text=True)
    text = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0, text.splitlines()[-1] if text else ""


def check(payload: Path, needed: list[str] | None = None, machine: dict | None = None) -> dict:
    """Both checks on the wheels under ``payload``; a JSON-ready report."""
    needed = bundle_deps.load_needed() if needed is None else needed
    machine = bundle_deps.load_machine() if machine is None else machine
    wheels = sorted(Path(payload).glob("*.whl"))
    dists = [bundle_deps.wheel_dist(w) for w in wheels]
    result = bundle_deps.check_set(dists, needed, machine)
    pip_ok, pip_line = pip_dry_run(wheels) if wheels else (False, "no wheels")
    problems = list(result.problems)
    if not pip_ok:
        problems.append(f"pip --dry-run: {pip_line}")
    return dict(ok=not problems, problems=problems, pip=pip_line,
                wheels=[(w.name, w.stat().st_size) for w in wheels],
                from_machine=sorted(n for n in needed if n not in {d.name for d in dists}),
                left_out=result.left_out, trusted=result.trusted)


def summary(report: dict) -> str:
    size = sum(s for _, s in report["wheels"])
    lines = [f"{len(report['wheels'])} wheels, {size / 2**20:.1f} MiB; "
             f"{len(report['from_machine'])} needed distributions from the machine; "
             f"{len(report['left_out'])} requirements on distributions the run does not import; "
             f"{len(report['trusted'])} lower bounds trusted to the machine's newer image",
             f"pip: {report['pip']}"]
    if "parts" in report:
        lines.append(f"payload {report['payload_bytes'] / 2**20:.1f} MiB in "
                     f"{len(report['parts'])} parts")
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    lines.append("offline check: " + ("PASS" if report["ok"] else "FAIL"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    report = check(Path(argv[0]))
    print(json.dumps({k: report[k] for k in ("problems", "left_out", "trusted")}, indent=1))
    print(summary(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
