"""The GPU side: receive the bundle's parts, install it, run the e2e tests and the QA.

    python3 tools/gpu/gpu_run.py receive DIR     # after each transfer: keep DIR's parts
    python3 tools/gpu/gpu_run.py run --out DIR [--dry-run] [--steps preflight e2e qa]

``receive`` checks each part of ``DIR`` against the manifest (sha256) and keeps it in
the stash (``--stash``, default /root/kvoffload_bundle), then says which are missing.
``run`` assembles the parts (every file checked), installs the wheels with
``pip install --no-index --no-deps --target``, unpacks the tests and benchmarks, and
runs each step with the installed packages first on ``PYTHONPATH``:

- ``preflight``: imports what the engine run imports, checks every installed
  distribution's requirements against what the machine really has;
- ``e2e``: the single-card accuracy tests with ``KVOFFLOAD_HAL_BACKEND=cuda``;
- ``qa``: ``benchmarks/gpu_long_doc_qa.py`` (our connector beside vLLM's).

Each step's output goes to ``DIR/<step>.log``, the summary to ``DIR/steps.json`` (at
most 8 files come back from a run). ``--dry-run`` does everything up to the steps
and writes the steps' commands to ``steps.json`` instead of running them.
``--from-tree .`` takes the tests, benchmarks and this project from the working tree
that travels with every call (installed with ``pip --no-build-isolation``): a rerun
after a fix needs no new bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle_parts  # noqa: E402

STASH = Path("/root/kvoffload_bundle")
STEPS = ("preflight", "e2e", "qa")
#: The engine runs on CUDA with the CUDA backend.
GPU_ENV = {"VLLM_TARGET_DEVICE": "cuda", "KVOFFLOAD_HAL_BACKEND": "cuda", "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
#: Per step, where the caller's environment does not set them: FlashAttention 3 (the
#: build the bundle keeps); batch-invariant kernels for the accuracy tests (a prompt
#: computed whole and one computed after a cached prefix give the same logits, as on
#: the CPU platform), vLLM's default kernels for the benchmark.
#: vLLM's FlashInfer sampler is off: flashinfer does not travel (its import fails).
GPU_TUNING = {"VLLM_FLASH_ATTN_VERSION": "3", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
STEP_TUNING = {"preflight": {}, "e2e": {"VLLM_BATCH_INVARIANT": "1"},
               "qa": {"VLLM_BATCH_INVARIANT": "0"}}
#: The baseline, then the CUDA backend eager (``accelerator``) and lazy, and the
#: corrupting control; ``eager`` would repeat ``accelerator`` with the variable set.
E2E_TESTS = ["tests/e2e/singlecard/test_accuracy.py", "-k", "lazy or accelerator or canary"]
#: Each step's limit, cut to what is left of ``--deadline-s`` (one device command
#: runs at most 600 s, install and start included).
STEP_TIMEOUT_S = {"preflight": 90, "e2e": 240, "qa": 300}


def receive(src: Path, stash: Path) -> list[str]:
    """Keep every part of ``src`` the manifest names (checked); returns the missing."""
    stash.mkdir(parents=True, exist_ok=True)
    manifest = bundle_parts.load_manifest(src / bundle_parts.MANIFEST)
    kept = stash / bundle_parts.MANIFEST
    if kept.is_file() and bundle_parts.load_manifest(kept) != manifest:
        for old in stash.glob("part-*"):  # another bundle's parts
            old.unlink()
    shutil.copyfile(src / bundle_parts.MANIFEST, kept)
    for part in sorted(src.glob("part-*")):
        bundle_parts.check_part(manifest, part)
        shutil.copyfile(part, stash / part.name)
    return bundle_parts.missing_parts(manifest, stash)


def install(stash: Path) -> tuple[Path, Path]:
    """Assemble and install the bundle once per manifest; returns (site, src)."""
    manifest = bundle_parts.load_manifest(stash / bundle_parts.MANIFEST)
    site, src, done = stash / "site", stash / "src", stash / "installed.json"
    if done.is_file() and json.loads(done.read_text()) == manifest:
        return site, src
    payload = stash / "payload"
    shutil.rmtree(payload, ignore_errors=True)
    files = bundle_parts.assemble(manifest, stash, payload)
    shutil.rmtree(site, ignore_errors=True)
    wheels = [str(f) for f in files if f.suffix == ".whl"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site), *wheels], check=True)
    shutil.rmtree(src, ignore_errors=True)
    archive = payload / "src.tar.gz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    shutil.rmtree(payload)
    done.write_text(json.dumps(manifest))
    return site, src


def install_tree(root: Path, stash: Path) -> Path:
    """This project from the working tree ``root``, into a target of its own."""
    own = stash / "own"
    shutil.rmtree(own, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-build-isolation", "--no-compile", "--target", str(own), str(root)],
                   check=True)
    return own


def step_commands(site: Path, src: Path, out: Path, qa_args: list[str],
                  own: Path | None = None) -> dict:
    """Each step's command line, working directory and environment additions."""
    path = [str(site), str(src / "tests"), str(src / "benchmarks")]
    py = sys.executable
    commands = {
        "preflight": [py, str(src / "tools/gpu/preflight.py"), str(site)],
        "e2e": [py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *E2E_TESTS],
        "qa": [py, str(src / "benchmarks/gpu_long_doc_qa.py"), "--out-dir", str(out), *qa_args],
    }
    steps = {}
    for name, cmd in commands.items():
        tuning = {**GPU_TUNING, **STEP_TUNING[name]}
        env = {key: os.environ.get(key, value) for key, value in tuning.items()}
        env.update(GPU_ENV, PYTHONPATH=os.pathsep.join(([str(own)] if own else []) + path))
        steps[name] = dict(cmd=cmd, cwd=str(src), env=env)
    return steps


