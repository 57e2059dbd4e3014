"""The device calls for a built bundle: one per part, the last one runs."""

import os

import bundle_parts
import device_calls


def test_one_call_per_part_then_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(device_calls, "ROOT", tmp_path)
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "a.whl").write_bytes(os.urandom(2500))
    parts = tmp_path / "build" / "gpu_bundle" / "parts"
    bundle_parts.split(payload, parts, part_bytes=1000)
    calls = device_calls.device_calls(parts, "--num-documents 8")
    assert [c["carry"][1] for c in calls] == [
        f"build/gpu_bundle/parts/part-00{i}" for i in range(3)]
    assert all(c["carry"][0] == "build/gpu_bundle/parts/manifest.json" for c in calls)
    assert [c["command"] for c in calls[:2]] == [device_calls.RECEIVE] * 2
    assert calls[-1]["command"] == "tools/gpu/run_on_gpu.sh $OUT --num-documents 8"
    assert calls[-1]["timeout_s"] == 600 and calls[0]["timeout_s"] == 60
