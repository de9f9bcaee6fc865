"""The loop's one tick timer on uvloop (``probing/ticks.py``): armed at whole milliseconds, so a
tick is never resolved early and costs one timer callback, shared by every tick of its
millisecond (issue 36: the re-armed timer spun the loop until its clock reached the deadline)."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from cri_prober.probing.ticks import TIMER_GRANULARITY, TickTimers, Wake, timer_at
from tests.support.timers import counting_uvloop
from tests.support.waiting import HANG_GUARD

# uvloop's loop, counting the timers ``TickTimers`` arms.
CountingLoop = counting_uvloop(TickTimers)


def test_timer_at_rounds_up_to_the_next_whole_millisecond() -> None:
    """Never before the deadline, at most one granularity after it, on a whole millisecond;
    a deadline already on one keeps it."""
    rng = random.Random(11)
    deadlines = [rng.uniform(0, 1e6) for _ in range(10_000)]
    deadlines += [1.0, 2.5, 1234.567, math.nextafter(1.0, 2.0), math.nextafter(1000.001, 2e3)]
    for deadline in deadlines:
        at = timer_at(deadline)
        assert deadline <= at <= deadline + TIMER_GRANULARITY + 1e-9, deadline
        assert abs(at * 1000 - round(at * 1000)) < 1e-6, deadline
    assert timer_at(2.5) == 2.5


def _run(main: Any) -> Any:
    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        return runner.run(main())


def test_a_tick_in_a_milliseconds_first_half_costs_one_timer() -> None:
    """A deadline early in a millisecond: uvloop would round a timer armed for it down and fire
    it before the deadline; the timer is armed once, and the tick still comes no earlier."""

    async def main() -> tuple[int, int, list[float]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        timers = TickTimers(loop)
        rng = random.Random(7)
        early: list[float] = []
        armed_before = loop.armed
        for _ in range(60):
            whole_ms = math.floor(loop.time() * 1000) / 1000
            deadline = whole_ms + 0.002 + rng.uniform(0.00005, 0.00045)
            wakeup: asyncio.Future[Wake] = loop.create_future()
            timers.add(deadline, wakeup)
            async with asyncio.timeout(HANG_GUARD):
                assert await wakeup is Wake.TICK
            if loop.time() < deadline:
                early.append(deadline - loop.time())
        return loop.armed - armed_before, len(timers), early

    armed, left, early = _run(main)
    assert early == []
    assert left == 0
    assert armed == 60  # one timer per tick: none re-armed because it fired before its tick


def test_ticks_due_within_one_millisecond_share_one_callback() -> None:
    """Twenty workers' ticks within one millisecond, added in any order: one timer, armed once,
    resolves them all, in deadline order, none before its own deadline."""

    async def main() -> tuple[int, list[int], list[int], list[float]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        timers = TickTimers(loop)
        rng = random.Random(3)
        whole_ms = math.floor(loop.time() * 1000) / 1000 + 0.005
        deadlines = [whole_ms + rng.uniform(0.00001, 0.00095) for _ in range(20)]
        fired: list[int] = []
        early: list[int] = []
        wakeups = []
        armed_before = loop.armed
        for index, deadline in enumerate(deadlines):
            wakeup: asyncio.Future[Wake] = loop.create_future()

            def seen(future: asyncio.Future[Wake], index: int = index) -> None:
                fired.append(index)
                if loop.time() < deadlines[index]:
                    early.append(index)

            wakeup.add_done_callback(seen)
            timers.add(deadline, wakeup)
            wakeups.append(wakeup)
        async with asyncio.timeout(HANG_GUARD):
            results = await asyncio.gather(*wakeups)
        assert all(result is Wake.TICK for result in results)
        order = sorted(range(20), key=lambda i: deadlines[i])
        return loop.armed - armed_before, fired, order, [float(i) for i in early]

    armed, fired, order, early = _run(main)
    assert early == []
    assert fired == order
    assert armed == 1


def test_timer_at_is_a_reading_of_uvloops_clock() -> None:
    """uvloop's clock reads whole milliseconds divided by 1000. A timer armed at ``k * 0.001``
    could be one ulp above the clock's reading ``k / 1000`` of that millisecond, so a deadline
    there (a time given back to a probe is itself whole milliseconds) was not due when the timer
    fired, and re-arming for it spun the loop until the next millisecond (issue 36)."""
    rng = random.Random(5)
    for ms in [14_699_067, *(rng.randrange(10**6, 10**11) for _ in range(20_000))]:
        reading = ms / 1000
        for deadline in (reading, math.nextafter(reading, math.inf), ms * 0.001):
            at = timer_at(deadline)
            assert at >= deadline, deadline
            # What the clock reads at the millisecond the timer is armed for.
            assert at == round(at * 1000) / 1000, deadline
