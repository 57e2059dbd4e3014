"""A clock a test moves by hand: pass it where code takes ``clock=time.monotonic``."""


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def install_clock(root: object, clock: FakeClock) -> int:
    """Give every object of the package reachable from ``root`` (a scheduler) ``clock``
    where it took ``time.monotonic``, whatever the attribute is named; returns how many
    attributes were set (0: nothing there reads a clock)."""
    import time

    seen: set[int] = set()
    todo = [root]
    installed = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
            continue
        if not type(obj).__module__.startswith("kvoffload_hal"):
            continue
        fields = getattr(obj, "__dict__", {})
        for name, value in list(fields.items()):
            if value is time.monotonic:
                setattr(obj, name, clock)
                installed += 1
            else:
                todo.append(value)
    return installed
