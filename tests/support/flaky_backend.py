"""A CPU backend whose first load fails (before copying anything), then works."""

from kvoffload_hal.backends.cpu import CpuCopyBackend
from kvoffload_hal.hal import Direction, register_backend


class FlakyLoadsBackend(CpuCopyBackend):
    name = "flaky-loads"

    def __init__(self, device=None) -> None:
        super().__init__(device)
        self.failed_loads = 0

    def _launch(self, direction, batch, fence):
        if direction is Direction.LOAD and not self.failed_loads:
            self.failed_loads += 1
            raise RuntimeError("injected load failure (once)")
        return super()._launch(direction, batch, fence)


register_backend(FlakyLoadsBackend.name, f"{__name__}:FlakyLoadsBackend",
                 FlakyLoadsBackend.synchronous_compute)
