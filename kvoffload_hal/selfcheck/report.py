"""The verdict line and the human-readable report of a self-check result."""

from __future__ import annotations

__all__ = ["render_text", "verdict"]

_RUNTIME_LABEL = {"cuda": "CUDA driver", "npu": "AscendCL"}


def _fraction(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "n/a"


def verdict(result: dict) -> str:
    """One line: PASS or FAIL, with what decided it."""
    name = result["backend"]
    if result.get("error"):
        return f"FAIL: {result['error']}"
    trips = result["round_trips"]
    bad = [t for t in trips if not t["ok"]]
    bw = result["bandwidth"]
    if bad:
        first = bad[0]
        return (f"FAIL: {len(bad)} of {len(trips)} round trips wrong on the {name!r} backend; "
                f"first: {first['layout']}, block size {first['block_size']}: {first['error']}")
    if bw is not None and bw["error"]:
        return f"FAIL: the bandwidth copies failed on the {name!r} backend: {bw['error']}"
    line = f"PASS: {len(trips)} of {len(trips)} round trips byte-exact on the {name!r} backend"
    if bw is not None:
        line += (f"; scattered copies at {_fraction(bw['store_gbps'], bw['store_limit_gbps'])} "
                 f"(D2H) and {_fraction(bw['load_gbps'], bw['load_limit_gbps'])} (H2D) of one "
                 f"contiguous copy")
    if result["environment"]["copy_mode"] == "loop fallback":
        line += "; copies use the per-copy loop fallback (slower; see the docs)"
    return line


def _header(result: dict) -> list[str]:
    env = result["environment"]
    runtime = _RUNTIME_LABEL.get(result["backend"], "runtime")
    device = env["device"] + (f" ({env['device_name']})" if env.get("device_name") else "")
    return [
        f"kvoffload_hal {env['kvoffload_hal']} self-check",
        f"backend:   {result['backend']} ({result['reason']})",
        f"device:    {device}",
        "runtime:   " + ("n/a (no device runtime)" if env["runtime_version"] == "n/a"
                            else f"{runtime} {env['runtime_version']}"),
        f"copy path: {env['copy_path']} [{env['copy_mode']}]",
        *([f"kernel:    {env['copy_kernel']}"] if env.get("copy_kernel") else []),
        f"software:  torch {env['torch']}"
        + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
        + (f" (CANN {env['torch_cann']})" if env.get("torch_cann") else "")
        + f", python {env['python']}, {env['platform']}",
        f"cpu:       {env['cpu']}",
    ]


def _round_trip_lines(result: dict) -> list[str]:
    params = result["round_trip_params"]
    lines = [f"round trips: {params['copied_blocks']} scattered blocks each way, "
             f"{params['device_blocks']} device / {params['host_blocks']} host blocks, "
             f"{params['layers']} layers"]
    for t in result["round_trips"]:
        status = "ok  " if t["ok"] else "FAIL"
        line = (f"  {status} {t['layout']:<38} block size {t['block_size']:>4}  "
                f"{t['regions']:>2} regions  {t['bytes_per_block']:>7} B/block")
        if t["error"]:
            line += f"  {t['error']}"
        lines.append(line)
    return lines


def _bandwidth_lines(bw: dict | None) -> list[str]:
    if bw is None:
        return ["bandwidth: skipped"]
    lines = [f"bandwidth: {bw['blocks']} blocks of {bw['block_bytes'] >> 10} KiB = "
             f"{bw['total_bytes'] / 2**20:.0f} MiB per job; scattered = {bw['descriptors']} "
             f"descriptors, limit = 1 contiguous copy"]
    if bw["error"]:
        return [*lines, f"  FAIL {bw['error']}"]
    for label, key in (("D2H (store)", "store"), ("H2D (load) ", "load")):
        got, limit = bw[f"{key}_gbps"], bw[f"{key}_limit_gbps"]
        lines.append(f"  {label} {got:8.2f} GB/s scattered {limit:8.2f} GB/s contiguous  "
                     f"{_fraction(got, limit)} of the limit")
    lines.append(f"  host tier set-up {bw['host_setup_s_per_gib']:.3f} s per GiB "
                 "(allocate_host and first write: start-up cost of cpu_bytes_to_use)")
    return lines


def render_text(result: dict) -> str:
    """The report printed without ``--json``; its last line is the verdict."""
    if result.get("environment") is None:
        return f"verdict: {result['verdict']}"
    lines = [*_header(result), *_round_trip_lines(result), *_bandwidth_lines(result["bandwidth"]),
             f"checks took {result['seconds']:.1f} s", f"verdict: {result['verdict']}"]
    return "\n".join(lines)
