"""Import check of a bundle on a stand-in for the GPU machine (needs the network).

    python tools/gpu/import_check.py [--out build/gpu_bundle] [--python312 PATH]

Builds ``OUT/machine312``, a CPython 3.12 venv holding what the bundle takes from
the machine (``report.json``'s ``from_machine``: torch 2.11.0 and the machine's
known versions, the latest release of the others), installs the bundle's wheels
as the GPU side does (``pip install --no-index --no-deps --target OUT/site312``),
then runs ``preflight.py`` there: the requirement check against that environment
and the imports of the engine run's modules, but for those whose kernels need the
driver library (``libcuda.so.1``) where it does not load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bundle_deps  # noqa: E402
from build_bundle import ROOT, find_python312  # noqa: E402


def machine_requirements(report: dict, machine: dict) -> list[str]:
    """What the stand-in installs: each distribution taken from the machine, at the
    machine's version where known."""
    out = []
    for name in report["from_machine"]:
        version = machine.get(name)
        out.append(f"{name}=={version}" if version else name)
    return out


def build_standin(python312: str, venv: Path, requirements: list[str]) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([python312, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *requirements], check=True)
    return py


def install_bundle(py: Path, payload: Path, site: Path) -> None:
    shutil.rmtree(site, ignore_errors=True)
    wheels = [str(w) for w in sorted(payload.glob("*.whl"))]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site), *wheels], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_bundle")
    parser.add_argument("--python312", default=None)
    args = parser.parse_args(argv)
    report = json.loads((args.out / "report.json").read_text())
    requirements = machine_requirements(report, bundle_deps.load_machine())
    py = build_standin(args.python312 or find_python312(), args.out / "machine312",
                       requirements)
    site = args.out / "site312"
    install_bundle(py, args.out / "payload", site)
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_TARGET_DEVICE="cuda")
    cmd = [str(py), str(HERE / "preflight.py"), str(site), "--without-driver"]
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
