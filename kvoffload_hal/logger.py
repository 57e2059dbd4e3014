"""Logging through vLLM's logger when vLLM is installed, the standard library otherwise.

The HAL and the backends do not need vLLM, so importing them must not require it.
"""

from __future__ import annotations

import logging

try:
    from vllm.logger import init_logger as _vllm_init_logger
except ImportError:  # vLLM absent: the HAL still works on its own
    _vllm_init_logger = None


def init_logger(name: str) -> logging.Logger:
    if _vllm_init_logger is not None:
        return _vllm_init_logger(name)
    return logging.getLogger(name)
