"""Host memory as ``/proc/meminfo`` gives it, now and when this process started.

The data-parallel ranks of one server each run an engine of their own on the
same host. They start together, and each checks its own CPU tier against the
memory available when it allocates: two ranks can each find room for their own
tier and overcommit the host together. :func:`note_start` records
``MemAvailable`` the first time vLLM loads this package's plugin in a process
(:mod:`kvoffload_hal.plugin`), which it does before the process loads a model
or allocates any KV cache; :func:`available_at_start` gives that figure back,
for the check of the ranks' sum (:func:`kvoffload_hal.config.check_replicas`).

Imported by the plugin in every vLLM process: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import os

_available_at_start: int | None = None


def host_memory(field: str) -> int:
    """``MemTotal`` or ``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = "SC_PHYS_PAGES" if field == "MemTotal" else "SC_AVPHYS_PAGES"
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def note_start() -> None:
    """Record ``MemAvailable`` once per process (later calls keep the first figure)."""
    global _available_at_start
    if _available_at_start is None:
        _available_at_start = host_memory("MemAvailable")


def available_at_start() -> int:
    """``MemAvailable`` as :func:`note_start` recorded it (now, if it never ran)."""
    return _available_at_start if _available_at_start is not None \
        else host_memory("MemAvailable")
