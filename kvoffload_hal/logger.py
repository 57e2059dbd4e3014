"""Logging through vLLM's logger when vLLM is installed, the standard library otherwise.

The HAL and the backends do not need vLLM, so importing them must not require it.

``log_once(logger, level, msg, *args)`` logs a message the first time its
formatted text is seen in this process (per logger and level), e.g. the copy
path a backend chose: every worker constructs a backend, and the line says the
same thing each time.
"""

from __future__ import annotations

import logging
import threading

try:
    from vllm.logger import init_logger as _vllm_init_logger
except ImportError:  # vLLM absent: the HAL still works on its own
    _vllm_init_logger = None


def init_logger(name: str) -> logging.Logger:
    if _vllm_init_logger is not None:
        return _vllm_init_logger(name)
    return logging.getLogger(name)


_logged_messages: set[tuple[str, int, str]] = set()
_logged_lock = threading.Lock()


def log_once(logger: logging.Logger, level: int, msg: str, *args: object) -> bool:
    """Log ``msg % args`` unless ``logger`` already logged that text at ``level``.

    Returns True when it logged. The key is the formatted text, so the same
    format with other arguments (another copy path, another limit) logs again.
    """
    key = (logger.name, level, msg % args if args else msg)
    with _logged_lock:
        if key in _logged_messages:
            return False
        _logged_messages.add(key)
    logger.log(level, msg, *args, stacklevel=2)
    return True
