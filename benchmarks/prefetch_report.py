"""Table and plot of ``prefetch.py``."""

from __future__ import annotations

import os
from pathlib import Path

from kvoffload_hal import vllm_compat


def _table(rows: list[dict]) -> list[str]:
    lines = ["| ms per block read | prefetch | TTFT steps mean | TTFT steps p90 | "
             "TTFT ms mean | TTFT ms p90 | total s | steps | lookups answered "
             "\"ask later\" | blocks prefetched | blocks from disk | CPU hit tokens |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['read_ms']:g} | {r['mode']} | {r['ttft_steps_mean']:.1f} | "
            f"{r['ttft_steps_p90']:.0f} | {r['ttft_ms_mean']:.0f} | {r['ttft_ms_p90']:.0f} | "
            f"{r['total_s']:.2f} | {r['steps']:.0f} | {r['waits']:.0f} | "
            f"{r['prefetched']:.0f} | {r['from_disk']:.0f} | {r['hit_tokens']:.0f} |")
    return lines


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    reads = list(dict.fromkeys(r["read_ms"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / len(modes)
    for m, mode in enumerate(modes):
        sel = {r["read_ms"]: r for r in rows if r["mode"] == mode}
        xs = [i + m * width for i in range(len(reads))]
        for ax, key in zip(axes, ("ttft_steps", "ttft_ms")):
            ax.bar(xs, [sel[x][f"{key}_mean"] for x in reads], width, label=f"{mode}: mean")
            ax.scatter(xs, [sel[x][f"{key}_p90"] for x in reads], marker="_", s=200,
                       color="black")
        axes[2].bar(xs, [sel[x]["total_s"] for x in reads], width, label=mode)
    titles = ("TTFT of queued requests, steps (bar: mean, dash: p90)",
              "TTFT of queued requests, ms (bar: mean, dash: p90)", "total time, s")
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(reads))])
        ax.set_xticklabels([f"{x:g} ms / block read" for x in reads])
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    top = max(r["total_s"] for r in rows)
    axes[2].set_ylim(0, top * 1.4)  # room for the legend above the bars
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(rows: list[dict], out_dir: Path | None, setup: dict) -> None:
    import vllm

    from kvoffload_hal.selfcheck.environment import cpu_model

    s = setup
    lines = [f"## Prefetch for waiting requests (vLLM {vllm.__version__})", "",
             f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f} at the end.", "",
             f"Engine harness, `cpu` copy backend, disk tier. {s['docs']} documents of "
             f"{s['doc_blocks']} blocks ({s['doc_blocks'] * s['bs']} tokens) served once, "
             "then the device prefix cache and the CPU tier "
             f"({s['cpu_blocks']} blocks) emptied: the disk holds them alone. Then one "
             f"question per document, batch of {s['batch']} (`max_num_seqs`), "
             f"{s['gen']} tokens each; each disk block read takes the time given more (two "
             f"IO threads), each step that runs a forward pass at least {s['step_ms']:g} ms. "
             f"The first {s['batch']} questions fill the batch, then the other "
             f"{s['docs'] - s['batch']} arrive together and queue behind it: their TTFT is "
             f"from their arrival. Medians of {s['repeats']} runs, the cases interleaved; "
             "the tokens of every question are equal across the cases, and every KV read "
             "is checked.", ""]
    lines += _table(rows)
    text = "\n".join(lines) + "\n"
    print(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tag = vllm_compat.vllm_tag()
        (out_dir / f"prefetch_vllm{tag}.md").write_text(text)
        _plot(rows, out_dir / f"prefetch_vllm{tag}.png")
