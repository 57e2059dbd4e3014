"""One fresh backend per check, released the same way by every check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvoffload_hal.hal.backend import DmaCopyBackend


class BackendSession:
    """A fresh backend and the host buffer a check allocates through it."""

    def __init__(self, backend: DmaCopyBackend) -> None:
        self.backend = backend
        self.host: torch.Tensor | None = None

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        self.host = self.backend.allocate_host(num_bytes)
        return self.host


@contextmanager
def backend_session(make_backend: Callable[[], DmaCopyBackend],
                    outcome: Any) -> Iterator[BackendSession]:
    """Any exception inside becomes ``outcome.error`` (one line); at the end the backend
    is shut down and its host buffer freed, unless a copy may still use it."""
    session = BackendSession(make_backend())
    try:
        yield session
    except Exception as e:  # noqa: BLE001 - reported as this check's failure
        outcome.error = " ".join(f"{type(e).__name__}: {e}".split())
    finally:
        if session.backend.shutdown() and session.host is not None:
            session.backend.free_host(session.host)
