"""Validators of ``kv_connector_extra_config`` values.

Each returns the value when it is right, and otherwise raises ``ValueError`` in one
line naming the key, the value and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def where(key: str, value: Any) -> str:
    return f"kv_connector_extra_config['{key}']={value!r}"


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where(key, value)}: expected an integer number of bytes > 0")
    return value


def positive_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where(key, value)}: expected a number of seconds > 0")
    return float(value)


def seconds(key: str, value: Any) -> float:
    """A number of seconds >= 0 (0 usually meaning: do not wait)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{where(key, value)}: expected a number of seconds >= 0")
    return float(value)


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where(key, value)}: expected true or false")
    return value


def text(key: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ValueError(f"{where(key, value)}: expected a {'' if allow_empty else 'non-empty '}"
                         "string")
    return value


def one_of(key: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{where(key, value)}: expected one of {', '.join(choices)}")
    return value


def count(key: str, value: Any, what: str) -> int:
    """An integer >= 0 counting ``what`` (0 usually meaning off or no limit)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where(key, value)}: expected an integer number of {what} >= 0")
    return value


def share(key: str, value: Any) -> float:
    """A fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{where(key, value)}: expected a number > 0 and <= 1")
    return float(value)


def whole_blocks(key: str, bytes_per_rank: int, block_bytes: int) -> int:
    """Whole blocks of ``block_bytes`` in ``bytes_per_rank``; at least one."""
    if bytes_per_rank < block_bytes:
        raise ValueError(
            f"kv_connector_extra_config['{key}'] gives {bytes_per_rank} bytes per rank, less "
            f"than one KV block ({block_bytes} bytes); expected at least {block_bytes} "
            "bytes per rank")
    return bytes_per_rank // block_bytes
