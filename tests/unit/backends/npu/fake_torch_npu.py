"""A small stand-in for the ``torch.npu`` stream/event surface the NPU backend uses.

Streams and events carry integer handles, like the ``aclrtStream``/``aclrtEvent``
pointers torch_npu exposes; ``stream.npu_stream`` is what reaches the fake
libascendcl, so tests can tell which stream a batch ran on. Copies in the fake
runtime finish inside the call, so an event is complete once recorded, unless
the test holds completion (``hold_completion``) to model a slow DMA.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeEvent:
    npu: FakeNpuModule
    handle: int
    enable_timing: bool = False
    recorded_on: FakeStream | None = None
    done: bool = False

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.npu.current_stream()
        self.recorded_on = stream
        stream.log.append(("record", self.handle, self.npu.acl_calls()))
        self.done = stream is self.npu.compute_stream or not self.npu.hold_completion

    def query(self) -> bool:
        if self.npu.fail_query:
            raise RuntimeError("fake ACL error 507011: the stream task failed")
        if not self.done and not self.npu.hold_completion:
            self.done = True
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("both events need enable_timing=True")
        return 2.5  # milliseconds


@dataclass
class FakeStream:
    npu: FakeNpuModule
    npu_stream: int  # raw aclrtStream handle, passed to ACL through ctypes
    device: Any = None
    log: list = field(default_factory=list)

    def wait_event(self, event: FakeEvent) -> None:
        # The number of ACL copy calls made so far orders the wait against them.
        self.log.append(("wait", event.handle, self.npu.acl_calls()))

    def synchronize(self) -> None:
        self.log.append(("synchronize", None, self.npu.acl_calls()))


class FakeNpuModule:
    """Installed as ``torch.npu``: Stream, Event, current_stream, set_device, ..."""

    def __init__(self, acl_calls: Callable[[], int] = lambda: 0) -> None:
        self._handles = itertools.count(0x5000, 0x10)
        self.acl_calls = acl_calls
        self.streams: list[FakeStream] = []  # every stream made, the compute stream first
        self.events: list[FakeEvent] = []
        self.compute_stream = self.Stream()
        self.set_device_calls: list[tuple[int, str]] = []
        self.hold_completion = False
        self.fail_query = False
        self.available = True

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802
        stream = FakeStream(self, next(self._handles), device)
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802
              interprocess: bool = False) -> FakeEvent:
        event = FakeEvent(self, next(self._handles), enable_timing)
        self.events.append(event)
        return event

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.compute_stream

    def set_device(self, device: int) -> None:
        self.set_device_calls.append((device, threading.current_thread().name))

    def current_device(self) -> int:
        return 0

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return int(self.available)

    def release(self) -> None:
        """Let every launched copy complete (the end of a modelled slow DMA)."""
        self.hold_completion = False


def fake_torch_npu_module() -> types.ModuleType:
    """A ``torch_npu`` module with a spec, so ``importlib.util.find_spec`` accepts it."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    return module
