"""Probe timeouts give back the time a stalled event loop fired them late, on both loops."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from cri_prober.probing.handlers.deadline import timeout_after

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


async def never_answered(stall: float) -> tuple[float, float]:
    """Wait 0.1 s for a byte that never comes, the loop stalled for ``stall`` s meanwhile."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    scope = timeout_after(0.1)
    started = loop.time()
    try:
        if stall:
            loop.call_soon(time.sleep, stall)
        with pytest.raises(TimeoutError):
            async with scope as inner:
                await loop.sock_recv(ours, 1)
        assert inner.expired()
        return loop.time() - started, scope.granted
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_silence_times_out_at_the_deadline_on_a_prompt_loop(loop_name: str) -> None:
    took, granted = run_on(loop_name, never_answered(0.0))
    assert 0.1 - 1e-6 <= took < 0.1 + 0.09  # (floating-point: uvloop counts milliseconds)
    assert granted < 0.05


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_stall_time_given_back_is_capped_at_one_timeout(loop_name: str) -> None:
    took, granted = run_on(loop_name, never_answered(0.5))
    # Stalled 0.5 s through a 0.1 s deadline: 0.1 s given back (the cap), then it expires.
    assert granted == pytest.approx(0.1, abs=1e-6)
    assert 0.6 <= took < 0.5 + 0.1 + 0.1 + 0.09
