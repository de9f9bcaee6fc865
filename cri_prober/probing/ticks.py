"""A worker's ticks: the clock it waits on, the loop's one timer heap, and the bookkeeping of a
Go-ticker-like period (its anchored grid, triggers, dropped ticks and how late a step came).

``TickLoop`` is the part of a probe worker that knows nothing of probes: ``ProbeWorker``
(``worker.py``) and ``MirrorWorker`` (``mirror.py``) build their loops on it. Time comes from an
injected ``Clock``, so tests never sleep through periods.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import math
import time
import weakref
from typing import Protocol

__all__ = [
    "LOOP_CLOCK",
    "TIMER_GRANULARITY",
    "Cancellable",
    "Clock",
    "LoopClock",
    "TickLoop",
    "TickTimers",
    "Wake",
    "resolve",
    "timer_at",
]


class Cancellable(Protocol):
    """What cancels a scheduled wake-up (``asyncio.TimerHandle`` is one)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """The worker's notion of time."""

    def monotonic(self) -> float: ...
    def wall(self) -> float: ...
    def wake_at(self, deadline: float, wakeup: asyncio.Future[Wake]) -> Cancellable:
        """Resolve ``wakeup`` with TICK at monotonic ``deadline`` (never before it) unless it is
        resolved first; returns what cancels that."""
        ...


class Wake(enum.Enum):
    """Why a worker's wait ended."""

    TICK = "tick"
    TRIGGER = "trigger"
    STOP = "stop"


class LoopClock:
    """The real clock: the event loop's monotonic time and the system's wall time, and one
    timer per loop for every waiting worker's tick (``TickTimers``)."""

    def __init__(self) -> None:
        self._timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TickTimers] = (
            weakref.WeakKeyDictionary()
        )
        # The latest loop's timers, one attribute read (loops in other threads look them up).
        self._latest: tuple[asyncio.AbstractEventLoop | None, TickTimers | None] = (None, None)

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        return time.time()

    def wake_at(self, deadline: float, wakeup: asyncio.Future[Wake]) -> Cancellable:
        loop = asyncio.get_running_loop()
        latest_loop, timers = self._latest
        if latest_loop is not loop or timers is None:
            timers = self._timers.get(loop)
            if timers is None:
                timers = self._timers[loop] = TickTimers(loop)
            self._latest = (loop, timers)
        timers.add(deadline, wakeup)
        return _LEFT_TO_FIRE


# The event loop's timer granularity: uvloop keeps time and timers in whole milliseconds.
TIMER_GRANULARITY = 0.001
MS_PER_SECOND = 1000


def timer_at(deadline: float) -> float:
    """The loop time to arm a tick's timer for: ``deadline`` rounded up to the next whole
    millisecond (at most ``TIMER_GRANULARITY`` later, never earlier).

    uvloop's ``loop.time()`` is its cached millisecond clock and ``call_at`` rounds the delay to
    the nearest millisecond, so a timer armed for the deadline itself fired up to half a
    millisecond before it whenever the deadline fell in a millisecond's first half: the tick was
    not due, and re-arming it for a delay that rounds to zero is a ``call_soon``: the loop spun,
    one callback per iteration, until its clock reached the next millisecond (170 callbacks and
    0.2-0.3 ms of CPU per jittered tick, issue 36). Armed at a whole millisecond the timer fires
    when the loop's clock reads that millisecond, so the tick is due then, and every tick due
    within that millisecond is resolved by the same callback.
    """
    # Milliseconds divided by 1000, as uvloop's clock reads them: a product by 0.001 can land
    # one ulp above the clock's reading of the same millisecond, and a deadline there (a time
    # given back, itself whole milliseconds) was never due on it: the loop spun until the next.
    ticks = math.ceil(deadline * MS_PER_SECOND)
    at = ticks / MS_PER_SECOND
    if at < deadline:  # the product rounded down (a deadline a hair past a millisecond)
        at = (ticks + 1) / MS_PER_SECOND
    return at


