"""Tables and plot of ``scheduler_overhead.py``."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

from scheduler_overhead_points import OURS, TIMED, UPSTREAM, Point

TARGET_RATIO = 0.5  # ours / upstream, at every point
TARGET_EXTRA_BYTES = 32  # a policy's steady-state memory over lru, per CPU block


def machine_line() -> str:
    """The host, as ``lscpu`` names it, and whether it has AVX-512 and AMX."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "lscpu: unavailable"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    flags = fields.get("Flags", "").split()
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"lscpu: {model}, {fields.get('CPU(s)', '?').strip()} CPUs, flags include "
            + (" ".join(wanted) or "none of avx2/avx512f/amx"))


def format_table(points: list[Point]) -> str:
    ours = {(p.cpu_blocks, p.live_requests): p for p in points if p.connector == OURS}
    theirs = {(p.cpu_blocks, p.live_requests): p for p in points if p.connector == UPSTREAM}
    lines = ["| CPU blocks | live requests | ours µs/step | upstream µs/step | ours/upstream "
             "| target | CPU-tier loads | preemptions | finished |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(ours):
        a, b = ours[key], theirs.get(key)
        if b is None:
            continue
        r = a.us_per_step / b.us_per_step
        lines.append(f"| {key[0]} | {key[1]} | {a.us_per_step:.0f} | {b.us_per_step:.0f} | "
                     f"{r:.2f} | <= {TARGET_RATIO} {'✓' if r <= TARGET_RATIO else '✗'} | "
                     f"{a.loads}/{b.loads} | {a.preemptions}/{b.preemptions} | "
                     f"{a.finished}/{b.finished} |")
    lines += ["", "Per call, µs per step (ours / upstream):", "",
              "| CPU blocks | live requests | " + " | ".join(TIMED[:5]) + " |",
              "|---:|---:|" + "---:|" * 5]
    for key in sorted(ours):
        a, b = ours[key], theirs.get(key)
        if b is None:
            continue
        cells = []
        for name in TIMED[:5]:
            if name == "request_finished":
                x = sum(a.connector_s.get(n, 0) for n in TIMED[4:6]) / a.steps * 1e6
                y = sum(b.connector_s.get(n, 0) for n in TIMED[4:6]) / b.steps * 1e6
            else:
                x = a.connector_s.get(name, 0) / a.steps * 1e6
                y = b.connector_s.get(name, 0) / b.steps * 1e6
            cells.append(f"{x:.0f} / {y:.0f}")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_eviction_table(points: list[Point], reference: str) -> str:
    """Ours with each eviction policy, µs per step and CPU-tier loads, against ``reference``;
    last, the time in the policy's own calls (``Eviction.on_stored`` and the rest)."""
    evictions = list(dict.fromkeys(p.extra["eviction"] for p in points))
    others = [e for e in evictions if e != reference]
    by = {(p.cpu_blocks, p.live_requests, p.extra["eviction"]): p for p in points}
    lines = ["| CPU blocks | live requests | " + " | ".join(f"{e} µs/step" for e in evictions)
             + " | " + " | ".join(f"{e}/{reference}" for e in others) + " | "
             + " | ".join(f"{e}/{reference} by round, median" for e in others) + " | "
             + " | ".join(f"{e} loads" for e in evictions) + " | "
             + " | ".join(f"{e}/{reference} loads" for e in others) + " | "
             + " | ".join(f"{e} policy calls µs/step" for e in evictions) + " |",
             "|---:|---:|" + "---:|" * (3 * len(evictions) + 3 * len(others))]
    for nb, live in sorted({(p.cpu_blocks, p.live_requests) for p in points}):
        ref = by[nb, live, reference]
        lines.append(f"| {nb} | {live} | "
                     + " | ".join(f"{by[nb, live, e].us_per_step:.0f}" for e in evictions) + " | "
                     + " | ".join(f"{by[nb, live, e].us_per_step / ref.us_per_step:.2f}"
                                  for e in others) + " | "
                     + " | ".join(f"{paired_ratio(by[nb, live, e], ref):.2f}"
                                  for e in others) + " | "
                     + " | ".join(f"{by[nb, live, e].loads}" for e in evictions) + " | "
                     + " | ".join(f"{by[nb, live, e].loads / max(1, ref.loads):.2f}"
                                  for e in others) + " | "
                     + " | ".join(f"{by[nb, live, e].extra.get('eviction_us', float('nan')):.1f}"
                                  for e in evictions) + " |")
    return "\n".join(lines)


def paired_ratio(point: Point, reference: Point) -> float:
    """The median over the repeats of ``point``'s µs per step over ``reference``'s in
    the same round (the two ran back to back: what the host was doing then cancels)."""
    mine = point.extra.get("us_per_step_runs", [point.us_per_step])
    theirs = reference.extra.get("us_per_step_runs", [reference.us_per_step])
    return statistics.median(a / b for a, b in zip(mine, theirs))


def write_plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu_blocks = sorted({p.cpu_blocks for p in points})
    fig, axes = plt.subplots(1, len(cpu_blocks), figsize=(4 * len(cpu_blocks), 3.6),
                             sharey=True, squeeze=False)
    for ax, nb in zip(axes[0], cpu_blocks):
        for name, style in ((OURS, "o-"), (UPSTREAM, "s--")):
            rows = sorted((p for p in points if p.connector == name and p.cpu_blocks == nb),
                          key=lambda p: p.live_requests)
            ax.plot([p.live_requests for p in rows], [p.us_per_step for p in rows], style,
                    label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{nb} CPU blocks", fontsize=9)
        ax.set_xlabel("live requests")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("connector scheduler µs / engine step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"


def format_memory_table(rows: list[dict], reference: str = "lru") -> str:
    """Start-up and steady-state memory by CPU-tier size and eviction policy
    (``scheduler_overhead_memory.py``), then each policy's extra over ``reference``."""
    traced = all("traced_steady" in r for r in rows)
    lines = ["| CPU blocks | eviction | start-up s | RSS after start-up MiB | RSS steady MiB "
             "| RSS peak MiB |" + (" traced steady MiB | eviction modules B/block |" if traced
                                   else ""),
             "|---:|:---|---:|---:|---:|---:|" + ("---:|---:|" if traced else "")]
    for r in rows:
        line = (f"| {r['cpu_blocks']} | {r['eviction']} | {r['startup_s']:.2f} | "
                f"{_mib(r['rss_startup'])} | {_mib(r['rss_steady'])} | {_mib(r['rss_peak'])} |")
        if traced:
            line += (f" {_mib(r['traced_steady'])} | "
                     f"{r['eviction_traced'] / r['cpu_blocks']:.1f} |")
        lines.append(line)
    by_key = {(r["cpu_blocks"], r["eviction"]): r for r in rows}
    extra = [f"| CPU blocks | eviction | RSS steady B/block over {reference} |"
             + (f" traced steady B/block over {reference} |" if traced else "")
             + f" target (<= {TARGET_EXTRA_BYTES}) |",
             "|---:|:---|---:|" + ("---:|" if traced else "") + ":---:|"]
    for (blocks, eviction), r in sorted(by_key.items()):
        ref = by_key.get((blocks, reference))
        if ref is None or eviction == reference:
            continue
        rss = (r["rss_steady"] - ref["rss_steady"]) / blocks
        line = f"| {blocks} | {eviction} | {rss:.1f} |"
        ok = rss <= TARGET_EXTRA_BYTES
        if traced:
            python = (r["traced_steady"] - ref["traced_steady"]) / blocks
            line += f" {python:.1f} |"
            ok = ok and python <= TARGET_EXTRA_BYTES
        extra.append(line + f" {'✓' if ok else '✗'} |")
    return "\n".join(lines + [""] + extra)
