"""Clocks the test moves by hand: `ManualClock`, the one stand-in for ``time.monotonic`` that pod
sources, the registry and the runtime's liveness take as ``clock``, and `WorkerClock`, the one
virtual-time implementation of the probe worker's ``Clock`` protocol."""

from __future__ import annotations

import asyncio

from cri_prober.probing.worker import Wake

# The wall-clock time at which a `WorkerClock` starts (its monotonic time starts at 0).
WALL0 = 1_700_000_000.0


class ManualClock:
    """``now`` seconds; ``clock.now += 11`` (or ``advance(11)``) moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class WorkerClock(ManualClock):
    """Virtual time for a probe worker (``cri_prober.probing.worker.Clock``): a wait returns at
    once, moving time to its deadline unless woken first. Monotonic time starts at 0, wall time
    at `WALL0`."""

    def __init__(self, now: float = 0.0) -> None:
        super().__init__(now)

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL0 + self.now

    def wake_at(self, deadline: float, wakeup: asyncio.Future[Wake]) -> asyncio.Handle:
        def fire() -> None:
            if not wakeup.done():  # a stop or trigger that landed first wins
                self.now = max(self.now, deadline)
                wakeup.set_result(Wake.TICK)

        return asyncio.get_running_loop().call_soon(fire)