class TickTimers:
    """Every waiting worker's tick on one loop, in a heap under one timer handle.

    A waiting worker holds a future and a heap entry (a tuple) for a whole period; with a timer
    handle of its own it held a handle, uvloop's timer and their arguments too, about 600 bytes
    more (tracemalloc, issue 25: a node's memory, by what is kept) and more objects for the
    collector's oldest generation. A wake-up is never cancelled: a worker's wait ends by
    resolving its future (a trigger, a stop), and the entry, found resolved when it comes due,
    is dropped then (a period later at most).

    The handle is armed for the head's deadline rounded up to the loop's millisecond
    (``timer_at``): a tick is never resolved before its deadline, and at most about a
    millisecond after it plus however late the loop runs the callback.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: list[tuple[float, int, asyncio.Future[Wake]]] = []
        self._order = itertools.count()  # equal deadlines fire in the order they were added
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    def __len__(self) -> int:
        return len(self._due)

    def add(self, deadline: float, wakeup: asyncio.Future[Wake]) -> None:
        """Resolve ``wakeup`` with TICK at monotonic ``deadline``, never before it, unless it
        is resolved first."""
        heapq.heappush(self._due, (deadline, next(self._order), wakeup))
        # A deadline in the millisecond the handle is armed for already has its callback.
        if deadline < self._armed_for:
            at = timer_at(deadline)
            if at < self._armed_for:
                self._arm(at)

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_for = at
        self._handle = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        # A Go ticker fires no earlier than its time: entries not yet due (a loop whose timers
        # may fire a hair early, asyncio's by its clock's resolution) wait for the next arming.
        self._handle, self._armed_for = None, math.inf
        due, now = self._due, self._loop.time()
        while due and due[0][0] <= now:
            wakeup = heapq.heappop(due)[2]
            if not wakeup.done():
                wakeup.set_result(Wake.TICK)
        if due:
            self._arm(timer_at(due[0][0]))


class _LeftToFire:
    """What ``LoopClock.wake_at`` returns: nothing to cancel (see ``TickTimers``)."""

    def cancel(self) -> None:
        pass


_LEFT_TO_FIRE = _LeftToFire()
# The real clock of every worker not given one (it keeps no state but its loops' timers).
LOOP_CLOCK = LoopClock()


def resolve(future: asyncio.Future[Wake], wake: Wake) -> None:
    if not future.done():
        future.set_result(wake)


class TickLoop:
    """The wait-and-tick state of one worker: what its current wait is armed with, the trigger
    and stop it may be woken by, and the tick the step in progress serves.

    A Go ticker keeps at most one tick pending: ticks missed while a step ran are dropped and the
    grid keeps its phase; ``take_tick`` says which tick a step serves and how many it dropped, and
    ``lateness`` how late the step came after it (the step's record carries both).
    """

    __slots__ = (
        "_clock",
        "_grid_anchor",
        "_stop_requested",
        "_tick_due",
        "_ticks_dropped",
        "_timer",
        "_trigger_pending",
        "_urgent",
        "_wakeup",
    )

    def __init__(self, clock: Clock, grid_anchor: float | None) -> None:
        self._clock = clock
        # Wall-clock time the kubelet would have started this worker (pod admission): its ticks
        # fall on that grid (§3.10). None: the worker starts its grid now, with an immediate step.
        self._grid_anchor = grid_anchor
        # The tick the step in progress serves (monotonic; None: a first or manual step, never
        # late) and how many ticks were dropped before it: its record says so.
        self._tick_due: float | None = None
        self._ticks_dropped = 0
        self._wakeup: asyncio.Future[Wake] | None = None
        self._timer: Cancellable | None = None  # the tick the current wait is armed with
        self._stop_requested = False
        self._trigger_pending = False
        self._urgent = False  # set by probe_now(): a trigger that may end the jitter early

    # -- control (non-blocking, idempotent, like the kubelet's 1-slot channels) -----------------

    def _request_stop(self) -> None:
        self._stop_requested = True
        if self._wakeup is not None:
            resolve(self._wakeup, Wake.STOP)

    def trigger(self) -> None:
        """Run a probe now instead of waiting for the next tick; extra triggers coalesce.

        Like the kubelet's manual trigger, it does not cut the start-up jitter short: a trigger
        that arrives during the jitter runs right after the first step.
        """
        self._trigger_pending = True
        if self._wakeup is not None:
            resolve(self._wakeup, Wake.TRIGGER)

    def probe_now(self) -> None:
        """Run a probe now, even during the start-up jitter (a person asked for it)."""
        self._urgent = True
        self.trigger()

    @property
    def stopped(self) -> bool:
        """True once stop() was called."""
        return self._stop_requested

    # -- waiting --------------------------------------------------------------------------------

    def _first_anchored_tick(self, period: float) -> float | None:
        """The first tick of the anchored grid still to come (monotonic), or None if unanchored."""
        if self._grid_anchor is None:
            return None
        now_wall = self._clock.wall()
        elapsed = now_wall - self._grid_anchor
        if elapsed < 0:
            return None  # clocks disagree: fall back to an immediate step
        ticks_done = int(elapsed // period)
        return self._clock.monotonic() + (ticks_done + 1) * period - elapsed

    def _wait(self, deadline: float) -> asyncio.Future[Wake]:
        """The wake-up to await until ``deadline``: a tick, a trigger or a stop (pass what it
        gives to ``_woken``). A future and a timer, no coroutine: a waiting worker holds as
        little as it can, for a whole period."""
        wakeup: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        if self._stop_requested:
            wakeup.set_result(Wake.STOP)
        elif self._trigger_pending:
            wakeup.set_result(Wake.TRIGGER)
        else:
            self._wakeup = wakeup
            self._timer = self._clock.wake_at(deadline, wakeup)
        return wakeup

    def _woken(self, wake: Wake) -> Wake:
        """What a wait ended with, once its timer is cancelled and a trigger consumed."""
        self._wakeup = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is Wake.TRIGGER:
            self._trigger_pending = False
        return Wake.STOP if self._stop_requested else wake

    # -- ticks ----------------------------------------------------------------------------------

    def _take_tick(self, now: float, next_tick: float, period: float) -> float:
        """A tick woke the worker at ``now``: note the tick its step serves and the ticks
        dropped before it, and return the next tick.

        Like a Go ticker, at most one tick is pending: missed ticks are dropped and the grid
        keeps its phase. A tick counts even when the loop's timer fired a hair early (uvloop's
        timers have millisecond resolution).
        """
        missed = max(1, int((now - next_tick) // period) + 1)
        self._tick_due = next_tick + (missed - 1) * period
        self._ticks_dropped = missed - 1
        return next_tick + missed * period

    def _tick_served(self) -> None:
        """The step is over: the next one serves no tick until ``_take_tick`` says so."""
        self._tick_due, self._ticks_dropped = None, 0

    def _lateness(self, started_mono: float) -> tuple[float, int]:
        """How late the step that started at ``started_mono`` came after its tick, and the ticks
        dropped before it."""
        if self._tick_due is None:
            return 0.0, 0
        return max(0.0, started_mono - self._tick_due), self._ticks_dropped
