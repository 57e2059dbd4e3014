"""Copy throughput of a HAL backend against one large copy of the same bytes.

For each block size, one device KV tensor ``[num_blocks, block_bytes]`` and one
host buffer of ``--total-mib`` each are bound to the backend; a store and a load
of every block, in a random permutation of block ids on both sides (so almost
no runs merge: one descriptor per block), go through the real
``bind``/``submit``/``flush`` path. The limit is one single-call copy of the
same total bytes measured in the same run: on the CPU the fastest of
``torch.Tensor.copy_``, ``ctypes.memmove`` and ``numpy.copyto`` between two
contiguous buffers; on a device ``torch.Tensor.copy_`` in the job's direction.

Prints a table and writes ``docs/benchmarks/copy_bench.{png,md}``.

    python benchmarks/copy_bench.py [--backend cpu] [--total-mib 256] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, TransferJob
from kvoffload_hal.hal.regions import host_regions_for
from kvoffload_hal.hal.registry import create_backend

KIB = 1 << 10
MIB = 1 << 20
BLOCK_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB)
# Targets of the brief: fraction of the single-copy limit per block size.
TARGET_LARGE, TARGET_SMALL, LARGE_FROM = 0.90, 0.70, 256 * KIB
OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


@dataclass(frozen=True)
class Row:
    block_bytes: int
    direction: str
    descriptors: int
    best_gbps: float
    median_gbps: float
    limit_gbps: float
    limit_name: str

    @property
    def ratio(self) -> float:
        return self.best_gbps / self.limit_gbps


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _limit_candidates(dst: torch.Tensor, src: torch.Tensor) -> dict[str, Callable[[], object]]:
    candidates: dict[str, Callable[[], object]] = {"torch.Tensor.copy_": lambda: dst.copy_(src)}
    if dst.device.type == "cpu" and src.device.type == "cpu":
        d_ptr, s_ptr, n = dst.data_ptr(), src.data_ptr(), dst.numel()
        d_np, s_np = dst.numpy(), src.numpy()
        candidates["ctypes.memmove"] = lambda: ctypes.memmove(d_ptr, s_ptr, n)
        candidates["numpy.copyto"] = lambda: np.copyto(d_np, s_np)
    return candidates


def _best_limit(dst: torch.Tensor, src: torch.Tensor, device: torch.device,
                repeats: int) -> tuple[str, float]:
    best_name, best_s = "", float("inf")
    for name, fn in _limit_candidates(dst, src).items():
        fn()  # warm-up
        s = min(_time(fn, device, repeats))
        if s < best_s:
            best_name, best_s = name, s
    return best_name, best_s


def bench_block_size(backend_name: str, device: torch.device, block_bytes: int,
                     total_bytes: int, repeats: int, rng: np.random.Generator) -> list[Row]:
    num_blocks = total_bytes // block_bytes
    nbytes = num_blocks * block_bytes
    backend: DmaCopyBackend = create_backend(backend_name, device)
    kv = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, device=device)
    kv.fill_(1)  # touch every page before timing
    host = backend.allocate_host(nbytes)
    host.fill_(2)
    try:
        device_regions = backend.describe_kv_tensor(kv, num_blocks)
        backend.bind(device_regions, host_regions_for(device_regions, host.data_ptr(), num_blocks))
        rows = []
        for job_id, direction in enumerate((Direction.STORE, Direction.LOAD)):
            src_ids, dst_ids = rng.permutation(num_blocks), rng.permutation(num_blocks)
            next_id = [job_id * (repeats + 1)]

            def one_job() -> None:
                backend.submit(TransferJob(next_id[0], direction, src_ids, dst_ids))
                next_id[0] += 1
                (result,) = backend.flush()
                assert result.ok and result.num_bytes == nbytes, result

            one_job()  # warm-up: thread start, first touch of the queues
            seconds = _time(one_job, device, repeats)
            flat = kv.view(-1)
            dst, src = (host, flat) if direction is Direction.STORE else (flat, host)
            limit_name, limit_s = _best_limit(dst, src, device, repeats)
            rows.append(Row(
                block_bytes=block_bytes,
                direction=direction.value,
                descriptors=num_blocks,  # a random permutation leaves (almost) no runs
                best_gbps=nbytes / min(seconds) / 1e9,
                median_gbps=nbytes / statistics.median(seconds) / 1e9,
                limit_gbps=nbytes / limit_s / 1e9,
                limit_name=limit_name,
            ))
        return rows
    finally:
        backend.shutdown()
        backend.free_host(host)


def _size_label(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def _target(block_bytes: int) -> float:
    return TARGET_LARGE if block_bytes >= LARGE_FROM else TARGET_SMALL


def format_table(rows: list[Row]) -> str:
    lines = [
        "| block | direction | descriptors | backend GB/s (best) | backend GB/s (median) "
        "| limit GB/s | ratio | target |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {_size_label(r.block_bytes)} | {r.direction} | {r.descriptors} | "
            f"{r.best_gbps:.2f} | {r.median_gbps:.2f} | {r.limit_gbps:.2f} | "
            f"{r.ratio:.0%} | {_target(r.block_bytes):.0%} |"
        )
    return "\n".join(lines)


def write_plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.block_bytes for r in rows})
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for direction, marker in (("store", "o"), ("load", "s")):
        pts = [r for r in rows if r.direction == direction]
        ax_bw.plot([r.block_bytes for r in pts], [r.best_gbps for r in pts],
                   marker=marker, label=f"backend {direction}")
        ax_bw.plot([r.block_bytes for r in pts], [r.limit_gbps for r in pts],
                   linestyle="--", marker=marker, alpha=0.6, label=f"limit ({direction})")
        ax_ratio.plot([r.block_bytes for r in pts], [r.ratio for r in pts],
                      marker=marker, label=direction)
    ax_ratio.step(sizes, [_target(s) for s in sizes], where="post", color="grey",
                  linestyle=":", label="target")
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_size_label(s) for s in sizes])
        ax.set_xlabel("block size (random block ids)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_ylim(bottom=0)
    ax_ratio.set_ylabel("backend / limit")
    ax_ratio.set_ylim(0, max(1.2, max(r.ratio for r in rows) * 1.1))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", help="registry name (default: cpu)")
    parser.add_argument("--device", default=None,
                        help="torch device of the KV tensor (default: cpu for the cpu "
                             "backend, else the backend name, e.g. cuda)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per job (MiB)")
    parser.add_argument("--repeats", type=int, default=7, help="timed jobs per point")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mib, args.repeats = min(args.total_mib, 64), min(args.repeats, 3)
    device = torch.device(args.device or ("cpu" if args.backend == "cpu" else args.backend))
    rng = np.random.default_rng(args.seed)

    rows: list[Row] = []
    for block_bytes in BLOCK_SIZES:
        rows += bench_block_size(args.backend, device, block_bytes, args.total_mib * MIB,
                                 args.repeats, rng)
    limit_names = sorted({r.limit_name for r in rows})
    header = (f"backend `{args.backend}` on `{device}`, {args.total_mib} MiB per job, "
              f"best of {args.repeats}; limit: one `{'`/`'.join(limit_names)}` call "
              f"of the same bytes (fastest single-call copy, measured in the same run)")
    table = format_table(rows)
    print(header)
    print(table)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    md_path, png_path = args.out_dir / "copy_bench.md", args.out_dir / "copy_bench.png"
    md_path.write_text(f"# Copy throughput\n\n{header}.\n\n{table}\n\n![plot](copy_bench.png)\n")
    write_plot(rows, png_path, f"{args.backend} backend vs single-copy limit")
    print(f"wrote {md_path} and {png_path}")


if __name__ == "__main__":
    main()
