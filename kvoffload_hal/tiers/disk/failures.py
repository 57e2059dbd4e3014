"""The disk tier's failed block IO in the log: each kind at once, then a count per window.

A kind is what failed and why (``writing``, ``OSError`` ENOSPC). Its first
failure is logged at once; later ones are counted and said in one line, with
their number, at the first failure after ``interval_s`` since the last line. A
disk that fills up again an hour later is in the log again (once per process
hid it), and a full disk under heavy load logs a line per window, not per block.
Called from the tier's IO threads.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

INTERVAL_S = 30.0


@dataclass
class _Kind:
    said_at: float
    unsaid: int = 0


class FailureLog:
    def __init__(self, logger, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[tuple[str, str], _Kind] = {}
        self._lock = threading.Lock()

    def failed(self, doing: str, error: BaseException) -> bool:
        """One block's ``doing`` failed with ``error``; True when a line was logged."""
        why = type(error).__name__
        code = getattr(error, "errno", None)
        if code in errno.errorcode:
            why += f" ({errno.errorcode[code]})"
        now = self._clock()
        with self._lock:
            kind = self._kinds.get((doing, why))
            if kind is None:
                self._kinds[(doing, why)] = _Kind(now)
                count, since = 1, None
            elif now - kind.said_at < self.interval_s:
                kind.unsaid += 1
                return False
            else:
                count, since = kind.unsaid + 1, now - kind.said_at
                kind.said_at, kind.unsaid = now, 0
        if since is None:
            self._logger.warning("disk tier: %s a block failed with %s; such blocks are "
                                 "recomputed", doing, why)
        else:
            self._logger.warning("disk tier: %s %d block(s) failed with %s in the last %.0f s; "
                                 "such blocks are recomputed", doing, count, why, since)
        return True
