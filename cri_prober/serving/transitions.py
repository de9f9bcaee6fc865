"""The transition log: every published probe result change, numbered, in a bounded replay buffer.

It records the manager's ``ResultChanged`` events. Each transition gets the next sequence number
(1, 2, ...) and a snapshot of its container's derived state, so a client that lost its stream can
resume after the last sequence it saw for as long as the buffer still holds what followed.

Sequences start again at 1 whenever cri-prober starts, so each log has an *incarnation*, a random
ID stamped on every transition: a resume names the incarnation its sequence came from, and one
from another process is refused instead of replaying that process's unrelated transitions.
``Signal`` is the wake-up primitive the API's streams wait on instead of polling.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cri_prober.errors import CriProberError
from cri_prober.manager.events import ResultChanged
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published
from cri_prober.probing.worker import HISTORY_OUTPUT_BYTES

DEFAULT_BUFFER_SIZE = 4096
INCARNATION_BYTES = 8  # 16 hex characters: two starts never share one in practice


def new_incarnation() -> str:
    """A fresh random incarnation ID."""
    # secrets.token_hex's own words (os.urandom, in hex), without the hmac and hashlib modules
    # that importing secrets loads (issue 36, idle RSS).
    return os.urandom(INCARNATION_BYTES).hex()


def _rfc3339(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class Signal:
    """Wakes every waiter on ``notify()``; ``close()`` wakes them for good.

    Waiters take ``current()`` *before* reading the state they watch, so a change that lands
    between the read and the wait still wakes them.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.closed = False

    def current(self) -> asyncio.Event:
        """The event the next ``notify()`` sets."""
        return self._event

    def notify(self) -> None:
        """Wake everyone waiting on the current event."""
        self._event.set()
        if not self.closed:
            self._event = asyncio.Event()

    def close(self) -> None:
        """Wake everyone, now and on every later wait."""
        self.closed = True
        self._event.set()


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of a published result, with its container as it was right after."""

    sequence: int
    incarnation: str  # the log (cri-prober process) that numbered it
    time: float  # wall-clock seconds since the epoch
    container_id: str
    container_name: str
    pod_name: str
    pod_namespace: str
    pod_uid: str
    kind: ProbeKind
    previous: Published | None
    result: Published
    consecutive: int
    output: str
    started: bool
    ready: bool
    healthy: bool
    reason: str = ""
    threshold: int = 0
    held: bool = False
    stop_requested: bool = False
    source: str = ""  # who decided it: "" cri-prober, "kubelet-mirror" the kubelet (--mirror)


class TransitionGap(CriProberError):
    """The transitions a reader asked for (or fell behind on) are no longer buffered."""


class OtherIncarnation(TransitionGap):
    """A resume from a sequence another incarnation (an earlier cri-prober process) issued."""


class IncarnationRequired(CriProberError):
    """A resume from a sequence above 0 without the incarnation that issued it."""


class TransitionLog:
    """Numbers every transition the manager publishes and keeps the last ``size`` for replay."""

    def __init__(
        self,
        *,
        size: int = DEFAULT_BUFFER_SIZE,
        clock: Callable[[], float] = time.time,
        incarnation: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("the transition buffer needs room for at least one transition")
        self._buffer: deque[Transition] = deque(maxlen=size)
        self._clock = clock
        self._appended = Signal()
        self.sequence = 0  # the last sequence number issued
        self.incarnation = incarnation or new_incarnation()
        self.started_at = clock()  # wall-clock seconds since the epoch

    # -- writing --------------------------------------------------------------------------------

    def record(self, event: ResultChanged) -> Transition:
        """Log one published change and wake the readers."""
        self.sequence += 1
        container = event.container
        transition = Transition(
            sequence=self.sequence,
            incarnation=self.incarnation,
            time=self._clock(),
            container_id=container.id,
            container_name=container.name,
            pod_name=container.pod.name,
            pod_namespace=container.pod.namespace,
            pod_uid=container.pod.uid,
            kind=event.kind,
            previous=event.previous,
            result=event.result,
            consecutive=event.consecutive,
            output=event.output[:HISTORY_OUTPUT_BYTES],
            started=event.health.started,
            ready=event.health.ready,
            healthy=event.health.serving,
            reason=event.reason,
            threshold=event.threshold,
            held=event.held,
            stop_requested=event.stop_requested,
            source=event.source,
        )
        self._buffer.append(transition)
        self._appended.notify()
        return transition

    # -- reading --------------------------------------------------------------------------------

    def close(self) -> None:
        """End every ``follow()`` (at shutdown)."""
        self._appended.close()

    def check_resume(self, since: int | None, incarnation: str | None) -> None:
        """Refuse a resume point that may name another process's transitions.

        ``incarnation`` is the one ``since`` came from (``None``: not given). A given incarnation
        must be this log's. ``since`` 0 claims no position, so it needs none; a larger ``since``
        without one is refused, since after a restart the same number names an unrelated
        transition and nothing else could tell.

        Raises:
            OtherIncarnation: ``incarnation`` is not this log's.
            IncarnationRequired: ``since`` is above 0 and ``incarnation`` is ``None``.
        """
        this = f"this cri-prober is {self.incarnation}, started at {_rfc3339(self.started_at)}"
        if incarnation is not None and incarnation != self.incarnation:
            claim = (
                f"sequence {since} belongs to incarnation {incarnation}"
                if since
                else f"incarnation {incarnation} is not running"
            )
            raise OtherIncarnation(
                f"{claim}; {this}. Sequences start again at 1 whenever cri-prober starts, and "
                "transitions from before then are not kept: resume without since_sequence, or "
                f"from 0 with incarnation {self.incarnation} to replay what this one still buffers"
            )
        if since and incarnation is None:
            raise IncarnationRequired(
                f"since_sequence {since} needs the incarnation it came from "
                f"(Transition.incarnation): sequences start again at 1 whenever cri-prober "
                f"restarts; {this}"
            )

    async def follow(
        self, since: int | None = None, incarnation: str | None = None
    ) -> AsyncIterator[Transition]:
        """Yield transitions as they happen; with ``since``, first those after it still buffered.

        ``incarnation`` is the one ``since`` came from (see ``check_resume``). Ends when the log
        is closed. Raises ``TransitionGap`` (``OtherIncarnation`` included) when ``since`` is out
        of reach, or when the reader fell so far behind that transitions it has not seen were
        dropped, and ``IncarnationRequired`` as ``check_resume`` says.
        """
        self.check_resume(since, incarnation)
        if since is not None and since > self.sequence:
            raise TransitionGap(
                f"sequence {since} was never issued by incarnation {self.incarnation}: the "
                f"newest transition is {self.sequence}"
            )
        cursor = self.sequence if since is None else since
        while True:
            wake = self._appended.current()
            pending = self._after(cursor)
            for transition in pending:
                cursor = transition.sequence
                yield transition
            if self._appended.closed:
                return
            if not pending:
                await wake.wait()

    def _after(self, cursor: int) -> list[Transition]:
        if cursor >= self.sequence:
            return []
        oldest = self._buffer[0].sequence
        if cursor < oldest - 1:
            first, last = cursor + 1, oldest - 1
            missing = (
                f"transition {first} is" if first == last else f"transitions {first}-{last} are"
            )
            raise TransitionGap(
                f"{missing} no longer buffered (only the last {self._buffer.maxlen} are kept); "
                f"resume without since_sequence, or from {last} to skip them"
            )
        return list(itertools.islice(self._buffer, cursor + 1 - oldest, None))


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "IncarnationRequired",
    "OtherIncarnation",
    "Signal",
    "Transition",
    "TransitionGap",
    "TransitionLog",
    "new_incarnation",
]
