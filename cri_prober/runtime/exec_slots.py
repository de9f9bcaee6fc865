"""Fair exec slots: the node-wide cap on starting ExecSync calls, shared so that no container can
hog it, and held only while an exec is young when others wait.

A plain semaphore hands slots out first come, first served, so whoever asks most holds most
(issue 15). Here a container (the key) holds at most ``per_key`` slots at a time, and containers
waiting for a slot take turns in the order they started waiting (round robin). Since issue 21 a
slot is *preemptible* once its exec is past its start hold (``ExecSlot.soften``): starting an exec
is what costs the runtime CPU, a command that has been running a while costs it little, so as
soon as anyone waits, every slot past its start hold goes to the line and its exec runs on
without one. A container whose exec was still running at the end of its start hold has *overrun*:
until one of its execs finishes within it, its calls are served after everyone else's and such
containers together hold at most ``overrun_share`` slots, so the others always find one.

A runtime that is slow for everyone is saturated (a node past its exec ceiling: the kubelet's
own exec probes alone can take containerd there). Once the median of the last answered execs is
past ``slow_after``, no container is judged by the start hold (each by its answer against that
median instead), and at most ``saturated_share`` young execs (a quarter of the slots by default)
start at a time: more would not make the runtime faster, only take its time from the kubelet's
probes, whose liveness timeouts restart containers (issue 25, ``bench/run process_cpu
--together``). The ticks this costs are counted and logged by the probe workers' owner.

A slot's bounds (``ExecSlot.bound``: its start hold and its longest hold) are kept by the clock,
not only by the loop's timers: whenever a call asks for a slot, every slot past a bound is
softened or given back first (issue 36). On a starved loop a timer runs late, after the calls
queued before it; the caller that finds the slot past its bound takes it at once.
One timer keeps every held slot's bounds (``watch_bounds``, armed for the earliest), not two
per exec: a loop timer made and cancelled per exec cost about 5 % of an exec's CPU in serve.
"""

from __future__ import annotations

import asyncio
import enum
import statistics
from collections import deque
from collections.abc import Callable

# How many answered execs the runtime's pace is judged from.
PACE_WINDOW = 32
# The fewest answered execs before the runtime can count as slow.
PACE_MIN_SAMPLES = 8
# With a slow runtime, an exec answered within this many times the median counts as on time.
SLOW_RUNTIME_GRACE = 2.0


class Standing(enum.IntEnum):
    """A container's place in line, best first: served in this order, round robin within each."""

    GOOD = 0  # its last exec finished within its start hold
    NEW = 1  # not seen yet (or forgotten)
    OVERRAN = 2  # its last exec was still running at the end of its start hold


