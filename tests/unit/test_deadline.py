"""Probe timeouts give back the time a stalled event loop fired them late, on both loops."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import pytest
import uvloop

from cri_prober.probing.handlers.deadline import (
    PROMPT_SECONDS,
    _LagAwareTimer,
    timeout_after,
    timeout_at,
)
from tests.support.timers import counting_uvloop

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run_on(loop_name: str, main: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(main)


async def answered_during_stall(lag_aware: bool) -> bytes:
    """Wait up to 0.1 s for a byte that arrives at once, while the loop is stalled for 0.3 s."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:

        def answer_then_stall() -> None:
            theirs.send(b"x")  # the answer is in time...
            time.sleep(0.3)  # ...but the loop does nothing else until past the deadline

        loop.call_soon(answer_then_stall)
        scope = timeout_after(0.1) if lag_aware else asyncio.timeout(0.1)
        async with scope:
            return await loop.sock_recv(ours, 1)
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_an_answer_that_came_during_a_stall_is_not_a_timeout(loop_name: str) -> None:
    assert run_on(loop_name, answered_during_stall(lag_aware=True)) == b"x"


def test_asyncio_timeout_fails_the_same_answer() -> None:
    """The control: asyncio's own timeout turns the stall into a false timeout."""
    with pytest.raises(TimeoutError):
        run_on("asyncio", answered_during_stall(lag_aware=False))


@dataclass(frozen=True)
class Expiry:
    """How one scope ended: the loop times around its creation, its first deadline, the
    deadline it finally had (given back time included), what it gave back, and when the block
    was cancelled."""

    created_after: float
    created_before: float
    first_deadline: float
    deadline: float
    granted: float
    expired_at: float


async def never_answered(stall: float) -> Expiry:
    """Wait 0.1 s for a byte that never comes, the loop stalled for ``stall`` s meanwhile."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    created_after = loop.time()
    scope = timeout_after(0.1)
    created_before = loop.time()
    first_deadline = scope.deadline
    try:
        if stall:
            loop.call_soon(time.sleep, stall)
        with pytest.raises(TimeoutError):
            async with scope as inner:
                await loop.sock_recv(ours, 1)
        expired_at = loop.time()
        assert inner.expired()
        return Expiry(
            created_after, created_before, first_deadline, scope.deadline, scope.granted, expired_at
        )
    finally:
        ours.close()
        theirs.close()


# No bound on how long a timeout took: a busy machine fires timers late, and that lateness is
# what the scope gives back. What is checked is the deadline the scope computed, that the block
# was never cancelled before it (uvloop fires some timers early), and what was given back.


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_silence_times_out_at_the_deadline(loop_name: str) -> None:
    """The first deadline is 0.1 s after the scope was made; the block is cancelled at its
    deadline, never before, having given back at most one timeout of loop lateness."""
    expiry = run_on(loop_name, never_answered(0.0))
    assert expiry.created_after + 0.1 <= expiry.first_deadline <= expiry.created_before + 0.1
    assert 0.0 <= expiry.granted <= 0.1
    # Time given back moves the deadline on by at least as much.
    assert expiry.deadline >= expiry.first_deadline + expiry.granted
    assert expiry.expired_at >= expiry.deadline


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_stall_time_given_back_is_capped_at_one_timeout(loop_name: str) -> None:
    """Stalled 0.5 s through a 0.1 s deadline: 0.1 s given back (the cap), counted from the end
    of the stall, then it expires."""
    expiry = run_on(loop_name, never_answered(0.5))
    assert expiry.granted == pytest.approx(0.1, abs=1e-6)
    # The timer ran no earlier than the stall's end (0.5 s after the scope was made).
    assert expiry.deadline >= expiry.created_after + 0.5 + 0.1 - 1e-6
    assert expiry.expired_at >= expiry.deadline


class SteppedLoop:
    """The two calls a lag-aware timer makes of its loop, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.timers.append((when, callback))
        return cast(asyncio.TimerHandle, _Handle())

    def fire_at(self, now: float) -> float:
        """Run the last timer armed, the clock at ``now``; the due time it was armed for."""
        self.now = now
        when, callback = self.timers[-1]
        callback()
        return when