def run_step(name: str, spec: dict, out: Path, limit_s: float | None = None) -> dict:
    start = time.monotonic()
    limit_s = STEP_TIMEOUT_S[name] if limit_s is None else min(limit_s, STEP_TIMEOUT_S[name])
    with open(out / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(spec["cmd"], cwd=spec["cwd"], stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, **spec["env"]},
                                  timeout=max(1.0, limit_s))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return dict(step=name, rc=rc, seconds=round(time.monotonic() - start, 1))


def machine_facts() -> dict:
    facts = {"python": sys.version.split()[0]}
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], ["lscpu"]):
        if shutil.which(cmd[0]):
            facts[cmd[0]] = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    return facts


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"machine": machine_facts()}
    site, src = install(args.stash)
    commit = src / "SOURCE_COMMIT"
    summary["bundle_commit"] = commit.read_text().strip() if commit.is_file() else None
    own = None
    if args.from_tree is not None:  # a fix made since the bundle was built
        src, own = args.from_tree, install_tree(args.from_tree, args.stash)
    commands = step_commands(site, src.resolve(), args.out, args.qa_args, own)
    summary["steps"] = results = []
    for name in args.steps:
        if args.dry_run:
            results.append(dict(step=name, **commands[name]))
        else:
            results.append(run_step(name, commands[name], args.out,
                                    deadline - time.monotonic()))
            print(json.dumps(results[-1]), flush=True)
        # After each step: a command stopped at its limit still leaves what ran.
        (args.out / "steps.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        if name == "preflight" and results[-1].get("rc", 0) != 0:
            break  # nothing else can run
    return 0 if all(r.get("rc", 0) == 0 for r in results) else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    rec = sub.add_parser("receive", help="keep the parts of a transfer")
    rec.add_argument("src", type=Path)
    go = sub.add_parser("run", help="install the bundle and run the steps")
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    go.add_argument("--dry-run", action="store_true")
    go.add_argument("--from-tree", type=Path, default=None, metavar="ROOT",
                    help="tests, benchmarks and this project from the working tree ROOT "
                         "instead of the bundle's (a rerun after a fix, no parts resent)")
    go.add_argument("--deadline-s", type=float, default=560,
                    help="every step ends by then (seconds from the start)")
    go.add_argument("--qa-args", nargs=argparse.REMAINDER, default=[],
                    help="passed on to gpu_long_doc_qa.py (last)")
    for p in (rec, go):
        p.add_argument("--stash", type=Path, default=STASH)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verb == "receive":
        missing = receive(args.src, args.stash)
        print(f"missing parts: {' '.join(missing)}" if missing else "all parts received")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