class ExecSlot:
    """One granted slot; ``finish()`` or ``release()`` gives it back (again is a no-op, so a
    timer, a preemption and a ``finally`` clause may all do so)."""

    __slots__ = (
        "_due",
        "_finished",
        "_on_due",
        "_owner",
        "_released",
        "_soft",
        "_soft_at",
        "granted_at",
        "key",
        "standing",
    )

    def __init__(self, owner: ExecSlots, key: str, standing: Standing, granted_at: float) -> None:
        self._owner = owner
        self.key = key
        self.standing = standing  # the standing it was granted under (counts toward its share)
        self.granted_at = granted_at  # the slots' clock
        self._released = False
        self._finished = False
        self._soft = False
        self._soft_at: float | None = None  # the end of its start hold (the slots' clock)
        self._due: float | None = None  # the end of its longest hold
        self._on_due: Callable[[], None] | None = None

    def bound(self, *, soft_at: float, due: float, on_due: Callable[[], None]) -> None:
        """When the slot is past its start hold (``soften``) and when it must go back
        (``on_due``, which gives it back), on the slots' clock. ``ExecSlots.watch_bounds`` keeps
        them by one timer for all slots; they also hold when it runs late: a call asking for a
        slot checks them."""
        self._soft_at, self._due, self._on_due = soft_at, due, on_due
        self._owner._bounded[self] = None

    def next_bound(self) -> float | None:
        """When it is next past a bound (its start hold, then its longest hold), if bounded.
        The longest hold is its call's, and stays bounded after the slot itself went back to
        the line (preempted past its start hold): the call is overdue then all the same."""
        if self._on_due is None:
            return None
        if self._released or self._soft:
            return self._due
        return self._soft_at

    def check_bounds(self, now: float) -> None:
        """Soften the slot, or tell its call it is overdue (which gives the slot back), if it is
        past a bound at ``now``."""
        on_due = self._on_due
        if on_due is None:
            return
        if self._due is not None and now >= self._due:
            self.unbind()
            on_due()  # gives the slot back, if the line has not taken it already
        elif not self._released and self._soft_at is not None and now >= self._soft_at:
            self.soften()

    def unbind(self) -> None:
        """Its call ended (answered, failed or cancelled): no bound of it is kept any more."""
        self._on_due = None
        self._owner._bounded.pop(self, None)

    @property
    def released(self) -> bool:
        """True once the slot went back."""
        return self._released

    @property
    def soft(self) -> bool:
        """True once its exec is past its start hold (the slot may be taken for a waiting call)."""
        return self._soft

    def soften(self) -> None:
        """The exec is past its start hold: its container overran, and the slot goes to the line
        now if anyone waits, or as soon as someone does."""
        if not self._soft:
            self._soft = True
            self._owner._soften(self)

    def release(self) -> None:
        """Give the slot back without judging the exec (it was cancelled, or it is overdue)."""
        if not self._released:
            self._released = True
            self._owner._release(self)

    def finish(self, *, paced: bool = True, took: float | None = None) -> None:
        """The exec was answered: give the slot back, and if it never got past its start hold
        (or, with a slow runtime, came within its pace) the container is in good standing.
        ``paced``: the answer tells the runtime's pace (an exit status within the command's
        timeout); one that timed out, or waited for a background child, tells only of the
        command. ``took``: how long the runtime took to answer (default: since the grant); the
        caller that knows when its call went out and when the answer came gives it, so that
        the loop's own delays (a starved loop) do not pass for the runtime's pace."""
        if not self._finished:  # preempted or not: the answer is news of the runtime's pace
            self._finished = True
            self._owner._answered(self, paced=paced, took=took)
        self.unbind()
        self.release()


