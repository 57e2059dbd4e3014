"""Tables and plot of ``shared_prefix.py``."""

from __future__ import annotations

from pathlib import Path

from kvoffload_hal import vllm_compat


def _harness_table(rows: list[dict]) -> list[str]:
    lines = ["| arrival | N | one copy per block | blocks copied | MiB copied | "
             "device blocks in use (most) | steps to first token (last request) | "
             "steps from the first first token to the last | "
             "ms to first token (last request) | requests that waited |",
             "|:---|---:|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arrival']} | {r['n']} | {'yes' if r['sharing'] else 'no'} | "
                     f"{r['blocks']} | {r['bytes'] / 2**20:.3f} | {r['device_blocks']} | "
                     f"{r['steps_first']} | {r['steps_behind']} | "
                     f"{r['seconds_first'] * 1e3:.0f} | {r['waits']} |")
    return lines


def _engine_table(rows: list[dict]) -> list[str]:
    lines = ["| N | one copy per block | blocks copied | requests that waited | "
             "seconds to the last first token |", "|---:|:---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {'yes' if r['sharing'] else 'no'} | {r['blocks']} | "
                     f"{r['waits']} | {r['seconds_first']:.3f} |")
    return lines


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for sharing, style in ((True, "o-"), (False, "s--")):
        for arrival in ("together", "one per step"):
            sel = [r for r in rows if r["sharing"] == sharing and r["arrival"] == arrival]
            label = f"{'one copy' if sharing else 'a copy per request'}, {arrival}"
            ns = [r["n"] for r in sel]
            axes[0].plot(ns, [r["blocks"] for r in sel], style, label=label)
            axes[1].plot(ns, [r["steps_first"] for r in sel], style, label=label)
    for ax, title in zip(axes, ("blocks copied CPU->device", "steps to the last first token")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("requests on one prefix (N)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(harness: list[dict], engine: list[dict], out_dir: Path | None) -> None:
    import vllm

    from kvoffload_hal.selfcheck.environment import cpu_model

    lines = [f"## N requests on one evicted prefix (vLLM {vllm.__version__})", "",
             f"CPU: {cpu_model()}.", "",
             "Engine harness, `bandwidth-bound` copy double (asynchronous loads, 1 ms per "
             "2 KiB block, one copy thread), an 8-block prefix; medians of 3 runs:", ""]
    lines += _harness_table(harness)
    if engine:
        lines += ["", "Real engine (tiny Llama, `cpu` backend, `load_mode: async`), an "
                  "8-block prefix (block size 32), one output token:", ""]
        lines += _engine_table(engine)
    text = "\n".join(lines) + "\n"
    print(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tag = vllm_compat.vllm_tag()
        (out_dir / f"shared_prefix_vllm{tag}.md").write_text(text)
        if harness:
            _plot(harness, out_dir / f"shared_prefix_vllm{tag}.png")
