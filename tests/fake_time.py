"""A clock that moves only when a test moves it: pass it where code takes ``time.monotonic``."""

from __future__ import annotations

__all__ = ["FakeTime"]


class FakeTime:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
