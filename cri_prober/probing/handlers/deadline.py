"""Probe timeouts that do not count time the event loop spent elsewhere.

A probe's ``timeoutSeconds`` bounds how long its target takes to answer. On one busy event loop
the timer that ends a probe can fire late, after a stall in which the answer already arrived but
was not yet read; an ``asyncio.timeout`` would then fail a probe whose target answered in time.
``timeout_at`` gives the probe back the time its timer fired late, up to one more timeout.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from cri_prober.probing.ticks import timer_at

# A timer this late (or less) is the loop's normal promptness, not a stall.
PROMPT_SECONDS = 0.002


class _LagAwareTimer:
    """Expires ``scope`` at ``due``, plus however late the loop was to fire it."""

    __slots__ = ("_allowance", "_due", "_handle", "_loop", "_scope", "granted")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, scope: asyncio.Timeout, due: float, allowance: float
    ) -> None:
        self._loop = loop
        self._scope = scope
        self._due = due
        self._allowance = allowance
        self.granted = 0.0  # seconds given back so far, for tests and logs
        # Armed at a whole millisecond (``timer_at``): uvloop fires a timer armed mid-millisecond
        # up to half of one early, and re-armed for the rest it spun the loop until due.
        self._handle: asyncio.TimerHandle | None = loop.call_at(timer_at(due), self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        late = now - self._due
        if late < 0:
            # Another loop's clock may still read before the deadline: wait for it, once.
            self._handle = self._loop.call_at(timer_at(self._due), self._fire)
            return
        if late > PROMPT_SECONDS and self._allowance > 0:
            # The loop did not run us for ``late`` s around the deadline: an answer that came
            # meanwhile is still unread. Give that time back, once per stall, within the cap.
            grant = min(late, self._allowance)
            self._allowance -= grant
            self.granted += grant
            self._due = now + grant
            self._handle = self._loop.call_at(timer_at(self._due), self._fire)
            return
        self._handle = None
        self._scope.reschedule(now)  # expires now: cancels the probe, exits with TimeoutError

    @property
    def due(self) -> float:
        """The loop time the scope expires at, once the time given back so far is added."""
        return self._due

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class LagAwareTimeout:
    """``async with timeout_at(deadline) as scope``: like ``asyncio.timeout_at``, the block is
    cancelled and ``TimeoutError`` raised at the deadline; ``scope.expired()`` tells so inside.
    Unlike it, time the loop fired the deadline late is given back (at most ``timeout`` s more).
    """

    __slots__ = ("_deadline", "_scope", "_timeout", "_timer")

    def __init__(self, deadline: float, timeout: float) -> None:
        self._deadline = deadline
        self._timeout = timeout
        self._scope = asyncio.timeout_at(None)
        self._timer: _LagAwareTimer | None = None

    @property
    def granted(self) -> float:
        """Seconds of loop stalls given back to the probe."""
        return 0.0 if self._timer is None else self._timer.granted

    @property
    def deadline(self) -> float:
        """The loop time the block is cancelled at: the deadline it was given, moved on by the
        time given back so far (for tests and logs; a timer may fire later than this, never
        earlier)."""
        return self._deadline if self._timer is None else self._timer.due

    async def __aenter__(self) -> asyncio.Timeout:
        scope = await self._scope.__aenter__()
        loop = asyncio.get_running_loop()
        self._timer = _LagAwareTimer(loop, scope, self._deadline, self._timeout)
        return scope

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # Turns the cancellation it caused into TimeoutError, as asyncio.timeout_at does.
        await self._scope.__aexit__(exc_type, exc, tb)


def timeout_at(deadline: float, timeout: float) -> LagAwareTimeout:
    """A probe's timeout ending at ``deadline`` (loop time) for a ``timeout`` s probe."""
    return LagAwareTimeout(deadline, timeout)


def timeout_after(timeout: float) -> LagAwareTimeout:
    """A probe's timeout ending ``timeout`` s from now."""
    return LagAwareTimeout(asyncio.get_running_loop().time() + timeout, timeout)
