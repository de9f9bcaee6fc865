"""Runtime liveness: whether the container runtime answers, told apart from the containers' health.

The kubelet keeps the two apart: its runtime health (a CRI Status call every 5 s; "container
runtime is down" after 30 s without an answer) and its PLEG health (a relist within 3 min) make
the *node* NotReady, and never count against a container. cri-prober learns the same from the
calls it makes anyway: every CRI call reports here when it starts and how it ended.

The runtime is **silent** while it has been asked something it normally answers at once (a read:
a listing, a status, Version) and has answered nothing at all since: the silence starts when
the first such request went out after the last answer, or when a call failed because the
runtime could not be reached (UNAVAILABLE). Any answer ends it, the runtime's own errors
included (NOT_FOUND is an answer); a timeout is not an answer. ExecSync and StopContainer do
not open a silence, since they take as long as the command or the grace period, but their
answers end one. An idle runtime is never silent: nobody asked it anything.

Two things follow from that:

- ``responsive``: False once a silence has lasted ``unresponsive_after`` seconds (10 s by
  default, a third of the kubelet's 30 s, because a sidecar that reports NOT_SERVING early
  costs nothing), True again at the next answer. Flips are published on ``changes``; the
  health service's ``""`` follows them.
- ``stalled_during(start, end)``: whether a silence of at least ``stall_seconds`` overlapped a
  window. A frozen runtime (SIGSTOP, a stuck runtime thread) that comes back may answer an
  exec that was in flight with its own timeout error, because its timer fired while it could
  not see the command exit; such an answer says nothing about the container.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

from cri_prober.topic import Topic

# No answer at all for this long while asked is a stall: a runtime that is merely busy still
# answers something (an exec, a status) every few hundred milliseconds on a loaded 2-core node.
DEFAULT_STALL_SECONDS = 5.0
# The health service's "" goes NOT_SERVING after this long without an answer.
DEFAULT_UNRESPONSIVE_AFTER = 10.0
# Methods that take as long as the command or the grace period they carry: slow is not silent.
SLOW_METHODS = frozenset({"ExecSync", "StopContainer"})
# How many ended silences are kept for ``stalled_during``; older ones cannot overlap a call
# still in flight unless that call has been waiting for many minutes.
_KEPT_SILENCES = 64

_NOT_AN_ANSWER = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})
_UNREACHABLE = frozenset({"UNAVAILABLE"})


class RuntimeLiveness:
    """Tracks the runtime's answers; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        unresponsive_after: float = DEFAULT_UNRESPONSIVE_AFTER,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unresponsive_after <= 0 or stall_seconds <= 0:
            raise ValueError("unresponsive_after and stall_seconds must be > 0")
        self.unresponsive_after = unresponsive_after
        self.stall_seconds = stall_seconds
        self._clock = clock
        self.last_answer: float | None = None  # clock time of the last answer
        self._asked: dict[int, float] = {}  # reads in flight: token -> when they went out
        self._failed_since: float | None = None  # the first unreachable call since the answer
        self._silences: deque[tuple[float, float]] = deque(maxlen=_KEPT_SILENCES)
        self._tokens = itertools.count()
        self._responsive = True
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        # Published with the new value whenever ``responsive`` flips.
        self.changes: Topic[bool] = Topic("runtime-liveness")

    # -- what the CRI client reports -----------------------------------------------------------

    def call_started(self, method: str) -> int:
        """A call went out; returns the token to pass to ``call_ended``."""
        token = next(self._tokens)
        if method not in SLOW_METHODS:
            self._asked[token] = self._clock()
            self._arm()
        return token

    def call_ended(self, token: int, method: str, code: str) -> None:
        """The call ended with gRPC status ``code`` (its name; "OK" on success)."""
        since = self.silent_since()  # this very call may be what kept the runtime silent
        asked_at = self._asked.pop(token, None)
        if code not in _NOT_AN_ANSWER:
            self._answered(since)
        elif code in _UNREACHABLE and self._failed_since is None:
            # The runtime could not be reached: silent since that call went out.
            self._failed_since = asked_at if asked_at is not None else self._clock()
            self._arm()
        elif asked_at is not None and code == "DEADLINE_EXCEEDED" and self._failed_since is None:
            # A read that got no answer in time keeps the silence it started going.
            self._failed_since = asked_at

    def close(self) -> None:
        """Stop watching the clock (the client is closing): no timer outlives it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._closed = True

    # -- what the rest asks --------------------------------------------------------------------

    def asking(self) -> bool:
        """Whether a read is in flight (one that would notice a silent runtime)."""
        return bool(self._asked)

    @property
    def responsive(self) -> bool:
        """False once the runtime has been silent for ``unresponsive_after`` seconds."""
        return self._responsive

    def silent_since(self) -> float | None:
        """Clock time the current silence began, or None while the runtime is answering."""
        starts = list(self._asked.values())
        if self._failed_since is not None:
            starts.append(self._failed_since)
        if not starts:
            return None
        earliest = min(starts)
        # A request sent before the last answer is not left unanswered by a silent runtime.
        return earliest if self.last_answer is None else max(earliest, self.last_answer)

    def silent_for(self) -> float | None:
        """Seconds the current silence has lasted, or None while the runtime is answering (for
        saying since when it has been unreachable)."""
        since = self.silent_since()
        return None if since is None else max(0.0, self._clock() - since)

    def stalled_during(self, start: float, end: float) -> bool:
        """Whether a silence of at least ``stall_seconds`` overlapped ``[start, end]``."""
        silences = list(self._silences)
        if (since := self.silent_since()) is not None:
            silences.append((since, self._clock()))
        return any(
            s_end - s_start >= self.stall_seconds and s_start <= end and s_end >= start
            for s_start, s_end in silences
        )

    # -- internals ------------------------------------------------------------------------------

    def _answered(self, since: float | None) -> None:
        now = self._clock()
        if since is not None and now - since >= self.stall_seconds:
            self._silences.append((since, now))
        self.last_answer = now
        self._failed_since = None
        self._set_responsive(True)
        # Reads still in flight now count as asked at this answer: if nothing else comes back,
        # the silence starts here.
        self._arm()

    def _check(self) -> None:
        since = self.silent_since()
        if since is None:
            return
        if self._clock() - since >= self.unresponsive_after:
            self._set_responsive(False)
        else:
            self._arm()

    def _arm(self) -> None:
        # The moment a silence would reach the threshold is known in advance: look then. One
        # timer at most; an answer in between does not cancel it (answers are frequent, timers
        # not free), the timer just finds the runtime answering and arms again if asked.
        if self._timer is not None or not self._responsive or self._closed:
            return
        since = self.silent_since()
        if since is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - the client only runs on a loop
            return
        delay = max(0.0, since + self.unresponsive_after - self._clock())
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._check()

    def _set_responsive(self, responsive: bool) -> None:
        if responsive != self._responsive:
            self._responsive = responsive
            self.changes.publish(responsive)


__all__ = [
    "DEFAULT_STALL_SECONDS",
    "DEFAULT_UNRESPONSIVE_AFTER",
    "SLOW_METHODS",
    "RuntimeLiveness",
]
