"""Copies beside compute on one CUDA GPU: what the copy kernel costs the model.

bf16 matrix products (``--n`` cubed, ``--products`` in a row) run on a stream of their
own, alone and while a thread stores and loads jobs of ``--total-mib`` in a loop (block
ids permuted on both sides, stores and loads alternating), once with the CUDA backend's
copy kernel taking both directions and once by DMA only. Reported per block size and
path: copy GB/s alone and beside the products, and the products' speed beside the
copies as a fraction of their speed alone. The jobs fence on the submitting thread's
default stream, which stays idle, so they never wait for the products.

Prints a table and writes ``docs/benchmarks/cuda_h100/cuda_beside_compute.{md,png}``
(``--out-dir``). Needs a CUDA GPU.

    python benchmarks/cuda_beside_compute.py [--blocks-kib 16 64] [--total-mib 256]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvoffload_hal.hal.backend import Direction, TransferJob
from kvoffload_hal.hal.regions import host_regions_for

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "cuda_h100"
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    block_kib: int
    path: str
    copies_alone_gbps: float
    copies_beside_gbps: float
    products_fraction: float


class Products:
    """bf16 ``n x n @ n x n`` products on their own stream."""

    def __init__(self, n: int, count: int) -> None:
        self.n, self.count = n, count
        self.a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        self.stream = torch.cuda.Stream()

    def tflops(self) -> float:
        with torch.cuda.stream(self.stream):
            for _ in range(3):  # warm-up
                self.a @ self.b
            self.stream.synchronize()
            start = time.perf_counter()
            for _ in range(self.count):
                self.a @ self.b
            self.stream.synchronize()
        return 2 * self.n ** 3 * self.count / (time.perf_counter() - start) / 1e12


class CopyLoop:
    """A bound backend and a thread that stores and loads every block until stopped."""

    job_ids = itertools.count()  # job ids only grow, across backends too

    def __init__(self, block_bytes: int, total_bytes: int, kernel: bool) -> None:
        from kvoffload_hal.backends.cuda import CudaCopyBackend

        self.backend = CudaCopyBackend("cuda:0", kernel_directions="all" if kernel else "off")
        self.num_blocks, self.block_bytes = total_bytes // block_bytes, block_bytes
        kv = torch.ones(self.num_blocks, block_bytes, dtype=torch.uint8, device="cuda")
        self.host = self.backend.allocate_host(self.num_blocks * block_bytes)
        self.host.fill_(2)
        regions = self.backend.describe_kv_tensor(kv, self.num_blocks)
        self.backend.bind(regions, host_regions_for(regions, self.host.data_ptr(),
                                                    self.num_blocks))
        self.kv = kv

    def run(self, seconds: float | None = None, during=None) -> float:
        """Copy until ``seconds`` pass or ``during()`` returns; GB/s over that time."""
        stop, moved = threading.Event(), []
        thread = threading.Thread(target=self._copy, args=(stop, moved))
        thread.start()
        try:
            if during is not None:
                time.sleep(0.05)  # the copies are under way first
                during()
            else:
                time.sleep(seconds)
        finally:
            stop.set()
            thread.join()
        return moved[0]

    def _copy(self, stop: threading.Event, out: list[float]) -> None:
        rng, moved, start = np.random.default_rng(0), 0, time.perf_counter()
        while not stop.is_set():
            job_id = next(self.job_ids)
            direction = Direction.STORE if job_id % 2 == 0 else Direction.LOAD
            self.backend.submit(TransferJob(job_id, direction, rng.permutation(self.num_blocks),
                                            rng.permutation(self.num_blocks)))
            (result,) = self.backend.flush()
            assert result.ok, result
            moved += self.num_blocks * self.block_bytes
        out.append(moved / (time.perf_counter() - start) / 1e9)

    def close(self) -> None:
        self.backend.shutdown()
        self.backend.free_host(self.host)


def measure(block_kib: int, total_mib: int, kernel: bool, products: Products,
            alone_tflops: float) -> Row:
    loop = CopyLoop(block_kib << 10, total_mib * MIB, kernel)
    try:
        copies_alone = loop.run(seconds=1.0)
        beside: list[float] = []
        copies_beside = loop.run(during=lambda: beside.append(products.tflops()))
    finally:
        loop.close()
    return Row(block_kib, "kernel" if kernel else "DMA", copies_alone, copies_beside,
               beside[0] / alone_tflops)


def format_table(rows: list[Row]) -> str:
    lines = ["| block | path | copies alone | copies beside the products "
             "| products beside the copies |", "|---:|:---|---:|---:|---:|"]
    lines += [f"| {r.block_kib} KiB | {r.path} | {r.copies_alone_gbps:.1f} GB/s | "
              f"{r.copies_beside_gbps:.1f} GB/s | {r.products_fraction:.0%} of alone |"
              for r in rows]
    return "\n".join(lines)


def write_plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for path_name, marker in (("kernel", "o"), ("DMA", "s")):
        pts = [r for r in rows if r.path == path_name]
        ax.plot([r.copies_beside_gbps for r in pts], [r.products_fraction for r in pts],
                marker=marker, linestyle="", label=path_name)
        for r in pts:
            ax.annotate(f"{r.block_kib} KiB", (r.copies_beside_gbps, r.products_fraction),
                        textcoords="offset points", xytext=(5, 4))
    ax.set_xlabel("copies beside the products (GB/s)")
    ax.set_ylabel("products' speed, fraction of alone")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks-kib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per job (MiB)")
    parser.add_argument("--n", type=int, default=8192, help="matrix size")
    parser.add_argument("--products", type=int, default=400, help="products per timing")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    products = Products(args.n, args.products)
    alone = products.tflops()
    rows = [measure(block, args.total_mib, kernel, products, alone)
            for block in args.blocks_kib for kernel in (True, False)]
    again = products.tflops()
    header = (f"{torch.cuda.get_device_name()}: bf16 {args.n}^3 products alone "
              f"{alone:.0f} TFLOP/s (after the copies: {again:.0f}); {args.total_mib} MiB "
              f"per copy job, stores and loads alternating")
    table = format_table(rows)
    print(header)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "cuda_beside_compute.md").write_text(
        f"# Copies beside compute\n\n{header}.\n\n{table}\n\n![plot](cuda_beside_compute.png)\n")
    write_plot(rows, args.out_dir / "cuda_beside_compute.png")


if __name__ == "__main__":
    main()
