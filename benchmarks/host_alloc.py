"""Start-up cost of the CPU tier's host memory, per GiB, on the CPU backend.

Times, for each size, best of ``--repeats``:

* ``allocate_host``: what the worker calls once at start-up. On the CPU backend
  it is ``torch.empty``, which only reserves address space;
* first touch: one write per 4 KiB page, the page faults the first stores pay
  later (the kernel zeroes each page as it maps it);
* ``mlock`` of a fresh, untouched buffer: faulting every page in and locking
  it, the part of a pinned allocation (``cuMemHostRegister``,
  ``aclrtMallocHost``) that a CPU can show; those also map every page for the
  device, which no CPU can measure;
* the free (``free_host`` and the last reference: ``munmap``).

Prints a markdown table with the host's CPU model and core count.

    python benchmarks/host_alloc.py [--sizes-gib 1 2 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import platform
import subprocess
import time

import torch

PAGE_BYTES = 4096
GiB = 1 << 30


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _mlock_seconds(libc, tensor: torch.Tensor) -> float | None:
    """Seconds to page-lock ``tensor`` (then unlocked); None where mlock is refused."""
    start = time.perf_counter()
    if libc.mlock(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(tensor.numel())) != 0:
        return None
    seconds = time.perf_counter() - start
    libc.munlock(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(tensor.numel()))
    return seconds


def measure(backend, num_bytes: int, libc) -> dict[str, float | None]:
    """Seconds per phase for ``num_bytes``: two allocations, one touched, one locked."""
    start = time.perf_counter()
    buffer = backend.allocate_host(num_bytes)
    allocated = time.perf_counter()
    buffer[::PAGE_BYTES].fill_(1)  # one byte per page: the faults, not a memset
    touched = time.perf_counter()
    backend.free_host(buffer)
    del buffer
    freed = time.perf_counter()
    buffer = backend.allocate_host(num_bytes)
    locked = _mlock_seconds(libc, buffer)  # faults every page in and locks it
    backend.free_host(buffer)
    del buffer
    return {"allocate": allocated - start, "touch": touched - allocated, "mlock": locked,
            "free": freed - touched}


def _best(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return min(values) if values else None


def _ms(seconds: float | None) -> str:
    return "refused" if seconds is None else f"{seconds * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from kvoffload_hal.backends.cpu.backend import CpuCopyBackend

    torch.set_num_threads(1)  # one thread faults the pages in, as one pinning call does
    backend = CpuCopyBackend()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Host: {_cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"backend `{backend.name}`; best of {args.repeats}; load average before: {load}\n")
    print("| tier GiB | allocate_host ms | first touch ms | mlock ms | free ms "
          "| allocate_host ms/GiB | first touch ms/GiB | mlock ms/GiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gib in args.sizes_gib:
        runs = [measure(backend, gib * GiB, libc) for _ in range(args.repeats)]
        best = {k: _best(runs, k) for k in ("allocate", "touch", "mlock", "free")}
        per = {k: None if v is None else v / gib for k, v in best.items()}
        print(f"| {gib} | {_ms(best['allocate'])} | {_ms(best['touch'])} | "
              f"{_ms(best['mlock'])} | {_ms(best['free'])} | {_ms(per['allocate'])} | "
              f"{_ms(per['touch'])} | {_ms(per['mlock'])} |")


if __name__ == "__main__":
    main()
