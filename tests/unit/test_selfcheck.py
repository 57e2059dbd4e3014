"""``python -m kvoffload_hal.selfcheck`` on the CPU backend, and on backends that corrupt copies."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import Direction, register_backend
from kvoffload_hal.selfcheck import main, run_selfcheck
from kvoffload_hal.selfcheck.kv_layouts import LAYOUTS
from kvoffload_hal.selfcheck.roundtrip import check_round_trip


def _flip_byte(address: int) -> None:
    byte = ctypes.c_uint8.from_address(address)
    byte.value ^= 0x5A


class CorruptingStoresBackend(CpuCopyBackend):
    """Copies every store, then flips one byte of its first destination."""

    name = "selfcheck-corrupting-stores"

    def _launch(self, direction, batch, fence):
        elapsed = super()._launch(direction, batch, fence)
        if direction is Direction.STORE and len(batch):
            _flip_byte(int(batch.dst_ptrs[0]) + int(batch.sizes[0]) // 2)
        return elapsed


class OverwritingNeighbourBackend(CpuCopyBackend):
    """Copies every load exactly, then flips the byte just after its lowest destination:
    the first byte of the next device block (or of padding), which the load was never
    asked to write."""

    name = "selfcheck-overwriting-neighbour"

    def _launch(self, direction, batch, fence):
        elapsed = super()._launch(direction, batch, fence)
        if direction is Direction.LOAD and len(batch):
            lowest = int(np.argmin(batch.dst_ptrs))
            # Other destinations of the same region lie above the lowest one, so this
            # byte is inside the tensor.
            _flip_byte(int(batch.dst_ptrs[lowest]) + int(batch.sizes[lowest]))
        return elapsed


for _cls in (CorruptingStoresBackend, OverwritingNeighbourBackend):
    register_backend(_cls.name, f"{__name__}:{_cls.__name__}",
                     synchronous_compute=_cls.synchronous_compute)


def _run_json(capsys, *args: str) -> tuple[int, dict]:
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_cpu_backend_json_reports_every_layout_byte_exact(capsys):
    code, result = _run_json(capsys, "--backend", "cpu", "--bandwidth-mib", "4")
    assert code == 0 and result["ok"] is True
    assert result["backend"] == "cpu" and result["reason"] == "requested with --backend=cpu"
    trips = result["round_trips"]
    assert {t["layout"] for t in trips} == set(LAYOUTS)
    assert {t["block_size"] for t in trips} == {16, 128}
    assert all(t["ok"] and t["store_ok"] and t["load_ok"] and t["error"] is None for t in trips)
    by_name = {(t["layout"], t["block_size"]): t for t in trips}
    # (k, v) per layer, two layers: four regions; MLA rope rows are 16 of 128 + 16 values.
    assert by_name[("dense tuple (k, v)", 16)]["regions"] == 4
    assert by_name[("mla tuple (nope, rope)", 16)]["bytes_per_block"] == 2 * 16 * (128 + 16) * 2
    bw = result["bandwidth"]
    assert bw["error"] is None and bw["total_bytes"] == 4 << 20
    assert bw["descriptors"] == bw["blocks"] == 128  # scattered: no two blocks merge
    for key in ("store_gbps", "store_limit_gbps", "load_gbps", "load_limit_gbps",
                "host_setup_s_per_gib"):
        assert bw[key] > 0, key
    env = result["environment"]
    assert env["copy_mode"] == "host memcpy" and env["runtime_version"] == "n/a"
    assert env["torch"] and env["python"] and env["copy_path"] != "unknown"
    assert result["verdict"].startswith("PASS: 10 of 10 round trips byte-exact on the 'cpu'")


def test_text_report_ends_with_the_verdict(capsys):
    assert main(["--backend", "cpu", "--bandwidth-mib", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("kvoffload_hal ") and "bandwidth: skipped" in lines
    assert lines[-1].startswith("verdict: PASS: 10 of 10 round trips byte-exact")


def test_a_corrupted_store_gives_a_failing_verdict_and_exit_status(capsys):
    code, result = _run_json(capsys, "--backend", CorruptingStoresBackend.name,
                             "--bandwidth-mib", "0")
    assert code == 1 and result["ok"] is False
    trips = result["round_trips"]
    assert trips and not any(t["store_ok"] for t in trips)
    assert all(t["error"].startswith("store (device -> host): host byte ") for t in trips)
    assert all(t["error"].endswith("(a block the job wrote)") for t in trips)
    assert result["verdict"].startswith(f"FAIL: {len(trips)} of {len(trips)} round trips wrong")


def test_a_load_writing_outside_its_blocks_is_caught():
    # The padded layout: the byte before a block is padding; the dense one: another block.
    for layout, where in (("dense tuple (k, v), padded blocks", "outside every block"),
                          ("dense tuple (k, v)", "(a block the job must not touch)")):
        trip = check_round_trip(OverwritingNeighbourBackend, layout, 16, "cpu", seed=3)
        assert trip.store_ok and not trip.load_ok, trip
        assert trip.error.startswith("load (host -> device): byte "), trip.error
        assert where in trip.error, trip.error
        clean = check_round_trip(CpuCopyBackend, layout, 16, "cpu", seed=3)
        assert clean.ok, clean.error


def test_injected_factory_is_used_for_every_check():
    built = []

    def make():
        built.append(CpuCopyBackend())
        return built[-1]

    result = run_selfcheck(make_backend=make, block_sizes=(16,), bandwidth_mib=1)
    assert result["ok"] and result["backend"] == "cpu"
    assert len(built) == len(LAYOUTS) + 1  # one per round trip, one for the bandwidth
    assert all(b._closed for b in built)


def test_an_unknown_backend_is_one_line_and_exit_status_2(capsys):
    assert main(["--backend", "no-such-backend"]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and out.startswith("verdict: FAIL: ")
    assert "'no-such-backend' is not a known backend; expected one of: auto, cpu" in out


def test_python_dash_m_on_the_cpu_backend():
    env = {**os.environ, "KVOFFLOAD_HAL_BACKEND": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "kvoffload_hal.selfcheck", "--backend", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("verdict: PASS: 10 of 10 round trips byte-exact"), proc.stdout
    assert any(line.startswith("  D2H (store)") and "GB/s" in line for line in lines)


def test_importing_selfcheck_loads_no_device_runtime():
    from support.imports import loaded_by

    added = loaded_by("import kvoffload_hal.selfcheck")
    assert added == {"modules": [], "libraries": [], "cuda_initialized": False}

