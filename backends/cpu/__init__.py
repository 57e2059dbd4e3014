"""Reference backend: host-to-host block copies on a copy thread."""

from kvoffload_hal.backends.cpu.backend import CpuCopyBackend

__all__ = ["CpuCopyBackend"]
