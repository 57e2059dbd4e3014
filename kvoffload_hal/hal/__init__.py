"""The hardware-abstraction layer: the DmaCopyBackend seam, regions, completion, registry,
and the plumbing vendor backends share."""

from kvoffload_hal.hal.backend import Direction, DmaCopyBackend, JobResult, TransferJob
from kvoffload_hal.hal.plumbing import chunk_bounds, enqueue_in_chunks, env_int, log_once
from kvoffload_hal.hal.regions import (
    BlockRegion,
    CopyBatch,
    build_copy_batch,
    describe_kv_tensor,
    host_regions_for,
    merge_runs,
)
from kvoffload_hal.hal.registry import (
    ENV_VAR,
    BackendSelectionError,
    backend_names,
    create_backend,
    get_backend_class,
    register_backend,
    resolve_backend_name,
)
from kvoffload_hal.hal.threaded import ThreadedCopyBackend

__all__ = [
    "ENV_VAR",
    "BackendSelectionError",
    "BlockRegion",
    "CopyBatch",
    "Direction",
    "DmaCopyBackend",
    "JobResult",
    "ThreadedCopyBackend",
    "TransferJob",
    "backend_names",
    "build_copy_batch",
    "chunk_bounds",
    "create_backend",
    "describe_kv_tensor",
    "enqueue_in_chunks",
    "env_int",
    "get_backend_class",
    "host_regions_for",
    "log_once",
    "merge_runs",
    "register_backend",
    "resolve_backend_name",
]
