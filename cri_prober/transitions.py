"""The transition log: every published probe result change, numbered, in a bounded replay buffer.

It is a manager observer. Each transition gets the next sequence number (1, 2, ...) and a snapshot
of its container's derived state, so a client that lost its stream can resume after the last
sequence it saw for as long as the buffer still holds what followed. ``Signal`` is the wake-up
primitive the API's streams wait on instead of polling.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cri_prober.manager import ProbeManager, Slot
from cri_prober.results import Published, ResultUpdate
from cri_prober.spec import ProbeKind
from cri_prober.worker import HISTORY_OUTPUT_BYTES, ProbeRecord, ProbeWorker

DEFAULT_BUFFER_SIZE = 4096


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


class TransitionGap(Exception):
    """The transitions a reader asked for (or fell behind on) are no longer buffered."""


class TransitionLog:
    """Numbers every transition the manager publishes and keeps the last ``size`` for replay."""

    def __init__(
        self,
        manager: ProbeManager,
        *,
        size: int = DEFAULT_BUFFER_SIZE,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if size < 1:
            raise ValueError("the transition buffer needs room for at least one transition")
        self._manager = manager
        self._buffer: deque[Transition] = deque(maxlen=size)
        self._on_change = on_change
        self._clock = clock
        self._appended = Signal()
        self.sequence = 0  # the last sequence number issued

    # -- ManagerObserver ------------------------------------------------------------------------

    def probe_finished(self, slot: Slot, kind: ProbeKind, record: ProbeRecord) -> None:
        """Attempts are not transitions; nothing to log."""

    def transition(self, slot: Slot, update: ResultUpdate, worker: ProbeWorker | None) -> None:
        """Log one published change and wake the readers."""
        record = worker.last_record if worker is not None else None
        output = (
            record.output
            if record is not None and record.container_id == update.container_id
            else ""
        )
        health = self._manager.health(slot)
        self.sequence += 1
        self._buffer.append(
            Transition(
                sequence=self.sequence,
                time=self._clock(),
                container_id=update.container_id,
                container_name=slot.key.container,
                pod_name=slot.pod.name,
                pod_namespace=slot.pod.namespace,
                pod_uid=slot.pod.uid,
                kind=update.kind,
                previous=update.previous,
                result=update.result,
                consecutive=worker.result_run if worker is not None else 0,
                output=output[:HISTORY_OUTPUT_BYTES],
                started=health.started,
                ready=health.ready,
                healthy=health.serving,
            )
        )
        self._appended.notify()
        if self._on_change is not None:
            self._on_change()

    def worker_stopped(self, slot: Slot, kind: ProbeKind) -> None:
        """A stopped worker's result is forgotten, which can change its container's health."""
        if self._on_change is not None:
            self._on_change()

    # -- reading --------------------------------------------------------------------------------

    def close(self) -> None:
        """End every ``follow()`` (at shutdown)."""
        self._appended.close()

    async def follow(self, since: int | None = None) -> AsyncIterator[Transition]:
        """Yield transitions as they happen; with ``since``, first those after it still buffered.

        Ends when the log is closed. Raises ``TransitionGap`` when ``since`` is out of reach, or
        when the reader fell so far behind that transitions it has not seen were dropped.
        """
        if since is not None and since > self.sequence:
            raise TransitionGap(
                f"sequence {since} was never issued: the newest transition is {self.sequence} "
                "(did cri-prober restart? then resume without since_sequence)"
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
    "Signal",
    "Transition",
    "TransitionGap",
    "TransitionLog",
]
