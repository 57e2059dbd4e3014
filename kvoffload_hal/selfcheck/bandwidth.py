"""Copy bandwidth of scattered blocks, against one contiguous copy of as many bytes.

One backend is bound to a single region pair: ``2 * n`` device blocks and ``n``
host blocks of ``block_bytes`` each. In each direction two jobs move the same
number of bytes through the same backend and the same memory:

* scattered: every other device block (``0, 2, 4, ...`` in random order) to/from
  the host blocks: no two blocks are adjacent, so the job is ``n`` descriptors,
  as a step of the connector with blocks spread over the KV cache;
* contiguous: device blocks ``0 .. n-1`` to/from host blocks ``0 .. n-1``: the
  runs merge into ONE descriptor, one large copy, which is the limit of what
  the link and the backend can do.

Each figure is the median of ``repeats`` timed jobs (``submit`` to the end of
``flush``), after one untimed job of each kind that touches every page.

The host buffer's set-up is timed too (``allocate_host`` and a first write of
every page), per GiB: what each GiB of ``cpu_bytes_to_use`` adds to a worker's
start-up on this backend (pinning and registering on CUDA and NPU; on the CPU
backend only the page faults).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, TransferJob
from kvoffload_hal.hal.regions import BlockRegion, merge_runs
from kvoffload_hal.selfcheck.session import backend_session

__all__ = ["BLOCK_BYTES", "Bandwidth", "measure_bandwidth"]

# One layer's K (or V) block of Llama-3-8B at 16 tokens per block:
# 16 tokens x 8 KV heads x 128 x 2 bytes.
BLOCK_BYTES = 32 << 10


@dataclass
class Bandwidth:
    """GB/s (1e9 bytes per second) of each kind of job, per direction."""

    block_bytes: int
    blocks: int
    descriptors: int  # of one scattered job; a contiguous job is 1
    store_gbps: float = 0.0  # device -> host, scattered
    store_limit_gbps: float = 0.0  # device -> host, one contiguous copy
    load_gbps: float = 0.0  # host -> device, scattered
    load_limit_gbps: float = 0.0  # host -> device, one contiguous copy
    host_setup_s_per_gib: float = 0.0  # allocate_host plus a first write of every page
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def ok(self) -> bool:
        return self.error is None


class _Timer:
    """Runs jobs on a bound backend with increasing ids and times them."""

    def __init__(self, backend: DmaCopyBackend) -> None:
        self.backend = backend
        self.next_id = {d: 0 for d in Direction}

    def seconds(self, direction: Direction, src: np.ndarray, dst: np.ndarray) -> float:
        job = TransferJob(self.next_id[direction], direction, src, dst)
        self.next_id[direction] += 1
        start = time.perf_counter()
        self.backend.submit(job)
        results = self.backend.flush()
        elapsed = time.perf_counter() - start
        failed = [r for r in results if not r.ok]
        if failed or not results:
            detail = failed[0].error if failed else "no result"
            raise RuntimeError(f"{direction.value} job {job.job_id} failed: {detail}")
        return elapsed


def _jobs(blocks: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Device and host block ids of a scattered and of a contiguous job."""
    scattered = 2 * rng.permutation(blocks)  # even device ids: never adjacent
    contiguous = np.arange(blocks)
    return {"scattered": (scattered, contiguous.copy()), "contiguous": (contiguous, contiguous)}


def _median_gbps(timer: _Timer, direction: Direction, device_ids: np.ndarray,
                 host_ids: np.ndarray, num_bytes: int, repeats: int) -> float:
    src, dst = (device_ids, host_ids) if direction is Direction.STORE else (host_ids, device_ids)
    timer.seconds(direction, src, dst)  # warm-up: first touch of every page
    times = [timer.seconds(direction, src, dst) for _ in range(repeats)]
    return num_bytes / statistics.median(times) / 1e9


def measure_bandwidth(make_backend: Callable[[], DmaCopyBackend],
                      tensor_device: torch.device | str, total_bytes: int,
                      block_bytes: int = BLOCK_BYTES, repeats: int = 3,
                      seed: int = 0) -> Bandwidth:
    """Scattered and contiguous GB/s in both directions; see the module docstring."""
    blocks = max(2, total_bytes // block_bytes)
    jobs = _jobs(blocks, np.random.default_rng(seed))
    descriptors = len(merge_runs(*jobs["scattered"])[2])
    outcome = Bandwidth(block_bytes, blocks, descriptors)
    device = torch.zeros(2 * blocks * block_bytes, dtype=torch.uint8, device=tensor_device)
    with backend_session(make_backend, outcome) as session:
        backend = session.backend
        start = time.perf_counter()
        host = session.allocate_host(blocks * block_bytes)
        host.zero_()
        outcome.host_setup_s_per_gib = round(
            (time.perf_counter() - start) / (blocks * block_bytes / 2**30), 4)
        backend.bind([BlockRegion(device.data_ptr(), 2 * blocks, block_bytes, block_bytes)],
                     [BlockRegion(host.data_ptr(), blocks, block_bytes, block_bytes)])
        timer = _Timer(backend)
        num_bytes = outcome.total_bytes
        for direction, fields in ((Direction.STORE, ("store_gbps", "store_limit_gbps")),
                                  (Direction.LOAD, ("load_gbps", "load_limit_gbps"))):
            for field, kind in zip(fields, ("scattered", "contiguous")):
                gbps = _median_gbps(timer, direction, *jobs[kind], num_bytes, repeats)
                setattr(outcome, field, round(gbps, 3))
    return outcome
