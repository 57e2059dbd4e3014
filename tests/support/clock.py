"""A clock a test moves by hand: pass it where code takes ``clock=time.monotonic``."""


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
