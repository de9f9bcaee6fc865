"""A monotonic clock the test moves by hand: the one stand-in for ``time.monotonic`` that pod
sources, the registry and the runtime's liveness take as ``clock``."""

from __future__ import annotations


class ManualClock:
    """``now`` seconds; ``clock.now += 11`` (or ``advance(11)``) moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
