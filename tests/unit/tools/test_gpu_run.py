"""The GPU-side driver up to the steps that need CUDA: receive, assemble, install, plan."""

import json
import os
import subprocess
import sys
import tarfile

import bundle_parts
import gpu_run
import pytest
from fake_wheels import make_wheel


def _bundle(tmp_path):
    """A payload of two wheels and a source archive, split in parts of 700 bytes."""
    payload = tmp_path / "payload"
    payload.mkdir()
    make_wheel(payload, "alpha", "1.0", files={"alpha/__init__.py": b"X = 'a' * 2000\n",
                                               "alpha/blob.bin": os.urandom(2000)})
    make_wheel(payload, "beta", "2.0")
    tools = tmp_path / "tools" / "gpu"
    tools.mkdir(parents=True)
    (tools / "preflight.py").write_text("print('ok')\n")
    (tmp_path / "SOURCE_COMMIT").write_text("abc123\n")
    with tarfile.open(payload / "src.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "tools", arcname="tools")
        tar.add(tmp_path / "SOURCE_COMMIT", arcname="SOURCE_COMMIT")
    manifest = bundle_parts.split(payload, tmp_path / "parts", part_bytes=700)
    assert len(manifest["parts"]) > 3
    return manifest


def _transfers(tmp_path, manifest, n=2):
    """The parts in ``n`` transfers, each a folder with the manifest."""
    names = [p["name"] for p in manifest["parts"]]
    for i in range(n):
        folder = tmp_path / f"transfer{i}"
        folder.mkdir()
        (folder / "manifest.json").write_bytes((tmp_path / "parts/manifest.json").read_bytes())
        for name in names[i::n]:
            (folder / name).write_bytes((tmp_path / "parts" / name).read_bytes())
        yield folder


def test_parts_arrive_in_transfers_then_install_and_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_FLASH_ATTN_VERSION", "2")  # the caller's choice stands
    manifest = _bundle(tmp_path)
    stash, out = tmp_path / "stash", tmp_path / "out"
    first, second = _transfers(tmp_path, manifest)
    missing = gpu_run.receive(first, stash)
    assert missing == [p["name"] for p in manifest["parts"]][1::2]
    assert gpu_run.receive(second, stash) == []
    rc = gpu_run.main(["run", "--out", str(out), "--dry-run", "--stash", str(stash),
                       "--qa-args", "--num-documents", "8"])
    assert rc == 0
    site = stash / "site"
    got = subprocess.run([sys.executable, "-c", "import alpha, beta; print(len(alpha.X))"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert got.stdout.strip() == "2000", got.stderr
    assert (stash / "src" / "tools/gpu/preflight.py").is_file()
    summary = json.loads((out / "steps.json").read_text())
    assert summary["bundle_commit"] == "abc123"
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == ["preflight", "e2e", "qa"]
    env = steps["e2e"]["env"]
    assert env["KVOFFLOAD_HAL_BACKEND"] == "cuda" and env["VLLM_TARGET_DEVICE"] == "cuda"
    assert env["PYTHONPATH"].split(":")[0] == str(site)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["VLLM_FLASH_ATTN_VERSION"] == "2"
    assert steps["qa"]["env"]["VLLM_BATCH_INVARIANT"] == "0"  # served as vLLM serves
    assert "tests/e2e/singlecard/test_accuracy.py" in steps["e2e"]["cmd"]
    assert steps["qa"]["cmd"][-2:] == ["--num-documents", "8"]
    assert str(out) in steps["qa"]["cmd"]


def test_an_installed_bundle_is_not_installed_again(tmp_path):
    manifest = _bundle(tmp_path)
    stash = tmp_path / "stash"
    gpu_run.receive(tmp_path / "parts", stash)
    gpu_run.install(stash)
    marker = stash / "site" / "alpha" / "marker"
    marker.write_text("kept")
    gpu_run.install(stash)
    assert marker.is_file()  # same manifest: nothing reinstalled
    assert json.loads((stash / "installed.json").read_text()) == manifest


def test_a_missing_or_damaged_part_stops_the_run(tmp_path):
    manifest = _bundle(tmp_path)
    stash = tmp_path / "stash"
    first, _ = _transfers(tmp_path, manifest)
    gpu_run.receive(first, stash)
    with pytest.raises(bundle_parts.BundleError, match="parts missing"):
        gpu_run.main(["run", "--out", str(tmp_path / "out"), "--dry-run",
                      "--stash", str(stash)])
    bad = tmp_path / "parts" / "part-001"
    data = bad.read_bytes()  # random bytes: flip the first one, whatever it is
    bad.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    with pytest.raises(bundle_parts.BundleError, match="part-001: sha256"):
        gpu_run.receive(tmp_path / "parts", stash)


def test_a_new_bundle_drops_the_old_parts(tmp_path):
    _bundle(tmp_path)
    stash = tmp_path / "stash"
    gpu_run.receive(tmp_path / "parts", stash)
    (tmp_path / "payload" / "gamma.txt").write_text("new")
    manifest = bundle_parts.split(tmp_path / "payload", tmp_path / "parts2", part_bytes=5000)
    (tmp_path / "parts2" / "part-000").unlink()
    assert gpu_run.receive(tmp_path / "parts2", stash) == ["part-000"]
    kept = sorted(p.name for p in stash.glob("part-*"))
    assert kept == [p["name"] for p in manifest["parts"]][1:]


def test_steps_run_with_their_environment_and_log(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_run.STEP_TIMEOUT_S, "e2e", 30)
    spec = dict(cmd=[sys.executable, "-c", "import os; print(os.environ['KVOFFLOAD_HAL_BACKEND'])"],
                cwd=str(tmp_path), env=dict(gpu_run.GPU_ENV))
    result = gpu_run.run_step("e2e", spec, tmp_path)
    assert result["rc"] == 0
    assert (tmp_path / "e2e.log").read_text().strip() == "cuda"


def test_a_step_past_its_time_is_stopped_and_said_so(tmp_path):
    spec = dict(cmd=[sys.executable, "-c", "import time; time.sleep(30)"], cwd=str(tmp_path),
                env={})
    result = gpu_run.run_step("preflight", spec, tmp_path, limit_s=1.0)
    assert result["rc"] == "timeout" and result["seconds"] < 10


def test_from_tree_runs_the_working_tree_and_its_package_first(tmp_path):
    _bundle(tmp_path)
    stash, tree = tmp_path / "stash", tmp_path / "tree"
    gpu_run.receive(tmp_path / "parts", stash)
    (tree / "owntree").mkdir(parents=True)
    (tree / "owntree" / "__init__.py").write_text("FIXED = True\n")
    (tree / "setup.py").write_text("from setuptools import setup\n"
                                   "setup(name='owntree', version='0.1', packages=['owntree'])\n")
    out = tmp_path / "out"
    assert gpu_run.main(["run", "--out", str(out), "--dry-run", "--stash", str(stash),
                         "--from-tree", str(tree)]) == 0
    steps = {s["step"]: s for s in json.loads((out / "steps.json").read_text())["steps"]}
    path = steps["e2e"]["env"]["PYTHONPATH"].split(":")
    assert path[:2] == [str(stash / "own"), str(stash / "site")]
    assert path[2] == str(tree.resolve() / "tests") and steps["e2e"]["cwd"] == str(tree.resolve())
    got = subprocess.run([sys.executable, "-c", "import owntree; print(owntree.FIXED)"],
                         env={"PYTHONPATH": path[0]}, capture_output=True, text=True)
    assert got.stdout.strip() == "True", got.stderr
