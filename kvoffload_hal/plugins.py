"""Plug-ins by name: ``"package.module:Class"`` targets, from entry points or registered.

Copy backends (:mod:`kvoffload_hal.hal.registry`), secondary tiers
(:mod:`kvoffload_hal.tiers.registry`) and eviction policies
(:mod:`kvoffload_hal.eviction.registry`) are all found this way. Listing targets
imports nothing; a target is imported only by :func:`load_class`, when used.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TypeVar

T = TypeVar("T")


def entry_point_targets(group: str) -> dict[str, str]:
    """``name -> "module:Class"`` of every installed entry point in ``group``."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def check_target(kind: str, target: str, class_word: str = "Class") -> None:
    """``ValueError`` unless ``target`` looks like ``"module:Class"``."""
    if ":" not in target:
        raise ValueError(f"{kind} target {target!r} must look like 'package.module:{class_word}'")


def load_class(kind: str, name: str, target: str, base: type[T],
               error: type[Exception]) -> type[T]:
    """Import ``target`` and check that it is a ``base`` subclass.

    Raises ``error`` with one line naming ``kind``, ``name`` and ``target``:
    ``"backend 'x' (m:C) cannot be imported: ..."`` or ``"... is not a Base subclass"``.
    """
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise error(f"{kind} {name!r} ({target}) cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"{kind} {name!r} ({target}) is not a {base.__name__} subclass")
    return cls


class PluginTargets:
    """The targets of one plug-in family by name: its built-ins first, then the entry
    points of ``group``, then names registered at run time (a built-in's name is
    reserved; an entry point or a registration of a name already found is ignored)."""

    def __init__(self, kind: str, group: str, builtin: dict[str, str],
                 class_word: str = "Class") -> None:
        self.kind = kind  # how messages name a member: "tier", "eviction policy"
        self.group = group
        self.builtin = dict(builtin)
        self.class_word = class_word
        self.registered: dict[str, str] = {}

    def register(self, name: str, target: str) -> None:
        """Register ``name`` -> ``"module:Class"``; ``ValueError`` for a built-in's name."""
        if name in self.builtin:
            raise ValueError(f"{self.kind} name {name!r} is reserved")
        check_target(self.kind, target, self.class_word)
        self.registered[name] = target

    def unregister(self, name: str) -> None:
        self.registered.pop(name, None)

    def targets(self) -> dict[str, str]:
        """Every member's ``"module:Class"``, built-ins first."""
        found = dict(self.builtin)
        for more in (entry_point_targets(self.group), self.registered):
            for name, target in more.items():
                found.setdefault(name, target)
        return found
