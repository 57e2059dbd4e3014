"""The soak's table (markdown) and plot (memory, fds and threads, hooks' p99 over time)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from soak.checks import Check


def table(checks: list[Check], figures: dict[str, str]) -> str:
    lines = ["| check | value | bound | |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.value} | {c.bound} | {'ok' if c.ok else 'FAIL'} |"
              for c in checks]
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in figures.items()]
    return "\n".join(lines)


def lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError as e:
        return f"lscpu unavailable: {e}"


def write(out: Path, text: str, rows: list[dict], faults: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "lscpu.txt").write_text(lscpu())
    with open(out / "samples.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k != "step_hook_s"}) + "\n")
    plot(out / "soak.png", rows, faults)


def _p99_ms(row: dict) -> float | None:
    steps = sorted(row.get("step_hook_s") or ())
    return steps[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e3 if steps else None


def plot(path: Path, rows: list[dict], faults: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    t0 = rows[0]["t"]
    minutes = [(r["t"] - t0) / 60 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(minutes, [r["rss_bytes"] / (1 << 20) for r in rows])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(minutes, [r["fds"] for r in rows], label="open fds")
    axes[1].plot(minutes, [r["threads"] for r in rows], label="threads")
    axes[1].plot(minutes, [r["disk_files"] for r in rows], label="files under disk_path")
    axes[1].legend(loc="upper left", fontsize=8)
    p99 = [(m, _p99_ms(r)) for m, r in zip(minutes, rows)]
    axes[2].plot([m for m, v in p99 if v is not None], [v for _, v in p99 if v is not None])
    axes[2].set_ylabel("hooks per step, p99 (ms)")
    axes[2].set_xlabel("minutes")
    for fault in faults:
        for ax in axes:
            ax.axvline((fault.started - t0) / 60, color="grey", alpha=0.3, lw=0.8)
    axes[0].set_title("soak: served connector (grey lines: injected faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