class _Handle:
    def cancel(self) -> None:
        pass


class RecordedScope:
    """What a timer does to the scope it ends: ``reschedule(now)`` expires it."""

    def __init__(self) -> None:
        self.expired_at: float | None = None

    def reschedule(self, when: float | None) -> None:
        self.expired_at = when


def stepped_timer(deadline: float, timeout: float) -> tuple[SteppedLoop, RecordedScope, Any]:
    loop, scope = SteppedLoop(), RecordedScope()
    timer = _LagAwareTimer(
        cast(asyncio.AbstractEventLoop, loop), cast(asyncio.Timeout, scope), deadline, timeout
    )
    return loop, scope, timer


def test_a_prompt_timer_expires_at_the_deadline_giving_nothing_back() -> None:
    """Fired within PROMPT_SECONDS of its deadline, the timer expires the scope there."""
    loop, scope, timer = stepped_timer(100.1, 0.1)
    assert loop.timers[0][0] == pytest.approx(100.1)
    loop.fire_at(100.1 + PROMPT_SECONDS / 2)
    assert scope.expired_at == 100.1 + PROMPT_SECONDS / 2
    assert (timer.granted, timer.due, len(loop.timers)) == (0.0, 100.1, 1)


def test_an_early_timer_waits_for_its_deadline() -> None:
    """uvloop may fire a timer up to half a millisecond early: it is armed again, unchanged."""
    loop, scope, timer = stepped_timer(100.1, 0.1)
    loop.fire_at(100.0995)
    armed_for: float = loop.timers[-1][0]
    assert (scope.expired_at, round(armed_for, 6)) == (None, 100.1)
    loop.fire_at(100.1)
    assert (scope.expired_at, timer.granted) == (100.1, 0.0)


def test_a_late_timer_gives_back_its_lateness_up_to_one_timeout() -> None:
    """Fired 0.03 s late, the timer gives 0.03 s back from now; a second stall of 0.5 s gets only
    what is left of the cap (0.07 s); the next firing expires the scope, however late."""
    loop, scope, timer = stepped_timer(100.1, 0.1)
    loop.fire_at(100.13)
    assert timer.granted == pytest.approx(0.03)
    assert timer.due == pytest.approx(100.16)
    assert timer.due <= loop.timers[-1][0] <= timer.due + 0.001  # the next whole ms
    loop.fire_at(100.66)
    assert timer.granted == pytest.approx(0.1)
    assert timer.due == pytest.approx(100.73)
    assert timer.due <= loop.timers[-1][0] <= timer.due + 0.001  # the next whole ms
    assert scope.expired_at is None
    loop.fire_at(101.0)
    assert scope.expired_at == 101.0
    assert timer.granted == pytest.approx(0.1)


# uvloop's loop, counting the timers a lag-aware timer arms.
CountingLoop = counting_uvloop(_LagAwareTimer)


def test_a_timeout_early_in_a_millisecond_arms_one_timer_on_uvloop() -> None:
    """uvloop rounds a timer to the nearest millisecond and fired one armed early in a
    millisecond before its deadline; re-armed for the rest, it spun the loop (one callback per
    iteration) until its clock caught up. Armed at the next whole millisecond, each timeout
    that expires is one timer, and still never before its deadline (issue 36)."""

    async def main() -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        early: list[float] = []
        for offset in (0.00005, 0.0001, 0.0002, 0.0003, 0.0004) * 4:
            whole_ms = math.floor(loop.time() * 1000) / 1000
            deadline = whole_ms + 0.002 + offset
            with pytest.raises(TimeoutError):
                async with timeout_at(deadline, 0.002):
                    await asyncio.Event().wait()
            if loop.time() < deadline:
                early.append(deadline - loop.time())
        return loop.armed, early

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        armed, early = runner.run(main())
    assert early == []
    # One timer per timeout; a stall on a busy machine may add one grant each, never a spin.
    assert 20 <= armed <= 40
