"""The tests' one fake clock: time moves only when a test moves it, so TTLs, leases, windows and
backoffs are tested without sleeping. Code under test takes a clock (a function of no arguments)."""

from __future__ import annotations


class FakeClock:
    """Seconds since an arbitrary start, 0 unless given. Pass the clock itself where code wants
    seconds (as time.monotonic or time.time give them), `clock.millis` where it wants milliseconds."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def millis(self) -> int:
        return round(self.now * 1000)

    def advance(self, seconds: float) -> None:
        self.now += seconds
