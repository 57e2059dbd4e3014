"""The hardware-abstraction seam: :class:`DmaCopyBackend`.

The core of the connector asks a backend for exactly this: "here is host memory
for the offload tier, here are the device KV tensors, copy these blocks in this
direction, tell me when done". Only ``kvoffload_hal.backends.<vendor>`` knows how.

Contract of each operation (every method is called from the engine thread
unless stated otherwise):

``unavailable_reason()`` (classmethod)
    ``None`` when the backend can run in this process, else one line naming
    what is missing ("torch_npu is not importable"). Side-effect free: it must
    not initialise a device.

``allocate_host(num_bytes)`` / ``free_host(tensor)``
    Allocate the host memory of the offload tier as a 1-D ``uint8`` tensor,
    pinned or registered with the device runtime where DMA needs it, and
    release it (unregistering first). ``free_host`` is called only once no job
    touching the memory is in flight.

``allocate_host_regions(device_regions, num_host_blocks)`` / ``free_host_regions(host)``
    The CPU tier's host memory as the connector uses it: a dense host region
    per device region, each wholly inside one allocation
    (:class:`~kvoffload_hal.hal.host.HostChunks`). The default is one
    ``allocate_host`` buffer; a backend whose runtime caps one allocation
    spreads the regions over several (NPU: ``aclrtMallocHost`` chunks).

``describe_kv_tensor(tensor, num_blocks)``
    Describe one device KV tensor as block-addressable byte regions
    (:class:`~kvoffload_hal.hal.regions.BlockRegion`). The default derives them
    from shape and strides; a backend overrides it only for layouts the
    generic rule cannot see.

``bind(device_regions, host_regions)``
    Fix the region pairs every later job copies between; region ``i`` on the
    device is mirrored by region ``i`` on the host. Called once, before any
    submission.

``submit(job)``
    Queue one batch of block copies in one direction (:attr:`Direction.STORE`
    device->host, :attr:`Direction.LOAD` host->device) and return at once; the
    copies run asynchronously on the backend's own stream or thread. Runs of
    consecutive block ids become one copy descriptor. A store never reads a
    block before the compute already enqueued on the device has finished.
    Job ids must increase per direction; submitting an id that was already
    submitted is a no-op, so a job is launched at most once. One submission
    per direction per engine step is the normal case. ``submit`` raises only
    for misuse (not bound, shut down); a job that fails once accepted, even
    before its copies start, is reported failed by ``poll``/``flush``.

``rebind(device_regions)``
    The device side of the pairs moved (vLLM's sleep mode remaps the KV cache):
    replace it with regions of the same count and layout, keeping the host side.
    Called only with no job pending (after ``flush``).

``forward_done()`` / ``step_done()``
    ``forward_done``: the step's forward pass is enqueued (vLLM's
    ``finish_forward``); jobs submitted until ``step_done`` may be ordered after
    that pass instead of after all compute enqueued at their submission (the
    sampler's, say). ``step_done``: jobs fence at their submission again.
    Default: nothing (every job fences at its submission, always correct).

``poll()``
    Non-blocking: the :class:`JobResult` of every job that finished since the
    last call, each exactly once. A job whose copy failed is reported with
    ``ok=False`` and never as a success.

``flush()``
    Block until every job submitted so far (queued and not yet launched, as
    well as launched) has finished; return their results, as ``poll`` would.
    Used before blocks of preempted requests are reused.

``shutdown(timeout_s)``
    Stop accepting jobs, wait up to ``timeout_s`` for jobs in flight, release
    what the backend owns, and return without hanging even if a copy never
    completes. Returns True when no copy can touch host or device memory any
    more (every job ended, device queues drained); False when one may still
    run, in which case the caller must keep the host buffer alive. Idempotent.

What a backend says about itself, for logs, metrics and the self-check, is
declared on :class:`DmaCopyBackend` too (callers read nothing else, and import
no vendor module to interpret it): ``copy_path`` and whether it is a per-copy
fallback (``copy_path_is_fallback``, from the class's ``fallback_copy_paths``),
``runtime_version`` of the class's ``runtime_name``, ``host_memcpy``, and
``synchronous_compute``, which the registry repeats for the scheduler process.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvoffload_hal.hal.host import HostChunks, one_buffer
from kvoffload_hal.hal.regions import BlockRegion, describe_kv_tensor, host_bytes_per_block

__all__ = ["Direction", "DmaCopyBackend", "JobResult", "TransferJob"]


class Direction(str, enum.Enum):
    """Direction of one job: a batch never mixes the two."""

    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device


@dataclass(frozen=True)
class TransferJob:
    """Copy block ``src_block_ids[k]`` to block ``dst_block_ids[k]`` in every bound region.

    For a store the sources are device blocks and the destinations host blocks;
    for a load the reverse. ``tag`` is carried to the :class:`JobResult`
    untouched (the connector uses it for the requests waiting on the job).
    """

    job_id: int
    direction: Direction
    src_block_ids: Sequence[int] | np.ndarray
    dst_block_ids: Sequence[int] | np.ndarray
    tag: Any = None

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"job {self.job_id}: {len(self.src_block_ids)} source blocks vs "
                f"{len(self.dst_block_ids)} destination blocks"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True)
class JobResult:
    """Outcome of one job. ``ok=False`` means its destination blocks hold garbage."""

    job_id: int
    direction: Direction
    ok: bool
    num_blocks: int
    num_bytes: int
    seconds: float
    tag: Any = None
    error: str | None = field(default=None, compare=False)


class DmaCopyBackend(ABC):
    """Copies KV blocks between device regions and host regions; see the module docstring."""

    #: Name under which the registry selects this backend (``KVOFFLOAD_HAL_BACKEND``).
    name: ClassVar[str] = ""
    #: True where the device's compute has already finished when the worker submits
    #: a step's copies (vLLM's CPU platform runs the forward pass synchronously).
    #: There is then no compute left to overlap the copies with, and the worker
    #: waits for them: their results reach the scheduler in the same step, so a
    #: request waiting for a load is scheduled one step earlier.
    #: The worker reads this flag on its backend. The scheduler process never
    #: imports a backend and asks the registry instead, which must say the same:
    #: a built-in's entry in ``hal/registry.py``; a plug-in's
    #: ``register_backend(..., synchronous_compute=True)`` or its entry in the group
    #: ``kvoffload_hal.synchronous_backends`` (undeclared: False, always safe).
    synchronous_compute: ClassVar[bool] = False
    #: Copies are plain host memcpy (no device, no DMA engine), as in the CPU backend;
    #: the self-check then reports the copy mode ``host memcpy``.
    host_memcpy: ClassVar[bool] = False
    #: The vendor runtime whose version :attr:`runtime_version` reports ("CUDA
    #: driver", "AscendCL"); None for a backend without one (the self-check says "n/a").
    runtime_name: ClassVar[str | None] = None
    #: The values of :attr:`copy_path` that are a per-copy loop standing in for a
    #: batched call (the runtime lacks the batch call, or answered "not supported").
    #: Empty for a backend without such a fallback.
    fallback_copy_paths: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None

    @property
    def copy_path(self) -> str | None:
        """The call block copies go through now, e.g. ``"cuMemcpyBatchAsync (CUDA 12.8
        ABI)"``, for logs, the self-check and the ``copy_path_fallbacks`` metric.

        None while not known yet: a backend may only know it once :meth:`bind` has
        loaded its runtime (CUDA), or from construction (CPU, NPU); from ``bind`` on it
        is a string. Before the first copy it names the best call the runtime offers.
        It changes at most once, and only to one of :attr:`fallback_copy_paths`: when a
        batched call answers "not supported" and the backend moves to a per-copy loop
        for good. Cheap and side-effect free.
        """
        return None

    @property
    def copy_kernel(self) -> str | None:
        """The device kernel the backend copies small blocks with, where it has one (the
        CUDA backend's copy kernel), else None; known from :meth:`bind` on. Jobs it does
        not take go through :attr:`copy_path`."""
        return None

    @property
    def copy_path_is_fallback(self) -> bool:
        """:attr:`copy_path` is one of :attr:`fallback_copy_paths` (False while None)."""
        return self.copy_path in self.fallback_copy_paths

    @property
    def runtime_version(self) -> str | None:
        """The version of :attr:`runtime_name`, e.g. "12.8" or "9.1.0". Always None where
        :attr:`runtime_name` is None; otherwise None until the runtime is loaded (CUDA:
        ``allocate_host`` or ``bind``; NPU: construction) or when it will not say.
        Side-effect free: it never loads or initialises the runtime."""
        return None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """One line saying what is missing for this backend to run here, or None."""
        return None

    @abstractmethod
    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """Host memory of the offload tier: 1-D uint8, pinned/registered as DMA needs."""

    @abstractmethod
    def free_host(self, tensor: torch.Tensor) -> None:
        """Release memory from :meth:`allocate_host` (unregister first where needed)."""

    def allocate_host_regions(self, device_regions: Sequence[BlockRegion],
                              num_host_blocks: int) -> HostChunks:
        """The CPU tier's host memory: a region mirroring each device region,
        ``num_host_blocks`` dense blocks each, none straddling two allocations.
        Default: one :meth:`allocate_host` buffer; a backend whose runtime caps
        one allocation overrides it (NPU)."""
        buffer = self.allocate_host(num_host_blocks * host_bytes_per_block(device_regions))
        return one_buffer(buffer, device_regions, num_host_blocks)

    def free_host_regions(self, host: HostChunks) -> None:
        """Release memory from :meth:`allocate_host_regions`, once no job can touch it."""
        for chunk in host.chunks:
            self.free_host(chunk)

    def describe_kv_tensor(self, tensor: torch.Tensor, num_blocks: int) -> list[BlockRegion]:
        """Device KV tensor -> block regions. Default: derived from shape and strides."""
        return describe_kv_tensor(tensor, num_blocks)

    @abstractmethod
    def bind(self, device_regions: Sequence[BlockRegion],
             host_regions: Sequence[BlockRegion]) -> None:
        """Fix the region pairs that later jobs copy between."""

    def rebind(self, device_regions: Sequence[BlockRegion]) -> None:
        """New addresses for the bound device regions (same count and layout)."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow a KV cache remap")

    def forward_done(self) -> None:
        """The step's forward pass is enqueued: see the module docstring."""

    def step_done(self) -> None:
        """Jobs submitted from now on fence at their submission."""

    @abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Queue ``job`` asynchronously; a job id already submitted is ignored."""

    @abstractmethod
    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the last call, without blocking."""

    @abstractmethod
    def flush(self) -> list[JobResult]:
        """Wait for every submitted job, queued or launched; return their results."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop, wait at most ``timeout_s`` for jobs in flight, release resources.

        True when no copy can still touch memory; see the module docstring."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Jobs submitted whose result has not been returned yet."""