class ExecSlots:
    """``capacity`` slots, at most ``per_key`` of them held by one key, handed out fairly.

    ``remember`` bounds how many keys' standings are kept (oldest forgotten first: a forgotten
    key is NEW again); containers come and go, and nothing tells this class which are gone.
    """

    def __init__(
        self,
        capacity: int,
        *,
        per_key: int = 1,
        overrun_share: int | None = None,
        saturated_share: int | None = None,
        remember: int = 4096,
        slow_after: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if per_key < 1:
            raise ValueError("per_key must be >= 1")
        if overrun_share is None:
            overrun_share = max(1, capacity // 4)
        if not 1 <= overrun_share <= capacity:
            raise ValueError("overrun_share must be between 1 and capacity")
        if saturated_share is None:
            saturated_share = max(1, capacity // 4)
        if not 1 <= saturated_share <= capacity:
            raise ValueError("saturated_share must be between 1 and capacity")
        if remember < 1:
            raise ValueError("remember must be >= 1")
        self.capacity = capacity
        self.per_key = per_key
        self.overrun_share = overrun_share
        self.saturated_share = saturated_share
        self._remember = remember
        self._free = capacity
        self._held: dict[str, int] = {}
        self._overrun_held = 0  # slots granted to OVERRAN keys, still held
        self._standing: dict[str, Standing] = {}  # GOOD or OVERRAN, least recently judged first
        # Slots past their start hold, still held: kept only while nobody waits.
        self._soft: dict[ExecSlot, None] = {}
        self._waiters: dict[str, deque[asyncio.Future[ExecSlot]]] = {}
        # Keys with waiters, one line per standing, in turn order (dicts keep insertion order;
        # re-inserting a key moves it to the back). Keys that hold their full share stay where
        # they are, so they are first in line again as soon as their slot comes back.
        self._lines: tuple[dict[str, None], ...] = tuple({} for _ in Standing)
        self.preemptions = 0  # slots taken from execs past their start hold for a waiting call
        self.overruns = 0  # execs still running at the end of their start hold
        # The runtime counts as saturated once the median answer takes longer than this (None:
        # never; the client passes its start hold).
        self.slow_after = slow_after
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._paces: deque[float] = deque(maxlen=PACE_WINDOW)  # seconds from grant to answer
        self._pace: float | None = None  # their median, once there are PACE_MIN_SAMPLES
        self._slow = False  # the runtime is saturated (its pace is past slow_after)
        self._reserved = 0  # slots kept unused meanwhile
        self._bounded: dict[ExecSlot, None] = {}  # slots whose calls have bounds (ExecSlot.bound)
        # One timer for every held slot's bounds (``watch_bounds``), armed for the earliest.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    @property
    def runtime_pace(self) -> float | None:
        """The median seconds from grant to answer of the last answered execs (None: too few)."""
        return self._pace

    @property
    def runtime_slow(self) -> bool:
        """The runtime answers everyone's execs slowly (saturated): a start hold says nothing of
        a container, and at most ``saturated_share`` young execs start at a time."""
        return self._slow

    @property
    def in_use(self) -> int:
        """Slots held right now."""
        return self.capacity - self._free

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot right now."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def held_by(self, key: str) -> int:
        """Slots ``key`` holds right now."""
        return self._held.get(key, 0)

    def standing(self, key: str) -> Standing:
        """Where ``key``'s next call goes in line."""
        return self._standing.get(key, Standing.NEW)

    def check_bounds(self) -> None:
        """Soften or give back every held slot past a bound now, whether or not its timers ran."""
        if not self._bounded:
            return
        now = self._clock()
        for slot in list(self._bounded):
            slot.check_bounds(now)

    def watch_bounds(self) -> None:
        """Keep the held slots' bounds by a timer on the running loop too, so that they hold
        when no call asks for a slot (its start hold softens a slot for whoever waits, its
        longest hold gives it back): one timer for all of them, armed for the earliest bound,
        instead of two per exec (issue 36: each costs a loop timer made and closed, about 5 %
        of an exec's CPU). The caller calls it after ``ExecSlot.bound``; the clock must be the
        loop's (the default)."""
        earliest = min(
            (at for slot in self._bounded if (at := slot.next_bound()) is not None), default=None
        )
        if earliest is None:
            return
        if self._timer is not None:
            if self._timer_at <= earliest:
                return  # it fires first, and arms again for what is left then
            self._timer.cancel()
        self._timer_at = earliest
        self._timer = asyncio.get_running_loop().call_at(earliest, self._on_timer, earliest)

    def close(self) -> None:
        """Stop the bounds' timer (the client is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self, at: float) -> None:
        self._timer = None
        # The timer ran, so ``at`` has come, whatever the clock's rounding says.
        now = max(self._clock(), at)
        for slot in list(self._bounded):
            slot.check_bounds(now)
        self.watch_bounds()

    async def acquire(self, key: str) -> ExecSlot:
        """Wait for a slot for ``key``; a slot granted to a call cancelled meanwhile goes back."""
        self.check_bounds()
        standing = self.standing(key)
        if self._room() and key not in self._waiters and self._may_take(key, standing):
            # After every change the lines have been served as far as they can be, so a free
            # slot means nobody who may take it is waiting: no one is overtaken here.
            return self._grant(key, standing)
        future: asyncio.Future[ExecSlot] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, deque()).append(future)
        if not any(key in line for line in self._lines):
            self._lines[standing][key] = None
        self._preempt_soft()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release()  # granted just as the caller was cancelled
            else:
                self._forget(key, future)
            raise

    def _may_take(self, key: str, standing: Standing) -> bool:
        if self.held_by(key) >= self.per_key:
            return False
        return standing is not Standing.OVERRAN or self._overrun_held < self.overrun_share

    def _grant(self, key: str, standing: Standing) -> ExecSlot:
        self._free -= 1
        self._held[key] = self._held.get(key, 0) + 1
        if standing is Standing.OVERRAN:
            self._overrun_held += 1
        return ExecSlot(self, key, standing, self._clock())

    def _release(self, slot: ExecSlot) -> None:
        self._free += 1
        if (held := self._held[slot.key] - 1) > 0:
            self._held[slot.key] = held
        else:
            del self._held[slot.key]
        if slot.standing is Standing.OVERRAN:
            self._overrun_held -= 1
        self._soft.pop(slot, None)
        # Its call's bound stays (``ExecSlot.unbind`` ends it): a slot preempted past its start
        # hold leaves a call that is overdue at its longest hold like any other.
        self._serve_lines()

    def _room(self) -> bool:
        return self._free > self._reserved

    def _answered(self, slot: ExecSlot, *, paced: bool, took: float | None = None) -> None:
        if took is None:
            took = self._clock() - slot.granted_at
        if not slot.soft:
            self._judge(slot.key, Standing.GOOD)
        elif self._pace is not None and self.runtime_slow:
            on_time = took <= SLOW_RUNTIME_GRACE * self._pace
            self._judge(slot.key, Standing.GOOD if on_time else Standing.OVERRAN)
        if not paced:
            return
        self._paces.append(took)
        if len(self._paces) >= PACE_MIN_SAMPLES:
            self._pace = statistics.median(self._paces)
            self._slow = self.slow_after is not None and self._pace > self.slow_after
            self._reserved = self.capacity - self.saturated_share if self._slow else 0

    def _soften(self, slot: ExecSlot) -> None:
        self.overruns += 1
        if not self.runtime_slow:
            self._judge(slot.key, Standing.OVERRAN)  # else judged by its answer
        if not slot.released:
            self._soft[slot] = None
            self._preempt_soft()

    def _judge(self, key: str, standing: Standing) -> None:
        """Record ``key``'s standing; a call of it waiting in line moves to the back of its line."""
        was = self._standing.pop(key, Standing.NEW)
        self._standing[key] = standing
        if len(self._standing) > self._remember:
            del self._standing[next(iter(self._standing))]
        if was is not standing and key in self._lines[was]:
            del self._lines[was][key]
            self._lines[standing][key] = None

    def _preempt_soft(self) -> None:
        """Someone waits: every slot past its start hold goes back (its exec runs on)."""
        if not self._waiters:
            return
        while self._soft:
            slot = next(iter(self._soft))
            self.preemptions += 1
            slot.release()  # drops it from _soft and serves the lines
            if not self._waiters:
                return

    def _serve_lines(self) -> None:
        if not self._waiters:
            return  # nobody in line (an exec's usual end: its slot went back to no one)
        while self._room():
            # Best standing first; within a line, skips only keys that hold their full share
            # (at most ``capacity`` of them). Once OVERRAN keys hold their share, they all wait.
            found = next(
                (
                    (standing, key)
                    for standing in self._open_lines()
                    for key in self._lines[standing]
                    if self.held_by(key) < self.per_key
                ),
                None,
            )
            if found is None:
                return
            standing, key = found
            line = self._lines[standing]
            waiters = self._waiters[key]
            future = waiters.popleft()
            if not future.cancelled():  # a cancelled caller forgets its own entry later
                future.set_result(self._grant(key, standing))
            del line[key]
            if waiters:
                line[key] = None  # its next call waits for its next turn, at the back
            else:
                del self._waiters[key]

    def _open_lines(self) -> tuple[Standing, ...]:
        if self._overrun_held < self.overrun_share:
            return (Standing.GOOD, Standing.NEW, Standing.OVERRAN)
        return (Standing.GOOD, Standing.NEW)

    def _forget(self, key: str, future: asyncio.Future[ExecSlot]) -> None:
        waiters = self._waiters.get(key)
        if waiters is None or future not in waiters:
            return  # already taken out of the line
        waiters.remove(future)
        if not waiters:
            del self._waiters[key]
            for line in self._lines:
                line.pop(key, None)


__all__ = ["ExecSlot", "ExecSlots", "Standing"]
